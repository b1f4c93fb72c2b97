// The VRAM budget's choice of resident layers: within the room, spread over the step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
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

// The store is contiguous, as the ring: a region too long for what is left at the end goes to the start
// and evicts what it overlaps there, though the bytes alone would fit beside the newer regions.
TEST(RingPlan, ReplayPlacesRegionsAsTheRingDoes) {
  const std::vector<bool> none(3, false);
  // 1 at [0, 4), 2 at [4, 6); 0 (6 bytes) does not fit in [6, 10): at [0, 6) it evicts both, so 2 is
  // copied again (by bytes alone only 1 would go: 12 bytes).
  EXPECT_EQ(replay_copies({6, 4, 2}, {1, 2, 0, 2}, none, 10), 14u);
  EXPECT_EQ(replay_copies({6, 4, 2}, {1, 2, 0, 2}, none, 12), 12u);  // room for all three
}

// A step of the loop is counted once the passes settle. Here the second pass copies 0 again; that copy
// lands in [4, 5), at the end of the store, which the longer regions after it skip, so from the third
// pass on 0 is a hit.
TEST(RingPlan, AStepOfTheLoopIsCountedOnceThePassesSettle) {
  const std::vector<std::size_t> bytes = {1, 3, 4}, uses = {0, 1, 2};
  const std::vector<bool> none(3, false);
  const std::vector<std::size_t> twice = {0, 1, 2, 0, 1, 2};
  EXPECT_EQ(replay_copies(bytes, uses, none, 5), 8u);
  EXPECT_EQ(replay_copies(bytes, twice, none, 5) - replay_copies(bytes, uses, none, 5), 8u);  // the 2nd pass
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 5), 7u);
}

// The loop's step against the loop itself, on many small random loops: the bytes a step copies once the
// loop has settled (passes 25-48 of a long run, where the copies repeat with a period that divides 12) are
// what replay_step_in_loop gives. Taking two passes in a row that copy the same for settled fails here: a
// loop can copy the same twice and then go on to another figure (seen after a yield's re-plan).
TEST(RingPlan, TheLoopsStepIsWhatTheLongRunCopiesOnceSettled) {
  std::uint64_t seed = 12345;
  const auto next = [&seed](std::size_t n) {  // a small linear congruential generator: the same cases anywhere
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::size_t>((seed >> 33) % n);
  };
  int checked = 0;
  for (int c = 0; c < 3000; ++c) {
    const std::size_t layers = 2 + next(6);
    std::vector<std::size_t> bytes(layers);
    for (auto& b : bytes) b = 1 + next(9);
    std::vector<std::size_t> uses(3 + next(12));
    for (auto& u : uses) u = next(layers);
    const std::size_t capacity = 4 + next(24);
    const std::vector<bool> none(layers, false);
    std::vector<std::size_t> run;
    std::vector<std::uint64_t> total{0};  // total[k]: copied by the first k passes
    for (int pass = 1; pass <= 48; ++pass) {
      run.insert(run.end(), uses.begin(), uses.end());
      total.push_back(replay_copies(bytes, run, none, capacity));
    }
    const auto step = [&](int pass) { return total[pass] - total[pass - 1]; };
    bool periodic = true;  // passes 25-48 repeat with period 12 (any period that divides it)
    for (int pass = 37; pass <= 48; ++pass) periodic = periodic && step(pass) == step(pass - 12);
    if (!periodic) continue;
    ++checked;
    const std::uint64_t settled = (total[48] - total[36]) / 12;
    ASSERT_EQ(replay_step_in_loop(bytes, uses, none, capacity), settled)
        << "case " << c << ": " << layers << " layers, " << uses.size() << " uses, capacity " << capacity;
  }
  EXPECT_GT(checked, 2900);
}

