// The VRAM budget's choice of resident layers: within the room, spread over the step.
#include <gtest/gtest.h>

#include <numeric>

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

}  // namespace
}  // namespace layerstream
