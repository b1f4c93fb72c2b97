#include "layerstream/vram_budget.h"

#include <algorithm>

#include "layerstream/alignment.h"
#include "layerstream/check.h"

namespace layerstream {
namespace {
constexpr std::size_t kRingAlignment = kBlockAlignment;  // as DeviceRing places regions
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kMostHeadroomPermille = 250;
}  // namespace

std::size_t steady_peak(std::size_t window_peak, std::size_t live_at_start, std::size_t live_now) {
  return live_now > live_at_start ? window_peak + (live_now - live_at_start) : window_peak;
}

void CyclePeaks::start(std::size_t live, bool at_cycle_start) {
  *this = CyclePeaks();
  started_ = true;
  partial_first_ = !at_cycle_start;
  first_base_ = base_ = step_held_ = live;
}

void CyclePeaks::cycle_started(std::size_t live) {
  if (!started_) return;
  on_live(live);  // the cycle ends where the next begins
  const std::size_t kept = live > base_ ? live - base_ : 0;
  if (partial_first_ && cycles_begun_ == 0) {
    partial_step_ = step_held_;  // its start is unknown: its peaks as they are
    partial_gap_ = gap_held_;
  } else {
    most_step_ = std::max(most_step_, step_above_);
    most_gap_ = std::max(most_gap_, gap_above_ > kept ? gap_above_ - kept : 0);
  }
  gap_seen_ = gap_seen_ || in_gap_;
  ++cycles_begun_;
  base_ = live;
  step_above_ = gap_above_ = gap_held_ = 0;
  step_held_ = live;
  in_gap_ = false;
}

void CyclePeaks::on_event(CycleEvent event, std::size_t live) {
  switch (event) {
    case CycleEvent::kStepStarted: cycle_started(live); break;
    case CycleEvent::kBackwardEnded: backward_ended(); break;
    case CycleEvent::kForwardResumed: forward_resumed(); break;
  }
}

void CyclePeaks::backward_ended() {
  if (started_) in_gap_ = true;
}

void CyclePeaks::forward_resumed() { in_gap_ = false; }

void CyclePeaks::on_live(std::size_t live) {
  if (!started_) return;
  // Above the cycle's start only: a release of what the cycle began with is no rise.
  const std::size_t above = live > base_ ? live - base_ : 0;
  std::size_t& most = in_gap_ ? gap_above_ : step_above_;
  most = std::max(most, above);
  std::size_t& held = in_gap_ ? gap_held_ : step_held_;
  held = std::max(held, live);
}

std::size_t CyclePeaks::predicted() const {
  const std::size_t from_cycles = base_ + std::max(most_step_, step_above_);
  return partial_first_ ? std::max(from_cycles, partial_step_) : from_cycles;
}

std::size_t CyclePeaks::predicted_gap() const {
  // The current cycle's gap so far counts whole: what it keeps for the next is not known yet.
  const bool seen = gap_seen_ || in_gap_ || partial_gap_ > 0;
  if (!seen) return 0;
  const std::size_t from_cycles = base_ + std::max(most_gap_, gap_above_);
  return std::max(from_cycles, partial_gap_);
}

std::size_t CyclePeaks::held_since_start() const { return base_ > first_base_ ? base_ - first_base_ : 0; }

std::size_t ring_footprint(std::size_t device_bytes) {
  return (device_bytes + kRingAlignment - 1) / kRingAlignment * kRingAlignment;
}

std::size_t least_ring_bytes(std::size_t largest_device_bytes, std::size_t attached_device_bytes) {
  return std::min(kMinRingLayers * ring_footprint(largest_device_bytes), ring_footprint(attached_device_bytes));
}

std::size_t ring_bytes_for(std::size_t layer_bytes, std::size_t floor, const std::size_t* fixed) {
  const std::size_t aligned = ring_footprint(layer_bytes);
  const std::size_t wanted = fixed != nullptr ? *fixed : std::max(3 * aligned, floor);
  LS_CHECK_ARG(wanted >= aligned, "LAYERSTREAM_RING_MB is ", wanted / kMiB, " MiB, smaller than a layer of ",
               layer_bytes, " bytes; raise it to at least ", (aligned + kMiB - 1) / kMiB, " MiB (3x that is better)");
  return wanted;
}

std::vector<std::size_t> candidate_rings(std::size_t current, std::size_t largest_device_bytes, bool fixed) {
  std::vector<std::size_t> rings = {current};
  if (fixed) return rings;
  const std::size_t unit = ring_footprint(largest_device_bytes);
  for (std::size_t k : {3u, 4u, 5u, 6u, 8u, 10u}) {
    if (k * unit > current) rings.push_back(k * unit);
  }
  return rings;
}

BudgetPlan plan_budget(const std::vector<std::size_t>& sizes, const std::vector<std::size_t>& footprints,
                       const std::vector<std::size_t>& uses, std::size_t room, std::size_t current_ring,
                       std::size_t largest_device_bytes, bool ring_fixed, const Lookahead& ahead) {
  BudgetPlan out;
  out.room = room;
  const RingPlan stay = plan_ring_and_residency(sizes, uses, room, {current_ring}, 1.0, footprints, ahead);
  out.stay_copied = stay.copied_bytes;
  out.ring = plan_ring_and_residency(sizes, uses, room, candidate_rings(current_ring, largest_device_bytes, ring_fixed),
                                     1.0, footprints, ahead);
  if (out.ring.copied_bytes > stay.copied_bytes) out.ring = stay;
  return out;
}

BudgetRecorder::Outcome BudgetRecorder::observe(LayerId layer, Use use, std::uint64_t correct_predictions) {
  if (use == Use::kStepStart) saw_step_start_ = true;
  if (planned_) return Outcome::kNothing;
  Outcome out = Outcome::kRecording;
  if (!recording_) {
    if (use == Use::kInStep && saw_step_start_) return Outcome::kNothing;  // wait for the next step's start
    if (use == Use::kWithoutGrad) {
      if (told_waiting_) return Outcome::kNothing;
      told_waiting_ = true;  // once, not at every call of the passes before training
      return Outcome::kWaiting;
    }
    recording_ = true;
    told_waiting_ = true;  // the wait for the first training step is over: not said after a restart
    hits_at_start_ = correct_predictions;
    out = Outcome::kStarted;
  }
  if (seen_.insert(layer).second) first_uses_.push_back(layer);
  if (uses_.size() < (std::size_t{1} << 22)) uses_.push_back(layer);
  if (correct_predictions - hits_at_start_ >= 2 * first_uses_.size() + 2) {
    planned_ = true;
    return Outcome::kPlanNow;
  }
  return out;
}

void BudgetRecorder::restart() {
  recording_ = false;
  first_uses_.clear();
  seen_.clear();
  uses_.clear();
}

std::vector<LayerId> BudgetRecorder::take_uses() {
  std::vector<LayerId> out;
  out.swap(uses_);
  return out;
}

BudgetHeadroom::Room BudgetHeadroom::room_for(std::size_t limit, std::size_t peak, std::size_t ring,
                                              std::size_t gap_peak, std::size_t gap_start) {
  Room r;
  r.headroom = limit / 1000 * permille_;
  threshold_ = r.headroom / 2;
  gap_threshold_ = limit / 1000 * kMostHeadroomPermille;
  // The ring and the resident copies share what the process may hold beyond its peak without the ring.
  const auto room_at = [&](std::size_t at, std::size_t free_there) {
    const std::size_t others = at > ring ? at - ring : 0;
    return limit > others + free_there ? limit - others - free_there : 0;
  };
  r.room = room_at(peak, r.headroom);
  // Between steps the quarter and the headroom at the gap's peak: an allocation there finds the quarter free
  // even when the allocator's blocks hold more than the sizes asked (seen on the H200, 2026-12-01: FLUX.1's
  // gap came 56 MiB above a plan that left the quarter alone, and everything resident was given back). Or
  // the headroom there and the quarter above the cycle's start, which is_pressure then keeps for the gap.
  if (gap_peak > 0) {
    const std::size_t at_step = r.room;
    r.room = quarter_above_start_ ? std::min({r.room, room_at(gap_peak, r.headroom),
                                              room_at(gap_start, gap_threshold_ + r.headroom)})
                                  : std::min(r.room, room_at(gap_peak, gap_threshold_ + r.headroom));
    if (lend_gap_) {  // the headroom at both peaks; what the quarter would have kept is lent
      const std::size_t lending = std::min(at_step, room_at(gap_peak, r.headroom));
      r.lent = lending > r.room ? lending - r.room : 0;
      r.room = std::max(r.room, lending);
    }
  }
  return r;
}

void BudgetHeadroom::after_yield(bool between_steps, bool gap_measured) {
  threshold_ = 0;
  gap_threshold_ = 0;
  if (between_steps) {
    if (!gap_measured) permille_ = kMostHeadroomPermille;
  } else {
    permille_ = std::min(permille_ * 2, kMostHeadroomPermille);
  }
}

}  // namespace layerstream
