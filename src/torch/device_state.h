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
// Parts: the engine and its ring's sizing (RingSizing), the copies ahead of need (Prefetch), the VRAM
// budget's policy (BudgetController, torch-free, in the core: this state feeds it events and carries out
// its actions), the counters (Counters), and the pending downloads.
// Thread-safety: mu_ guards the engine, the prefetch state, the budget's serialized calls and the pending
// downloads; the engine is thread-safe itself. Without mu_: the layer-call step edge, the end of a backward
// (autograd's callback thread) and the pressure thresholds torch's allocator callbacks read (atomics in
// the budget); yield_for_pressure takes mu_ with try_lock only (the allocator may run inside our own call).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "layerstream/access_predictor.h"
#include "layerstream/backend.h"
#include "layerstream/budget_controller.h"
#include "layerstream/pinned_arena.h"
#include "layerstream/shared_host.h"
#include "layerstream/stats_fields.h"
#include "layerstream/transfer_engine.h"
#include "layerstream/vram_budget.h"
#include "layerstream/settings.h"

namespace layerstream::torchglue {

enum class Mode { kCuda, kSim, kCpu };

// Host memory shared between the engine and tensors: the backend that pinned it and the arena.
struct HostPool {
  std::shared_ptr<Backend> backend;
  std::unique_ptr<PinnedArena> arena;
};

// One block of host memory for a layer: from the arena, or a segment shared with the other ranks of
// the host (host_share.h). Frees itself when the last tensor (or layer) holding it goes.
class HostBlockRef {
 public:
  HostBlockRef(std::shared_ptr<HostPool> pool, std::size_t bytes);
  HostBlockRef(std::shared_ptr<HostPool> pool, std::unique_ptr<SharedHostSegment> segment);
  ~HostBlockRef();
  HostBlockRef(const HostBlockRef&) = delete;
  HostBlockRef& operator=(const HostBlockRef&) = delete;
  const HostBlock& block() const { return block_; }
  char* data() const { return static_cast<char*>(block_.data); }
  SharedHostSegment* segment() const { return segment_.get(); }

 private:
  std::shared_ptr<HostPool> pool_;
  std::unique_ptr<SharedHostSegment> segment_;  // destroyed before pool_ (it uses its backend)
  HostBlock block_;
};


// How a quantized or packed layer's weight was rebuilt for one use: into its ring region's scratch, found
// there from an earlier use of the same copy, into memory of its own (torch's allocator: resident layers,
// layouts the core does not take, a second stream), or found in the scratch the engine's derive stream
// decoded into after the copy (losslessly packed weights).
// kOstrisDecoded: an OstrisLinear call whose weight layerstream decoded (ostris_fast.h).
enum class DequantUse { kIntoScratch, kReused, kOwnMemory, kOnCopy, kOstrisDecoded };

// A device state's counters: its engine's (the retired engines' counters added), its predictor's, and its
// own, LAYERSTREAM_STATE_FIELDS (layerstream/stats_fields.h, which says what each counts).
struct StateStats {
  EngineStats engine;
  PredictorStats predictor;
  LAYERSTREAM_STATE_FIELDS(LAYERSTREAM_STATS_MEMBER)
};

// Marks, on this thread, a layer forward that the caller runs with grad enabled. torch turns grad mode
// off inside an autograd function's forward, where the layer is fetched, so the state cannot ask torch
// there whether this use belongs to a training step (the VRAM budget plans from those).
class GradForwardScope {
 public:
  explicit GradForwardScope(bool grad_enabled);
  ~GradForwardScope();
  GradForwardScope(const GradForwardScope&) = delete;
  GradForwardScope& operator=(const GradForwardScope&) = delete;
  static bool active();

 private:
  bool previous_;
};

class DeviceState : public std::enable_shared_from_this<DeviceState> {
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
  // A layer that takes `device_bytes` in the ring (its scratch included: a quantized layer's dequantized
  // weight) was attached: the engine built at the first call sizes its ring for the largest of them (so the
  // ring need not grow, a rebuild, as larger layers come along).
  void note_attached(std::size_t device_bytes) {
    raise_to(ring_.largest_attached, device_bytes);
    ring_.attached_device_bytes += device_bytes;
  }
  // The engine as it is (nullptr before the first streamed call), never building one.
  TransferEngine* current_engine();
  std::uint64_t generation() const { return generation_; }

