// DeviceState's events and actions (device_state.h): each layer use teaches the access predictor and feeds
// the VRAM budget (BudgetController, in the core, decides); this file carries out what it decides (copies
// ahead of need, resident layers made and given back, the plan's ring) and logs its lines outside mu_. The
// state's construction, its engine and its counters are in device_state.cc.
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

}  // namespace

void DeviceState::set_memory_resolver(MemoryResolver resolver, PeakWindowStarter start_peak_window,
                                      CycleMarker mark_cycle) {
  memory_resolver() = std::move(resolver);
  peak_window_starter() = std::move(start_peak_window);
  cycle_marker() = std::move(mark_cycle);
}

void DeviceState::note_use(LayerId layer, bool fresh_each_use) {
  const bool grad = at::GradMode::is_enabled() || GradForwardScope::active();
  const StepEdge edge = budget_.on_layer_call(grad, torch::autograd::get_current_graph_task_id() < 0);
  if (edge.resumed) mark_cycle(edge.began ? CycleEvent::kStepStarted : CycleEvent::kForwardResumed);
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
  // LAYERSTREAM_VRAM_GAP=lend: the gap's loan goes back first, and the plan stands; when it frees nothing,
  // the yield below.
  if (const std::size_t lend = budget_.lend_first(want, between_steps); lend > 0) {
    std::vector<LayerId> given;
    const std::size_t lent = engine_->yield_resident(lend, &given);
    if (lent > 0) {
      budget_.on_lent(lent, given);
      return true;
    }
  }
  const std::size_t freed = engine_->yield_resident(want);
  if (freed == 0) return false;
  budget_.on_yielded(freed, between_steps, free_bytes);
  return true;
}

void DeviceState::note_resident_layer_gone(std::size_t bytes) { budget_.on_resident_gone(bytes); }

void DeviceState::note_backward_pass() {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0 || step_task_.exchange(task) == task) return;
  std::weak_ptr<DeviceState> weak = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([weak] {
    if (auto state = weak.lock()) {
      state->budget_.on_backward_ended();
      state->step_task_ = -1;
      state->mark_cycle(CycleEvent::kBackwardEnded);
    }
  });
}

void DeviceState::start_peak_window_locked() {
  if (mode_ == Mode::kSim) {
    auto& sim = static_cast<SimBackend&>(*pool_->backend);
    sim.reset_device_peak();
    if (budget_.vram_peak() == VramPeak::kCycles) {
      sim.start_cycle_peaks(/*at_cycle_start=*/budget_.step_began());
    }
  } else if (peak_window_starter()) {
    peak_window_starter()(*this);
  }
}

void DeviceState::mark_cycle(CycleEvent event) {
  if (mode_ != Mode::kSim) {
    if (cycle_marker()) cycle_marker()(*this, event);
    return;
  }
  if (budget_.vram_peak() == VramPeak::kCycles) static_cast<SimBackend&>(*pool_->backend).cycle_event(event);
}

DeviceMemoryView DeviceState::memory_view() {
  DeviceMemoryView view;
  if (mode_ == Mode::kSim) {
    // The simulated card: its capacity (or the budget), and the most allocated on it since the window's start.
    const std::size_t total = pool_->backend->device_memory_info().second;
    const VramBudget& budget = budget_.config().budget;
    view.limit = budget.automatic ? total : budget.bytes;
    auto& sim = static_cast<SimBackend&>(*pool_->backend);
    view.peak = sim.device_peak_bytes();  // since the window's start
    if (budget_.vram_peak() == VramPeak::kCycles) {
      const CyclePeaks cycles = sim.cycle_peaks();
      view.peak = cycles.predicted();
      view.gap_peak = cycles.predicted_gap();
      view.gap_start = cycles.cycle_start();
      view.held_since = cycles.held_since_start();
      view.cycles = true;
    }
  } else if (memory_resolver()) {
    view = memory_resolver()(*this, budget_.config().budget);
  }
  return view;
}

DeviceState::UseOutcome DeviceState::observe_and_prefetch(LayerId layer, bool fresh_each_use) {
  UseOutcome out;
  if (!prefetch_.on && !budget_.may_act()) return out;
  std::lock_guard<std::mutex> lock(mu_);  // also keeps the engine from being rebuilt meanwhile
  if (!engine_) return out;
  out.pressure_report = budget_.take_pressure(engine_->ring_capacity(),
                                              [this] { return ring_bytes_for(ring_.largest_attached.load()); });
  out.gone_report = budget_.take_gone(!out.pressure_report.empty());
  if (prefetch_.predictor_generation != generation_) {  // layer ids of an older engine mean nothing now
    prefetch_.predictor = AccessPredictor();
    prefetch_.predictor_generation = generation_;
    prefetch_.fresh_each_use.clear();
    budget_.on_engine_rebuilt();
  }
  if (fresh_each_use) {
    prefetch_.fresh_each_use.insert(layer);
  } else {
    prefetch_.fresh_each_use.erase(layer);
  }
  prefetch_.predictor.observe(layer);
  // An autograd function's forward runs with grad mode off: its caller says whether grad was on
  // (GradForwardScope).
  const bool training = at::GradMode::is_enabled() || GradForwardScope::active();
  remake_resident_locked(layer, training);  // lent to the last gap: used in a step again
  const UseActions act = budget_.on_layer_use(layer, training, prefetch_.predictor.stats().correct);
  if (act.start_peak_window) start_peak_window_locked();
  out.waits_for_training = act.waits_for_training;
  out.plan_now = act.plan_now;
  if (prefetch_.on) out.prefetch_error = prefetch_locked(layer, training);
  return out;
}

