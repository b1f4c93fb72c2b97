// BudgetController: the VRAM budget's policy for one device, without torch. Its owner (the torch glue's
// DeviceState, or a test) feeds it events (a layer call, a layer use, the end of a backward pass, memory
// pressure, resident layers that left with their model, a rebuilt engine, a view of the device's memory)
// and carries out the actions it returns (start measuring the peak, plan now, yield N bytes, make this
// layer resident again, rebuild the ring at R bytes and keep the layers S resident). The arithmetic it
// decides with is vram_budget.h's; the log lines it returns are the owner's to write (outside its locks).
//
// Thread-safety: two kinds of calls.
//   - Any thread, no lock (atomics): on_layer_call, on_backward_ended, on_resident_gone and the readers
//     pressure_threshold(), gap_pressure_threshold(), in_training_step(), step_began(), held_by_gap(),
//     may_act(). torch's allocator callbacks and autograd's end-of-backward callback call these.
//   - Every other call: the owner serializes them (DeviceState holds its mutex; pressure takes it with
//     try_lock, never waiting). No call blocks or touches device memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "layerstream/settings.h"
#include "layerstream/vram_budget.h"

namespace layerstream {

// What the device can give this process and what it has used at its peak (for the VRAM budget).
struct DeviceMemoryView {
  std::size_t limit = 0;  // bytes the process may use ("auto": free + its own reserved, under torch's fraction)
  std::size_t peak = 0;   // the most the process has held (torch's peak reserved on CUDA)
  bool cycles = false;  // measured by LAYERSTREAM_VRAM_PEAK=cycles (CyclePeaks, the default), not the window
  std::size_t held_since = 0;  // of `peak`: what the step made after its own peak and still holds (steady_peak)
  std::size_t gap_peak = 0;    // the peak between steps (cycles only; 0: not measured)
  std::size_t gap_start = 0;   // what the current cycle began with, the gap's floor (cycles only)
};

// The settings the budget reads once, when its device state is made.
struct BudgetConfig {
  VramBudget budget;                      // LAYERSTREAM_VRAM_BUDGET
  VramPeak peak = VramPeak::kCycles;      // LAYERSTREAM_VRAM_PEAK
  VramGap gap = VramGap::kQuarterAtPeak;  // LAYERSTREAM_VRAM_GAP
  bool ring_fixed = false;                // LAYERSTREAM_RING_MB given: the plan keeps the ring as it is
  std::size_t resident_bytes = 0;         // LAYERSTREAM_RESIDENT_MB
  std::size_t lookahead_layers = 0;       // the copies made ahead of need, replayed by the plan (0: none)
  static BudgetConfig from(const Settings& settings);
};

// A layer the plan weighs, as the engine holds it now.
struct PlannedLayer {
  LayerId id = 0;
  std::size_t bytes = 0;     // copied and resident bytes (its host block)
  std::size_t in_ring = 0;   // what it takes in the ring, its scratch included
  bool never_ahead = false;  // copied again at every use (a trainable weight): never copied ahead of need
};

// A layer call's step edge: the first training forward since a backward ended (`resumed`), and of those
// the ones outside any backward, where a training step begins (`began`).
struct StepEdge {
  bool resumed = false;
  bool began = false;
};

// What a layer use asks of the owner, in this order: start measuring the peak, say once that the budget
// waits for a training step, plan now (with a fresh DeviceMemoryView, outside the owner's lock).
struct UseActions {
  bool start_peak_window = false;
  bool waits_for_training = false;
  bool plan_now = false;
};

// A plan: the ring (rebuilt at the next call with no layer in use when it is not the one in use) and,
// by index of the layers given to plan(), which stay resident. `ignored`: the line to log instead (no
// view of the device's memory); nothing else is set then.
struct PlanDecision {
  std::string ignored;
  std::size_t ring_bytes = 0;
  bool rebuild = false;
  std::vector<bool> resident;
  std::uint64_t stay_copied = 0;   // estimated copies per planned sequence with the ring in use
  std::uint64_t copied_bytes = 0;  // with the chosen ring
};

// What the owner made of a plan (keep_resident in the glue): the layers kept and their bytes, those that
// stream, those whose copy could not be issued; `deferred`: host blocks of the layers made resident as
// they register with the rebuilt engine (keep_on_register).
struct KeptLayers {
  std::size_t layers = 0, bytes = 0, streamed = 0, not_copied = 0;
  std::string copy_error;  // what the last copy that could not be issued raised
  std::vector<const void*> deferred;
};

// The budget's counters for stats().
struct BudgetCounters {
  bool planned = false;
  std::size_t room = 0;
  std::uint64_t estimate = 0;
  std::uint64_t pressure_yields = 0, pressure_yielded_bytes = 0;
  std::uint64_t gap_lends = 0, gap_lent_bytes = 0;
};

class BudgetController {
 public:
  static constexpr std::size_t kUnknown = std::numeric_limits<std::size_t>::max();
  // Gaps in a row that took the lent quarter back before lending stops (LAYERSTREAM_VRAM_GAP=lend).
  static constexpr int kLendsInARow = 3;