  // Records that `layer` (of the current engine) is in use, and issues the copies of the layers the
  // access predictor expects next, up to a third of the ring, so that they arrive ahead of need.
  // LAYERSTREAM_PREFETCH=0 turns this off (copies then happen only when a layer is called).
  // `fresh_each_use`: the layer copies its bytes again at every use (a trainable weight, see
  // StreamedLayer::with_region), so a copy made ahead of need would be dropped unused: none is made.
  void note_use(LayerId layer, bool fresh_each_use = false);
  // Called once per layer registered in the engine: keeps it resident on the device while the
  // LAYERSTREAM_RESIDENT_MB budget lasts (first come, first kept: forward order), where the budget's plan
  // names its block, or where the layer held a resident copy of `resident_before` bytes until it was packed
  // again into a new block of no more bytes; streams it otherwise.
  void consider_residency(TransferEngine& engine, LayerId layer, std::size_t bytes, std::size_t resident_before = 0);

  // LAYERSTREAM_VRAM_BUDGET: once the order of layer uses has repeated (the first step is over, so its
  // peak memory is known), layers within budget - peak - headroom stay on the device for good, spread
  // evenly over the order of first use (residency_plan.h); the rest stream. The ring's size is chosen in
  // the same plan (plan_ring_and_residency) unless LAYERSTREAM_RING_MB fixes it: a ring that keeps a
  // checkpointed block's layers from its recomputed forward to its backward may save more copies than the
  // resident layers its memory would hold. A new ring size rebuilds the engine at the next layer call. The view of the device comes from `resolver` on CUDA
  // (installed by the Python module: it reads torch's allocator), from the backend on the simulator.
  // The peak it reports is windowed: from the window's start (`start_peak_window`, at the first training
  // forward) to now, so that what the process held before training (the model placed on the device before
  // attach, text encoders, samples) does not count as the training step's.
  using MemoryResolver = std::function<DeviceMemoryView(DeviceState&, const VramBudget&)>;
  using PeakWindowStarter = std::function<void(DeviceState&)>;
  // The training cycle's events for LAYERSTREAM_VRAM_PEAK=cycles (CyclePeaks, vram_budget.h).
  using CycleMarker = std::function<void(DeviceState&, CycleEvent)>;
  static void set_memory_resolver(MemoryResolver resolver, PeakWindowStarter start_peak_window,
                                  CycleMarker mark_cycle);

