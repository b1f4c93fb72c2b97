#include "device_state.h"
#include "host_share.h"
#include "layerstream/vram_budget.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cstdlib>
#include <unordered_map>

#include "layerstream/check.h"
#include "layerstream/cuda_backend.h"
#include "layerstream/log.h"
#include "layerstream/sim_backend.h"

#ifdef LAYERSTREAM_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "layerstream/cuda_check.h"
#endif

namespace layerstream::torchglue {

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;


std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<std::weak_ptr<DeviceState>>& registry() {
  static auto* r = new std::vector<std::weak_ptr<DeviceState>>();  // outlives static teardown
  return *r;
}

#ifdef LAYERSTREAM_TORCH_CUDA
// The stream that device memory from torch's caching allocator is taken for (see engine_for): one per
// device, created at first use and never destroyed (torch's own pool streams may run other work).
cudaStream_t allocation_stream(c10::DeviceIndex index) {
  static std::mutex m;
  static auto* streams = new std::unordered_map<int, cudaStream_t>();  // outlives static teardown
  std::lock_guard<std::mutex> lock(m);
  auto it = streams->find(index);
  if (it != streams->end()) return it->second;
  c10::cuda::CUDAGuard guard(index);
  cudaStream_t s = nullptr;
  LS_CUDA_CHECK_MSG(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "could not create a CUDA stream on device ",
                    static_cast<int>(index));
  streams->emplace(index, s);
  return s;
}

// Ring memory from torch's caching allocator: it then counts in torch.cuda.memory_allocated() and
// obeys set_per_process_memory_fraction, like every other tensor of the process. The allocator pools
// freed blocks by the stream they were allocated for, and hands a block to an allocation for the same
// stream even while kernels queued there may still use it. So not the current (compute) stream: a
// block freed there with kernels still queued could be filled by our copy first and overwritten by them
// after (seen: a VRAM budget's resident copies overwritten mid-run). Nor the engine's own H2D stream,
// which every engine creates anew: each ring freed would stay cached for a stream that no longer exists,
// taken back only when an allocation of this process fails (seen: fifty engines in one process held
// the whole H200, and processes beside it ran out of memory). A stream of layerstream's own per device,
// which never runs anything and lives as long as the process: every block in its pool was freed by
// us, and we free only memory that nothing reads or writes any more (the engine synchronizes first).
void take_ring_from_torch(EngineOptions& options, const c10::Device& device) {
  const c10::DeviceIndex index = device.index();
  const cudaStream_t key = allocation_stream(index);
  options.ring_allocator.allocate = [index, key](std::size_t bytes, StreamHandle) -> void* {
    c10::cuda::CUDAGuard guard(index);
    try {
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, key);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  };
  options.ring_allocator.deallocate = [](void* p) { c10::cuda::CUDACachingAllocator::raw_delete(p); };
}
#endif

}  // namespace

HostBlockRef::HostBlockRef(std::shared_ptr<HostPool> pool, std::size_t bytes)
    : pool_(std::move(pool)), block_(pool_->arena->allocate(bytes)) {}

HostBlockRef::HostBlockRef(std::shared_ptr<HostPool> pool, std::unique_ptr<SharedHostSegment> segment)
    : pool_(std::move(pool)), segment_(std::move(segment)) {
  block_ = HostBlock{segment_->data(), segment_->bytes(), segment_->pinned()};
  HostShare::note_block(static_cast<std::int64_t>(block_.bytes), +1);
}

HostBlockRef::~HostBlockRef() {
  if (segment_) {
    HostShare::note_block(static_cast<std::int64_t>(block_.bytes), -1);
    segment_.reset();
    return;
  }
  try {
    pool_->arena->free(block_.data);
  } catch (const std::exception& e) {
    log(LogLevel::kError, std::string("freeing a host block failed: ") + e.what());
  }
}

DeviceState::DeviceState(const c10::Device& device, Mode mode)
    : device_(device), mode_(mode), budget_(BudgetConfig::from(*Settings::current())) {
  const std::shared_ptr<const Settings> settings = Settings::current();
  prefetch_.on = settings->prefetch;
  prefetch_.lookahead_layers = settings->prefetch_layers;
  ring_.policy = settings->ring_policy;
  pool_ = std::make_shared<HostPool>();
  ArenaOptions arena;
  arena.chunk_bytes = settings->chunk_bytes;
  arena.pinned_cap_bytes = settings->pinned_cap_bytes.value_or(0);
  switch (mode) {
    case Mode::kCuda:
      pool_->backend = std::shared_ptr<Backend>(make_cuda_backend(device.index()));
      break;
    case Mode::kSim: {
      SimOptions o;
      o.device = device.has_index() ? device.index() : 0;  // cpu:N: a second simulated device
      // The host's memory stands in for the device's (LAYERSTREAM_SIM_DEVICE_MB; tests: a small simulated card),
      // and a platform that pins only so much (a tiny `ulimit -l`).
      o.device_capacity_bytes = settings->sim_device_bytes;
      if (settings->sim_pinnable_bytes) o.pinned_capacity_bytes = *settings->sim_pinnable_bytes;
      if (settings->sim_faults) {
        // Tests: delay operations and scramble copies (the value seeds the injector).
        o.seed = *settings->sim_faults;
        o.delay_probability = 0.5;
        o.max_delay_us = 200;
        o.scramble_copies = true;
      }
      pool_->backend = std::make_shared<SimBackend>(o);
      host_stream_ = Stream(*pool_->backend);
      break;
    }
    case Mode::kCpu: {
      SimOptions o;  // only its host allocation is used: no streams, no copies
      pool_->backend = std::make_shared<SimBackend>(o);
      break;
    }
  }
  pool_->arena = std::make_unique<PinnedArena>(*pool_->backend, arena);
  budget_.set_name(describe());
}

