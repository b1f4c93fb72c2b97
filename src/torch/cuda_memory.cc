#include "cuda_memory.h"

#ifdef LAYERSTREAM_TORCH_CUDA

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>

#include "cuda_allocation_retry.h"
#include "device_state.h"
#include "layerstream/vram_budget.h"

namespace layerstream::torchglue {
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

// Bytes the process has asked of the allocator and not freed yet, and their most since the window's start,
// per device. `on`: counting (a window was started); before that the tracker returns at once.
// With LAYERSTREAM_VRAM_PEAK=cycles (`cycles_on`) the training cycles' rises too (CyclePeaks), under `mu`: a
// leaf lock, taken inside the allocator's trace callback (under the allocator's own lock); nothing is asked
// of the allocator while it is held.
struct PeakWindow {
  std::atomic<bool> on{false};
  std::atomic<std::int64_t> start{0};  // live when the window began
  std::atomic<std::int64_t> live{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<bool> cycles_on{false};
  std::mutex mu;
  CyclePeaks cycles;  // guarded by mu
};
constexpr int kMostDevices = 64;
std::array<PeakWindow, kMostDevices>& windows() {
  static auto* w = new std::array<PeakWindow, kMostDevices>();  // the tracker outlives static teardown
  return *w;
}

// The allocator's statistics are arrays over pool types; the first is the aggregate of all of them.
constexpr std::size_t kAggregate = 0;

void on_trace(const alloc::TraceEntry& entry) {
  const int device = entry.device_;
  if (device < 0 || device >= kMostDevices) return;
  PeakWindow& w = windows()[device];
  if (!w.on.load(std::memory_order_relaxed)) return;
  const auto size = static_cast<std::int64_t>(entry.size_);
  if (entry.action_ == alloc::TraceEntry::ALLOC) {
    const std::int64_t now = w.live.fetch_add(size) + size;
    std::int64_t seen = w.peak.load();
    while (now > seen && !w.peak.compare_exchange_weak(seen, now)) {
    }
  } else if (entry.action_ == alloc::TraceEntry::FREE_COMPLETED) {
    w.live.fetch_sub(size);
  } else {
    return;
  }
  if (w.cycles_on.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(w.mu);
    w.cycles.on_live(static_cast<std::size_t>(std::max<std::int64_t>(w.live.load(), 0)));
  }
}

void on_out_of_memory(int64_t device, size_t alloc, size_t allowed, size_t free);  // below

void start_window(DeviceState& state) {
  static std::once_flag attached;
  std::call_once(attached, [] {
    alloc::attachAllocatorTraceTracker(&on_trace);
    alloc::attachOutOfMemoryObserver(&on_out_of_memory);
    install_allocation_retry();
  });
  const c10::DeviceIndex index = state.device().index();
  if (index < 0 || index >= kMostDevices) return;
  PeakWindow& w = windows()[index];
  // requested_bytes counts what ALLOC and FREE_COMPLETED carry (the sizes asked, before rounding).
  const auto now = static_cast<std::int64_t>(alloc::getDeviceStats(index).requested_bytes[kAggregate].current);
  w.start = now;
  w.live = now;
  w.peak = now;
  if (state.vram_peak() == VramPeak::kCycles) {
    std::lock_guard<std::mutex> lock(w.mu);
    w.cycles.start(static_cast<std::size_t>(std::max<std::int64_t>(now, 0)), state.step_began_at_this_use());
    w.cycles_on = true;
  }
  w.on = true;
}

// A training cycle's event on `state`'s device (LAYERSTREAM_VRAM_PEAK=cycles): a step's first forward, the
// end of its backward, a forward inside a backward.
void mark_cycle(DeviceState& state, CycleEvent event) {
  const c10::DeviceIndex index = state.device().index();
  if (index < 0 || index >= kMostDevices) return;
  PeakWindow& w = windows()[index];
  if (!w.cycles_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(w.mu);
  w.cycles.on_event(event, static_cast<std::size_t>(std::max<std::int64_t>(w.live.load(), 0)));
}

// Free memory an allocation could still get on `index`: the driver's free memory plus what torch caches
// unused (its allocator frees its cache and asks the driver again before it raises out of memory), and under
// a memory fraction what is left of the fraction beside what torch has handed out. Sets `limit` to what the
// process may hold in all. (Seen on the H200, 2026-12-01: counting the cache as used, the 31 GiB AI-Toolkit's
// flow leaves cached before training (the model placed on the GPU before attach, a text encoder) looked like
// no room at all under a 24 GiB cap, and resident layers were given back at every new bucket.)
// `whole`: the same without the free pieces of segments that still hold allocations (torch's inactive
// splits). An allocation that found no cached block cannot use those pieces: its allocator can only ask the
// driver, or release whole free segments and ask again. (Seen on the H200, 2026-12-02: Wan 2.2-shaped with
// 41 frames under a 24 GiB cap, `auto`, ran out of memory inside a step asking 336 MiB while 2.12 GiB were
// reserved but unallocated, all of them counted as free here, so nothing resident was given back.)
std::size_t free_for_allocation(c10::DeviceIndex index, std::size_t* limit, std::size_t* whole) {
  std::size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) {
    (void)cudaGetLastError();
    if (whole != nullptr) *whole = std::numeric_limits<std::size_t>::max();
    return std::numeric_limits<std::size_t>::max();  // unknown: no pressure is assumed
  }
  const auto stats = alloc::getDeviceStats(index);
  const auto reserved = static_cast<std::size_t>(stats.reserved_bytes[kAggregate].current);
  const auto in_use = std::min(reserved, static_cast<std::size_t>(stats.allocated_bytes[kAggregate].current));
  const auto split = std::min(reserved - in_use,
                              static_cast<std::size_t>(std::max<std::int64_t>(
                                  stats.inactive_split_bytes[kAggregate].current, 0)));
  const double fraction = alloc::getMemoryFraction(index);
  const auto allowed = static_cast<std::size_t>(std::min(1.0, fraction) * static_cast<double>(total));
  if (limit != nullptr) *limit = std::min(free_bytes + reserved, allowed);
  // What an allocation can get when `unusable` of what torch reserved is not for it (at least what it holds).
  const auto free_beside = [&](std::size_t unusable) {
    return std::min(free_bytes + (reserved - unusable), allowed > unusable ? allowed - unusable : 0);
  };
  if (whole != nullptr) *whole = free_beside(in_use + split);
  return free_beside(in_use);
}

DeviceMemoryView cuda_memory_view(DeviceState& state, const VramBudget& budget) {
  const c10::DeviceIndex index = state.device().index();
  DeviceMemoryView view;
  if (index >= 0 && index < kMostDevices && windows()[index].on) {
    PeakWindow& w = windows()[index];
    const auto bytes = [](std::int64_t v) { return static_cast<std::size_t>(std::max<std::int64_t>(v, 0)); };
    const std::size_t window_peak = bytes(w.peak.load());
    view.peak = steady_peak(window_peak, bytes(w.start.load()), bytes(w.live.load()));
    view.held_since = view.peak - window_peak;
    if (state.vram_peak() == VramPeak::kCycles && w.cycles_on.load()) {
      std::lock_guard<std::mutex> lock(w.mu);
      view.peak = w.cycles.predicted();
      view.held_since = w.cycles.held_since_start();
      view.gap_peak = w.cycles.predicted_gap();
      view.gap_start = w.cycles.cycle_start();
      view.cycles = true;
    }
  } else {  // no window yet (a plan before any training forward cannot happen; kept for safety)
    view.peak = static_cast<std::size_t>(alloc::getDeviceStats(index).requested_bytes[kAggregate].peak);
  }
  if (!budget.automatic) {
    view.limit = budget.bytes;
    return view;
  }
  const c10::cuda::CUDAGuard guard(index);
  (void)free_for_allocation(index, &view.limit, nullptr);
  return view;
}

// Bytes held on `index` above what the current training cycle began with (cycles only; else 0): between
// steps, what the gap itself (the optimizer's step, a sample, the user's tensors) holds so far.
std::size_t held_above_cycle_start(c10::DeviceIndex index) {
  if (index < 0 || index >= kMostDevices) return 0;
  PeakWindow& w = windows()[index];
  if (!w.on.load() || !w.cycles_on.load()) return 0;
  const auto live = static_cast<std::size_t>(std::max<std::int64_t>(w.live.load(), 0));
  std::lock_guard<std::mutex> lock(w.mu);  // the leaf lock, under the allocator's as in on_trace
  const std::size_t start = w.cycles.cycle_start();
  return live > start ? live - start : 0;
}

// torch's allocator runs this when no cached block fits an allocation, before it asks the driver (and
// before it frees its cache and tries again, then raises out of memory). It is not told the allocation's
// size and runs at every such miss, also when the driver has room. Inside a training step the plan knows
// the step's peak, so memory is given back only when the device is short of it (below half the headroom
// the plan left). Between steps the plan knows nothing of what is asked (a sample, a text encoder, the
// user's tensors), so resident layers are given back when less than a quarter of what the process may use
// is free, and the plan leaves that quarter free at the gap's peak (vram_budget.h); with
// LAYERSTREAM_VRAM_GAP=start, when what the gap holds so far and what is free add up to less than that
// quarter, which the plan leaves free above the cycle's start. Inside a step with the allocation retry
// installed, only what brings the free memory back to the plan's headroom goes back
// (BudgetHeadroom::pressure_yield_bytes); otherwise every idle resident layer. What it frees goes to the
// allocator's cache, which the allocator releases to the driver before its last try.
class YieldToPressure : public c10::FreeMemoryCallback {
 public:
  bool Execute() override {
    const c10::DeviceIndex index = c10::cuda::current_device();
    bool freed = false;
    std::size_t room = std::numeric_limits<std::size_t>::max(), whole = room;
    std::optional<std::size_t> held;  // held_above_cycle_start, read once and only where a state asks it
    bool measured = false;
    for (const auto& state : DeviceState::live()) {
      if (state->mode() != Mode::kCuda || state->device().index() != index) continue;
      const std::size_t threshold = state->pressure_threshold();
      if (threshold == 0) continue;  // nothing resident by a plan
      const bool between_steps = !state->in_training_step();
      if (!measured) {
        room = free_for_allocation(index, nullptr, &whole);
        measured = true;
      }
      // Inside a step the plan's own peak is known: a miss is pressure when what a miss can still get is
      // short. Between steps the quarter is compared with all that is free, as the plan measured it (the
      // flows of 2026-12-01 ran without a yield so); with LAYERSTREAM_VRAM_GAP=start, with what is free and
      // what the gap holds together, less the copies the plan itself made in this cycle.
      const std::size_t free_now = between_steps ? room : whole;
      std::size_t gap_used = 0;
      if (between_steps && state->quarter_above_start()) {
        if (!held) held = held_above_cycle_start(index);
        gap_used = state->held_by_gap(*held);
      }
      if (BudgetHeadroom::is_pressure(threshold, state->gap_pressure_threshold(), between_steps, free_now, gap_used)) {
        const std::size_t want =
            BudgetHeadroom::pressure_yield_bytes(threshold, between_steps, free_now, allocation_retry_installed());
        freed = state->yield_for_pressure(want, between_steps, free_now) || freed;
      }
    }
    return freed;
  }
};

// An allocation that failed all the same (inside a step, larger than the room the plan left) where the
// allocation retry (cuda_allocation_retry.h) does not catch it (a raw allocation, a torch it does not wrap):
// the resident layers are given back now, so that the caller's next try finds their memory (AI-Toolkit's
// trainer catches an out-of-memory error in a step, empties the cache and goes on with the next step).
void on_out_of_memory(int64_t device, size_t /*alloc*/, size_t /*allowed*/, size_t free_bytes) {
  if (allocation_retry_armed()) return;  // the wrapper gives back what the allocation needs and tries again
  for (const auto& state : DeviceState::live()) {
    if (state->mode() != Mode::kCuda || state->device().index() != device) continue;
    if (state->pressure_threshold() == 0) continue;
    (void)state->yield_for_pressure(std::numeric_limits<std::size_t>::max(), false, free_bytes);
  }
}

}  // namespace

std::size_t room_for_allocation(int device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  std::size_t whole = 0;
  (void)free_for_allocation(static_cast<c10::DeviceIndex>(device), nullptr, &whole);
  return whole;
}

void install_cuda_memory_probe() {
  DeviceState::set_memory_resolver(&cuda_memory_view, &start_window, &mark_cycle);
}

}  // namespace layerstream::torchglue

namespace c10 {
REGISTER_FREE_MEMORY_CALLBACK(layerstream_yield_to_pressure, layerstream::torchglue::YieldToPressure)
}  // namespace c10

#else

namespace layerstream::torchglue {
void install_cuda_memory_probe() {}
std::size_t room_for_allocation(int) { return 0; }
}  // namespace layerstream::torchglue

#endif
