// DeviceState's policy (device_state.h): what each layer use teaches the access predictor and the VRAM
// budget, the prefetch it leads to, which layers stay resident, and how resident copies give memory back
// under pressure. The state's construction, its engine and its counters are in device_state.cc.
#include "device_state.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>

#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/sim_backend.h"
#include "layerstream/vram_budget.h"

namespace layerstream::torchglue {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

DeviceState::MemoryResolver& memory_resolver() {
  static auto* r = new DeviceState::MemoryResolver();
  return *r;
}
DeviceState::PeakWindowStarter& peak_window_starter() {
  static auto* s = new DeviceState::PeakWindowStarter();
  return *s;
}
DeviceState::CycleMarker& cycle_marker() {
  static auto* m = new DeviceState::CycleMarker();
  return *m;
}

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

void DeviceState::set_memory_resolver(MemoryResolver resolver, PeakWindowStarter start_peak_window,
                                      CycleMarker mark_cycle) {
  memory_resolver() = std::move(resolver);
  peak_window_starter() = std::move(start_peak_window);
  cycle_marker() = std::move(mark_cycle);
}

void DeviceState::note_use(LayerId layer, bool fresh_each_use) {
  // A forward with grad enabled starts (or continues) a training step; a pass without grad (a sample, a
  // frozen teacher inside a step) leaves the flag as it is. A step begins at its first forward outside any
  // backward; one inside a backward (a reentrant checkpoint's recompute, after its nested backward ended)
  // goes on with the step.
  const bool grad = at::GradMode::is_enabled() || GradForwardScope::active();
  const bool resumed = grad && !in_step_.exchange(true);  // the first training forward since a backward ended
  const bool began = resumed && torch::autograd::get_current_graph_task_id() < 0;
  step_began_ = began;
  if (resumed) mark_cycle(began ? CycleEvent::kStepStarted : CycleEvent::kForwardResumed);
  const UseOutcome outcome = observe_and_prefetch(layer, fresh_each_use);
  if (!outcome.prefetch_error.empty()) {
    log_once("prefetch-failed", LogLevel::kWarning,
             "layerstream: a copy ahead of need could not be issued (" + outcome.prefetch_error +
                 "); such layers are copied when they are used instead, where an error that persists is raised");
  }
  // Logged outside mu_, as the plan's report below: a Python log sink takes the GIL.
  if (!outcome.pressure_report.empty()) log(LogLevel::kWarning, outcome.pressure_report);
  if (!outcome.gone_report.empty()) log(LogLevel::kInfo, outcome.gone_report);
  if (outcome.waits_for_training) {
    log_once("vram-budget-waits-for-training", LogLevel::kInfo,
             "layerstream VRAM budget: planned from the first training steps (a forward with grad enabled); "
             "until then every layer streams");
  }
  if (!outcome.plan_now) return;
  // Outside the lock: the resolver takes the GIL, and a thread holding the GIL may be waiting for mu_.
  const DeviceMemoryView view = memory_view();
  std::string report;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (engine_) report = apply_vram_budget_locked(view);
  }
  if (!report.empty()) log(view.limit == 0 ? LogLevel::kWarning : LogLevel::kInfo, report);
}

bool DeviceState::yield_for_pressure(std::size_t want, bool between_steps, std::size_t free_bytes) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || !engine_) return false;
  // LAYERSTREAM_VRAM_GAP=lend: between steps the layers the gap's quarter holds go back first, once per gap,
  // and the plan stands (they are copied again at their next use in a step). Not when the allocation is
  // known to want more than they free (the simulator says how much; torch's allocator does not).
  const std::size_t lend = lendable_bytes_.load();
  const bool unknown = want == std::numeric_limits<std::size_t>::max();
  if (between_steps && lend > 0 && !gap_lent_.load() && (unknown || want <= lend)) {
    std::vector<LayerId> given;
    const std::size_t lent = engine_->yield_resident(lend, &given);
    if (lent > 0) {
      gap_lent_ = true;
      to_remake_.insert(given.begin(), given.end());
      ++gap_lends_;
      gap_lent_bytes_ += lent;
      if (++lends_in_a_row_ >= kLendsInARow) {
        // Every gap asks for it (the optimizer's temporaries missing torch's cache each time, say): each step
        // would copy the lent layers again and the allocator churn. Keep the quarter free instead.
        headroom_.set_lend_gap(false);
        lend_stopped_ = true;
        request_replan(/*between_steps=*/true);
      }
      return true;
    }
  }
  const std::size_t freed = engine_->yield_resident(want);
  if (freed == 0) return false;
  note_yield(freed, between_steps, free_bytes);
  return true;
}