  explicit BudgetController(const BudgetConfig& config);
  // The device as log lines name it (DeviceState::describe()).
  void set_name(std::string name) { name_ = std::move(name); }
  const BudgetConfig& config() const { return config_; }

  // ---- any thread ----
  // A layer is called: `grad` (a forward with grad enabled, or its caller's), `outside_backward` (no
  // autograd graph task runs). A training step begins at its first forward outside any backward.
  StepEdge on_layer_call(bool grad, bool outside_backward);
  void on_backward_ended();                    // the step's backward pass is over: the gap begins
  void on_resident_gone(std::size_t bytes) { feed_.resident_gone += bytes; }  // left with a freed model
  bool may_act() const { return config_.budget.enabled || feed_.pending.load(); }
  bool in_training_step() const { return step_.in_step.load(); }
  bool step_began() const { return step_.began.load(); }
  VramPeak vram_peak() const { return config_.peak; }
  bool quarter_above_start() const { return headroom_.quarter_above_start(); }  // set once, at construction
  // The free device memory under which an allocator miss counts as pressure (BudgetHeadroom::is_pressure):
  // half the last plan's headroom inside a step; a quarter of the limit between steps. 0: no plan.
  std::size_t pressure_threshold() const { return feed_.threshold.load(); }
  std::size_t gap_pressure_threshold() const { return feed_.gap_threshold.load(); }
  // Of `held` (above the cycle's start), what the gap holds: less the copies this cycle's plan made.
  std::size_t held_by_gap(std::size_t held) const {
    const std::size_t own = step_.plan_added.load();
    return held > own ? held - own : 0;
  }

  // ---- memory pressure (owner's lock) ----
  // LAYERSTREAM_VRAM_GAP=lend: bytes to give back first as the gap's loan (the layers the gap's quarter
  // holds), once per gap, the plan standing; 0: none. Not when the allocation is known to want more.
  std::size_t lend_first(std::size_t want, bool between_steps) const;
  void on_lent(std::size_t lent, const std::vector<LayerId>& given);  // lent > 0
  // Resident copies gave `freed` > 0 bytes back (`free_bytes` free then; kUnknown): nothing more is given
  // back until the budget plans again, at the next layer use.
  void on_yielded(std::size_t freed, bool between_steps, std::size_t free_bytes);

  // ---- a layer use (owner's lock), in this order ----
  // A yield since the last use: the plan is forgotten and the headroom raised; with the least ring (asked of
  // `least_ring` then) below the ring in use, and the ring not fixed, the ring shrinks back at the next
  // rebuild. The line to log (a warning), "" when no yield was pending.
  std::string take_pressure(std::size_t ring_capacity, const std::function<std::size_t()>& least_ring);
  // Resident layers left with their model since the last use: plan again. The line to log (info), or "".
  std::string take_gone(bool pressure_reported);
  void on_engine_rebuilt();  // the engine was rebuilt since the last use: its layer ids are new
  // LAYERSTREAM_VRAM_GAP=lend: whether `layer`, lent to the last gap, is to be made resident again now (in
  // a training step); true once. remake_pending: the same, without taking it.
  bool take_remake(LayerId layer, bool training);
  bool remake_pending(LayerId layer, bool training) const;
  // Its copy found no room: the bytes to yield now (all), then on_yielded(freed, true, kUnknown).
  std::size_t remake_failed();
  // `training`: a forward with grad enabled; `correct_predictions`: the access predictor's count.
  UseActions on_layer_use(LayerId layer, bool training, std::uint64_t correct_predictions);