  // A managed layer that was resident left the engine with its model (freed, or detached): `bytes` of device
  // memory the plan counted went with it. The budget plans again at the next layer call, so that the models
  // still in use can grow into that memory. Any thread; takes no lock.
  void note_resident_layer_gone(std::size_t bytes);
  // Memory pressure: an allocation of the process found no room (torch's allocator runs its free-memory
  // callbacks; the simulator its pressure hook). Gives back the resident copies no lease holds, so that the
  // allocator can hand their memory out, and has the VRAM budget plan again from the next training steps
  // with more headroom (the device ring, when the plan grew it, shrinks back at the next call with no
  // layer in use). Never waits for the state's lock: returns false when it is taken (the caller is
  // layerstream itself, allocating) or when nothing was given back.
  // `between_steps`: the yield was not the plan's fault (an allocation between training steps), so the next
  // plan keeps its headroom. `free_bytes`: what an allocation could still get then (SIZE_MAX: not known),
  // for the log line that reports the yield.
  bool yield_for_pressure(std::size_t want, bool between_steps = false,
                          std::size_t free_bytes = std::numeric_limits<std::size_t>::max());
  // The free device memory under which a cache miss of torch's allocator inside a training step counts as
  // pressure: half the headroom the budget's last plan left (the plan expects the step's peak to leave all
  // of it free, so a miss at the planned peak is not pressure); 0 before a plan: nothing to give back.
  std::size_t pressure_threshold() const { return budget_.pressure_threshold(); }
  // Between steps (BudgetHeadroom::is_pressure): a quarter of what the process may use, for what the gap
  // holds and what is free together.
  std::size_t gap_pressure_threshold() const { return budget_.gap_pressure_threshold(); }
  // Whether a training step is under way: from a layer's use in a forward with grad enabled to the end of
  // the backward pass that follows (note_backward_pass). Between steps (the optimizer, samples, a text
  // encoder, the user's own tensors) the budget's plan knows nothing of what the process allocates, so a
  // cache miss of torch's allocator there gives every resident layer back (the allocation's size is not
  // known to the allocator's callbacks), and the plan is made again without more headroom.
  bool in_training_step() const { return budget_.in_training_step(); }
  // Whether the layer use being observed is a training step's first (LAYERSTREAM_VRAM_PEAK=cycles' window).
  bool step_began_at_this_use() const { return budget_.step_began(); }
  VramPeak vram_peak() const { return budget_.vram_peak(); }
  // LAYERSTREAM_VRAM_GAP=start: between steps the quarter is asked of what is free and what the gap holds
  // together (BudgetHeadroom::is_pressure).
  bool quarter_above_start() const { return budget_.quarter_above_start(); }
  // Of `held`, the bytes held above the training cycle's start, what the gap holds: less the copies the
  // budget's plan made in this cycle (its resident layers and the ring's growth), which the next cycle's
  // start counts (else the plan's own copies pass for the gap's use).
  std::size_t held_by_gap(std::size_t held) const { return budget_.held_by_gap(held); }
  // Called by a layer's backward: queues, once per backward pass (autograd graph task), the end of the step.
  void note_backward_pass();

  // The stream consumers release on: torch's current stream (CUDA) or the host's proxy stream (sim).
  StreamHandle consumer_stream();
  // Joins every pending gradient download of this device.
  void sync_downloads();
  // Keeps a download's destination memory (and, on the simulator, its source's: there is no caching
  // allocator whose record_stream could do it) alive until sync_downloads().
  void keep_until_synced(c10::Storage storage);
  // True the first time it is called for autograd graph task `task` (since another task claimed it):
  // the caller then queues the end-of-backward join, the others need not.
  bool claim_end_of_backward_join(int task) { return join_task_.exchange(task) != task; }
  void note_dequant(DequantUse use) { ++counters_.dequant[static_cast<int>(use)]; }
  void note_ostris_kept(std::size_t bytes) { counters_.ostris_kept_bytes += bytes; }
  StateStats stats();
  std::string describe() const;

  // Every live state (for sync_grad_transfers and stats).
  static std::vector<std::shared_ptr<DeviceState>> live();

 private:
  DeviceState(const c10::Device& device, Mode mode);
  // The ring for a largest layer of `layer_bytes`: LAYERSTREAM_RING_MB, else 3x the layer and at least
  // ring_floor().
  std::size_t ring_bytes_for(std::size_t layer_bytes) const;
  // The least ring on a GPU (0 elsewhere): kMinRingLayers of the largest layer attached, and never more
  // than the attached layers take ("min": about what the stock manager holds at the same settings).
  std::size_t ring_floor() const;