void DeviceState::note_resident_layer_gone(std::size_t bytes) { resident_gone_bytes_ += bytes; }

void DeviceState::note_yield(std::size_t freed, bool between_steps, std::size_t free_bytes) {
  ++pressure_yields_;
  pressure_yielded_bytes_ += freed;
  pressure_free_ = free_bytes;
  pressure_threshold_ = 0;  // until the next plan: nothing more to give back
  gap_pressure_threshold_ = 0;
  request_replan(between_steps);
}

void DeviceState::request_replan(bool between_steps) {
  // A yield inside a step says the plan left too little; one between steps says nothing about the plan.
  if (!pressure_pending_ || !between_steps) pressure_between_steps_ = between_steps;
  pressure_pending_ = true;
}

void DeviceState::note_backward_pass() {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0 || step_task_.exchange(task) == task) return;
  std::weak_ptr<DeviceState> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) {
      state->in_step_ = false;
      state->step_task_ = -1;
      state->gap_in_window_ = true;
      state->mark_cycle(CycleEvent::kBackwardEnded);
    }
  });
}

std::string DeviceState::replan_after_pressure_locked() {
  const std::size_t free_then = pressure_free_.load();
  const std::string given =
      lend_stopped_.exchange(false)
          ? detail::concat("layerstream: the gaps between training steps on ", describe(), " took back the quarter "
                           "lent to resident layers ", kLendsInARow, " times in a row (", gap_lent_bytes_.load() / kMiB,
                           " MiB over ", gap_lends_.load(), " time(s) so far): LAYERSTREAM_VRAM_GAP=lend stops, and "
                           "the plan leaves the quarter free as the default does")
          : detail::concat("layerstream: an allocation of this process ",
                           pressure_between_steps_.load() ? "between training steps" : "inside a training step",
                           " found no room on ", describe(),
                           free_then != std::numeric_limits<std::size_t>::max()
                               ? detail::concat(" (", free_then / kMiB, " MiB free)")
                               : std::string(),
                           ": resident layers gave their memory back (", pressure_yielded_bytes_.load() / kMiB,
                           " MiB over ", pressure_yields_.load(), " time(s) so far); they stream now");
  if (!vram_budget_.enabled) return given;
  // Plan again from the next training steps, whose peak now includes what asked for the memory (when it is
  // still held); after a yield inside a step with more headroom each time, so that a process whose peak
  // keeps growing does not yield at every step. A yield between steps (a sample, the user's tensors) keeps
  // the headroom: the next plan measures the step again.
  headroom_.after_yield(pressure_between_steps_.exchange(false), vram_peak_ == VramPeak::kCycles);
  forget_plan_locked();
  budget_room_ = 0;
  const std::size_t least = ring_bytes_for(largest_attached_.load());
  const bool shrink = !ring_fixed_ && engine_->ring_capacity() > least;
  if (shrink) {  // the plan's deeper ring goes back to the least at the next call with no layer in use
    planned_ring_bytes_ = least;
    shrink_pending_ = true;
  }
  return detail::concat(given, "; the VRAM budget plans again from the next training steps with ",
                        headroom_.permille() / 10, "% headroom",
                        shrink ? detail::concat(", and the device ring goes back to ", least / kMiB, " MiB") : "");
}

void DeviceState::start_peak_window_locked() {
  gap_in_window_ = false;
  plan_deferred_ = false;
  if (mode_ == Mode::kSim) {
    auto& sim = static_cast<SimBackend&>(*pool_->backend);
    sim.reset_device_peak();
    if (vram_peak_ == VramPeak::kCycles) {
      sim.start_cycle_peaks(/*at_cycle_start=*/step_began_);
    }
  } else if (peak_window_starter()) {
    peak_window_starter()(*this);
  }
}

