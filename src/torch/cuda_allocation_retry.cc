#include "cuda_allocation_retry.h"

#ifdef LAYERSTREAM_TORCH_CUDA

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <atomic>
#include <cstddef>
#include <limits>
#include <mutex>
#include <string>

#include "cuda_memory.h"
#include "device_state.h"
#include "layerstream/log.h"

// The torch releases whose CUDAAllocator interface the wrapper below delegates in full (every virtual
// function, pure or not, checked against their headers). Elsewhere it is not built: a virtual it did not
// delegate would silently take the base class's default (a CUDA graph capture's notification, a memory
// pool's use count), so on another torch the budget keeps the out-of-memory observer alone.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11 && TORCH_VERSION_MINOR <= 13
#define LAYERSTREAM_ALLOCATION_RETRY 1
#endif

namespace layerstream::torchglue {

#ifdef LAYERSTREAM_ALLOCATION_RETRY
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

// Set on the allocating thread while the wrapper's first try runs: the out-of-memory observer then leaves
// the yield to the wrapper, which knows the allocation's size.
thread_local bool g_retry_armed = false;
std::atomic<bool> g_installed{false};

// Gives back resident layers of the budgets on `device` for an allocation of `bytes` that ran out of memory:
// what it lacks beside the room there is (and an eighth of its size for the segments' rounding and
// fragments), or all of them when `bytes` is the largest size_t. True when anything was freed.
bool yield_for_allocation(c10::DeviceIndex device, std::size_t bytes) {
  const bool all = bytes == std::numeric_limits<std::size_t>::max();
  const std::size_t room = room_for_allocation(device);
  const std::size_t want = all ? bytes : (bytes > room ? bytes - room : 0) + bytes / 8;
  bool freed = false;
  for (const auto& state : DeviceState::live()) {
    if (state->mode() != Mode::kCuda || state->device().index() != device) continue;
    freed = state->yield_for_pressure(want, !state->in_training_step(), room) || freed;
  }
  return freed;
}

// torch's CUDA allocator with one change: a tensor allocation that runs out of memory while layers of a VRAM
// budget are resident on its device gives them back (as many as the allocation needs, then all) and is tried
// again, so the memory the budget borrowed is returned on demand instead of failing the caller. Everything
// else, and every allocation that fits, goes to the wrapped allocator unchanged. raw_alloc (the ring's and the
// resident layers' own memory, cuBLAS workspaces) is not retried: a layer made resident never pushes out
// another. Lives for the whole process (torch keeps pointers to its allocator).
class RetryingAllocator final : public alloc::CUDAAllocator {
 public:
  explicit RetryingAllocator(alloc::CUDAAllocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    {
      g_retry_armed = true;
      try {
        c10::DataPtr p = inner_->allocate(n);
        g_retry_armed = false;
        return p;
      } catch (const c10::OutOfMemoryError&) {
        g_retry_armed = false;
        if (!yield_for_allocation(c10::cuda::current_device(), n)) throw;
      } catch (...) {
        g_retry_armed = false;
        throw;
      }
    }
    ++retries_;
    try {
      return inner_->allocate(n);
    } catch (const c10::OutOfMemoryError&) {
      // The layers given back were not where the allocation needed room (fragmented segments): all of them.
      if (!yield_for_allocation(c10::cuda::current_device(), std::numeric_limits<std::size_t>::max())) throw;
    }
    return inner_->allocate(n);
  }