// Copies ahead of need, as the engine's prefetch makes them. Two slots, uses 0 1 0 2 looped: on demand each
// step copies 0, 1 and 2 (30). With one layer looked ahead, 1 and then 2 are copied while 0 is in use, each
// placed past 0's region (it is held) over the other: 0 stays, and a step copies 20. A lookahead whose
// layers take more than a third of the store copies nothing ahead.
TEST(RingPlan, TheReplayMakesTheCopiesAheadOfNeedPastTheHeldRegion) {
  const std::vector<std::size_t> bytes = {10, 10, 10}, uses = {0, 1, 0, 2};
  const std::vector<bool> none(3, false);
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 20), 30u);
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 20, {}, Lookahead{1, {1, 1, 1}, {}}), 20u);
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 20, {}, Lookahead{1, {7, 7, 7}, {}}), 30u);  // 7 > 20 / 3
  // A layer never copied ahead (a trainable one) is skipped as the used one is: 2 is then copied on demand.
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 20, {}, Lookahead{1, {1, 1, 1}, {false, false, true}}), 30u);
  EXPECT_THROW(replay_step_in_loop(bytes, uses, none, 20, {}, Lookahead{1, {1, 1}, {}}), InvalidArgument);
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
  // Bytes alone: both streamed layers stay in the ring from one step to the next.
  EXPECT_EQ(plan_ring_and_residency(bytes, uses, 45, {30, 60}).copied_bytes, 0u);
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
  const std::vector<std::size_t> uses = checkpointed_step(4, 3);
  // An 8-byte ring holds two layers: a block's first layer is gone by its backward. A 12-byte one holds a
  // block, with less room left for resident layers.
  const std::size_t room = 18, ring_sizes[] = {8, 12, 16};
  const RingPlan plan = plan_ring_and_residency(bytes, uses, room, {8, 12, 16});
  std::uint64_t per_ring[3];
  for (int i = 0; i < 3; ++i) {
    const std::vector<bool> keep = spread_residency(bytes, room - ring_sizes[i]);
    per_ring[i] = replay_step_in_loop(bytes, uses, keep, ring_sizes[i]);
  }
  // 8 (two resident): a block's first layer is copied again for its backward, 19 copies a step.
  // 12 (one resident): each block is held from its recomputed forward to its backward, 16 copies.
  // 16 (none resident): the same, and the ring's extra layer does not repay the resident one, 18.
  EXPECT_EQ(per_ring[0], 76u);
  EXPECT_EQ(per_ring[1], 64u);
  EXPECT_EQ(per_ring[2], 72u);
  EXPECT_EQ(plan.ring_bytes, 12u);
  EXPECT_EQ(plan.copied_bytes, per_ring[1]);
  EXPECT_EQ(plan.resident, spread_residency(bytes, room - 12));
  std::size_t kept = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) kept += plan.resident[i] ? bytes[i] : 0;
  EXPECT_LE(kept + plan.ring_bytes, room);
}

// The budget records a step and part of the next before it plans: the step is the record's shortest
// period.
TEST(RingPlan, OneStepIsTheShortestPeriodOfTheRecord) {
  const std::vector<std::size_t> step = checkpointed_step(3, 2);  // 6 + 3 * 4 = 18 uses
  std::vector<std::size_t> record = step;
  record.insert(record.end(), step.begin(), step.begin() + 11);
  EXPECT_EQ(one_step(record), step);
  EXPECT_EQ(one_step({1, 2, 3}), std::vector<std::size_t>({1, 2, 3}));  // no repetition: all of it
  record.insert(record.end(), step.begin() + 11, step.end());
  record.insert(record.end(), step.begin(), step.end());
  EXPECT_EQ(one_step(record), step);  // three whole steps
  EXPECT_EQ(one_step({4, 4, 4}), std::vector<std::size_t>({4}));
  EXPECT_EQ(one_step({1, 2, 1, 3}), std::vector<std::size_t>({1, 2, 1, 3}));  // a border but not a period
  EXPECT_EQ(one_step({}), std::vector<std::size_t>());
}

// A step of a loop begins with what the previous one left in the ring: the end of a backward (the first
// block) is the start of the next forward. The plan counts that step, not the first from an empty ring.
TEST(RingPlan, TheReplayCountsAStepOfTheLoopWhichReusesTheLastOnesTail) {
  const std::vector<std::size_t> bytes(12, 4);
  const std::vector<std::size_t> uses = checkpointed_step(4, 3);
  const std::vector<bool> none(12, false);
  std::vector<std::size_t> twice = uses;
  twice.insert(twice.end(), uses.begin(), uses.end());
  // From an empty ring: the forward's 12 copies, then blocks 2, 1 and 0 again (block 3 is still there).
  EXPECT_EQ(replay_copies(bytes, uses, none, 12), 84u);
  // The next step finds block 0 in the ring: 18 copies.
  EXPECT_EQ(replay_copies(bytes, twice, none, 12), 156u);
  EXPECT_EQ(replay_step_in_loop(bytes, uses, none, 12), 72u);
  // Within 1% of the fewest copies, the deepest ring wins (it fetches further ahead at the same bytes);
  // when nothing is copied, the smallest (below).
  const RingPlan tie = plan_ring_and_residency(bytes, uses, 100, {12, 16}, 1.0);
  EXPECT_EQ(tie.ring_bytes, 12u);  // everything fits beside either: nothing copied
  const std::vector<std::size_t> big(12, 400);
  const RingPlan deep = plan_ring_and_residency(big, uses, 1300, {1200, 1204}, 1.0);
  EXPECT_EQ(deep.ring_bytes, 1204u);  // the same copies: no room for a resident layer beside either
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
