#include "layerstream/budget_controller.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "layerstream/check.h"

namespace layerstream {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// What the plan's peak measured, for its INFO line: " MiB in ... (...": the caller closes the parenthesis.
std::string describe_peak(const DeviceMemoryView& view, const BudgetHeadroom& rule) {
  const char* what = view.cycles ? " MiB in a training cycle (the most a step rose above its cycle's start, on "
                                   "the current cycle's start; LAYERSTREAM_VRAM_PEAK=cycles"
                                 : " MiB in the training step (from its first forward";
  const char* held = view.cycles ? " MiB of it held since the first cycle, such as the optimizer's state"
                                 : " MiB of it made after the step's own peak and still held, such as the "
                                   "optimizer's state";
  return detail::concat(what, "; what the process held before is not counted",
                        view.held_since > 0 ? detail::concat("; ", view.held_since / kMiB, held) : std::string(),
                        view.gap_peak > 0 ? detail::concat("; ", view.gap_peak / kMiB, " MiB between steps, where ",
                                                           rule.quarter_above_start()
                                                               ? "the headroom is left free, and a quarter and "
                                                                 "the headroom above the cycle's start "
                                                                 "(LAYERSTREAM_VRAM_GAP=start)"
                                                           : rule.lend_gap()
                                                               ? "the headroom is left free, and a quarter is lent "
                                                                 "to resident layers given back first on demand "
                                                                 "(LAYERSTREAM_VRAM_GAP=lend)"
                                                               : "a quarter is left free beside the headroom")
                                          : std::string());
}

}  // namespace

BudgetConfig BudgetConfig::from(const Settings& settings) {
  BudgetConfig c;
  c.budget = settings.vram_budget;
  c.peak = settings.vram_peak;
  c.gap = settings.vram_gap;
  c.ring_fixed = settings.ring_bytes.has_value();
  c.resident_bytes = settings.resident_bytes;
  c.lookahead_layers = settings.prefetch ? settings.prefetch_layers : 0;
  return c;
}

BudgetController::BudgetController(const BudgetConfig& config) : config_(config) {
  headroom_.set_quarter_above_start(config.gap == VramGap::kQuarterAboveStart);
  headroom_.set_lend_gap(config.gap == VramGap::kLend);
}

StepEdge BudgetController::on_layer_call(bool grad, bool outside_backward) {
  // A forward with grad enabled starts (or continues) a training step; a pass without grad (a sample, a
  // frozen teacher inside a step) leaves the flag as it is. A step begins at its first forward outside any
  // backward; one inside a backward (a reentrant checkpoint's recompute, after its nested backward ended)
  // goes on with the step.
  StepEdge edge;
  edge.resumed = grad && !step_.in_step.exchange(true);
  edge.began = edge.resumed && outside_backward;
  step_.began = edge.began;
  if (edge.began) step_.plan_added = 0;  // the new cycle's start counts them
  return edge;
}

void BudgetController::on_backward_ended() {
  step_.in_step = false;
  step_.gap_in_window = true;
}

std::size_t BudgetController::lend_first(std::size_t want, bool between_steps) const {
  const std::size_t lend = loan_.lendable;
  const bool unknown = want == kUnknown;
  return between_steps && lend > 0 && !loan_.lent && (unknown || want <= lend) ? lend : 0;
}

void BudgetController::on_lent(std::size_t lent, const std::vector<LayerId>& given) {
  loan_.lent = true;
  loan_.to_remake.insert(given.begin(), given.end());
  ++loan_.lends;
  loan_.lent_bytes += lent;
  if (++loan_.in_a_row >= kLendsInARow) {
    // Every gap asks for it (the optimizer's temporaries missing torch's cache each time, say): each step
    // would copy the lent layers again and the allocator churn. Keep the quarter free instead.
    headroom_.set_lend_gap(false);
    loan_.stopped = true;
    request_replan(/*between_steps=*/true);
  }
}

void BudgetController::on_yielded(std::size_t freed, bool between_steps, std::size_t free_bytes) {
  ++feed_.yields;
  feed_.yielded_bytes += freed;
  feed_.free_bytes = free_bytes;
  feed_.threshold = 0;  // until the next plan: nothing more to give back
  feed_.gap_threshold = 0;
  request_replan(between_steps);
}

void BudgetController::request_replan(bool between_steps) {
  // A yield inside a step says the plan left too little; one between steps says nothing about the plan.
  if (!feed_.pending || !between_steps) feed_.between_steps = between_steps;
  feed_.pending = true;
}

std::string BudgetController::describe_yield() const {
  const std::size_t free_then = feed_.free_bytes.load();
  if (loan_.stopped) {
    return detail::concat("layerstream: the gaps between training steps on ", name_, " took back the quarter "
                          "lent to resident layers ", kLendsInARow, " times in a row (", loan_.lent_bytes / kMiB,
                          " MiB over ", loan_.lends, " time(s) so far): LAYERSTREAM_VRAM_GAP=lend stops, and "
                          "the plan leaves the quarter free as the default does");
  }
  return detail::concat("layerstream: an allocation of this process ",
                        feed_.between_steps.load() ? "between training steps" : "inside a training step",
                        " found no room on ", name_,
                        free_then != kUnknown ? detail::concat(" (", free_then / kMiB, " MiB free)") : std::string(),
                        ": resident layers gave their memory back (", feed_.yielded_bytes.load() / kMiB, " MiB over ",
                        feed_.yields.load(), " time(s) so far); they stream now");
}

