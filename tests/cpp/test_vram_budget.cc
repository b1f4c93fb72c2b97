// The VRAM budget's decisions (vram_budget.h): the ring's size, when a plan is made and from which uses,
// the room a step's peak leaves, when an allocator miss is memory pressure, and what a yield changes.
#include <gtest/gtest.h>

#include <string>

#include "layerstream/check.h"
#include "layerstream/vram_budget.h"

namespace layerstream {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(VramBudget, TheLeastRingIsFourOfTheLargestLayerAndNeverMoreThanTheLayersTake) {
  EXPECT_EQ(least_ring_bytes(100 * kMiB, 10000 * kMiB), 400 * kMiB);
  EXPECT_EQ(least_ring_bytes(100 * kMiB, 250 * kMiB), 250 * kMiB);  // the whole model is smaller
  EXPECT_EQ(least_ring_bytes(1000, 100000), ring_footprint(1000) * kMinRingLayers);  // rounded as the ring does
  EXPECT_EQ(ring_footprint(1), 256u);
  EXPECT_EQ(ring_footprint(256), 256u);
}

TEST(VramBudget, TheDefaultRingIsThreeLayersAtLeastTheFloorAndAFixedOneMustHoldALayer) {
  EXPECT_EQ(ring_bytes_for(100 * kMiB, 0, nullptr), 300 * kMiB);
  EXPECT_EQ(ring_bytes_for(100 * kMiB, 400 * kMiB, nullptr), 400 * kMiB);
  const std::size_t fixed = 150 * kMiB;
  EXPECT_EQ(ring_bytes_for(100 * kMiB, 400 * kMiB, &fixed), fixed);
  const std::size_t small = 50 * kMiB;
  try {
    ring_bytes_for(100 * kMiB, 0, &small);
    FAIL() << "a fixed ring smaller than a layer was taken";
  } catch (const InvalidArgument& e) {
    const std::string expected = "LAYERSTREAM_RING_MB is 50 MiB, smaller than a layer of 104857600 bytes; raise it "
                                 "to at least 100 MiB (3x that is better) [";  // then where it was raised
    EXPECT_EQ(std::string(e.what()).substr(0, expected.size()), expected);
  }
}

TEST(VramBudget, CandidateRingsAreTheOneInUseThenDeeperMultiplesOfTheLargestLayer) {
  EXPECT_EQ(candidate_rings(400 * kMiB, 100 * kMiB, false),
            (std::vector<std::size_t>{400 * kMiB, 500 * kMiB, 600 * kMiB, 800 * kMiB, 1000 * kMiB}));
  EXPECT_EQ(candidate_rings(400 * kMiB, 100 * kMiB, true), (std::vector<std::size_t>{400 * kMiB}));
}

TEST(VramBudget, TheRecorderWaitsForATrainingForwardThenPlansOnceTheOrderRepeated) {
  BudgetRecorder r;
  // Passes before training (samples under no_grad): not recorded; said once.
  EXPECT_EQ(r.observe(1, false, 0), BudgetRecorder::Outcome::kWaiting);
  EXPECT_EQ(r.observe(2, false, 0), BudgetRecorder::Outcome::kNothing);
  EXPECT_FALSE(r.recording());
  std::uint64_t hits = 5;  // predictions right before recording do not count
  EXPECT_EQ(r.observe(1, true, hits), BudgetRecorder::Outcome::kStarted);
  EXPECT_EQ(r.observe(2, true, hits), BudgetRecorder::Outcome::kRecording);
  EXPECT_EQ(r.observe(3, true, hits), BudgetRecorder::Outcome::kRecording);
  // Three layers: the plan is due after 2 * 3 + 2 correct predictions since recording began.
  BudgetRecorder::Outcome last = BudgetRecorder::Outcome::kNothing;
  int uses = 3;
  for (int i = 0; i < 8; ++i) {
    last = r.observe(static_cast<LayerId>(1 + i % 3), false, ++hits);  // a use without grad is recorded too
    ++uses;
    if (i < 7) EXPECT_EQ(last, BudgetRecorder::Outcome::kRecording) << i;
  }
  EXPECT_EQ(last, BudgetRecorder::Outcome::kPlanNow);
  EXPECT_TRUE(r.planned());
  EXPECT_EQ(r.first_uses(), (std::vector<LayerId>{1, 2, 3}));
  EXPECT_EQ(r.take_uses().size(), static_cast<std::size_t>(uses));
  EXPECT_TRUE(r.take_uses().empty());
  EXPECT_EQ(r.observe(1, true, ++hits), BudgetRecorder::Outcome::kNothing);  // planned: nothing more recorded
  // After a yield: recorded again from the next training forward, without saying again that it waits.
  r.unplan();
  EXPECT_FALSE(r.planned());
  EXPECT_TRUE(r.first_uses().empty());
  EXPECT_EQ(r.observe(1, false, hits), BudgetRecorder::Outcome::kNothing);
  EXPECT_EQ(r.observe(1, true, hits), BudgetRecorder::Outcome::kStarted);
}

TEST(VramBudget, TheStepPeakIsTheMostExcursionOnTopOfTheLatestStepsBase) {
  constexpr std::size_t kMiB = 1 << 20;
  StepPeaks p;
  EXPECT_FALSE(p.started());
  p.step_started(500 * kMiB);  // before the window: nothing
  EXPECT_FALSE(p.started());
  // The first step begins with 1000 MiB held (the model's leftovers, not counted as the step's) and its
  // backward peaks at 7144 MiB: an excursion of 6144.
  p.start(1000 * kMiB, /*at_step_start=*/true);
  p.on_live(4000 * kMiB);
  p.on_live(7144 * kMiB);
  p.on_live(1100 * kMiB);
  EXPECT_EQ(p.predicted(), 7144 * kMiB);
  p.step_ended();
  // Between steps: the optimizer's state (1200 MiB) is made and a sample peaks at 9000 MiB, then is freed.
  p.on_live(2300 * kMiB);
  p.on_live(9000 * kMiB);
  p.on_live(2300 * kMiB);
  EXPECT_EQ(p.predicted(), 6144 * kMiB + 2300 * kMiB);  // the sample is no step's excursion
  EXPECT_EQ(p.held_since_start(), 1300 * kMiB);
  // The second step begins on that base; halfway through its forward (3000 MiB of activations so far) the
  // plan reads: the first step's excursion on the new base, nothing counted twice.
  p.step_started(2300 * kMiB);
  p.on_live(5300 * kMiB);
  EXPECT_EQ(p.predicted(), (6144 + 2300) * kMiB);
  EXPECT_EQ(p.held_since_start(), 1300 * kMiB);
  // A step that rises further (a larger bucket) raises the prediction; a later smaller one does not lower it.
  p.on_live(9300 * kMiB);
  EXPECT_EQ(p.predicted(), 9300 * kMiB);
  p.step_ended();
  p.on_live(2300 * kMiB);
  p.step_started(2300 * kMiB);
  p.on_live(3300 * kMiB);
  EXPECT_EQ(p.predicted(), (7000 + 2300) * kMiB);
  // What the process freed since the window began (a text encoder dropped) lowers the base.
  p.step_ended();
  p.on_live(300 * kMiB);
  p.step_started(300 * kMiB);
  EXPECT_EQ(p.predicted(), 7300 * kMiB);
  EXPECT_EQ(p.held_since_start(), 0u);
  // A new window forgets the earlier steps.
  p.start(100 * kMiB, true);
  EXPECT_EQ(p.predicted(), 100 * kMiB);
}

TEST(VramBudget, AWindowBegunInsideAStepKeepsThatStepsPeakAsTheLeast) {
  constexpr std::size_t kMiB = 1 << 20;
  StepPeaks p;
  // A plan again after a yield inside a step: 5000 MiB held then (3000 of them that step's activations).
  p.start(5000 * kMiB, /*at_step_start=*/false);
  p.on_live(8000 * kMiB);
  EXPECT_EQ(p.predicted(), 8000 * kMiB);  // its base is unknown: its peak as it is
  p.step_ended();
  p.on_live(2000 * kMiB);
  EXPECT_EQ(p.predicted(), 8000 * kMiB);
  // The next step, from 2000 MiB, rises by 4000 so far: the partial step's 8000 stays the least.
  p.step_started(2000 * kMiB);
  p.on_live(6000 * kMiB);
  EXPECT_EQ(p.predicted(), 8000 * kMiB);
  p.on_live(10500 * kMiB);
  EXPECT_EQ(p.predicted(), 10500 * kMiB);
  p.step_ended();
  p.on_live(2000 * kMiB);
  p.step_started(2000 * kMiB);
  EXPECT_EQ(p.predicted(), 10500 * kMiB);  // the full step's excursion (8500) on its base
  EXPECT_EQ(p.held_since_start(), 0u);
}

TEST(VramBudget, TheRoomIsTheLimitLessThePeakWithoutTheRingAndTheHeadroom) {
  BudgetHeadroom h;
  EXPECT_EQ(h.threshold(), 0u);
  EXPECT_FALSE(BudgetHeadroom::is_pressure(h.threshold(), h.gap_threshold(), true, 0));  // before a plan
  const std::size_t limit = 24000 * kMiB;
  const BudgetHeadroom::Room r = h.room_for(limit, 6000 * kMiB, 500 * kMiB);
  EXPECT_EQ(r.headroom, limit / 1000 * 50);
  EXPECT_EQ(r.room, limit - (6000 - 500) * kMiB - r.headroom);
  EXPECT_EQ(h.threshold(), r.headroom / 2);
  EXPECT_EQ(h.gap_threshold(), limit / 4);
  // A peak beyond the limit leaves no room, without wrapping around.
  EXPECT_EQ(h.room_for(limit, 30000 * kMiB, 500 * kMiB).room, 0u);
}

TEST(VramBudget, AMissIsPressureInsideAStepBelowHalfTheHeadroomAndBetweenStepsBelowAQuarter) {
  BudgetHeadroom h;
  const BudgetHeadroom::Room r = h.room_for(24000 * kMiB, 6000 * kMiB, 500 * kMiB);
  const std::size_t t = h.threshold(), g = h.gap_threshold();
  // At the plan's own peak all the headroom is free: not pressure (the H200 saw a yield at every step when
  // the threshold was the whole headroom).
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, false, r.headroom));
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, false, t));
  EXPECT_TRUE(BudgetHeadroom::is_pressure(t, g, false, t - 1));
  // Between steps the allocator's callback cannot know what is asked: a 4 GiB tensor with 3.5 GiB free is
  // pressure there, not inside a step.
  EXPECT_TRUE(BudgetHeadroom::is_pressure(t, g, true, 3500 * kMiB));
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, false, 3500 * kMiB));
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, true, g));
}

