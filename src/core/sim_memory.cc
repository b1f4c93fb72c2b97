// SimBackend (sim_backend.h): the simulated device's and host's memory: pinned allocations and
// registrations against the pinned capacity, device allocations against the device capacity (with the
// memory pressure hook, as torch's allocator runs its free-memory callbacks), the device's peak.
#include <cstdlib>

#ifdef _WIN32
#include <malloc.h>
#endif

#include "layerstream/alignment.h"
#include "layerstream/check.h"
#include "sim_backend_impl.h"

namespace layerstream {

namespace sim {

constexpr std::size_t kAlignment = kBlockAlignment;

// MSVC has no std::aligned_alloc.
void* aligned_allocate(std::size_t bytes) {
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
#ifdef _WIN32
  return _aligned_malloc(rounded, kAlignment);
#else
  return std::aligned_alloc(kAlignment, rounded);
#endif
}

void aligned_free(void* p) {
#ifdef _WIN32
  _aligned_free(p);
#else
  std::free(p);
#endif
}

}  // namespace sim

using sim::aligned_allocate;
using sim::aligned_free;

void* SimBackend::host_alloc_pinned(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "host_alloc_pinned: size must be positive");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->pinned_bytes + bytes > impl_->options.pinned_capacity_bytes) return nullptr;
  void* p = aligned_allocate(bytes);
  if (p == nullptr) return nullptr;
  impl_->pinned_allocs[p] = bytes;
  impl_->pinned_bytes += bytes;
  return p;
}

void SimBackend::host_free_pinned(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->pinned_allocs.find(ptr);
  if (it == impl_->pinned_allocs.end()) return;
  impl_->drain_all(lock);  // cudaFreeHost synchronizes the device
  impl_->checker.forget(ptr, it->second);
  impl_->pinned_bytes -= it->second;
  impl_->pinned_allocs.erase(it);
  aligned_free(ptr);
}

bool SimBackend::host_register(void* ptr, std::size_t bytes, bool /*read_only*/) {
  LS_CHECK_ARG(ptr != nullptr && bytes > 0, "host_register: empty range");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->pinned_bytes + bytes > impl_->options.pinned_capacity_bytes) return false;
  impl_->registered[ptr] = bytes;
  impl_->pinned_bytes += bytes;
  return true;
}

void SimBackend::host_unregister(void* ptr) noexcept {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->registered.find(ptr);
  if (it == impl_->registered.end()) return;
  impl_->drain_all(lock);
  impl_->checker.forget(ptr, it->second);
  impl_->pinned_bytes -= it->second;
  impl_->registered.erase(it);
}

void* SimBackend::device_alloc(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "device_alloc: size must be positive");
  std::function<bool(std::size_t)> hook;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1 && !(hook && hook(bytes))) return nullptr;  // outside the lock: the hook frees memory
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->device_bytes + bytes > impl_->options.device_capacity_bytes) {
      hook = impl_->pressure_hook;
      continue;
    }
    void* p = aligned_allocate(bytes);
    if (p == nullptr) return nullptr;
    impl_->device_allocs[p] = bytes;
    impl_->device_bytes += bytes;
    impl_->device_peak = std::max(impl_->device_peak, impl_->device_bytes);
    impl_->cycles.on_live(impl_->device_bytes);
    return p;
  }
  return nullptr;
}

void SimBackend::set_memory_pressure_hook(std::function<bool(std::size_t bytes)> hook) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pressure_hook = std::move(hook);
}

std::size_t SimBackend::device_peak_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->device_peak;
}

void SimBackend::reset_device_peak() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->device_peak = impl_->device_bytes;
}

void SimBackend::start_cycle_peaks(bool at_cycle_start) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cycles.start(impl_->device_bytes, at_cycle_start);
}

void SimBackend::cycle_event(CycleEvent event) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->cycles.on_event(event, impl_->device_bytes);
}

CyclePeaks SimBackend::cycle_peaks() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->cycles;
}

void SimBackend::device_free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->device_allocs.find(ptr);
  if (it == impl_->device_allocs.end()) return;
  impl_->drain_all(lock);  // cudaFree synchronizes the device
  impl_->checker.forget(ptr, it->second);
  impl_->device_bytes -= it->second;
  impl_->cycles.on_live(impl_->device_bytes);
  impl_->device_allocs.erase(it);
  aligned_free(ptr);
}

std::pair<std::size_t, std::size_t> SimBackend::device_memory_info() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return {impl_->options.device_capacity_bytes - impl_->device_bytes,
          impl_->options.device_capacity_bytes};
}

SimMemoryStats SimBackend::memory_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  SimMemoryStats s;
  for (auto& [p, n] : impl_->device_allocs) s.device_bytes += n;
  for (auto& [p, n] : impl_->pinned_allocs) s.pinned_bytes += n;
  for (auto& [p, n] : impl_->registered) s.registered_bytes += n;
  s.streams = impl_->streams.size();
  s.events = impl_->events.size();
  return s;
}

}  // namespace layerstream