void DeviceState::mark_cycle(CycleEvent event) {
  if (event == CycleEvent::kStepStarted) plan_added_bytes_ = 0;  // the new cycle's start counts them
  if (mode_ != Mode::kSim) {
    if (cycle_marker()) cycle_marker()(*this, event);
    return;
  }
  if (vram_peak_ == VramPeak::kCycles) static_cast<SimBackend&>(*pool_->backend).cycle_event(event);
}

DeviceMemoryView DeviceState::memory_view() {
  DeviceMemoryView view;
  if (mode_ == Mode::kSim) {
    // The simulated card: its capacity (or the budget), and the most allocated on it since the window's start.
    const std::size_t total = pool_->backend->device_memory_info().second;
    view.limit = vram_budget_.automatic ? total : vram_budget_.bytes;
    auto& sim = static_cast<SimBackend&>(*pool_->backend);
    view.peak = sim.device_peak_bytes();  // since the window's start
    if (vram_peak_ == VramPeak::kCycles) {
      const CyclePeaks cycles = sim.cycle_peaks();
      view.peak = cycles.predicted();
      view.gap_peak = cycles.predicted_gap();
      view.gap_start = cycles.cycle_start();
      view.held_since = cycles.held_since_start();
      view.cycles = true;
    }
  } else if (memory_resolver()) {
    view = memory_resolver()(*this, vram_budget_);
  }
  return view;
}

DeviceState::UseOutcome DeviceState::observe_and_prefetch(LayerId layer, bool fresh_each_use) {
  UseOutcome out;
  if (!prefetch_ && !vram_budget_.enabled && !pressure_pending_) return out;
  std::lock_guard<std::mutex> lock(mu_);  // also keeps the engine from being rebuilt meanwhile
  if (!engine_) return out;
  if (pressure_pending_.exchange(false)) out.pressure_report = replan_after_pressure_locked();
  const std::size_t gone = resident_gone_bytes_.exchange(0);
  if (gone > 0 && vram_budget_.enabled && recorder_.planned() && out.pressure_report.empty()) {
    // A freed model's resident layers left memory the plan no longer uses: plan again from the next training
    // steps (the layers still resident stay until then; the new plan counts them as its own).
    forget_plan_locked();
    out.gone_report = detail::concat("layerstream VRAM budget on ", describe(), ": resident layers of a model no "
                                     "longer managed left with it (", gone / kMiB, " MiB); the budget plans again "
                                     "from the next training steps");
  }
  if (predictor_generation_ != generation_) {  // layer ids of an older engine mean nothing now
    predictor_ = AccessPredictor();
    predictor_generation_ = generation_;
    fresh_each_use_.clear();
    to_remake_.clear();  // the rebuilt engine makes the plan's layers resident as they register
    if (keep_plan_) {
      recorder_.restart();
    } else {
      forget_plan_locked();  // a rebuilt engine: plan its layers again
    }
    keep_plan_ = false;
  }
  if (fresh_each_use) {
    fresh_each_use_.insert(layer);
  } else {
    fresh_each_use_.erase(layer);
  }
  predictor_.observe(layer);
  // An autograd function's forward runs with grad mode off: its caller says whether grad was on
  // (GradForwardScope).
  const bool training = at::GradMode::is_enabled() || GradForwardScope::active();
  if (training && step_began_ && !gap_lent_.exchange(false)) lends_in_a_row_ = 0;  // =lend: a gap that kept it
  if (training) remake_resident_locked(layer);     // lent to the last gap: used in a step again
  if (vram_budget_.enabled) {
    using Use = BudgetRecorder::Use;
    const Use use = !training ? Use::kWithoutGrad : step_began_ ? Use::kStepStart : Use::kInStep;  // note_use's
    switch (recorder_.observe(layer, use, predictor_.stats().correct)) {
      case BudgetRecorder::Outcome::kWaiting: out.waits_for_training = true; break;
      case BudgetRecorder::Outcome::kStarted: start_peak_window_locked(); break;
      case BudgetRecorder::Outcome::kPlanNow:
        // The cycles' measure plans once the window has seen a gap between steps (else its peak is unknown).
        plan_deferred_ = vram_peak_ == VramPeak::kCycles && !gap_in_window_;
        out.plan_now = !plan_deferred_;
        break;
      default:
        if (plan_deferred_ && step_began_ && gap_in_window_) {  // the next step's first forward
          plan_deferred_ = false;
          out.plan_now = true;
        }
        break;
    }
  }
  if (!prefetch_) return out;
  const std::size_t budget = engine_->ring_capacity() / 3;
  std::size_t planned = 0;
  for (LayerId next : predictor_.predict(lookahead_layers_)) {
    if (next == layer || fresh_each_use_.count(next) != 0) continue;
    const std::optional<std::size_t> bytes = layer_bytes_locked(next, /*in_ring=*/true);
    if (!bytes) break;  // that layer is gone (freed model): the prediction is stale
    planned += *bytes;
    if (planned > budget) break;
    if (training && to_remake_.count(next) != 0) {  // copied ahead into its own memory again
      remake_resident_locked(next);
      continue;
    }
    try {
      engine_->prefetch(next);
    } catch (const std::exception& e) {
      // The engine left nothing of it in the ring; the layer's own fetch copies it (and raises what persists).
      out.prefetch_error = e.what();
      break;
    }
  }
  return out;
}

