// The VRAM budget's choice of resident layers: within the room, spread over the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "layerstream/check.h"
#include "layerstream/residency_plan.h"

namespace layerstream {
namespace {

std::size_t kept_bytes(const std::vector<std::size_t>& bytes, const std::vector<bool>& keep) {
  std::size_t sum = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) sum += keep[i] ? bytes[i] : 0;
  return sum;
}

TEST(ResidencyPlan, EverythingFitsEverythingStays) {
  const std::vector<std::size_t> bytes{10, 20, 30};
  EXPECT_EQ(spread_residency(bytes, 60), std::vector<bool>({true, true, true}));
  EXPECT_EQ(spread_residency(bytes, 1000), std::vector<bool>({true, true, true}));
}

TEST(ResidencyPlan, NothingFitsNothingStays) {
  EXPECT_EQ(spread_residency({10, 20}, 5), std::vector<bool>({false, false}));
  EXPECT_EQ(spread_residency({}, 5), std::vector<bool>());
}

TEST(ResidencyPlan, HalfTheRoomKeepsEveryOtherLayerNotTheFirstHalf) {
  const std::vector<std::size_t> bytes(8, 100);
  const auto keep = spread_residency(bytes, 400);
  EXPECT_EQ(kept_bytes(bytes, keep), 400u);
  // No two streamed layers in a row: each streamed copy has a resident layer's compute beside it.
  for (std::size_t i = 1; i < keep.size(); ++i) EXPECT_TRUE(keep[i] || keep[i - 1]) << i;
}

TEST(ResidencyPlan, NeverMoreThanTheRoomAndNoRoomLeftUnusedThatALayerCouldTake) {
  std::vector<std::size_t> bytes;
  for (int i = 0; i < 300; ++i) bytes.push_back(54 + (i * 37) % 73);  // FLUX-like mixed sizes (MiB)
  const std::size_t total = std::accumulate(bytes.begin(), bytes.end(), std::size_t{0});
  for (std::size_t room : {total / 10, total / 3, total * 2 / 3, total - 1}) {
    const auto keep = spread_residency(bytes, room);
    const std::size_t kept = kept_bytes(bytes, keep);
    EXPECT_LE(kept, room);
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      if (!keep[i]) EXPECT_GT(kept + bytes[i], room) << "layer " << i << " would still fit";
    }
    // Spread: every quarter of the step keeps a share of its bytes near the overall share.
    const std::size_t q = bytes.size() / 4;
    for (std::size_t part = 0; part < 4; ++part) {
      std::size_t in = 0, all = 0;
      for (std::size_t i = part * q; i < (part + 1) * q; ++i) {
        all += bytes[i];
        in += keep[i] ? bytes[i] : 0;
      }
      EXPECT_NEAR(static_cast<double>(in) / all, static_cast<double>(room) / total, 0.12) << "room " << room;
    }
  }
}


// ---- the ring's size, chosen with the resident layers ---------------------------------------------------

TEST(RingPlan, ReplayIsFirstInFirstOutAndAHitDoesNotRefresh) {
  const std::vector<std::size_t> bytes = {10, 10, 10};
  const std::vector<bool> none(3, false);
  EXPECT_EQ(replay_copies(bytes, {0, 1, 0, 2, 1}, none, 20), 30u);  // 1 is still there after 2 evicts 0
  EXPECT_EQ(replay_copies(bytes, {0, 1, 0, 2, 0}, none, 20), 40u);  // least-recently-used would keep 0
  EXPECT_EQ(replay_copies(bytes, {0, 1, 0, 2, 1}, none, 10), 50u);
  EXPECT_EQ(replay_copies(bytes, {0, 1, 0, 2, 1}, {true, false, true}, 10), 10u);  // resident: never
  EXPECT_EQ(replay_copies({10, 30}, {1, 1, 0, 1}, {false, false}, 20), 100u);  // 30: larger than the store
  EXPECT_THROW(replay_copies(bytes, {3}, none, 20), InvalidArgument);
}

