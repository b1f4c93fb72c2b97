// DeviceState: everything layerstream holds for one torch device of the process.
//
// Ownership: a DeviceState owns its Backend, its TransferEngine (streams, ring) and shares its HostPool
// (backend + pinned arena) with every tensor that views arena memory, so host blocks outlive the state
// when tensors do (AI-Toolkit's detach keeps the old pinned Parameters reachable). The state itself is
// shared by the StreamedLayers on that device and by the `_DEVICE_STATE` entry; it is destroyed, with its
// streams, events and ring, when the last of them lets go.
//
// Modes:
//   kCuda: the CUDA backend; compute on torch's current stream of the device; ring memory from torch's
//          caching allocator.
//   kSim:  the simulator; compute on the CPU (the host is the consumer); used by CI to drive the same
//          fetch/release/reuse logic as CUDA, with fault injection and the race checker.
//   kCpu:  a CPU process device, as upstream: weights stay in the arena and layers compute on the CPU
//          directly, without the engine.
// Thread-safety: engine_for() and the statistics are guarded; the engine is thread-safe itself.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "layerstream/access_predictor.h"
#include "layerstream/backend.h"
#include "layerstream/pinned_arena.h"
#include "layerstream/transfer_engine.h"

namespace layerstream::torchglue {

enum class Mode { kCuda, kSim, kCpu };

// Host memory shared between the engine and tensors: the backend that pinned it and the arena.
struct HostPool {
  std::shared_ptr<Backend> backend;
  std::unique_ptr<PinnedArena> arena;
};

// One arena block; frees itself when the last tensor (or layer) holding it goes.
class HostBlockRef {
 public:
  HostBlockRef(std::shared_ptr<HostPool> pool, std::size_t bytes);
  ~HostBlockRef();
  HostBlockRef(const HostBlockRef&) = delete;
  HostBlockRef& operator=(const HostBlockRef&) = delete;
  const HostBlock& block() const { return block_; }
  char* data() const { return static_cast<char*>(block_.data); }

 private:
  std::shared_ptr<HostPool> pool_;
  HostBlock block_;
};

struct StateStats {
  EngineStats engine;
  PredictorStats predictor;
  std::uint64_t engines_built = 0;
  std::uint64_t sim_races = 0;  // sim mode: unordered accesses the race checker found
};

class DeviceState {
 public:
  static std::shared_ptr<DeviceState> create(const c10::Device& device, Mode mode);
  ~DeviceState();
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  const c10::Device& device() const { return device_; }
  Mode mode() const { return mode_; }
  Backend& backend() { return *pool_->backend; }
  const std::shared_ptr<HostPool>& pool() const { return pool_; }

  // The engine, built (or rebuilt larger) so that its ring holds a layer of `layer_bytes`. A rebuild
  // changes `generation()`: layers then register again.
  TransferEngine& engine_for(std::size_t layer_bytes);
  // The engine as it is (nullptr before the first streamed call), never building one.
  TransferEngine* current_engine();
  std::uint64_t generation() const { return generation_; }

  // Records that `layer` (of the current engine) is in use, and issues the copies of the layers the
  // access predictor expects next, up to a third of the ring, so that they arrive ahead of need.
  // LAYERSTREAM_PREFETCH=0 turns this off (copies then happen only when a layer is called).
  void note_use(LayerId layer);
  // Called once per layer registered in the engine: keeps it resident on the device while the
  // LAYERSTREAM_RESIDENT_MB budget lasts (first come, first kept: forward order), streams it otherwise.
  void consider_residency(TransferEngine& engine, LayerId layer, std::size_t bytes);

  // The stream consumers release on: torch's current stream (CUDA) or the host's proxy stream (sim).
  StreamHandle consumer_stream();
  // Joins every pending gradient download of this device.
  void sync_downloads();
  // Keeps a download's source alive until sync_downloads() (sim: there is no caching allocator whose
  // record_stream could do it).
  void keep_until_synced(at::Tensor source);
  StateStats stats();
  std::string describe() const;

  // Every live state (for sync_grad_transfers and stats).
  static std::vector<std::shared_ptr<DeviceState>> live();

 private:
  DeviceState(const c10::Device& device, Mode mode);
  std::size_t ring_bytes_for(std::size_t layer_bytes) const;

  c10::Device device_;
  Mode mode_;
  std::shared_ptr<HostPool> pool_;
  std::mutex mu_;
  std::unique_ptr<TransferEngine> engine_;
  std::uint64_t generation_ = 0;
  std::uint64_t engines_built_ = 0;
  EngineStats retired_;  // counters of engines replaced by a larger one
  bool prefetch_ = true;
  std::size_t resident_budget_ = 0;  // LAYERSTREAM_RESIDENT_MB
  AccessPredictor predictor_;
  std::uint64_t predictor_generation_ = 0;  // the engine generation whose layer ids it has seen
  std::vector<at::Tensor> download_sources_;
  Stream host_stream_;   // sim only
};

}  // namespace layerstream::torchglue
