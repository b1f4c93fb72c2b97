// The VRAM budget's decisions (vram_budget.h): the ring's size, when a plan is made and from which uses,
// the room a step's peak leaves, when an allocator miss is memory pressure, and what a yield changes.
#include <gtest/gtest.h>

#include <limits>
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

TEST(VramBudget, TheRecorderWaitsForATrainingStepsStartThenPlansOnceTheOrderRepeated) {
  using Use = BudgetRecorder::Use;
  BudgetRecorder r;
  // Passes before training (samples under no_grad): not recorded; said once.
  EXPECT_EQ(r.observe(1, Use::kWithoutGrad, 0), BudgetRecorder::Outcome::kWaiting);
  EXPECT_EQ(r.observe(2, Use::kWithoutGrad, 0), BudgetRecorder::Outcome::kNothing);
  EXPECT_FALSE(r.recording());
  std::uint64_t hits = 5;  // predictions right before recording do not count
  EXPECT_EQ(r.observe(1, Use::kStepStart, hits), BudgetRecorder::Outcome::kStarted);
  EXPECT_EQ(r.observe(2, Use::kInStep, hits), BudgetRecorder::Outcome::kRecording);
  EXPECT_EQ(r.observe(3, Use::kInStep, hits), BudgetRecorder::Outcome::kRecording);
  // Three layers: the plan is due after 2 * 3 + 2 correct predictions since recording began.
  BudgetRecorder::Outcome last = BudgetRecorder::Outcome::kNothing;
  int uses = 3;
  for (int i = 0; i < 8; ++i) {
    last = r.observe(static_cast<LayerId>(1 + i % 3), Use::kWithoutGrad, ++hits);  // recorded too
    ++uses;
    if (i < 7) EXPECT_EQ(last, BudgetRecorder::Outcome::kRecording) << i;
  }
  EXPECT_EQ(last, BudgetRecorder::Outcome::kPlanNow);
  EXPECT_TRUE(r.planned());
  EXPECT_EQ(r.first_uses(), (std::vector<LayerId>{1, 2, 3}));
  EXPECT_EQ(r.take_uses().size(), static_cast<std::size_t>(uses));
  EXPECT_TRUE(r.take_uses().empty());
  EXPECT_EQ(r.observe(1, Use::kStepStart, ++hits), BudgetRecorder::Outcome::kNothing);  // planned: no more
  // After a yield (here inside a step): recorded again from the next step's start, not from the rest of
  // this step (a recompute with grad in its backward), and without saying again that it waits.
  r.unplan();
  EXPECT_FALSE(r.planned());
  EXPECT_TRUE(r.first_uses().empty());
  EXPECT_EQ(r.observe(2, Use::kInStep, hits), BudgetRecorder::Outcome::kNothing);
  EXPECT_EQ(r.observe(2, Use::kWithoutGrad, hits), BudgetRecorder::Outcome::kNothing);
  EXPECT_FALSE(r.recording());
  EXPECT_EQ(r.observe(1, Use::kStepStart, hits), BudgetRecorder::Outcome::kStarted);
  EXPECT_EQ(r.first_uses(), (std::vector<LayerId>{1}));
}

TEST(VramBudget, AModelWhoseStepsNeverStartWithGradIsRecordedFromItsFirstUseWithGrad) {
  // Every layer in reentrant checkpoints: the forward without grad, the recompute with grad inside the
  // backward; no use starts a step, so the first use with grad starts the record.
  using Use = BudgetRecorder::Use;
  BudgetRecorder r;
  EXPECT_EQ(r.observe(1, Use::kWithoutGrad, 0), BudgetRecorder::Outcome::kWaiting);
  EXPECT_EQ(r.observe(1, Use::kInStep, 0), BudgetRecorder::Outcome::kStarted);
  EXPECT_TRUE(r.recording());
  // A recorder that began with a step (nothing before it) does not say it waits after a restart either:
  // that message is about the passes before the first training step.
  BudgetRecorder s;
  EXPECT_EQ(s.observe(1, Use::kStepStart, 0), BudgetRecorder::Outcome::kStarted);
  s.unplan();
  EXPECT_EQ(s.observe(1, Use::kWithoutGrad, 0), BudgetRecorder::Outcome::kNothing);
  EXPECT_EQ(s.observe(1, Use::kInStep, 0), BudgetRecorder::Outcome::kNothing);
  EXPECT_EQ(s.observe(1, Use::kStepStart, 0), BudgetRecorder::Outcome::kStarted);
}

