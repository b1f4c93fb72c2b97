// The VRAM budget's decisions for one device, without torch: how large the ring is, which uses of a
// training step it plans from, how much room the step's peak leaves, when an allocation that found no
// cached block is memory pressure, and what a yield to that pressure changes. The torch glue
// (DeviceState) feeds it what it observes (layer uses, torch's allocator, the simulator) and carries out
// what it decides (rebuild the ring, make layers resident, give them back); the tests drive it directly.
//
// Thread-safety: none; the owner serializes calls (DeviceState holds its mutex).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "layerstream/residency_plan.h"

namespace layerstream {

using LayerId = std::uint64_t;  // as the TransferEngine names layers

// Bytes a layer takes in the ring: its device bytes rounded up to the ring's alignment.
std::size_t ring_footprint(std::size_t device_bytes);

// The least ring on a GPU ("min", and the first steps of a VRAM budget's run): kMinRingLayers of the
// largest layer attached, never more than all the attached layers take. Sized from the layers, not the
// device: a ring of an eighth of the device (up to 3 GiB) was faster on FLUX.1 but held 2.3 GB more than
// the stock manager at the same settings, where people offload because memory is short.
constexpr std::size_t kMinRingLayers = 4;
std::size_t least_ring_bytes(std::size_t largest_device_bytes, std::size_t attached_device_bytes);

// The ring for a largest layer of `layer_bytes`: `fixed` (LAYERSTREAM_RING_MB) when given, else three of
// the layer (room for the next one wherever the held one sits) and at least `floor`. Raises InvalidArgument
// when a fixed ring cannot hold the layer.
std::size_t ring_bytes_for(std::size_t layer_bytes, std::size_t floor, const std::size_t* fixed);

// Rings the plan weighs: the one in use, then 3, 4, 5, 6, 8 and 10 of the largest layer that are deeper
// (10: the deepest measured, FLUX.2 under 24 GiB). Only the one in use when the ring is fixed.
std::vector<std::size_t> candidate_rings(std::size_t current, std::size_t largest_device_bytes, bool fixed);

// LAYERSTREAM_VRAM_PEAK=window: the peak a plan must leave room for, from the first training step's window
// (from its first forward to the next step's first forward): the window's peak plus what the process has held since the window began and
// still holds (`live_now` above `live_at_start`): the optimizer's state, made at the first step's
// optimizer.step() after the backward's peak, is in every later step beside the activations. (Seen on the
// H200, 2026-12-01: a plan from the window's peak alone left too little room, and the next steps yielded.)
// Read in the middle of the second step, this counts more than a step takes: the window's peak already
// holds the second step's start with the optimizer's state, and `live_now` that step's activations so far
// (FLUX.2-shaped on the H200: planned for 20389 MiB, steps peaked at 13.7 GiB). A per-step measure without
// that margin (each step's rise above its own start, on its latest start; 880e5b0, reverted) planned FLUX.2
// in AI-Toolkit's flow better (1.961 s/step, no yield) but FLUX.1's flow then yielded at two gaps between
// steps (0.75-0.83 s/step against 0.587 here): those gaps found less than the quarter free that the
// between-steps rule asks. LAYERSTREAM_VRAM_PEAK=window; the default, CyclePeaks below, measures the gaps.
std::size_t steady_peak(std::size_t window_peak, std::size_t live_at_start, std::size_t live_now);

// The default measure (LAYERSTREAM_VRAM_PEAK=cycles; on the H200 in AI-Toolkit's flow under 24 GiB, 2026-12-01:
// FLUX.1 0.564 s/step with no yield against the window's 0.612 with one, FLUX.2 2.078 against 2.093): the peaks of a
// training cycle, from one step's first forward to the next's, in two parts: the step (its forward and
// backward) and the gap after its backward (the optimizer's step, a sample, the next bucket's inputs). Each
// part's rise is the most it held above what the cycle began with; the gap's rise less what the cycle kept
// for the next (its start is higher by it: the optimizer's state made at the first step, the user's
// tensors), so that what is kept is counted once, in the next cycle's start. A release of what the cycle
// began with (resident layers given back) is no rise. The predicted peaks are the most risen over the
// cycles that ended and the current one so far, on top of what the current cycle began with; the plan
// leaves the headroom free at the step's peak and the gap's quarter and the headroom at the gap's (or above
// the cycle's start: BudgetHeadroom), so that the allocations of a gap seen before never find the device
// short. A window begun inside a step (a plan again after a yield there) keeps that partial cycle's peaks,
// as they are, as the least it predicts.
// Not thread-safe: its owner serializes the calls (the CUDA glue: one leaf lock per device).
// A training cycle's events, as the torch glue sees them: a step's first forward (outside any backward), the
// end of its backward, a training forward inside a backward after a nested one ended (a reentrant recompute).
enum class CycleEvent { kStepStarted, kBackwardEnded, kForwardResumed };
class CyclePeaks {
 public:
  void on_event(CycleEvent event, std::size_t live);  // one of the three below; `live`: bytes held now
  void start(std::size_t live, bool at_cycle_start);  // the window begins, `live` bytes held
  void cycle_started(std::size_t live);              // a training step's first forward (outside a backward)
  void backward_ended();                             // the step's backward is over: the gap begins
  void forward_resumed();                            // a training forward in the gap (a reentrant recompute)
  void on_live(std::size_t live);                    // after each allocation and each free
  std::size_t predicted() const;                     // the step's peak
  std::size_t predicted_gap() const;                 // the gap's peak; 0 before any gap was seen
  std::size_t held_since_start() const;  // how much more the current cycle began with than the window did
  std::size_t cycle_start() const { return base_; }  // held when the current cycle began (its gap's floor)