std::string BudgetController::take_pressure(std::size_t ring_capacity,
                                            const std::function<std::size_t()>& least_ring_of) {
  if (!feed_.pending.exchange(false)) return std::string();
  const std::string given = describe_yield();
  loan_.stopped = false;
  if (!config_.budget.enabled) return given;
  // Plan again from the next training steps, whose peak now includes what asked for the memory (when it is
  // still held); after a yield inside a step with more headroom each time, so that a process whose peak
  // keeps growing does not yield at every step. A yield between steps (a sample, the user's tensors) keeps
  // the headroom: the next plan measures the step again.
  headroom_.after_yield(feed_.between_steps.exchange(false), config_.peak == VramPeak::kCycles);
  forget_plan();
  room_ = 0;
  const std::size_t least_ring = least_ring_of();
  const bool shrink = !config_.ring_fixed && ring_capacity > least_ring;
  if (shrink) {  // the plan's deeper ring goes back to the least at the next call with no layer in use
    ring_.planned = least_ring;
    ring_.shrink = true;
  }
  return detail::concat(given, "; the VRAM budget plans again from the next training steps with ",
                        headroom_.permille() / 10, "% headroom",
                        shrink ? detail::concat(", and the device ring goes back to ", least_ring / kMiB, " MiB") : "");
}

std::string BudgetController::take_gone(bool pressure_reported) {
  const std::size_t gone = feed_.resident_gone.exchange(0);
  if (gone == 0 || !config_.budget.enabled || !recorder_.planned() || pressure_reported) return std::string();
  // A freed model's resident layers left memory the plan no longer uses: plan again from the next training
  // steps (the layers still resident stay until then; the new plan counts them as its own).
  forget_plan();
  return detail::concat("layerstream VRAM budget on ", name_, ": resident layers of a model no longer managed left "
                        "with it (", gone / kMiB, " MiB); the budget plans again from the next training steps");
}

void BudgetController::on_engine_rebuilt() {
  loan_.to_remake.clear();  // the rebuilt engine makes the plan's layers resident as they register
  if (ring_.keep_plan) {
    recorder_.restart();
  } else {
    forget_plan();  // a rebuilt engine: plan its layers again
  }
  ring_.keep_plan = false;
}

bool BudgetController::remake_pending(LayerId layer, bool training) const {
  return training && loan_.to_remake.count(layer) != 0;
}

bool BudgetController::take_remake(LayerId layer, bool training) {
  return training && !loan_.to_remake.empty() && loan_.to_remake.erase(layer) != 0;
}

std::size_t BudgetController::remake_failed() {
  // No room: what the gap's allocation took is still held, so the lent memory cannot come back. As after a
  // yield between steps, the rest goes back too and the budget plans again from the steps that hold it (a
  // failed try at every use would cost torch's allocator its whole out-of-memory path each time).
  loan_.to_remake.clear();
  return kUnknown;
}

UseActions BudgetController::on_layer_use(LayerId layer, bool training, std::uint64_t correct_predictions) {
  UseActions out;
  if (training && step_.began && !std::exchange(loan_.lent, false)) loan_.in_a_row = 0;  // a gap that kept it
  if (!config_.budget.enabled) return out;
  using Use = BudgetRecorder::Use;
  const Use use = !training ? Use::kWithoutGrad : step_.began ? Use::kStepStart : Use::kInStep;
  switch (recorder_.observe(layer, use, correct_predictions)) {
    case BudgetRecorder::Outcome::kWaiting: out.waits_for_training = true; break;
    case BudgetRecorder::Outcome::kStarted:
      step_.gap_in_window = false;
      plan_deferred_ = false;
      out.start_peak_window = true;
      break;
    case BudgetRecorder::Outcome::kPlanNow:
      // The cycles' measure plans once the window has seen a gap between steps (else its peak is unknown).
      plan_deferred_ = config_.peak == VramPeak::kCycles && !step_.gap_in_window;
      out.plan_now = !plan_deferred_;
      break;
    default:
      if (plan_deferred_ && step_.began && step_.gap_in_window) {  // the next step's first forward
        plan_deferred_ = false;
        out.plan_now = true;
      }
      break;
  }
  return out;
}

void BudgetController::forget_plan() {
  recorder_.unplan();
  plan_deferred_ = false;
  planned_resident_.clear();
  loan_.lendable = 0;
  loan_.to_remake.clear();
}