TEST(VramBudget, TheSteadyPeakAddsWhatTheWindowLeftHeldAndNothingForWhatItFreed) {
  constexpr std::size_t kMiB = 1 << 20;
  // The first step peaked at 6 GiB; 1.2 GiB of optimizer state made after it is still held.
  EXPECT_EQ(steady_peak(6144 * kMiB, 1000 * kMiB, 2200 * kMiB), 7344 * kMiB);
  // What the window freed (a text encoder dropped in the step) does not lower the peak.
  EXPECT_EQ(steady_peak(6144 * kMiB, 3000 * kMiB, 1000 * kMiB), 6144 * kMiB);
  EXPECT_EQ(steady_peak(6144 * kMiB, 1000 * kMiB, 1000 * kMiB), 6144 * kMiB);
}

TEST(VramBudget, ACyclesStepAndGapRisesCountTheOptimizersTemporariesAndItsStateOnce) {
  CyclePeaks p;
  p.cycle_started(500 * kMiB);  // before the window: nothing
  p.backward_ended();
  EXPECT_EQ(p.predicted_gap(), 0u);
  // Step 1 begins with 1000 MiB held; its backward peaks at 4000 (3000 of activations, 200 of them the
  // gradients it leaves); the optimizer's step then makes 1200 MiB of state and 1500 of temporaries on top.
  p.start(1000 * kMiB, /*at_cycle_start=*/true);
  p.on_live(4000 * kMiB);
  EXPECT_EQ(p.predicted(), 4000 * kMiB);
  EXPECT_EQ(p.predicted_gap(), 0u);  // no gap seen yet
  p.on_live(1200 * kMiB);
  p.backward_ended();
  p.on_live(2400 * kMiB);  // the state
  p.on_live(3900 * kMiB);  // and the temporaries: the gap rose 2900 above the cycle's start
  EXPECT_EQ(p.predicted_gap(), 3900 * kMiB);  // the cycle so far counts whole
  p.on_live(2400 * kMiB);
  p.on_live(2200 * kMiB);  // zero_grad frees the gradients
  // Step 2 begins with the state held: the first cycle's step rose 3000, its gap 2900 less the 1200 it kept.
  p.cycle_started(2200 * kMiB);
  EXPECT_EQ(p.predicted(), (3000 + 2200) * kMiB);
  EXPECT_EQ(p.predicted_gap(), (1700 + 2200) * kMiB);
  EXPECT_EQ(p.held_since_start(), 1200 * kMiB);
  p.on_live(4200 * kMiB);  // halfway through its forward (a smaller bucket): nothing counted twice
  EXPECT_EQ(p.predicted(), 5200 * kMiB);
  p.on_live(5700 * kMiB);  // its backward rises 3500: the most now
  EXPECT_EQ(p.predicted(), 5700 * kMiB);
  p.on_live(2400 * kMiB);
  p.backward_ended();
  p.on_live(3900 * kMiB);
  p.on_live(2200 * kMiB);
  p.cycle_started(2200 * kMiB);
  EXPECT_EQ(p.predicted(), (3500 + 2200) * kMiB);
  EXPECT_EQ(p.predicted_gap(), (1700 + 2200) * kMiB);
  // A reentrant recompute: training forwards inside the backward after a nested backward ended.
  p.on_live(3000 * kMiB);
  p.backward_ended();
  p.on_live(3100 * kMiB);  // the gap so far
  p.forward_resumed();
  p.on_live(4000 * kMiB);  // a step's rise again, not the gap's
  EXPECT_EQ(p.predicted(), (3500 + 2200) * kMiB);
  EXPECT_EQ(p.predicted_gap(), (1700 + 2200) * kMiB);
}