 private:
  bool started_ = false;
  bool partial_first_ = false;  // the window began inside a cycle, whose start is unknown
  bool in_gap_ = false;
  bool gap_seen_ = false;
  std::size_t cycles_begun_ = 0;
  std::size_t first_base_ = 0;
  std::size_t base_ = 0;          // held when the current cycle began
  std::size_t step_above_ = 0;    // the most held above base_ in the current cycle's step
  std::size_t gap_above_ = 0;     // the most held above base_ in the current cycle's gap
  std::size_t most_step_ = 0;     // the largest step rise over the cycles that ended
  std::size_t most_gap_ = 0;      // the largest gap rise (less what its cycle kept) over the cycles that ended
  std::size_t step_held_ = 0;     // the most held in the current cycle's step, and in its gap
  std::size_t gap_held_ = 0;
  std::size_t partial_step_ = 0;  // the partial first cycle's, kept
  std::size_t partial_gap_ = 0;
};

// The plan for one step's record: the ring and resident layers (plan_ring_and_residency over the
// candidates), kept at the current ring unless another copies fewer bytes (a rebuild costs a stall and the
// resident copies again). `ahead`: the copies the engine makes ahead of need, replayed too (Lookahead).
struct BudgetPlan {
  RingPlan ring;                  // ring.ring_bytes: the chosen ring; ring.resident: by layer, first-use order
  std::uint64_t stay_copied = 0;  // the estimate with the ring in use
  std::size_t room = 0;           // bytes the ring and the resident layers share
};
BudgetPlan plan_budget(const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& footprints,
                       const std::vector<std::size_t>& uses, std::size_t room, std::size_t current_ring,
                       std::size_t largest_device_bytes, bool ring_fixed, const Lookahead& ahead = {});

// When the budget plans, and from what: uses are recorded from the first use of a training step (its first
// forward with grad enabled; passes before it, such as samples, have neither a step's order nor its peak),
// and the plan is made once the order has repeated (the access predictor has been right twice as often as
// there are layers: the second step is under way, and the first one's peak is on record). After a restart
// (a yield, a rebuilt engine) the record begins again at the next step's start, never inside a step: a
// record begun in a backward lacks the step's forward, and its plan would leave those layers out. A model
// whose steps never start with grad (every layer in reentrant checkpoints: the forward runs without grad,
// the recompute inside the backward) is recorded from its first use with grad, as no step start comes.
class BudgetRecorder {
 public:
  enum class Outcome {
    kNothing,         // not planning, or a use outside training while waiting
    kWaiting,         // the first use outside training while waiting (say once that it waits)
    kStarted,         // recording started here: start the windowed peak
    kRecording,       // recorded
    kPlanNow,         // recorded, and the plan is due now
  };
  enum class Use {
    kWithoutGrad,  // outside training (a sample, an evaluation), or a backward's own use
    kInStep,       // with grad, in a step already under way (a checkpoint's recompute, a later forward)
    kStepStart,    // the first forward with grad since the last backward ended: a training step begins
  };
  // `correct_predictions`: the access predictor's count of correct predictions so far.
  Outcome observe(LayerId layer, Use use, std::uint64_t correct_predictions);
  // Forget the record (a rebuilt engine, a yield): plan again from the next training step.
  void restart();
  // Plan again (as restart) and wait for a new plan; `planned()` false.
  void unplan() {
    restart();
    planned_ = false;
  }
  bool planned() const { return planned_; }
  bool recording() const { return recording_; }
  const std::vector<LayerId>& first_uses() const { return first_uses_; }
  // The recorded uses, handed over (and forgotten) for the plan.
  std::vector<LayerId> take_uses();