  // The device ring's sizing: the largest layer attached and all of them (any thread: atomics), the
  // placement setting, and whether the last ring could not be had.
  struct RingSizing {
    std::atomic<std::size_t> largest_attached{0};
    std::atomic<std::size_t> attached_device_bytes{0};  // every layer's device_bytes ever attached here
    RingPolicy policy = RingPolicy::kFifo;              // LAYERSTREAM_RING_POLICY
    std::atomic<bool> build_failed{false};  // the last ring could not be allocated: read the settings again
  };
  // Copies ahead of need (under mu_, but `on` and `lookahead_layers` are set once, at construction).
  struct Prefetch {
    bool on = true;  // LAYERSTREAM_PREFETCH
    // How many predicted layers a call may copy ahead (and at most a third of the ring's bytes);
    // LAYERSTREAM_PREFETCH_LAYERS.
    std::size_t lookahead_layers = 8;
    AccessPredictor predictor;
    std::uint64_t predictor_generation = 0;  // the engine generation whose layer ids it has seen
    std::unordered_set<LayerId> fresh_each_use;  // note_use(): layers never copied ahead of need
  };
  // The state's own counters (stats()): engines built and retired, how weights were rebuilt.
  struct Counters {
    std::uint64_t engines_built = 0;  // under mu_
    EngineStats retired;              // counters of engines replaced by a larger one; under mu_
    std::array<std::atomic<std::uint64_t>, 5> dequant{};  // by DequantUse
    std::atomic<std::uint64_t> ostris_kept_bytes{0};      // stats' ostris_kept_bytes
  };
  static void raise_to(std::atomic<std::size_t>& value, std::size_t to) {
    std::size_t seen = value.load();
    while (to > seen && !value.compare_exchange_weak(seen, to)) {
    }
  }

  c10::Device device_;
  Mode mode_;
  std::shared_ptr<HostPool> pool_;
  std::mutex mu_;
  std::unique_ptr<TransferEngine> engine_;
  std::uint64_t generation_ = 0;
  RingSizing ring_;
  Prefetch prefetch_;
  Counters counters_;
  // The VRAM budget's policy (budget_controller.h): its any-thread calls without mu_, the others under it.
  BudgetController budget_;
  std::atomic<int> step_task_{-1};  // the graph task whose end-of-step callback is queued
  std::vector<c10::Storage> downloads_in_flight_;  // memory the pending downloads read or write; under mu_
  Stream host_stream_;   // sim only
  std::atomic<int> join_task_{-1};  // the graph task whose end-of-backward join is queued

  // What a layer call leaves the caller to do outside mu_ (a Python log sink takes the GIL).
  struct UseOutcome {
    bool plan_now = false;            // plan the budget now
    bool waits_for_training = false;  // say that the budget waits for a training step
    std::string prefetch_error;       // what a failed copy ahead of need raised (logged once)
    std::string pressure_report;      // what a yield to memory pressure did (logged)
    std::string gone_report;          // resident layers that left with their model: the plan is made again
  };
  UseOutcome observe_and_prefetch(LayerId layer, bool fresh_each_use);  // takes mu_
  // Copies the predicted layers ahead of need (or, lent to the last gap, into their own memory again).
  // Caller holds mu_; returns what a copy that could not be issued raised ("" if none).
  std::string prefetch_locked(LayerId layer, bool training);
  // LAYERSTREAM_VRAM_GAP=lend: a layer the last gap took back becomes resident again (at its use or its copy
  // ahead of need in a training step); nothing for any other layer. Caller holds mu_.
  void remake_resident_locked(LayerId layer, bool training);
  // Starts the windowed peak (the simulator's own, or the resolver's starter on CUDA). Caller holds mu_.
  void start_peak_window_locked();
  // A training cycle's event: to the simulated device's CyclePeaks, or to the CUDA glue's (set_memory_resolver).
  void mark_cycle(CycleEvent event);
  DeviceMemoryView memory_view();
  std::string apply_vram_budget_locked(const DeviceMemoryView& view);  // the line to log
  // Makes the plan's layers resident (`resident`, by index of `layers`; with `rebuild`, as they register with
  // the rebuilt engine), and with `give_back_others` gives back the resident copies the plan no longer keeps.
  KeptLayers keep_resident_locked(const std::vector<PlannedLayer>& layers, const std::vector<bool>& resident,
                                  bool rebuild, bool give_back_others);
  // Which of a layer's sizes layer_bytes_locked gives: its packed bytes (host_block), what it takes in the ring
  // with its scratch (device_bytes), or what the prefetcher counts for it in the ring (prefetch_bytes).
  enum class LayerSize { kPacked, kInRing, kPrefetched };
  // nullopt: the layer is no longer in the engine (its model was freed).
  std::optional<std::size_t> layer_bytes_locked(LayerId layer, LayerSize size) const;
};

}  // namespace layerstream::torchglue