TEST(VramBudget, WhatAGapKeepsIsTheNextCyclesStartAndAReleaseOfTheStartIsNoRise) {
  // The user's 4 GiB, taken between steps and held into the next: the next start, not a rise.
  CyclePeaks q;
  q.start(1000 * kMiB, true);
  q.on_live(3000 * kMiB);
  q.on_live(1000 * kMiB);
  q.backward_ended();
  q.on_live(5096 * kMiB);
  q.cycle_started(5096 * kMiB);
  EXPECT_EQ(q.predicted(), (2000 + 5096) * kMiB);
  EXPECT_EQ(q.predicted_gap(), 5096 * kMiB);
  // Freed in the next gap (the user gave it back): a lower start, the same rises.
  q.on_live(7096 * kMiB);
  q.on_live(5096 * kMiB);
  q.backward_ended();
  q.on_live(1000 * kMiB);
  q.cycle_started(1000 * kMiB);
  EXPECT_EQ(q.predicted(), 3000 * kMiB);
  EXPECT_EQ(q.predicted_gap(), 1000 * kMiB);
  // Resident layers uploaded inside a cycle are a rise of its step (a plan leaves them room).
  q.on_live(9000 * kMiB);
  q.cycle_started(9000 * kMiB);
  EXPECT_EQ(q.predicted(), (8000 + 9000) * kMiB);
  // A window whose cycle begins with 8000 MiB of resident layers and gives them back in its gap: no rise.
  CyclePeaks r;
  r.start(9000 * kMiB, true);
  r.on_live(10000 * kMiB);
  r.on_live(9000 * kMiB);
  r.backward_ended();
  r.on_live(1000 * kMiB);
  r.on_live(1500 * kMiB);
  r.cycle_started(1000 * kMiB);
  EXPECT_EQ(r.predicted(), 2000 * kMiB);
  EXPECT_EQ(r.predicted_gap(), 1000 * kMiB);
}

TEST(VramBudget, ACycleWindowBegunInsideAStepKeepsThatPeakAsTheLeast) {
  CyclePeaks p;
  p.start(5000 * kMiB, /*at_cycle_start=*/false);  // 3000 of the 5000 are this step's activations
  p.on_live(8000 * kMiB);
  EXPECT_EQ(p.predicted(), 8000 * kMiB);
  p.on_live(2500 * kMiB);
  p.backward_ended();
  p.on_live(3500 * kMiB);
  p.on_live(2000 * kMiB);
  p.cycle_started(2000 * kMiB);
  p.on_live(6000 * kMiB);
  EXPECT_EQ(p.predicted(), 8000 * kMiB);  // the next full cycle rose 4000 so far: the partial peak stays
  EXPECT_EQ(p.predicted_gap(), 3500 * kMiB);
  p.on_live(10500 * kMiB);
  p.on_live(2000 * kMiB);
  p.backward_ended();
  p.on_live(2500 * kMiB);
  p.cycle_started(2000 * kMiB);
  EXPECT_EQ(p.predicted(), 10500 * kMiB);
  EXPECT_EQ(p.predicted_gap(), 3500 * kMiB);
  EXPECT_EQ(p.held_since_start(), 0u);
}

