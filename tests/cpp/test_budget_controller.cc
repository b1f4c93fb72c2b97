// The VRAM budget's controller without torch: when it plans, what a yield, a gap's loan, a freed model and
// a failed remake change, and the lines it has its owner log. BudgetOwner (budget_owner.h) drives it as
// DeviceState does over a modelled device.
#include "layerstream/budget_controller.h"

#include <gtest/gtest.h>

#include "budget_owner.h"
#include "layerstream/check.h"

namespace layerstream {
namespace {

using testing::BudgetOwner;

constexpr std::size_t kMiB = std::size_t{1} << 20;

BudgetConfig budget_config(VramPeak peak = VramPeak::kCycles, VramGap gap = VramGap::kQuarterAtPeak) {
  BudgetConfig c;
  c.budget.enabled = true;
  c.budget.automatic = true;
  c.peak = peak;
  c.gap = gap;
  return c;
}

// One training step of `layers` layers: each forward allocates `act`, the backward frees it in reverse,
// and the gap after it allocates and frees `gap` (the optimizer's temporaries).
void step(BudgetOwner& o, std::size_t layers, std::size_t act, std::size_t gap) {
  std::size_t held = 0;
  for (LayerId i = 0; i < layers; ++i) {
    o.call(i, /*grad=*/true, /*outside_backward=*/true);
    if (o.allocate(act)) held += act;
  }
  for (LayerId i = layers; i-- > 0;) o.call(i, /*grad=*/false, /*outside_backward=*/false);
  o.release(held);
  o.backward_ended();
  if (o.allocate(gap)) o.release(gap);
}

// Eight layers of 16 MiB on a 1 GiB device, 32 MiB of activations per layer, a 64 MiB gap: steps until the
// budget planned.
void plan_first(BudgetOwner& o) {
  for (int i = 0; i < 6 && o.plans() == 0; ++i) step(o, 8, 32 * kMiB, 64 * kMiB);
  ASSERT_EQ(o.plans(), 1u);
}
const std::vector<std::size_t> kEightLayers(8, 16 * kMiB);

TEST(BudgetController, ItPlansOnceTheOrderRepeatedAndWithCyclesOnlyAfterAGapWasSeen) {
  BudgetOwner o(budget_config(), 1024 * kMiB, kEightLayers);
  // Uses without grad before training (a sample) only have it say, once, that it waits.
  for (LayerId i = 0; i < 8; ++i) o.call(i, false, true);
  EXPECT_EQ(o.plans(), 0u);
  step(o, 8, 32 * kMiB, 64 * kMiB);
  EXPECT_EQ(o.plans(), 0u);  // the first step is only recorded
  for (int i = 0; i < 4; ++i) step(o, 8, 32 * kMiB, 64 * kMiB);
  ASSERT_EQ(o.plans(), 1u);
  EXPECT_TRUE(o.budget().counters().planned);
  const std::string& line = o.log().back();
  EXPECT_EQ(line.rfind("layerstream VRAM budget on sim:0: 1024 MiB (auto), peak ", 0), 0u) << line;
  EXPECT_NE(line.find("MiB between steps, where a quarter is left free beside the headroom), 5% headroom: 8 "
                      "layers (128 MiB) stay on the device, 0 stream"),
            std::string::npos)
      << line;
  // Planned, it stays planned: no more plans, no yield, everything resident.
  for (int i = 0; i < 10; ++i) step(o, 8, 32 * kMiB, 64 * kMiB);
  EXPECT_EQ(o.plans(), 1u);
  EXPECT_EQ(o.budget().counters().pressure_yields, 0u);
  EXPECT_EQ(o.resident_bytes(), 128 * kMiB);
  EXPECT_GE(o.least_margin(), 0);
  EXPECT_EQ(o.ooms(), 0u);
}

TEST(BudgetController, WithoutABudgetNothingIsPlannedButAYieldIsStillReported) {
  BudgetConfig config;  // LAYERSTREAM_VRAM_BUDGET unset
  BudgetController b(config);
  b.set_name("sim:0");
  EXPECT_FALSE(b.may_act());
  const UseActions act = b.on_layer_use(1, true, 100);
  EXPECT_FALSE(act.plan_now || act.start_peak_window || act.waits_for_training);
  b.on_yielded(5 * kMiB, /*between_steps=*/true, 300 * kMiB);
  EXPECT_TRUE(b.may_act());
  EXPECT_EQ(b.take_pressure(64 * kMiB, [] { return std::size_t{0}; }),
            "layerstream: an allocation of this process between training steps found no room on sim:0 (300 MiB "
            "free): resident layers gave their memory back (5 MiB over 1 time(s) so far); they stream now");
  EXPECT_EQ(b.take_pressure(64 * kMiB, [] { return std::size_t{0}; }), "");  // said once per yield
  EXPECT_FALSE(b.may_act());
}

TEST(BudgetController, AYieldInsideAStepForgetsThePlanDoublesTheHeadroomAndShrinksTheRing) {
  BudgetOwner o(budget_config(), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  ASSERT_GT(b.pressure_threshold(), 0u);
  b.on_yielded(48 * kMiB, /*between_steps=*/false, 20 * kMiB);
  EXPECT_EQ(b.pressure_threshold(), 0u);  // nothing more to give back until the next plan
  EXPECT_EQ(b.gap_pressure_threshold(), 0u);
  bool asked = false;
  const std::string line = b.take_pressure(512 * kMiB, [&] {
    asked = true;
    return 64 * kMiB;
  });
  EXPECT_TRUE(asked);
  EXPECT_EQ(line, "layerstream: an allocation of this process inside a training step found no room on sim:0 (20 MiB "
                  "free): resident layers gave their memory back (48 MiB over 1 time(s) so far); they stream now; "
                  "the VRAM budget plans again from the next training steps with 10% headroom, and the device ring "
                  "goes back to 64 MiB");
  EXPECT_FALSE(b.counters().planned);
  EXPECT_EQ(b.pending_ring(), 64 * kMiB);
}

// Sixty-four layers of 16 MiB on a 1 GiB device (the plan keeps as many as fit beside the steps), then a
// step that holds `extra` more from its fourth layer to its backward's end (a larger bucket): the miss there
// is pressure. Returns the resident bytes just before that step.
std::size_t plan_then_grow(BudgetOwner& o, std::size_t extra) {
  const auto grown_step = [&](std::size_t more) {
    std::size_t held = 0;
    for (LayerId i = 0; i < 64; ++i) {
      o.call(i, /*grad=*/true, /*outside_backward=*/true);
      if (o.allocate(4 * kMiB)) held += 4 * kMiB;
      if (i == 3 && more > 0 && o.allocate(more)) held += more;
    }
    for (LayerId i = 64; i-- > 0;) o.call(i, /*grad=*/false, /*outside_backward=*/false);
    o.release(held);
    o.backward_ended();
    if (o.allocate(16 * kMiB)) o.release(16 * kMiB);
  };
  for (int i = 0; i < 6; ++i) grown_step(0);
  EXPECT_EQ(o.plans(), 1u);
  const std::size_t before = o.resident_bytes();
  grown_step(extra);
  for (int i = 0; i < 12; ++i) grown_step(0);
  return before;
}

TEST(BudgetController, APressureInsideAStepWithTheAllocationRetryGivesBackTheHeadroomNotEveryLayer) {
  const std::vector<std::size_t> sizes(64, 16 * kMiB);
  // Lending the gap's quarter (LAYERSTREAM_VRAM_GAP=lend), the step's peak has only the headroom beside it.
  const BudgetConfig config = budget_config(VramPeak::kCycles, VramGap::kLend);
  BudgetOwner all(config, 1024 * kMiB, sizes), some(config, 1024 * kMiB, sizes);
  some.set_allocation_retry(true);
  const std::size_t extra = 56 * kMiB;  // more than the 5% headroom (51 MiB) the plan left at the peak
  const std::size_t before = plan_then_grow(all, extra);
  ASSERT_EQ(plan_then_grow(some, extra), before);
  ASSERT_GT(before, 20 * 16 * kMiB);
  // Without the retry every resident layer went back; with it, what brought the free memory back to the
  // headroom (51 MiB of the 1 GiB) at the miss that found less than half of it free: two layers of 16 MiB.
  EXPECT_EQ(all.budget().counters().pressure_yields, 1u);
  EXPECT_EQ(all.budget().counters().pressure_yielded_bytes, before);
  EXPECT_EQ(some.budget().counters().pressure_yields, 1u);
  EXPECT_EQ(some.budget().counters().pressure_yielded_bytes, 2 * 16 * kMiB);
  EXPECT_EQ(some.ooms(), 0u);
  EXPECT_EQ(some.retries(), 0u);  // the callback's yield made the room before the allocation failed
  // Both planned again with 10% headroom, from steps that no longer hold the extra, to the same layers.
  EXPECT_EQ(all.plans(), 2u);
  EXPECT_EQ(some.plans(), 2u);
  EXPECT_EQ(some.resident_bytes(), all.resident_bytes());
  EXPECT_NE(some.log().back().find("10% headroom"), std::string::npos) << some.log().back();
}

TEST(BudgetController, AYieldBetweenStepsKeepsTheHeadroomTheCyclesMeasured) {
  BudgetOwner o(budget_config(), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  b.on_yielded(16 * kMiB, /*between_steps=*/true, BudgetController::kUnknown);
  const std::string line = b.take_pressure(o.ring(), [&] { return o.ring(); });
  EXPECT_EQ(line, "layerstream: an allocation of this process between training steps found no room on sim:0: "
                  "resident layers gave their memory back (16 MiB over 1 time(s) so far); they stream now; the VRAM "
                  "budget plans again from the next training steps with 5% headroom");
  EXPECT_EQ(b.pending_ring(), 0u);  // the ring in use is the least: nothing to shrink
}

TEST(BudgetController, AGapTakesItsLoanOncePerGapAndAfterThreeInARowLendingStops) {
  BudgetOwner o(budget_config(VramPeak::kCycles, VramGap::kLend), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  const std::size_t lend = b.lend_first(BudgetController::kUnknown, /*between_steps=*/true);
  ASSERT_GT(lend, 0u);
  EXPECT_EQ(b.lend_first(BudgetController::kUnknown, /*between_steps=*/false), 0u);  // inside a step: no loan
  EXPECT_EQ(b.lend_first(lend + 1, true), 0u);  // known to want more than the loan frees
  for (int gap = 1; gap <= 3; ++gap) {
    b.on_lent(lend, {0, 1});
    EXPECT_EQ(b.lend_first(BudgetController::kUnknown, true), 0u) << "once per gap";
    EXPECT_TRUE(b.take_remake(0, /*training=*/true));  // copied again at its next use in a step
    EXPECT_FALSE(b.take_remake(0, true));
    EXPECT_FALSE(b.remake_pending(1, /*training=*/false));
    EXPECT_TRUE(b.remake_pending(1, true));
    b.on_layer_call(false, false);
    b.on_backward_ended();
    ASSERT_TRUE(b.on_layer_call(true, true).began);
    b.on_layer_use(2, true, 0);  // the next step begins: its gap may take the loan again
  }
  EXPECT_EQ(b.counters().gap_lends, 3u);
  EXPECT_EQ(b.counters().gap_lent_bytes, 3 * lend);
  EXPECT_EQ(b.counters().pressure_yields, 0u);
  const std::string line = b.take_pressure(o.ring(), [&] { return o.ring(); });
  EXPECT_EQ(line.rfind(detail::concat("layerstream: the gaps between training steps on sim:0 took back the quarter "
                                      "lent to resident layers 3 times in a row (", 3 * lend / kMiB, " MiB over 3 "
                                      "time(s) so far): LAYERSTREAM_VRAM_GAP=lend stops"),
                       0),
            0u)
      << line;
  EXPECT_FALSE(b.counters().planned);
}

TEST(BudgetController, AStepWhoseGapKeptTheLoanStartsTheCountAgain) {
  BudgetOwner o(budget_config(VramPeak::kCycles, VramGap::kLend), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  const std::size_t lend = b.lend_first(BudgetController::kUnknown, true);
  for (int round = 0; round < 4; ++round) {
    b.on_lent(lend, {});
    b.on_backward_ended();
    b.on_layer_call(true, true);
    b.on_layer_use(0, true, 0);  // began after a lending gap
    b.on_backward_ended();
    b.on_layer_call(true, true);
    b.on_layer_use(0, true, 0);  // began after a gap that kept it: the count starts again
  }
  EXPECT_EQ(b.counters().gap_lends, 4u);
  EXPECT_EQ(b.take_pressure(o.ring(), [] { return std::size_t{0}; }), "");
  EXPECT_TRUE(b.counters().planned);
}

TEST(BudgetController, ARemakeWithoutRoomGivesBackTheRestAndPlansAgain) {
  BudgetOwner o(budget_config(VramPeak::kCycles, VramGap::kLend), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  b.on_lent(16 * kMiB, {3});
  ASSERT_TRUE(b.take_remake(3, true));
  b.on_lent(16 * kMiB, {4, 5});
  EXPECT_EQ(b.remake_failed(), BudgetController::kUnknown);
  EXPECT_FALSE(b.take_remake(4, true));  // the others are not remade either
  b.on_yielded(64 * kMiB, true, BudgetController::kUnknown);
  EXPECT_NE(b.take_pressure(o.ring(), [&] { return o.ring(); }).find("between training steps"), std::string::npos);
  EXPECT_FALSE(b.counters().planned);
}

TEST(BudgetController, ResidentLayersThatLeftWithTheirModelHaveItPlanAgainOnce) {
  BudgetController fresh(budget_config());
  fresh.on_resident_gone(8 * kMiB);
  EXPECT_EQ(fresh.take_gone(false), "");  // no plan yet: nothing to redo
  BudgetOwner o(budget_config(), 1024 * kMiB, kEightLayers);
  plan_first(o);
  BudgetController& b = o.budget();
  b.on_resident_gone(3 * kMiB);
  EXPECT_EQ(b.take_gone(/*pressure_reported=*/true), "");  // the pressure's new plan covers it
  EXPECT_TRUE(b.counters().planned);
  b.on_resident_gone(5 * kMiB);
  b.on_resident_gone(3 * kMiB);
  EXPECT_EQ(b.take_gone(false), "layerstream VRAM budget on sim:0: resident layers of a model no longer managed "
                                "left with it (8 MiB); the budget plans again from the next training steps");
  EXPECT_FALSE(b.counters().planned);
  EXPECT_EQ(b.take_gone(false), "");
}

TEST(BudgetController, ARegisteringLayerStaysResidentWhenPlannedOrWithinTheResidentSetting) {
  BudgetConfig config = budget_config();
  config.resident_bytes = 10 * kMiB;
  BudgetController b(config);
  const char blocks[3] = {};
  EXPECT_TRUE(b.keep_on_register(&blocks[0], 0, 6 * kMiB));
  EXPECT_FALSE(b.keep_on_register(&blocks[0], 6 * kMiB, 6 * kMiB));  // first come, first kept
  // A plan with a new ring keeps its layers resident as they register with the rebuilt engine.
  DeviceMemoryView view;
  view.limit = 1024 * kMiB;
  view.peak = 100 * kMiB;
  const std::vector<PlannedLayer> layers = {{0, 16 * kMiB, 16 * kMiB, false}, {1, 16 * kMiB, 16 * kMiB, false}};
  const PlanDecision plan = b.plan(view, layers, 48 * kMiB, 0);
  ASSERT_TRUE(plan.ignored.empty());
  KeptLayers kept;
  kept.layers = 1;
  kept.bytes = 16 * kMiB;
  kept.deferred = {&blocks[1]};
  (void)b.plan_applied(view, plan, kept, 48 * kMiB);
  EXPECT_TRUE(b.keep_on_register(&blocks[1], 100 * kMiB, 16 * kMiB));
  EXPECT_FALSE(b.keep_on_register(&blocks[2], 100 * kMiB, 16 * kMiB));
}

TEST(BudgetController, APlanWithoutAViewOfTheDeviceIsIgnoredWithOneLine) {
  BudgetController b(budget_config());
  const PlanDecision plan = b.plan(DeviceMemoryView{}, {{0, kMiB, kMiB, false}}, 4 * kMiB, 0);
  EXPECT_EQ(plan.ignored, "LAYERSTREAM_VRAM_BUDGET is set but nothing reports device memory here; ignored");
  EXPECT_EQ(b.pressure_threshold(), 0u);
}

TEST(BudgetController, AStepBeginsAtItsFirstTrainingForwardOutsideABackward) {
  BudgetController b(budget_config());
  EXPECT_FALSE(b.on_layer_call(false, true).resumed);  // no grad: a sample
  EXPECT_FALSE(b.in_training_step());
  const StepEdge first = b.on_layer_call(true, true);
  EXPECT_TRUE(first.resumed && first.began && b.step_began() && b.in_training_step());
  const StepEdge second = b.on_layer_call(true, true);
  EXPECT_FALSE(second.resumed || b.step_began());
  b.on_backward_ended();
  EXPECT_FALSE(b.in_training_step());
  const StepEdge recompute = b.on_layer_call(true, /*outside_backward=*/false);  // a reentrant recompute
  EXPECT_TRUE(recompute.resumed);
  EXPECT_FALSE(recompute.began);
}

}  // namespace
}  // namespace layerstream
