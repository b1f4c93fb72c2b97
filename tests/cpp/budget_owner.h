// A BudgetController's owner for the tests, as the torch glue's DeviceState is one, over a modelled device:
// layers of given sizes, a ring, resident copies and the step's own allocations (activations, the gap's
// optimizer temporaries) in `limit` bytes. It feeds the controller the events DeviceState feeds it, in the
// same order, carries out its actions the way DeviceState does, and measures the peaks the view reports
// as the simulator does (CyclePeaks for LAYERSTREAM_VRAM_PEAK=cycles, steady_peak for the window).
// An allocation that does not fit is an out-of-memory error (counted), after the allocator's pressure
// callback (BudgetHeadroom::is_pressure, then a yield) had its chance, as torch's allocator runs it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "layerstream/access_predictor.h"
#include "layerstream/budget_controller.h"

namespace layerstream::testing {

class BudgetOwner {
 public:
  BudgetOwner(const BudgetConfig& config, std::size_t limit, std::vector<std::size_t> sizes)
      : budget_(config), limit_(limit), sizes_(std::move(sizes)), host_(sizes_.size()),
        registered_(sizes_.size(), false) {
    budget_.set_name("sim:0");
    std::size_t largest = 0, all = 0;
    for (std::size_t s : sizes_) {
      largest = std::max(largest, s);
      all += ring_footprint(s);
    }
    least_ = std::max(3 * ring_footprint(largest), least_ring_bytes(largest, all));
    ring_ = least_;
  }

  BudgetController& budget() { return budget_; }
  std::size_t ring() const { return ring_; }
  std::size_t resident_bytes() const {
    std::size_t sum = 0;
    for (const auto& [id, bytes] : resident_) sum += bytes;
    return sum;
  }
  std::size_t used() const { return ring_ + resident_bytes() + held_; }
  std::size_t limit() const { return limit_; }
  // With the allocation retry (torch 2.11-2.13): an allocation that does not fit gives back what it asks and
  // is tried again (counted in retries(), not ooms()), and a yield inside a step gives back only the headroom.
  void set_allocation_retry(bool on) { retry_ = on; }
  std::size_t retries() const { return retries_; }
  // Allocations that did not fit at once (without the retry) or at all (with it).
  std::size_t ooms() const { return ooms_; }
  std::size_t plans() const { return plans_; }
  std::size_t rebuilds() const { return rebuilds_; }
  const std::vector<std::string>& log() const { return log_; }
  // What each plan left free at the peaks it was shown, less the pressure thresholds it set: negative
  // would mean a step (or a gap) at its measured peak counts as pressure, or runs out of memory.
  std::ptrdiff_t least_margin() const { return least_margin_; }
  const std::map<LayerId, std::size_t>& resident() const { return resident_; }

  // One layer call: the engine (rebuilt for the plan's ring between calls), the step edge, the use.
  void call(LayerId layer, bool grad, bool outside_backward) {
    if (budget_.pending_ring() != 0) rebuild();
    if (!registered_[layer]) {
      registered_[layer] = true;
      if (budget_.keep_on_register(&host_[layer], resident_bytes(), sizes_[layer])) make_resident(layer);
    }
    const StepEdge edge = budget_.on_layer_call(grad, outside_backward);
    if (edge.began) {
      cycle_start_ = used();
      cycles_.cycle_started(used());
    } else if (edge.resumed) {
      cycles_.forward_resumed();
    }
    use(layer, grad);
  }
  void backward_ended() {
    budget_.on_backward_ended();
    cycles_.backward_ended();
  }
  // The step (or, after backward_ended, the gap) allocates `want` bytes; false: out of memory (nothing held).
  bool allocate(std::size_t want) {
    const bool between = !budget_.in_training_step();
    const std::size_t free_now = limit_ > used() ? limit_ - used() : 0;
    const std::size_t gap_used = between && budget_.quarter_above_start() && used() > cycle_start_
                                     ? budget_.held_by_gap(used() - cycle_start_)
                                     : 0;
    // torch's allocator runs its callback when no cached block fits, before it asks the driver: here, at
    // every allocation that takes new memory, with what is free before it.
    const std::size_t threshold = budget_.pressure_threshold();
    if (BudgetHeadroom::is_pressure(threshold, budget_.gap_pressure_threshold(), between, free_now, gap_used)) {
      yield_for_pressure(BudgetHeadroom::pressure_yield_bytes(threshold, between, free_now, retry_), between,
                         free_now);
    }
    if (used() + want > limit_ && retry_) {
      // The allocation retry (cuda_allocation_retry.cc): what the allocation lacks and an eighth of its
      // size, tried again, then all of them.
      ++retries_;
      const std::size_t room = limit_ > used() ? limit_ - used() : 0;
      yield_for_pressure((want > room ? want - room : 0) + want / 8, between, room);
      if (used() + want > limit_) yield_for_pressure(BudgetController::kUnknown, between, room);
      if (used() + want > limit_) {
        ++ooms_;
        return false;
      }
    } else if (used() + want > limit_) {
      ++ooms_;
      if (budget_.pressure_threshold() != 0) yield_for_pressure(BudgetController::kUnknown, false, free_now);
      if (used() + want > limit_) return false;  // the caller's step fails
    }
    held_ += want;
    measure();
    return true;
  }
  void release(std::size_t bytes) { held_ -= bytes; }
  // A managed model's resident layer was freed (note_resident_layer_gone).
  void resident_layer_gone(LayerId layer) {
    auto it = resident_.find(layer);
    if (it == resident_.end()) return;
    budget_.on_resident_gone(it->second);
    resident_.erase(it);
  }