std::shared_ptr<DeviceState> DeviceState::create(const c10::Device& device, Mode mode) {
  std::shared_ptr<DeviceState> state(new DeviceState(device, mode));
  if (mode == Mode::kSim) {
    // The simulated card signals pressure as torch's allocator does: resident copies go back first. Weak:
    // the backend (shared with host blocks) may outlive the state.
    std::weak_ptr<DeviceState> weak = state;
    static_cast<SimBackend&>(state->backend()).set_memory_pressure_hook([weak](std::size_t bytes) {
      auto s = weak.lock();
      return s && s->yield_for_pressure(bytes, !s->in_training_step());
    });
  }
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove_if(r.begin(), r.end(), [](const auto& w) { return w.expired(); }), r.end());
  r.push_back(state);
  return state;
}

DeviceState::~DeviceState() {
  if (mode_ == Mode::kSim) static_cast<SimBackend&>(*pool_->backend).set_memory_pressure_hook({});
  engine_.reset();  // synchronizes its streams and the ring's readers first
  host_stream_.reset();
}

std::vector<std::shared_ptr<DeviceState>> DeviceState::live() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::shared_ptr<DeviceState>> out;
  for (auto& w : registry()) {
    if (auto s = w.lock()) out.push_back(std::move(s));
  }
  return out;
}

std::size_t DeviceState::ring_floor() const {
  // The stock manager keeps its last four forward weights (and four backward ones) on the device; the
  // least ring holds about as much (vram_budget.h). The VRAM budget (auto) deepens it where there is room.
  return mode_ == Mode::kCuda ? least_ring_bytes(ring_.largest_attached.load(), ring_.attached_device_bytes.load()) : 0;
}

std::size_t DeviceState::ring_bytes_for(std::size_t layer_bytes) const {
  const std::optional<std::size_t>& fixed = Settings::current()->ring_bytes;
  return layerstream::ring_bytes_for(layer_bytes, ring_floor(), fixed ? &*fixed : nullptr);
}

TransferEngine& DeviceState::engine_for(std::size_t layer_bytes) {
  // The ring could not be had at the last call: its message says to lower LAYERSTREAM_RING_MB and call again,
  // so the settings are read again first (outside mu_: a warning may go to a Python log sink).
  if (ring_.build_failed.exchange(false)) {
    Settings::refresh();
    std::lock_guard<std::mutex> lock(mu_);
    budget_.set_ring_fixed(Settings::current()->ring_bytes.has_value());
  }
  std::lock_guard<std::mutex> lock(mu_);
  // The budget's plan chose another ring: rebuild now if no layer is in use (between two layer calls),
  // else at a later call.
  const bool replan = engine_ && budget_.pending_ring() != 0 && engine_->stats().leases_outstanding == 0;
  // The ring holds three of the largest layer seen so far (ring_bytes_for), not just one: a layer
  // larger than a third of it could never be fetched ahead (the lookahead is a third of the ring) nor
  // sit beside the previous one and the next (seen: FLUX.2's 680 MB layers in a ring sized for the
  // 450 MB ones before them copied on demand, the GPU waiting 1.5 s per step). A ring that
  // LAYERSTREAM_RING_MB fixes grows only to hold the layer at all.
  const std::size_t wanted = budget_.ring_fixed() ? layer_bytes : 3 * ring_footprint(layer_bytes);
  if (engine_ && engine_->ring_capacity() >= wanted && !replan) return *engine_;
  LS_CHECK(mode_ != Mode::kCpu, "internal: the engine is not used on a CPU process device");
  if (engine_) {
    const EngineStats old = engine_->stats();
    LS_CHECK(old.leases_outstanding == 0, "cannot grow the device ring while ", old.leases_outstanding,
             " layer(s) are in use; attach every layer before the first forward");
    counters_.retired.add_counters(old);
    engine_.reset();
  }
  EngineOptions options;
  options.ring_policy = ring_.policy;
  options.ring_bytes = ring_bytes_for(std::max(layer_bytes, ring_.largest_attached.load()));
  if (replan) {
    options.ring_bytes = std::max(budget_.pending_ring(), options.ring_bytes);
    budget_.on_ring_rebuilt();
  }
  // LAYERSTREAM_TIME_WAITS=1: measure how long compute waits for copies (stats: copy_wait_us).
  options.time_waits = Settings::current()->time_waits;
#ifdef LAYERSTREAM_TORCH_CUDA
  if (mode_ == Mode::kCuda) take_ring_from_torch(options, device_);
#endif
  try {
    engine_ = std::make_unique<TransferEngine>(*pool_->backend, options);
  } catch (const OutOfDeviceMemory& e) {
    ring_.build_failed = true;
    throw OutOfDeviceMemory(detail::concat(
        "layerstream could not allocate its device ring of ", options.ring_bytes / kMiB, " MiB on ", describe(),
        " (LAYERSTREAM_RING_MB; by default ", kMinRingLayers, " of the largest layer on a GPU, its dequantized "
        "weight included, at least 3; this model's largest layer needs ", (layer_bytes + kMiB - 1) / kMiB,
        " MiB): ", e.what(), ". Free device memory, or set LAYERSTREAM_RING_MB lower, then call the layer again"));
  }
  ++generation_;
  ++counters_.engines_built;
  log(LogLevel::kInfo, "layerstream engine on " + describe() + ": device ring of " +
                           std::to_string(options.ring_bytes) + " bytes" +
                           (ring_.policy == RingPolicy::kLeastRecentlyUsed ? " (placement: least recently used)" : ""));
  return *engine_;
}

