// AccessPredictor: learns a checkpointed training step's order from one step and predicts the next
// step exactly; recovers after the order changes.
#include <gtest/gtest.h>

#include <vector>

#include "layerstream/access_predictor.h"
#include "layerstream/check.h"

namespace layerstream {
namespace {

// Layer ids in the order a checkpointed step uses them: forward, then per block (last first) the
// recomputed forward and the backward.
std::vector<std::uint64_t> checkpointed_step(std::uint64_t blocks, std::uint64_t per_block) {
  std::vector<std::uint64_t> order;
  for (std::uint64_t i = 0; i < blocks * per_block; ++i) order.push_back(i + 1);
  for (std::uint64_t b = blocks; b-- > 0;) {
    for (std::uint64_t i = 0; i < per_block; ++i) order.push_back(b * per_block + i + 1);
    for (std::uint64_t i = per_block; i-- > 0;) order.push_back(b * per_block + i + 1);
  }
  return order;
}

// Feeds one step and returns how many of its uses were predicted correctly.
std::uint64_t run_step(AccessPredictor& p, const std::vector<std::uint64_t>& step) {
  const std::uint64_t before = p.stats().correct;
  for (auto id : step) p.observe(id);
  return p.stats().correct - before;
}

TEST(AccessPredictor, SecondStepIsPredictedExactly) {
  AccessPredictor p;
  const auto step = checkpointed_step(6, 4);
  run_step(p, step);
  for (std::size_t i = 0; i < step.size(); ++i) {
    p.observe(step[i]);
    if (i + 1 == step.size()) continue;
    const auto next = p.predict(3);
    ASSERT_FALSE(next.empty()) << "no prediction after call " << i;
    for (std::size_t k = 0; k < next.size() && i + 1 + k < step.size(); ++k) {
      EXPECT_EQ(next[k], step[i + 1 + k]) << "call " << i << " + " << k;
    }
  }
  EXPECT_GE(run_step(p, step), step.size() - 3);
}

TEST(AccessPredictor, TinyBlocksWhoseForwardAndRecomputeLookAlike) {
  const auto step = checkpointed_step(3, 2);
  AccessPredictor p;
  run_step(p, step);
  EXPECT_GE(run_step(p, step), step.size() - 3);
  EXPECT_GE(run_step(p, step), step.size() - 3);
}

TEST(AccessPredictor, UnknownContextPredictsNothingAndAChangedOrderIsRelearned) {
  AccessPredictor p;
  EXPECT_TRUE(p.predict(4).empty());
  const auto train = checkpointed_step(3, 4);
  run_step(p, train), run_step(p, train);
  // An inference pass (forward only) breaks the pattern once; one training step relearns the
  // boundary, and the next one is predicted again.
  for (std::uint64_t id = 1; id <= 12; ++id) p.observe(id);
  run_step(p, train);
  EXPECT_GE(run_step(p, train), train.size() - 3);
}

// Without checkpointing: the forward, then the backward visits every layer in reverse.
std::vector<std::uint64_t> plain_step(std::uint64_t layers) {
  std::vector<std::uint64_t> order;
  for (std::uint64_t i = 1; i <= layers; ++i) order.push_back(i);
  for (std::uint64_t i = layers; i >= 1; --i) order.push_back(i);
  return order;
}

TEST(AccessPredictor, StepsWithoutCheckpointingAndAccumulatedMicroStepsArePredicted) {
  AccessPredictor p;
  const auto step = plain_step(10);
  run_step(p, step);
  EXPECT_GE(run_step(p, step), step.size() - 2);
  // Gradient accumulation: several forward+backward passes per optimizer step are the same sequence
  // again (the optimizer touches no managed layer), so they stay predicted.
  for (int micro = 0; micro < 4; ++micro) EXPECT_GE(run_step(p, step), step.size() - 2) << "micro " << micro;
}

TEST(AccessPredictor, RegularInferencePassesBetweenStepsAreLearnedToo) {
  AccessPredictor p;
  const auto train = checkpointed_step(3, 4);
  std::vector<std::uint64_t> sample;  // forward only, e.g. a preview image every few steps
  for (std::uint64_t id = 1; id <= 12; ++id) sample.push_back(id);
  for (int cycle = 0; cycle < 3; ++cycle) {
    run_step(p, train), run_step(p, train), run_step(p, sample);
  }
  // Once both patterns were seen in this rhythm, each is predicted but for the switches between them.
  EXPECT_GE(run_step(p, train), train.size() - 4);
  EXPECT_GE(run_step(p, train), train.size() - 4);
  EXPECT_GE(run_step(p, sample), sample.size() - 4);
}

TEST(AccessPredictor, BoundedHistoryKeepsPredicting) {
  AccessPredictor p(256);
  const auto step = checkpointed_step(2, 3);  // 18 calls per step
  for (int rep = 0; rep < 40; ++rep) {
    for (auto id : step) p.observe(id);
  }
  p.observe(step[0]);
  p.observe(step[1]);
  const auto next = p.predict(2);
  ASSERT_EQ(next.size(), 2u);
  EXPECT_EQ(next[0], step[2]);
  EXPECT_THROW(AccessPredictor(16), InvalidArgument);
}

}  // namespace
}  // namespace layerstream