// A layer with scratch (quantized codes and room for the weights dequantized from them) takes more of the
// store than it copies: fewer such layers fit, and each copy still counts its bytes only.
TEST(RingPlan, ReplayHoldsTheFootprintAndCountsTheBytes) {
  const std::vector<std::size_t> bytes = {10, 10, 10}, footprint = {30, 30, 30};
  const std::vector<bool> none(3, false);
  EXPECT_EQ(replay_copies(bytes, {0, 1, 0}, none, 60), 20u);                // bytes: all three would fit
  EXPECT_EQ(replay_copies(bytes, {0, 1, 2, 0}, none, 60, footprint), 40u);  // two fit: 2 evicts 0
  EXPECT_EQ(replay_copies(bytes, {0, 1, 2, 0}, none, 90, footprint), 30u);
  EXPECT_EQ(replay_copies(bytes, {0, 0}, none, 20, footprint), 20u);  // larger than the store: every time
  EXPECT_THROW(replay_copies(bytes, {0}, none, 60, {30}), InvalidArgument);
  // The plan: a 30-byte ring leaves 15 of the 45 for one resident layer (resident copies take the bytes);
  // the other two take turns in a ring that holds one footprint, where their bytes alone would both fit.
  const std::vector<std::size_t> uses = {0, 1, 2, 0, 1, 2};
  const RingPlan plan = plan_ring_and_residency(bytes, uses, 45, {30, 60}, 1.0, footprint);
  EXPECT_EQ(plan.ring_bytes, 30u);
  EXPECT_EQ(std::count(plan.resident.begin(), plan.resident.end(), true), 1);
  EXPECT_EQ(plan.copied_bytes, 40u);
  EXPECT_EQ(plan_ring_and_residency(bytes, uses, 45, {30, 60}).copied_bytes, 20u);
}

// Four checkpointed blocks of three layers: forward, then per block from the last: recomputed forward
// (a, b, c), backward (c, b, a).
std::vector<std::size_t> checkpointed_step(std::size_t blocks, std::size_t per_block) {
  std::vector<std::size_t> uses;
  for (std::size_t i = 0; i < blocks * per_block; ++i) uses.push_back(i);
  for (std::size_t b = blocks; b-- > 0;) {
    for (std::size_t l = 0; l < per_block; ++l) uses.push_back(b * per_block + l);
    for (std::size_t l = per_block; l-- > 0;) uses.push_back(b * per_block + l);
  }
  return uses;
}

TEST(RingPlan, ARingThatHoldsABlockWinsOverResidentLayersWhenItSavesMoreCopies) {
  const std::vector<std::size_t> bytes(12, 4);  // 48 bytes in 4 blocks of 3 layers
  std::vector<std::size_t> uses = checkpointed_step(4, 3);
  const std::vector<std::size_t> two_steps = [&] {
    std::vector<std::size_t> u = uses;
    u.insert(u.end(), uses.begin(), uses.end());
    return u;
  }();
  // An 8-byte ring holds two layers: a block's first layer is gone by its backward. A 12-byte one holds a
  // block, with less room left for resident layers.
  const std::size_t room = 18, ring_sizes[] = {8, 12, 16};
  const RingPlan plan = plan_ring_and_residency(bytes, two_steps, room, {8, 12, 16});
  // The choice is the cheapest candidate that fits, by the same replay.
  std::uint64_t cheapest = ~std::uint64_t{0};
  for (std::size_t ring : ring_sizes) {
    const std::vector<bool> keep = spread_residency(bytes, room - ring);
    cheapest = std::min(cheapest, replay_copies(bytes, two_steps, keep, ring));
  }
  EXPECT_EQ(plan.copied_bytes, cheapest);
  EXPECT_EQ(plan.copied_bytes, replay_copies(bytes, two_steps, plan.resident, plan.ring_bytes));
  const std::vector<bool> small_keep = spread_residency(bytes, room - 8);
  EXPECT_EQ(plan.ring_bytes, 12u);
  EXPECT_LT(plan.copied_bytes, replay_copies(bytes, two_steps, small_keep, 8));
  std::size_t kept = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) kept += plan.resident[i] ? bytes[i] : 0;
  EXPECT_LE(kept + plan.ring_bytes, room);
}

TEST(RingPlan, WhenEverythingFitsBesideTheFirstRingItStaysAndNothingIsCopied) {
  const std::vector<std::size_t> bytes(6, 4);
  const RingPlan plan = plan_ring_and_residency(bytes, checkpointed_step(2, 3), 100, {12, 24, 48});
  EXPECT_EQ(plan.ring_bytes, 12u);
  EXPECT_EQ(plan.copied_bytes, 0u);
  EXPECT_EQ(plan.resident, std::vector<bool>(6, true));
  // A first size larger than the room is still taken (the ring in use); larger ones that do not fit are not.
  const RingPlan tight = plan_ring_and_residency(bytes, checkpointed_step(2, 3), 8, {12, 24});
  EXPECT_EQ(tight.ring_bytes, 12u);
  EXPECT_EQ(tight.resident, std::vector<bool>(6, false));
  EXPECT_THROW(plan_ring_and_residency(bytes, {}, 8, {}), InvalidArgument);
}

}  // namespace
}  // namespace layerstream