void DeviceState::forget_plan_locked() {
  recorder_.unplan();
  plan_deferred_ = false;
  planned_resident_.clear();
  lendable_bytes_ = 0;
  to_remake_.clear();
}

void DeviceState::remake_resident_locked(LayerId layer) {
  if (to_remake_.empty() || to_remake_.erase(layer) == 0) return;
  bool made = true;
  try {
    made = engine_->make_resident(layer);
  } catch (const std::exception&) {
    // Its copy could not be issued (or the layer is gone): it streams, and its fetch raises what persists.
  }
  if (made) return;
  // No room: what the gap's allocation took is still held, so the lent memory cannot come back. As after a
  // yield between steps, the rest goes back too and the budget plans again from the steps that hold it (a
  // failed try at every use would cost torch's allocator its whole out-of-memory path each time).
  to_remake_.clear();
  const std::size_t unknown = std::numeric_limits<std::size_t>::max();
  note_yield(engine_->yield_resident(unknown), /*between_steps=*/true, unknown);
}

void DeviceState::consider_residency(TransferEngine& engine, LayerId layer, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!planned_resident_.empty() && planned_resident_.count(engine.host_block(layer).data) != 0) {
    engine.make_resident(layer);  // the VRAM budget's plan, carried over a rebuild for its ring
    return;
  }
  if (resident_budget_ == 0) return;
  // The engine's own count: layers re-packed or removed give their share back by themselves.
  if (engine.stats().resident_bytes + bytes > resident_budget_) return;
  engine.make_resident(layer);  // false (no device room) leaves it streaming
}

std::optional<std::size_t> DeviceState::layer_bytes_locked(LayerId layer, bool in_ring) const {
  try {
    return in_ring ? engine_->device_bytes(layer) : engine_->host_block(layer).bytes;
  } catch (const InvalidArgument&) {
    return std::nullopt;  // no longer in the engine (its model was freed)
  }
}

DeviceState::KeptLayers DeviceState::keep_resident_locked(const std::vector<LayerId>& ids,
                                                         const std::vector<std::size_t>& sizes,
                                                         const std::vector<bool>& resident, bool rebuild,
                                                         bool give_back_others) {
  planned_resident_.clear();
  KeptLayers out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    bool keep = resident[i];
    if (!keep && give_back_others && engine_->resident(ids[i])) {
      try {
        engine_->evict_resident(ids[i]);
      } catch (const std::exception&) {  // in use now: it stays until the next yield or plan
      }
    }
    if (keep && rebuild) {
      planned_resident_.insert(engine_->host_block(ids[i]).data);
    } else if (keep) {
      try {
        keep = engine_->make_resident(ids[i]);
      } catch (const std::exception& e) {  // its copy could not be issued: it streams (and the plan goes on)
        keep = false;
        ++out.not_copied;
        out.copy_error = e.what();
      }
    }
    if (keep) {
      ++out.layers;
      out.bytes += sizes[i];
    } else {
      ++out.streamed;
    }
  }
  return out;
}

