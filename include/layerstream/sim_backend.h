// SimBackend: the device played by host threads, for testing ordering rules on any CPU.
//
// Each stream is a host thread running its queue in order; copies really move bytes between host buffers;
// events really order streams. A seeded fault injector delays operations and scrambles the order in which a
// copy's bytes land, within what CUDA's stream rules allow, so that a missing event shows up as corrupted
// bytes in some schedules.
//
// Independently of timing, a happens-before race checker (vector clocks, computed in host enqueue order)
// records every pair of accesses to the same bytes, at least one a write, that no stream order or event
// orders. Accesses are those of the copies plus the ones declared through Backend::annotate_*(). Its
// verdict is deterministic: the same sequence of calls gives the same violations, whatever the timing.
//
// Memory: "device" and "pinned" allocations are aligned host allocations, tracked so that tests can see
// what is still held. Freeing waits for every stream to go idle first, as cudaFree does.
// Thread-safety: every method may be called from any host thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "layerstream/backend.h"
#include "layerstream/vram_budget.h"

namespace layerstream {

struct SimOptions {
  int device = 0;
  std::uint64_t seed = 0;
  // Probability that an operation is held back for a random time of up to max_delay_us before it runs.
  double delay_probability = 0.0;
  unsigned max_delay_us = 0;
  // Copies land in randomly ordered pieces instead of one memcpy.
  bool scramble_copies = false;
  // Capacity of the simulated device; allocations beyond it return nullptr.
  std::size_t device_capacity_bytes = std::size_t{1} << 30;
  // Pinned bytes the "platform" grants; requests beyond it are refused (nullptr / false).
  std::size_t pinned_capacity_bytes = ~std::size_t{0};
};

struct SimMemoryStats {
  std::size_t device_bytes = 0;
  std::size_t pinned_bytes = 0;
  std::size_t registered_bytes = 0;
  std::size_t streams = 0;
  std::size_t events = 0;
};

class SimBackend final : public Backend {
 public:
  explicit SimBackend(SimOptions options = {});
  ~SimBackend() override;
  SimBackend(const SimBackend&) = delete;
  SimBackend& operator=(const SimBackend&) = delete;

  BackendKind kind() const override { return BackendKind::kSim; }
  std::string name() const override;
  int device() const override;

  StreamHandle stream_create() override;
  void stream_destroy(StreamHandle stream) noexcept override;
  void stream_synchronize(StreamHandle stream) override;
  void stream_wait_event(StreamHandle stream, EventHandle event) override;

  EventHandle event_create() override;
  void event_destroy(EventHandle event) noexcept override;
  void event_record(EventHandle event, StreamHandle stream) override;
  bool event_query(EventHandle event) override;
  void event_synchronize(EventHandle event) override;

  void* host_alloc_pinned(std::size_t bytes) override;
  void host_free_pinned(void* ptr) noexcept override;
  bool host_register(void* ptr, std::size_t bytes, bool read_only = false) override;
  EventHandle event_create_timed() override;
  double event_elapsed_ms(EventHandle start, EventHandle end) override;
  void host_unregister(void* ptr) noexcept override;

  void* device_alloc(std::size_t bytes) override;
  void device_free(void* ptr) noexcept override;
  std::pair<std::size_t, std::size_t> device_memory_info() override;

  void memcpy_h2d_async(void* device_dst, const void* host_src, std::size_t bytes,
                        StreamHandle stream) override;
  void memcpy_d2h_async(void* host_dst, const void* device_src, std::size_t bytes,
                        StreamHandle stream) override;
  void launch_host_func(StreamHandle stream, std::function<void()> fn) override;

  void annotate_stream_access(StreamHandle stream, const void* ptr, std::size_t bytes,
                              bool is_write) override;
  void annotate_host_access(const void* ptr, std::size_t bytes, bool is_write) override;

  // Waits until every stream is idle (a device-wide synchronize; tests only).
  void synchronize_all();
  // Race checker verdicts so far, one human-readable line each.
  std::vector<std::string> violations() const;
  std::size_t violation_count() const;
  void clear_violations();
  // Total accesses the checker has examined (tests use it to prove the checker saw the work).
  std::uint64_t checked_accesses() const;
  SimMemoryStats memory_stats() const;
  // The next `count` memcpy_h2d_async calls throw Error (as a failed CUDA call does) before enqueuing
  // anything: tests of what the engine does when a copy cannot be issued.
  void fail_next_h2d_copies(int count);
  // Memory pressure, as torch's caching allocator signals it (its free-memory callbacks): a device_alloc
  // that does not fit calls `hook(bytes)` once, without the backend's lock, and tries again when it returns
  // true. The hook may free device memory (device_free). Empty: none.
  void set_memory_pressure_hook(std::function<bool(std::size_t bytes)> hook);
  // The most device memory held since reset_device_peak() (or since construction): a windowed peak, as
  // the torch glue measures one on CUDA.
  std::size_t device_peak_bytes() const;
  void reset_device_peak();
  // The training cycles' peaks of the simulated device (CyclePeaks, LAYERSTREAM_VRAM_PEAK=cycles), fed by
  // every device allocation and free as the torch glue feeds them from torch's allocator on CUDA.
  void start_cycle_peaks(bool at_cycle_start);  // the window begins (CyclePeaks::start)
  void cycle_event(CycleEvent event);
  CyclePeaks cycle_peaks() const;  // a copy, as of now

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace layerstream