  // ---- planning (owner's lock) ----
  // The layers to plan, in order of first use (the owner looks their sizes up; freed ones left out).
  const std::vector<LayerId>& plan_candidates() const { return recorder_.first_uses(); }
  // The plan from `view`, the layers the owner found, the ring in use and the bytes resident now.
  PlanDecision plan(const DeviceMemoryView& view, const std::vector<PlannedLayer>& layers, std::size_t ring,
                    std::size_t resident_now);
  // The owner carried the plan out: the line to log (info).
  std::string plan_applied(const DeviceMemoryView& view, const PlanDecision& plan, const KeptLayers& kept,
                           std::size_t ring);

  // ---- the engine (owner's lock) ----
  // Whether a layer registering with the engine stays resident: planned before a rebuild, or within
  // LAYERSTREAM_RESIDENT_MB (`resident_now` the engine's resident bytes).
  bool keep_on_register(const void* host_block, std::size_t resident_now, std::size_t bytes) const;
  std::size_t pending_ring() const { return ring_.planned; }  // the ring the plan chose; 0: none pending
  void on_ring_rebuilt();  // the pending ring was built
  bool ring_fixed() const { return config_.ring_fixed; }
  void set_ring_fixed(bool fixed) { config_.ring_fixed = fixed; }

  BudgetCounters counters() const;

 private:
  // The training step as layer calls and backward passes show it (any thread).
  struct StepFeed {
    std::atomic<bool> in_step{false};              // in_training_step()
    std::atomic<bool> began{false};                // step_began()
    std::atomic<bool> gap_in_window{false};        // a backward ended since the peak window began
    std::atomic<std::size_t> plan_added{0};        // held_by_gap(): made by this cycle's plan
  };
  // Memory pressure: set by a yield or a freed model (any thread), handled at the next layer use.
  struct PressureFeed {
    std::atomic<bool> pending{false};
    std::atomic<bool> between_steps{false};  // the pending yield came from between two steps
    std::atomic<std::size_t> free_bytes{kUnknown};  // free at the last yield
    std::atomic<std::size_t> resident_gone{0};
    std::atomic<std::uint64_t> yields{0};
    std::atomic<std::uint64_t> yielded_bytes{0};
    std::atomic<std::size_t> threshold{0};
    std::atomic<std::size_t> gap_threshold{0};
  };
  // LAYERSTREAM_VRAM_GAP=lend: what the plan's resident layers lend the gap's quarter; whether this gap
  // took it already; the layers it took, made resident again at their next use in a step (owner's lock).
  struct GapLoan {
    std::size_t lendable = 0;
    bool lent = false;
    std::unordered_set<LayerId> to_remake;
    std::uint64_t lends = 0, lent_bytes = 0;
    int in_a_row = 0;        // gaps in a row that took it (reset by a step whose gap did not)
    bool stopped = false;    // lending stopped: the next plan's warning says so
  };
  // The ring the plan chose, built at the next call with no layer in use (owner's lock).
  struct RingChoice {
    std::size_t planned = 0;     // 0: none pending
    bool keep_plan = false;      // the next rebuild is the plan's own: it is not planned again
    bool shrink = false;         // the pending rebuild is pressure's (back to the least ring): plan again
  };

  void request_replan(bool between_steps);
  void forget_plan();
  std::string describe_yield() const;

  BudgetConfig config_;
  std::string name_;
  BudgetRecorder recorder_;  // which uses the budget plans from, and when
  BudgetHeadroom headroom_;  // the plan's headroom and when a miss is pressure
  StepFeed step_;
  PressureFeed feed_;
  GapLoan loan_;
  RingChoice ring_;
  // LAYERSTREAM_VRAM_PEAK=cycles: a plan due before the window saw a gap waits for the next step's first
  // forward (the plan leaves room at the gap's peak too).
  bool plan_deferred_ = false;
  std::size_t room_ = 0;         // stats' vram_budget_room: what the plan left beside its ring
  std::uint64_t estimate_ = 0;   // stats' vram_budget_estimate
  std::unordered_set<const void*> planned_resident_;  // host blocks kept over a rebuild for the ring
};

}  // namespace layerstream