TEST(VramBudget, TheGapsQuarterIsLeftFreeAtTheGapsPeakBesideTheHeadroomAtTheSteps) {
  BudgetHeadroom h;
  const std::size_t limit = 24000 * kMiB, ring = 1000 * kMiB;
  // Step peak 12000 (ring in it): 24000 - 11000 - 5% (1200) = 11800 for the ring and the residents.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring).room, 11800 * kMiB);
  // A gap peaking at 10000 leaves a quarter (6000) and the headroom free there: 24000 - 9000 - 7200 = 7800.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 10000 * kMiB).room, 7800 * kMiB);
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 10000 * kMiB, 4000 * kMiB).room, 7800 * kMiB);  // start unused
  // A gap peaking at 6000: the step's peak decides.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 6000 * kMiB).room, 11800 * kMiB);
  EXPECT_EQ(h.gap_threshold(), 6000 * kMiB);
  // A yield between steps after a plan that measured the gaps keeps the headroom; without, a quarter.
  h.after_yield(/*between_steps=*/true, /*gap_measured=*/true);
  EXPECT_EQ(h.permille(), 50u);
  EXPECT_EQ(h.threshold(), 0u);
  h.after_yield(/*between_steps=*/true, /*gap_measured=*/false);
  EXPECT_EQ(h.permille(), 250u);
}

TEST(VramBudget, LendingTheGapsQuarterLeavesTheHeadroomAtBothPeaksAndSaysWhatItLent) {
  BudgetHeadroom h;
  h.set_lend_gap(true);
  const std::size_t limit = 24000 * kMiB, ring = 1000 * kMiB;
  // Step peak 12000, gap peak 10000: the default leaves 7800 (the quarter at the gap's peak); lending, the
  // step's peak decides (11800: the gap's peak with the headroom would leave 13800), and 4000 of it is lent.
  BudgetHeadroom::Room r = h.room_for(limit, 12000 * kMiB, ring, 10000 * kMiB);
  EXPECT_EQ(r.room, 11800 * kMiB);
  EXPECT_EQ(r.lent, 4000 * kMiB);
  // A gap peaking above the step (14000): the headroom at the gap's peak decides (9800), the default's 3800
  // of it is the rest, 6000 lent: all the quarter.
  r = h.room_for(limit, 12000 * kMiB, ring, 14000 * kMiB);
  EXPECT_EQ(r.room, 9800 * kMiB);
  EXPECT_EQ(r.lent, 6000 * kMiB);
  // A low gap: the default already leaves the step's room; nothing is lent.
  r = h.room_for(limit, 12000 * kMiB, ring, 6000 * kMiB);
  EXPECT_EQ(r.room, 11800 * kMiB);
  EXPECT_EQ(r.lent, 0u);
  // Before any gap was measured: the step's room, nothing lent; the thresholds are the default's.
  r = h.room_for(limit, 12000 * kMiB, ring);
  EXPECT_EQ(r.room, 11800 * kMiB);
  EXPECT_EQ(r.lent, 0u);
  EXPECT_EQ(h.gap_threshold(), 6000 * kMiB);
  EXPECT_EQ(h.threshold(), 600 * kMiB);
  // The default never lends.
  BudgetHeadroom d;
  EXPECT_EQ(d.room_for(limit, 12000 * kMiB, ring, 10000 * kMiB).lent, 0u);
}

TEST(VramBudget, WithTheQuarterAboveStartTheGapGetsTheHeadroomAtItsPeakAndAQuarterAboveTheCyclesStart) {
  BudgetHeadroom h;
  h.set_quarter_above_start(true);
  const std::size_t limit = 24000 * kMiB, ring = 1000 * kMiB;
  // A gap peaking at 14000 leaves the headroom there: 24000 - 13000 - 1200 = 9800.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 14000 * kMiB, 4000 * kMiB).room, 9800 * kMiB);
  // A gap that rose 10000 above a cycle's start of 4000 takes more than a quarter: its peak decides, with
  // no quarter on top of it (FLUX.2-shaped on the H200 kept 4.3 GiB resident that way, not 8.1).
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 14000 * kMiB, 4000 * kMiB).room,
            h.room_for(limit, 12000 * kMiB, ring, 14000 * kMiB, 0).room);
  // A gap that rose 2000 above a start of 9000: the quarter (6000) and the headroom above the start decide:
  // 24000 - 8000 - 7200 = 8800, under the 11800 its step and its peak would leave.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 11000 * kMiB, 9000 * kMiB).room, 8800 * kMiB);
  // A gap peaking low above a low start: the step's peak (11800, as above) decides.
  EXPECT_EQ(h.room_for(limit, 12000 * kMiB, ring, 6000 * kMiB, 1000 * kMiB).room, 11800 * kMiB);
  EXPECT_EQ(h.gap_threshold(), 6000 * kMiB);
}