std::string DeviceState::apply_vram_budget_locked(const DeviceMemoryView& view) {
  if (view.limit == 0) return "LAYERSTREAM_VRAM_BUDGET is set but nothing reports device memory here; ignored";
  const std::size_t ring = engine_->ring_capacity();
  // Layers still resident from an earlier plan (a yield gives back only what no call holds, and on the
  // simulator only what the allocation asked) were in the peaks measured: like the ring, the plan places
  // them anew, and gives back those it no longer keeps.
  const std::size_t resident_now = engine_->stats().resident_bytes;
  const BudgetHeadroom::Room room =
      headroom_.room_for(view.limit, view.peak, ring + resident_now, view.gap_peak, view.gap_start);
  pressure_threshold_ = headroom_.threshold();
  gap_pressure_threshold_ = headroom_.gap_threshold();
  std::vector<LayerId> ids;
  std::vector<std::size_t> sizes, footprints;  // copied and resident bytes; what each takes in the ring
  Lookahead ahead;  // the copies observe_and_prefetch makes ahead of need, replayed by the plan too
  ahead.layers = prefetch_ ? lookahead_layers_ : 0;
  std::unordered_map<LayerId, std::size_t> index;
  std::size_t largest = 0;
  for (LayerId id : recorder_.first_uses()) {
    const std::optional<std::size_t> bytes = layer_bytes_locked(id, false);
    const std::optional<std::size_t> in_ring = layer_bytes_locked(id, true);
    if (bytes && in_ring) {  // nullopt: freed since
      index.emplace(id, ids.size());
      ids.push_back(id);
      sizes.push_back(*bytes);
      footprints.push_back(ring_footprint(*in_ring));
      ahead.bytes.push_back(*in_ring);  // as observe_and_prefetch counts them
      ahead.never.push_back(fresh_each_use_.count(id) != 0);
      largest = std::max(largest, *in_ring);
    }
  }
  std::vector<std::size_t> recorded;
  for (LayerId id : recorder_.take_uses()) {
    if (auto it = index.find(id); it != index.end()) recorded.push_back(it->second);
  }
  const BudgetPlan budget = plan_budget(sizes, footprints, one_step(recorded), room.room, ring, largest, ring_fixed_,
                                        ahead);
  const RingPlan& plan = budget.ring;
  budget_room_ = room.room > plan.ring_bytes ? room.room - plan.ring_bytes : 0;
  budget_estimate_ = plan.copied_bytes;
  // With a new ring the resident copies are made as the layers register with the rebuilt engine
  // (consider_residency); with this one, now. Either way spread over the step (residency_plan.h):
  // streamed copies then overlap resident layers' compute.
  const bool rebuild = plan.ring_bytes != ring;
  planned_ring_bytes_ = rebuild ? plan.ring_bytes : 0;
  const KeptLayers kept = keep_resident_locked(ids, sizes, plan.resident, rebuild, resident_now > 0);
  const std::size_t kept_bytes = kept.bytes;
  plan_added_bytes_ = kept_bytes + (plan.ring_bytes > ring ? plan.ring_bytes - ring : 0);
  lendable_bytes_ = std::min(room.lent, kept_bytes);
  gap_lent_ = false;
  lends_in_a_row_ = 0;
  to_remake_.clear();
  const std::string lend_note =
      lendable_bytes_.load() > 0
          ? detail::concat("; ", lendable_bytes_.load() / kMiB, " MiB of them in the quarter lent between steps, given "
                           "back first when an allocation there needs it and copied again in the next step")
          : std::string();
  const std::string ring_note =
      rebuild ? detail::concat("; the device ring grows from ", ring / kMiB, " to ", plan.ring_bytes / kMiB,
                               " MiB at the next layer call (estimated copies per planned sequence ",
                               budget.stay_copied / kMiB, " -> ", plan.copied_bytes / kMiB, " MiB)")
              : std::string();
  return detail::concat("layerstream VRAM budget on ", describe(), ": ", view.limit / kMiB, " MiB",
                        vram_budget_.automatic ? " (auto)" : "", ", peak ", view.peak / kMiB,
                        describe_peak(view, headroom_),
                        "), ", headroom_.permille() / 10, "% headroom: ", kept.layers, " layers (", kept_bytes / kMiB,
                        " MiB) stay on the device, ", kept.streamed, " stream", lend_note, ring_note,
                        kept.not_copied > 0 ? detail::concat(" (", kept.not_copied, " of them planned to stay, but "
                                                             "their copy could not be issued: ", kept.copy_error, ")")
                                            : std::string());
}

}  // namespace layerstream::torchglue