std::string DeviceState::prefetch_locked(LayerId layer, bool training) {
  const std::size_t budget = engine_->ring_capacity() / 3;
  std::size_t planned = 0;
  for (LayerId next : prefetch_.predictor.predict(prefetch_.lookahead_layers)) {
    if (next == layer || prefetch_.fresh_each_use.count(next) != 0) continue;
    const std::optional<std::size_t> bytes = layer_bytes_locked(next, LayerSize::kPrefetched);
    if (!bytes) break;  // that layer is gone (freed model): the prediction is stale
    planned += *bytes;
    if (planned > budget) break;
    if (budget_.remake_pending(next, training)) {  // copied ahead into its own memory again
      remake_resident_locked(next, training);
      continue;
    }
    try {
      engine_->prefetch(next);
    } catch (const std::exception& e) {
      // The engine left nothing of it in the ring; the layer's own fetch copies it (and raises what persists).
      return e.what();
    }
  }
  return std::string();
}

void DeviceState::remake_resident_locked(LayerId layer, bool training) {
  if (!budget_.take_remake(layer, training)) return;
  bool made = true;
  try {
    made = engine_->make_resident(layer);
  } catch (const std::exception&) {
    // Its copy could not be issued (or the layer is gone): it streams, and its fetch raises what persists.
  }
  if (made) return;
  const std::size_t freed = engine_->yield_resident(budget_.remake_failed());
  budget_.on_yielded(freed, /*between_steps=*/true, BudgetController::kUnknown);
}

void DeviceState::consider_residency(TransferEngine& engine, LayerId layer, std::size_t bytes,
                                     std::size_t resident_before) {
  std::lock_guard<std::mutex> lock(mu_);
  // The VRAM budget's plan, carried over a rebuild for its ring, or LAYERSTREAM_RESIDENT_MB (first come, first
  // kept), or the layer's own place when it was resident before it was packed again and needs no more now;
  // false from make_resident (no device room) leaves it streaming.
  const bool kept_before = resident_before != 0 && bytes <= resident_before;  // block bytes, as remove_layer counts
  if (kept_before || budget_.keep_on_register(engine.host_block(layer).data, engine.stats().resident_bytes, bytes)) {
    engine.make_resident(layer);
  }
}

std::optional<std::size_t> DeviceState::layer_bytes_locked(LayerId layer, LayerSize size) const {
  try {
    switch (size) {
      case LayerSize::kPacked: return engine_->host_block(layer).bytes;
      case LayerSize::kInRing: return engine_->device_bytes(layer);
      case LayerSize::kPrefetched: return engine_->prefetch_bytes(layer);
    }
  } catch (const InvalidArgument&) {
    // no longer in the engine (its model was freed)
  }
  return std::nullopt;
}

KeptLayers DeviceState::keep_resident_locked(const std::vector<PlannedLayer>& layers, const std::vector<bool>& resident,
                                             bool rebuild, bool give_back_others) {
  KeptLayers out;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const LayerId id = layers[i].id;
    bool keep = resident[i];
    if (!keep && give_back_others && engine_->resident(id)) {
      try {
        engine_->evict_resident(id);
      } catch (const std::exception&) {  // in use now: it stays until the next yield or plan
      }
    }
    if (keep && rebuild) {
      out.deferred.push_back(engine_->host_block(id).data);
    } else if (keep) {
      try {
        keep = engine_->make_resident(id);
      } catch (const std::exception& e) {  // its copy could not be issued: it streams (and the plan goes on)
        keep = false;
        ++out.not_copied;
        out.copy_error = e.what();
      }
    }
    if (keep) {
      ++out.layers;
      out.bytes += layers[i].bytes;
    } else {
      ++out.streamed;
    }
  }
  return out;
}

std::string DeviceState::apply_vram_budget_locked(const DeviceMemoryView& view) {
  std::vector<PlannedLayer> layers;
  for (LayerId id : budget_.plan_candidates()) {
    const std::optional<std::size_t> bytes = layer_bytes_locked(id, LayerSize::kPacked);
    const std::optional<std::size_t> in_ring = layer_bytes_locked(id, LayerSize::kInRing);
    if (bytes && in_ring) {  // nullopt: freed since
      layers.push_back(PlannedLayer{id, *bytes, *in_ring, prefetch_.fresh_each_use.count(id) != 0});
    }
  }
  const std::size_t ring = engine_->ring_capacity();
  const std::size_t resident_now = engine_->stats().resident_bytes;
  const PlanDecision plan = budget_.plan(view, layers, ring, resident_now);
  if (!plan.ignored.empty()) return plan.ignored;
  const KeptLayers kept = keep_resident_locked(layers, plan.resident, plan.rebuild, resident_now > 0);
  return budget_.plan_applied(view, plan, kept, ring);
}

}  // namespace layerstream::torchglue