 private:
  bool planned_ = false;
  bool recording_ = false;
  bool told_waiting_ = false;
  bool saw_step_start_ = false;  // a use has started a step: the record waits for the next such use
  std::uint64_t hits_at_start_ = 0;
  std::vector<LayerId> first_uses_;
  std::unordered_set<LayerId> seen_;
  std::vector<LayerId> uses_;
};

// How much of the device the budget's plan may use, and when a miss of the allocator is memory pressure.
class BudgetHeadroom {
 public:
  struct Room {
    std::size_t headroom = 0;  // left free at the step's planned peak
    std::size_t room = 0;      // for the ring and the resident layers
    std::size_t lent = 0;      // of `room`, what the gap's quarter would have kept free (set_lend_gap)
  };
  // Room for the ring and resident layers on a device the process may use `limit` bytes of, whose step
  // peaked at `peak` with a ring of `ring` (the ring is counted again in the plan). Sets the threshold.
  // `gap_peak` (0: not measured): the peak between steps (CyclePeaks); `gap_start`: what the cycle began
  // with (the gap's floor). By default the plan leaves a quarter of the limit and the headroom free at the
  // gap's peak, on top of it, so that no allocation seen there before is taken for pressure
  // (gap_threshold()). With set_quarter_above_start(true) (LAYERSTREAM_VRAM_GAP=start) it leaves the
  // headroom free at the gap's peak and a quarter and the headroom above the cycle's start: a gap then gets
  // a quarter for its own allocations and the user's together, or the most a gap was seen to take if that
  // is more. (FLUX.2-shaped under 24 GiB, whose optimizer step takes 10 GiB between steps, kept 4.3 GiB of
  // layers resident under the default and 8.1 GiB before it, 7% slower: benchmarks/log.md, thirteenth
  // session.) With set_lend_gap(true) (LAYERSTREAM_VRAM_GAP=lend) the plan leaves the headroom free at the
  // step's peak and at the gap's, and lends the quarter to resident layers: `lent` says how much of `room`
  // the default would have kept free. The owner gives that much back first when an allocation between
  // steps finds less than the quarter free (is_pressure, unchanged), without planning again, and copies
  // those layers again in the next step: the gap keeps its quarter on demand, and a step whose gap asks
  // nothing copies them never.
  Room room_for(std::size_t limit, std::size_t peak, std::size_t ring, std::size_t gap_peak = 0,
                std::size_t gap_start = 0);
  // An allocation that found no cached block is pressure inside a step when less than half the headroom
  // is free (the plan's own peak leaves all of it free), and between steps when less than half the headroom
  // is free or what is free and `gap_used` add up to less than a quarter of the limit: the plan knows
  // nothing of what is asked there (a sample, a text encoder, the user's own tensors) and the allocator does
  // not say how much. `gap_used`: what the gap holds so far above the cycle's start, not counting what the
  // plan itself made resident in this cycle (LAYERSTREAM_VRAM_GAP=start; 0 by default, where the quarter is
  // asked of what is free alone). Never before a plan (nothing to give back). `threshold`, `gap_threshold`:
  // threshold() and gap_threshold() of the last plan (read without the owner's lock by the allocator's
  // callback).
  static bool is_pressure(std::size_t threshold, std::size_t gap_threshold, bool between_steps,
                          std::size_t free_bytes, std::size_t gap_used = 0) {
    if (threshold == 0) return false;
    if (free_bytes < threshold) return true;
    return between_steps && free_bytes + std::min(gap_used, gap_threshold) < gap_threshold;
  }
  // What a yield for pressure (is_pressure said so) gives back. Inside a step with the allocation retry
  // behind it (`retried`: an allocation that still fails gives back what it asks and is tried again), as much
  // as brings what is free back to the plan's whole headroom (twice `threshold`): the other resident layers
  // stay, and the plan that follows places them anew with twice the headroom, instead of copying every one
  // of them again. Between steps, or without the retry, all of them (the largest size_t): the callback is not
  // told what is asked, and after a yield nothing more is given back until the next plan.
  static std::size_t pressure_yield_bytes(std::size_t threshold, bool between_steps, std::size_t free_bytes,
                                          bool retried) {
    if (between_steps || !retried || threshold == 0) return std::numeric_limits<std::size_t>::max();
    const std::size_t headroom = 2 * threshold;
    return headroom > free_bytes ? headroom - free_bytes : threshold;
  }
  std::size_t gap_threshold() const { return gap_threshold_; }
  std::size_t threshold() const { return threshold_; }
  // Resident layers were given back: nothing more to give until the next plan. A yield inside a step
  // doubles the headroom (up to a quarter), so that a process whose step keeps growing does not yield at
  // every step; one between steps sets it to a quarter at once, the room a gap then finds, so that the
  // next sample or optimizer step does not yield again (seen on the H200, 2026-12-01: a yield at every
  // gap, each one emptying torch's cache for the next).
  // `gap_measured`: the plan measured the gaps (CyclePeaks) and left their quarter free: a yield between
  // steps then came from something no gap held before (the user's tensors, a text encoder), which the next
  // plan measures; the headroom at the step's peak stays.
  void after_yield(bool between_steps, bool gap_measured = false);
  std::size_t permille() const { return permille_; }
  void set_quarter_above_start(bool on) { quarter_above_start_ = on; }
  bool quarter_above_start() const { return quarter_above_start_; }
  void set_lend_gap(bool on) { lend_gap_ = on; }
  bool lend_gap() const { return lend_gap_; }

 private:
  std::size_t permille_ = 50;  // 5% at first: allocator fragmentation, a longer prompt
  std::size_t threshold_ = 0;
  std::size_t gap_threshold_ = 0;
  bool quarter_above_start_ = false;
  bool lend_gap_ = false;
};

}  // namespace layerstream