namespace {
thread_local bool grad_forward = false;
}  // namespace

GradForwardScope::GradForwardScope(bool grad_enabled) : previous_(grad_forward) { grad_forward = grad_enabled; }
GradForwardScope::~GradForwardScope() { grad_forward = previous_; }
bool GradForwardScope::active() { return grad_forward; }

TransferEngine* DeviceState::current_engine() {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_.get();
}

StreamHandle DeviceState::consumer_stream() {
#ifdef LAYERSTREAM_TORCH_CUDA
  if (mode_ == Mode::kCuda) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device_.index()).stream();
    // torch's default stream is the legacy default stream, whose handle is 0; name it explicitly so
    // that it is a valid, non-null handle for the core.
    return StreamHandle{stream != nullptr ? stream : cudaStreamLegacy};
  }
#endif
  LS_CHECK(mode_ == Mode::kSim, "internal: no consumer stream on a CPU process device");
  return host_stream_.get();
}

void DeviceState::sync_downloads() {
  TransferEngine* engine;
  std::vector<c10::Storage> memory;
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine = engine_.get();
    memory.swap(downloads_in_flight_);
  }
  if (engine) engine->sync_downloads();
  // `memory` is released here, after the copies into and out of it have landed.
}

void DeviceState::keep_until_synced(c10::Storage storage) {
  // Without sync_grad_transfers() (AI-Toolkit 323b4aaf has none) the list would only grow: past a few
  // hundred entries, join what is pending (the copies are long done by then; this costs next to nothing).
  constexpr std::size_t kMaxKept = 512;
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    downloads_in_flight_.push_back(std::move(storage));
    full = downloads_in_flight_.size() > kMaxKept;
  }
  if (full) sync_downloads();
}

StateStats DeviceState::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  StateStats s;
  if (engine_) s.engine = engine_->stats();
  s.engine.add_counters(counters_.retired);
  s.engine.arena = pool_->arena->stats();
  s.engines_built = counters_.engines_built;
  const auto& dequant = counters_.dequant;
  s.dequant_into_scratch = dequant[static_cast<int>(DequantUse::kIntoScratch)];
  s.dequant_reused = dequant[static_cast<int>(DequantUse::kReused)];
  s.dequant_own_memory = dequant[static_cast<int>(DequantUse::kOwnMemory)];
  s.dequant_on_copy = dequant[static_cast<int>(DequantUse::kOnCopy)];
  s.ostris_decoded = dequant[static_cast<int>(DequantUse::kOstrisDecoded)];
  s.ostris_kept_bytes = counters_.ostris_kept_bytes.load();
  s.predictor = prefetch_.predictor.stats();
  const BudgetCounters budget = budget_.counters();
  s.vram_budget_planned = budget.planned;
  s.vram_budget_room = budget.room;
  s.vram_budget_estimate = budget.estimate;
  s.pressure_yields = budget.pressure_yields;
  s.pressure_yielded_bytes = budget.pressure_yielded_bytes;
  s.gap_lends = budget.gap_lends;
  s.gap_lent_bytes = budget.gap_lent_bytes;
  if (mode_ == Mode::kSim) s.sim_races = static_cast<SimBackend&>(*pool_->backend).violation_count();
  return s;
}

std::string DeviceState::describe() const {
  const char* m = mode_ == Mode::kCuda ? "cuda" : mode_ == Mode::kSim ? "sim" : "cpu";
  return device_.str() + " [" + m + " backend: " + pool_->backend->name() + "]";
}

}  // namespace layerstream::torchglue