  // Delegated unchanged: c10::Allocator.
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { inner_->copy_data(dest, src, count); }
  bool is_simple_data_ptr(const c10::DataPtr& p) const override { return inner_->is_simple_data_ptr(p); }
  // c10::DeviceAllocator.
  bool initialized() override { return inner_->initialized(); }
  void emptyCache(c10::MempoolId_t id) override { inner_->emptyCache(id); }
  void recordStream(const c10::DataPtr& p, c10::Stream s) override { inner_->recordStream(p, s); }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex d) override {
    return inner_->getDeviceStats(d);
  }
  void resetAccumulatedStats(c10::DeviceIndex d) override { inner_->resetAccumulatedStats(d); }
  void resetPeakStats(c10::DeviceIndex d) override { inner_->resetPeakStats(d); }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex d) override { return inner_->getMemoryInfo(d); }
  // CUDAAllocator.
  void* raw_alloc(size_t n) override { return inner_->raw_alloc(n); }
  void* raw_alloc_with_stream(size_t n, cudaStream_t s) override { return inner_->raw_alloc_with_stream(n, s); }
  void raw_delete(void* p) override { inner_->raw_delete(p); }
  void init(int count) override { inner_->init(count); }
  double getMemoryFraction(c10::DeviceIndex d) override { return inner_->getMemoryFraction(d); }
  void setMemoryFraction(double f, c10::DeviceIndex d) override { inner_->setMemoryFraction(f, d); }
  std::vector<alloc::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex d) override {
    return inner_->getExpandableSegmentSizes(d);
  }
  void enable(bool value) override { inner_->enable(value); }
  bool isEnabled() const override { return inner_->isEnabled(); }
  void cacheInfo(c10::DeviceIndex d, size_t* largest) override { inner_->cacheInfo(d, largest); }
  void* getBaseAllocation(void* p, size_t* size) override { return inner_->getBaseAllocation(p, size); }
  void recordStream(const c10::DataPtr& p, c10::cuda::CUDAStream s) override { inner_->recordStream(p, s); }
  alloc::SnapshotInfo snapshot(c10::MempoolId_t id, bool traces) override { return inner_->snapshot(id, traces); }
  void beginAllocateToPool(c10::DeviceIndex d, c10::MempoolId_t id, std::function<bool(cudaStream_t)> f) override {
    inner_->beginAllocateToPool(d, id, std::move(f));
  }
  void endAllocateToPool(c10::DeviceIndex d, c10::MempoolId_t id) override { inner_->endAllocateToPool(d, id); }
  void releasePool(c10::DeviceIndex d, c10::MempoolId_t id) override { inner_->releasePool(d, id); }
  int getPoolUseCount(c10::DeviceIndex d, c10::MempoolId_t id) override { return inner_->getPoolUseCount(d, id); }
  void createOrIncrefPool(c10::DeviceIndex d, c10::MempoolId_t id, std::shared_ptr<CUDAAllocator> a) override {
    inner_->createOrIncrefPool(d, id, std::move(a));
  }
  void setUseOnOOM(c10::DeviceIndex d, c10::MempoolId_t id, bool use) override { inner_->setUseOnOOM(d, id, use); }
  void setNoSplit(c10::DeviceIndex d, c10::MempoolId_t id) override { inner_->setNoSplit(d, id); }
  bool checkPoolLiveAllocations(c10::DeviceIndex d, c10::MempoolId_t id,
                                const std::unordered_set<void*>& live) override {
    return inner_->checkPoolLiveAllocations(d, id, live);
  }
  alloc::ShareableHandle shareIpcHandle(void* p) override { return inner_->shareIpcHandle(p); }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return inner_->getIpcDevPtr(std::move(handle)); }
  bool isHistoryEnabled() override { return inner_->isHistoryEnabled(); }
  void recordHistory(bool on, alloc::CreateContextFn ctx, size_t most, alloc::RecordContext when, bool clear,
                     const std::vector<std::string>& skip) override {
    inner_->recordHistory(on, ctx, most, when, clear, skip);
  }
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    inner_->recordAnnotation(md);
  }
  void pushCompileContext(std::string& md) override { inner_->pushCompileContext(md); }
  void popCompileContext() override { inner_->popCompileContext(); }
  void setUserMetadata(const std::string& md) override { inner_->setUserMetadata(md); }
  std::string getUserMetadata() override { return inner_->getUserMetadata(); }
  void attachOutOfMemoryObserver(alloc::OutOfMemoryObserver o) override {
    inner_->attachOutOfMemoryObserver(std::move(o));
  }
  void attachAllocatorTraceTracker(alloc::AllocatorTraceTracker t) override {
    inner_->attachAllocatorTraceTracker(std::move(t));
  }
  void enablePeerAccess(c10::DeviceIndex d, c10::DeviceIndex to) override { inner_->enablePeerAccess(d, to); }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count, cudaStream_t s,
                          bool p2p) override {
    return inner_->memcpyAsync(dst, dst_device, src, src_device, count, s, p2p);
  }
  std::shared_ptr<alloc::AllocatorState> getCheckpointState(c10::DeviceIndex d, c10::MempoolId_t id) override {
    return inner_->getCheckpointState(d, id);
  }
  alloc::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex d,
                                                std::shared_ptr<alloc::AllocatorState> s) override {
    return inner_->setCheckpointPoolState(d, std::move(s));
  }
  std::string name() override { return inner_->name(); }
#if TORCH_VERSION_MINOR >= 12
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* p) override {
    return inner_->getContextForPointer(p);
  }
  void attachOomRejectionObserver(alloc::OomRejectionObserver o) override {
    inner_->attachOomRejectionObserver(std::move(o));
  }
#endif
#if TORCH_VERSION_MINOR >= 13
  void markCaptureBegin(c10::DeviceIndex d) override { inner_->markCaptureBegin(d); }
  void markCaptureEnd(c10::DeviceIndex d) override { inner_->markCaptureEnd(d); }
  c10::DataPtr allocateWithAddress(size_t size, void* addr) override { return inner_->allocateWithAddress(size, addr); }
#endif

  std::size_t retries() const { return retries_.load(); }

 private:
  alloc::CUDAAllocator* const inner_;
  std::atomic<std::size_t> retries_{0};
};

RetryingAllocator* g_wrapper = nullptr;  // leaked on purpose: torch keeps pointers to its allocator

}  // namespace

void install_allocation_retry() {
  static std::once_flag once;
  std::call_once(once, [] {
    alloc::CUDAAllocator* inner = alloc::allocator.load();
    if (inner == nullptr) return;
    g_wrapper = new RetryingAllocator(inner);
    alloc::allocator.store(g_wrapper);
    c10::SetAllocator(c10::DeviceType::CUDA, g_wrapper);
    g_installed = true;
    log(LogLevel::kDebug, "VRAM budget: torch's CUDA allocator (" + inner->name() +
                              ") now tries an allocation that ran out of memory again after resident layers "
                              "are given back");
  });
}

bool allocation_retry_armed() { return g_retry_armed; }
bool allocation_retry_installed() { return g_installed.load(); }
std::size_t allocation_retries() { return g_wrapper != nullptr ? g_wrapper->retries() : 0; }

#else  // a torch whose allocator interface was not checked: the out-of-memory observer alone

void install_allocation_retry() {}
bool allocation_retry_armed() { return false; }
bool allocation_retry_installed() { return false; }
std::size_t allocation_retries() { return 0; }

#endif

}  // namespace layerstream::torchglue

#else  // no CUDA torch

namespace layerstream::torchglue {
void install_allocation_retry() {}
bool allocation_retry_armed() { return false; }
bool allocation_retry_installed() { return false; }
std::size_t allocation_retries() { return 0; }
}  // namespace layerstream::torchglue

#endif