 private:
  void rebuild() {
    ring_ = std::max(budget_.pending_ring(), least_);
    budget_.on_ring_rebuilt();
    resident_.clear();
    registered_.assign(registered_.size(), false);
    ++generation_;
    ++rebuilds_;
    measure();
  }
  bool make_resident(LayerId layer) {
    if (resident_.count(layer) != 0) return true;
    if (used() + sizes_[layer] > limit_) return false;
    resident_[layer] = sizes_[layer];
    measure();
    return true;
  }
  std::size_t yield_resident(std::size_t want, std::vector<LayerId>* given = nullptr) {
    std::size_t freed = 0;
    while (freed < want && !resident_.empty()) {
      auto it = std::prev(resident_.end());  // any order: the engine gives back what no call holds
      freed += it->second;
      if (given != nullptr) given->push_back(it->first);
      resident_.erase(it);
    }
    return freed;
  }
  // DeviceState::yield_for_pressure.
  bool yield_for_pressure(std::size_t want, bool between, std::size_t free_bytes) {
    if (const std::size_t lend = budget_.lend_first(want, between); lend > 0) {
      std::vector<LayerId> given;
      const std::size_t lent = yield_resident(lend, &given);
      if (lent > 0) {
        budget_.on_lent(lent, given);
        return true;
      }
    }
    const std::size_t freed = yield_resident(want);
    if (freed == 0) return false;
    budget_.on_yielded(freed, between, free_bytes);
    return true;
  }
  // DeviceState::observe_and_prefetch and note_use, for the budget.
  void use(LayerId layer, bool grad) {
    if (!budget_.may_act()) return;
    const std::string pressure = budget_.take_pressure(ring_, [this] { return least_; });
    const std::string gone = budget_.take_gone(!pressure.empty());
    if (!pressure.empty()) log_.push_back(pressure);
    if (!gone.empty()) log_.push_back(gone);
    if (seen_generation_ != generation_) {
      predictor_ = AccessPredictor();
      seen_generation_ = generation_;
      budget_.on_engine_rebuilt();
    }
    predictor_.observe(layer);
    if (budget_.take_remake(layer, grad) && !make_resident(layer)) {
      budget_.on_yielded(yield_resident(budget_.remake_failed()), true, BudgetController::kUnknown);
    }
    const UseActions act = budget_.on_layer_use(layer, grad, predictor_.stats().correct);
    if (act.start_peak_window) {
      window_start_ = window_peak_ = used();
      cycles_.start(used(), budget_.step_began());
    }
    if (act.plan_now) plan();
  }
  void measure() {
    window_peak_ = std::max(window_peak_, used());
    cycles_.on_live(used());
  }
  void plan() {
    DeviceMemoryView view;
    view.limit = limit_;
    view.peak = steady_peak(window_peak_, window_start_, used());
    if (budget_.vram_peak() == VramPeak::kCycles) {
      view.cycles = true;
      view.peak = cycles_.predicted();
      view.gap_peak = cycles_.predicted_gap();
      view.gap_start = cycles_.cycle_start();
      view.held_since = cycles_.held_since_start();
    }
    const std::size_t ring_before = ring_, resident_before = resident_bytes();
    std::vector<PlannedLayer> layers;
    for (LayerId id : budget_.plan_candidates()) layers.push_back(PlannedLayer{id, sizes_[id], sizes_[id], false});
    const PlanDecision decision = budget_.plan(view, layers, ring_before, resident_before);
    ++plans_;
    KeptLayers kept;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const LayerId id = layers[i].id;
      bool keep = decision.resident[i];
      if (!keep && resident_before > 0) resident_.erase(id);
      if (keep && decision.rebuild) {
        kept.deferred.push_back(&host_[id]);
      } else if (keep) {
        keep = make_resident(id);
      }
      kept.layers += keep ? 1 : 0;
      kept.bytes += keep ? sizes_[id] : 0;
      kept.streamed += keep ? 0 : 1;
    }
    log_.push_back(budget_.plan_applied(view, decision, kept, ring_before));
    // What the device holds at the measured peaks once the plan is carried out (its ring built).
    const std::size_t mine_before = ring_before + resident_before;
    const std::size_t mine_after = std::max(decision.ring_bytes, ring_before) + kept.bytes;
    const auto margin = [&](std::size_t peak, std::size_t threshold) {
      const std::size_t others = peak > mine_before ? peak - mine_before : 0;
      return static_cast<std::ptrdiff_t>(limit_) - static_cast<std::ptrdiff_t>(others + mine_after) -
             static_cast<std::ptrdiff_t>(threshold);
    };
    if (kept.bytes > 0 || decision.ring_bytes > ring_before) {  // what the plan added must fit
      least_margin_ = std::min(least_margin_, margin(view.peak, budget_.pressure_threshold()));
      if (view.gap_peak > 0 && budget_.config().gap == VramGap::kQuarterAtPeak) {
        least_margin_ = std::min(least_margin_, margin(view.gap_peak, budget_.gap_pressure_threshold()));
      }
    }
  }

  BudgetController budget_;
  std::size_t limit_;
  std::vector<std::size_t> sizes_;
  std::vector<char> host_;  // a host block per layer: keep_on_register's keys
  std::vector<bool> registered_;
  std::size_t least_ = 0, ring_ = 0, held_ = 0;
  std::map<LayerId, std::size_t> resident_;
  std::uint64_t generation_ = 0, seen_generation_ = 0;
  AccessPredictor predictor_;
  std::size_t cycle_start_ = 0, window_start_ = 0, window_peak_ = 0;
  CyclePeaks cycles_;
  std::size_t ooms_ = 0, retries_ = 0, plans_ = 0, rebuilds_ = 0;
  bool retry_ = false;
  std::ptrdiff_t least_margin_ = PTRDIFF_MAX;
  std::vector<std::string> log_;
};

}  // namespace layerstream::testing