TEST(VramBudget, AYieldInsideAStepDoublesTheHeadroomOneBetweenStepsLeavesTheGapItsQuarter) {
  BudgetHeadroom h;
  h.room_for(1000 * kMiB, 0, 0);
  for (std::size_t expected : {100u, 200u, 250u, 250u}) {
    h.after_yield(false);
    EXPECT_EQ(h.permille(), expected);
    EXPECT_EQ(h.threshold(), 0u);  // nothing left to give until the next plan
    EXPECT_EQ(h.gap_threshold(), 0u);
  }
  BudgetHeadroom gap;
  gap.room_for(1000 * kMiB, 0, 0);
  gap.after_yield(true);
  EXPECT_EQ(gap.permille(), 250u);
  // The next plan leaves a quarter free at the step's peak: a gap then finds at least that, not pressure.
  const BudgetHeadroom::Room r = gap.room_for(1000 * kMiB, 100 * kMiB, 0);
  EXPECT_FALSE(BudgetHeadroom::is_pressure(gap.threshold(), gap.gap_threshold(), true, r.headroom));
}

TEST(VramBudget, ThePlanKeepsTheRingInUseUnlessAnotherCopiesLess) {
  // Four layers of 100 used forward then backward; room for all of them and a ring: everything stays,
  // nothing is copied, and the ring in use is kept.
  const std::vector<std::size_t> sizes(4, 100), footprints(4, 256);
  const std::vector<std::size_t> uses{0, 1, 2, 3, 3, 2, 1, 0};
  const BudgetPlan all = plan_budget(sizes, footprints, uses, 10000, 768, 100, false);
  EXPECT_EQ(all.ring.copied_bytes, 0u);
  EXPECT_EQ(all.stay_copied, 0u);
  EXPECT_EQ(all.ring.ring_bytes, 768u);
  EXPECT_EQ(all.ring.resident, std::vector<bool>(4, true));
  // No room for resident layers beyond the ring: whichever ring is chosen copies no more than the one in use.
  const BudgetPlan none = plan_budget(sizes, footprints, uses, 768, 768, 100, false);
  EXPECT_LE(none.ring.copied_bytes, none.stay_copied);
  EXPECT_EQ(none.room, 768u);
}

}  // namespace
}  // namespace layerstream