TEST(VramBudget, WithTheQuarterAboveStartAGapWithinItsPlannedRoomIsNeverPressure) {
  // The plan above: limit 24000, ring 1000, a gap rising 10000 above a start of 4000, a room of 9800 all
  // used. Free memory at each level the gap reaches is what the plan left there; none of it is pressure,
  // and 4 GiB asked at the gap's floor find room without a yield.
  BudgetHeadroom h;
  h.set_quarter_above_start(true);
  const std::size_t limit = 24000 * kMiB, start = 4000 * kMiB, rise = 10000 * kMiB;
  const BudgetHeadroom::Room r = h.room_for(limit, 12000 * kMiB, 1000 * kMiB, start + rise, start);
  const std::size_t free_at_start = limit - (start - 1000 * kMiB) - r.room;  // the ring counted once
  EXPECT_EQ(free_at_start, rise + r.headroom);
  for (std::size_t used = 0; used <= rise; used += 500 * kMiB) {
    EXPECT_FALSE(BudgetHeadroom::is_pressure(h.threshold(), h.gap_threshold(), true, free_at_start - used, used))
        << used / kMiB;
  }
  EXPECT_GE(free_at_start, std::size_t{4096} * kMiB);
  // Beyond the gap's measured peak: pressure once less than half the headroom is left.
  EXPECT_FALSE(BudgetHeadroom::is_pressure(h.threshold(), h.gap_threshold(), true, h.threshold(), rise + 600 * kMiB));
  EXPECT_TRUE(BudgetHeadroom::is_pressure(h.threshold(), h.gap_threshold(), true, h.threshold() - 1, rise + 700 * kMiB));
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
  // Between steps the allocator's callback cannot know what is asked: a 4 GiB tensor with 3.5 GiB free
  // and nothing held by the gap is pressure there, not inside a step.
  EXPECT_TRUE(BudgetHeadroom::is_pressure(t, g, true, 3500 * kMiB));
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, false, 3500 * kMiB));
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, true, g));
  // What the gap holds already counts toward its quarter: 3.5 GiB free beside 2.5 GiB held by the gap is not.
  EXPECT_FALSE(BudgetHeadroom::is_pressure(t, g, true, 3500 * kMiB, 2500 * kMiB));
  EXPECT_TRUE(BudgetHeadroom::is_pressure(t, g, true, 3500 * kMiB, 2499 * kMiB));
  // Half the headroom is the least free between steps too, whatever the gap holds.
  EXPECT_TRUE(BudgetHeadroom::is_pressure(t, g, true, t - 1, 20000 * kMiB));
}

TEST(VramBudget, APressureYieldInsideAStepWithTheRetryGivesBackTheHeadroomElseEverything) {
  BudgetHeadroom h;
  const BudgetHeadroom::Room r = h.room_for(24000 * kMiB, 6000 * kMiB, 500 * kMiB);
  const std::size_t t = h.threshold(), all = std::numeric_limits<std::size_t>::max();
  // Inside a step with the retry: what brings the free memory back to the whole headroom.
  EXPECT_EQ(BudgetHeadroom::pressure_yield_bytes(t, false, 560 * kMiB, true), r.headroom - 560 * kMiB);
  EXPECT_EQ(BudgetHeadroom::pressure_yield_bytes(t, false, 0, true), r.headroom);
  // Without the retry, between steps, or before a plan: everything idle.
  EXPECT_EQ(BudgetHeadroom::pressure_yield_bytes(t, false, 560 * kMiB, false), all);
  EXPECT_EQ(BudgetHeadroom::pressure_yield_bytes(t, true, 560 * kMiB, true), all);
  EXPECT_EQ(BudgetHeadroom::pressure_yield_bytes(0, false, 560 * kMiB, true), all);
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