PlanDecision BudgetController::plan(const DeviceMemoryView& view, const std::vector<PlannedLayer>& layers,
                                    std::size_t ring, std::size_t resident_now) {
  PlanDecision out;
  if (view.limit == 0) {
    out.ignored = "LAYERSTREAM_VRAM_BUDGET is set but nothing reports device memory here; ignored";
    return out;
  }
  // Layers still resident from an earlier plan (a yield gives back only what no call holds, and on the
  // simulator only what the allocation asked) were in the peaks measured: like the ring, the plan places
  // them anew, and gives back those it no longer keeps.
  const BudgetHeadroom::Room room =
      headroom_.room_for(view.limit, view.peak, ring + resident_now, view.gap_peak, view.gap_start);
  feed_.threshold = headroom_.threshold();
  feed_.gap_threshold = headroom_.gap_threshold();
  std::vector<std::size_t> sizes, footprints;  // copied and resident bytes; what each takes in the ring
  Lookahead ahead;  // the copies made ahead of need, replayed by the plan too
  ahead.layers = config_.lookahead_layers;
  std::unordered_map<LayerId, std::size_t> index;
  std::size_t largest = 0;
  for (const PlannedLayer& layer : layers) {
    index.emplace(layer.id, sizes.size());
    sizes.push_back(layer.bytes);
    footprints.push_back(ring_footprint(layer.in_ring));
    ahead.bytes.push_back(layer.in_ring);
    ahead.never.push_back(layer.never_ahead);
    largest = std::max(largest, layer.in_ring);
  }
  std::vector<std::size_t> recorded;
  for (LayerId id : recorder_.take_uses()) {
    if (auto it = index.find(id); it != index.end()) recorded.push_back(it->second);
  }
  const BudgetPlan budget =
      plan_budget(sizes, footprints, one_step(recorded), room.room, ring, largest, config_.ring_fixed, ahead);
  out.ring_bytes = budget.ring.ring_bytes;
  out.resident = budget.ring.resident;
  out.stay_copied = budget.stay_copied;
  out.copied_bytes = budget.ring.copied_bytes;
  room_ = room.room > out.ring_bytes ? room.room - out.ring_bytes : 0;
  estimate_ = out.copied_bytes;
  // With a new ring the resident copies are made as the layers register with the rebuilt engine
  // (keep_on_register); with this one, now. Either way spread over the step (residency_plan.h): streamed
  // copies then overlap resident layers' compute.
  out.rebuild = out.ring_bytes != ring;
  ring_.planned = out.rebuild ? out.ring_bytes : 0;
  loan_.lendable = room.lent;  // bounded by what was kept, in plan_applied
  planned_resident_.clear();
  return out;
}

std::string BudgetController::plan_applied(const DeviceMemoryView& view, const PlanDecision& plan,
                                           const KeptLayers& kept, std::size_t ring) {
  planned_resident_.insert(kept.deferred.begin(), kept.deferred.end());
  step_.plan_added = kept.bytes + (plan.ring_bytes > ring ? plan.ring_bytes - ring : 0);
  loan_.lendable = std::min(loan_.lendable, kept.bytes);
  loan_.lent = false;
  loan_.in_a_row = 0;
  loan_.to_remake.clear();
  const std::string lend_note =
      loan_.lendable > 0
          ? detail::concat("; ", loan_.lendable / kMiB, " MiB of them in the quarter lent between steps, given "
                           "back first when an allocation there needs it and copied again in the next step")
          : std::string();
  const std::string ring_note =
      plan.rebuild ? detail::concat("; the device ring grows from ", ring / kMiB, " to ", plan.ring_bytes / kMiB,
                                    " MiB at the next layer call (estimated copies per planned sequence ",
                                    plan.stay_copied / kMiB, " -> ", plan.copied_bytes / kMiB, " MiB)")
                   : std::string();
  return detail::concat("layerstream VRAM budget on ", name_, ": ", view.limit / kMiB, " MiB",
                        config_.budget.automatic ? " (auto)" : "", ", peak ", view.peak / kMiB,
                        describe_peak(view, headroom_), "), ", headroom_.permille() / 10, "% headroom: ", kept.layers,
                        " layers (", kept.bytes / kMiB, " MiB) stay on the device, ", kept.streamed, " stream",
                        lend_note, ring_note,
                        kept.not_copied > 0 ? detail::concat(" (", kept.not_copied, " of them planned to stay, but "
                                                             "their copy could not be issued: ", kept.copy_error, ")")
                                            : std::string());
}

bool BudgetController::keep_on_register(const void* host_block, std::size_t resident_now, std::size_t bytes) const {
  if (!planned_resident_.empty() && planned_resident_.count(host_block) != 0) return true;  // the plan's
  if (config_.resident_bytes == 0) return false;
  // The engine's own count: layers re-packed or removed give their share back by themselves.
  return resident_now + bytes <= config_.resident_bytes;
}

void BudgetController::on_ring_rebuilt() {
  ring_.planned = 0;
  ring_.keep_plan = !ring_.shrink;  // a shrink after memory pressure is planned again
  ring_.shrink = false;
}

BudgetCounters BudgetController::counters() const {
  BudgetCounters c;
  c.planned = recorder_.planned();
  c.room = room_;
  c.estimate = estimate_;
  c.pressure_yields = feed_.yields.load();
  c.pressure_yielded_bytes = feed_.yielded_bytes.load();
  c.gap_lends = loan_.lends;
  c.gap_lent_bytes = loan_.lent_bytes;
  return c;
}

}  // namespace layerstream
