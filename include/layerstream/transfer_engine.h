// TransferEngine: moves layers from the pinned arena to the device ring, and gradients back.
//
// One engine drives one device. It owns, for that device:
//   * the H2D stream: every write into the ring happens on it, one copy per layer (a layer's tensors are
//     packed together in one arena block by the caller);
//   * the D2H stream: every device-to-host download (gradients) happens on it;
//   * the PinnedArena holding the layers' host bytes, and the DeviceRing.
//
// The per-call protocol for a reader on stream S (e.g. the compute stream):
//     Lease l = engine.fetch(layer);      // copy enqueued on H2D (or bytes still in the ring reused)
//     engine.wait_ready(l, S);            // S waits (on the device) for the copy
//     ... enqueue work on S that reads engine.device_data(l) ...
//     engine.release(l, S);               // records "released" on S after that work
// After release, the lease is dead: device_data() and a second release() throw InvalidArgument. The
// bytes may stay in the ring, and a later fetch of the same layer reuses them without a copy, until the
// ring's head comes round; the overwriting copy waits on every released event first.
//
// Host bytes: the caller fills host_block(layer) after add_layer(). Before changing them again it calls
// begin_host_write(layer), which waits for copies still reading them and drops the stale device copy.
// Pageable host blocks (when pinning was refused) are staged through pinned bounce buffers.
//
// Derived data: a layer registered with `device_extra` bytes gets that much scratch after its bytes in its
// ring region (Lease::extra), which a reader may write between wait_ready and release (e.g. the weights it
// dequantizes from the codes). The scratch lives as long as the region: Lease::fill names the copy that
// filled the region, so a reader that finds the fill it derived from may use what it wrote there, on the
// stream that wrote it. Or the engine derives it: a layer's fill hook (add_external_layer) enqueues the
// derivation on a stream of the engine's after each copy, before the copy's ready event. A resident layer
// with a fill hook gets its scratch in a ring region of its own (`device_extra` bytes, nothing else), derived
// from the resident copy by the hook on that stream when the layer is prefetched or fetched, and kept while
// the ring keeps the region: a resident packed weight is decoded ahead of its use, beside the compute, as a
// streamed one is. A resident layer without a hook has no scratch.
//
// Downloads: download() enqueues a D2H copy ordered after the producer stream's work so far and returns
// a ticket; the device source and host destination must stay alive and untouched until wait_download()
// or sync_downloads() has returned.
//
// No call synchronizes the device; the host blocks only in begin_host_write, remove_layer, the bounce
// path, wait_download and sync_downloads, each on a specific event.
// Thread-safety: every method may be called from any thread (one internal mutex).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "layerstream/backend.h"
#include "layerstream/device_ring.h"
#include "layerstream/event_pool.h"
#include "layerstream/pinned_arena.h"
#include "layerstream/stats_fields.h"

namespace layerstream {

using LayerId = std::uint64_t;

// Where a layer's scratch starts in its ring region (right after its bytes, at the ring's alignment), and
// so how much of the ring the layer takes: scratch_offset(...) + extra.
inline std::size_t scratch_offset(std::size_t bytes, std::size_t extra, std::size_t alignment) {
  return extra == 0 ? bytes : (bytes + alignment - 1) / alignment * alignment;
}

struct EngineOptions {
  // Bytes of device memory for the ring; must hold the largest layer (and, for overlap, several).
  std::size_t ring_bytes = std::size_t{256} << 20;
  ArenaOptions arena;
  // Pinned staging for pageable layers: this many buffers of this size, used round-robin.
  std::size_t bounce_bytes = std::size_t{16} << 20;
  int bounce_buffers = 2;
  // Where the ring's device memory comes from. Empty: the backend (cudaMalloc). The torch glue passes
  // PyTorch's caching allocator, so the ring counts in torch.cuda.memory_allocated() and its limits.
  DeviceAllocator ring_allocator;
  // Measure how long consumers wait for copies: wait_ready() brackets its stream wait with two timed
  // events on the consumer stream (two event records more per fetch); wait_ready_host() times itself.
  bool time_waits = false;
  // Where the ring places a region (device_ring.h): first in, first out (the default), or over the span used
  // longest ago.
  RingPolicy ring_policy = RingPolicy::kFifo;
};

struct Lease {
  LayerId layer = 0;
  std::uint64_t ticket = 0;  // 0: no lease
  void* data = nullptr;      // device address of the packed layer; valid until release()
  std::size_t bytes = 0;
  EventHandle ready;         // the copy's completion; wait_ready() waits on it
  bool copied = false;       // false when served from bytes already in the ring
  // The region's scratch (add_external_layer's device_extra; nullptr where none was asked, and for a resident
  // layer without a fill hook or whose scratch region the ring could not hold),
  // and the number of the copy that filled the region: unique in the process, new for every copy into a
  // newly placed region or a resident buffer, unchanged while the bytes (and the scratch) stay put.
  void* extra = nullptr;
  std::size_t extra_bytes = 0;
  std::uint64_t fill = 0;
};

// The fields and what they count: LAYERSTREAM_ENGINE_COUNTERS and LAYERSTREAM_ENGINE_GAUGES
// (stats_fields.h).
struct EngineStats {
  LAYERSTREAM_ENGINE_COUNTERS(LAYERSTREAM_STATS_MEMBER)
  // Adds the cumulative counters (not the gauges) of `other`, e.g. of a retired engine.
  void add_counters(const EngineStats& other);

  LAYERSTREAM_ENGINE_GAUGES(LAYERSTREAM_STATS_MEMBER)
  ArenaStats arena;
};

class TransferEngine {
 public:
  TransferEngine(Backend& backend, EngineOptions options = {});
  // Waits for the engine's own streams, then frees everything it owns.
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  // Registers a layer of `bytes` packed bytes; its host block is allocated from the engine's arena.
  LayerId add_layer(std::size_t bytes);
  // Registers a layer whose host bytes the caller owns (e.g. an arena block shared with tensors that view
  // it). The caller keeps them alive and unchanged until remove_layer() or begin_host_write() returns.
  // `device_extra`: bytes of scratch after the layer's bytes in its ring region (see "Derived data").
  // `on_fill`: called after each copy into a ring region, with the region, its scratch and the engine's
  // derive stream, to enqueue on that stream the work that derives the scratch from the bytes (a decode
  // kernel). That stream waits for the copy first; the copy's ready event follows the derivation, so a
  // lease's consumer that waits for the copy sees the scratch derived, while the next copy on H2D need not
  // wait for it. For a resident layer it is called with the resident copy as `region` and a ring region of
  // `device_extra` bytes as `scratch` (see "Derived data"). It runs under the engine's lock: it
  // may enqueue work (launches, Backend::launch_host_func) but must not wait or call the engine.
  using FillHook = std::function<void(void* region, void* scratch, StreamHandle stream)>;
  LayerId add_external_layer(const HostBlock& block, std::size_t device_extra = 0, FillHook on_fill = {});
  // Bytes a layer takes in the ring: its packed bytes, plus its scratch at the ring's alignment.
  std::size_t device_bytes(LayerId layer) const;
  // The ring bytes a prefetcher counts for the layer: device_bytes(), except for a resident layer with a fill
  // hook, whose prefetch places only its scratch (see "Derived data").
  std::size_t prefetch_bytes(LayerId layer) const;
  // Forgets a layer: waits for copies reading its host bytes, drops its ring region and its resident copy,
  // frees its block. Returns the resident bytes it gave back (0: it was not resident). Throws
  // InvalidArgument while a lease on it is outstanding.
  std::size_t remove_layer(LayerId layer);
  HostBlock host_block(LayerId layer) const;
  void begin_host_write(LayerId layer);
  bool on_device(LayerId layer) const;

  Lease fetch(LayerId layer);
  // Issues the copy of `layer` now, ahead of its fetch, when it is not in the ring already and the ring
  // has room without touching held regions. The region is not held: a later fetch holds it (a reuse),
  // or a later placement may evict it unused. Returns whether a copy was issued.
  bool prefetch(LayerId layer);
  // Keeps `layer` on the device for good, in memory of its own outside the ring (from ring_allocator
  // when one is set), so that its fetches never copy again. Returns false when the device has no room
  // (nothing changes then). Host writes still apply: the next fetch after begin_host_write() copies anew.
  bool make_resident(LayerId layer);
  // Gives a resident layer's device memory back (after its last readers); it streams again.
  void evict_resident(LayerId layer);
  // Memory pressure (an allocation beside the engine that did not fit): gives back resident copies that no
  // lease holds, largest first, until `want` bytes are freed or none is left; returns the bytes freed. It
  // only tries the engine's lock (never waits for it): a caller inside an allocator that the engine's own
  // thread may be allocating from gets 0 instead of a deadlock. Each copy goes after its last readers and
  // copies (the host waits for their events), as evict_resident does. `given` (optional): the layers given
  // back are appended to it.
  std::size_t yield_resident(std::size_t want, std::vector<LayerId>* given = nullptr);
  bool resident(LayerId layer) const;
  void wait_ready(const Lease& lease, StreamHandle consumer);
  // For readers on the host itself (the simulator's CPU compute): blocks until the copy has landed.
  // Release afterwards on any stream: work enqueued after host reads is ordered after them.
  void wait_ready_host(const Lease& lease);
  void* device_data(const Lease& lease) const;
  void release(const Lease& lease, StreamHandle consumer);

  std::uint64_t download(void* host_dst, const void* device_src, std::size_t bytes,
                         StreamHandle producer);
  void wait_download(std::uint64_t ticket);
  void sync_downloads();

  EngineStats stats() const;
  std::size_t ring_capacity() const { return ring_.capacity(); }  // fixed at construction
  Backend& backend() const { return backend_; }
  StreamHandle h2d_stream() const { return h2d_.get(); }
  StreamHandle d2h_stream() const { return d2h_.get(); }

 private:
  struct Layer {
    HostBlock block;
    Event copied;        // recorded on H2D after each copy of this layer
    RegionId region = 0; // 0: not in the ring
    int leases = 0;
    bool owned = true;   // block allocated from arena_ (freed by remove_layer)
    std::size_t extra = 0;           // scratch bytes after the block in a ring region
    std::size_t extra_offset = 0;    // where the scratch starts in the region (block bytes, aligned)
    FillHook on_fill;                // derives the scratch after each ring copy (add_external_layer)
    Event landed;                    // with on_fill: recorded on H2D after each ring copy, before derive_
                                     // waits for it (copied is then recorded on derive_)
    std::uint64_t fill = 0;          // the copy that filled the ring region (Lease::fill)
    std::uint64_t resident_fill = 0;
    bool prefetched_unused = false;
    // With a resident copy and a fill hook: `region` holds only the scratch derived from the resident copy
    // (`extra` bytes from its start), derived from the copy `derived_from` names (its resident_fill).
    bool scratch_only = false;
    std::uint64_t derived_from = 0;
    // Residency: a device copy of its own, never evicted by the ring.
    DeviceBuffer resident;
    bool resident_stale = false;  // host bytes changed since the resident copy was made
    ReleaseRecord resident_released;
  };
  struct Outstanding {
    LayerId layer;
    RegionId region;  // 0 for a lease on a resident layer without a scratch region
    bool resident = false;  // a lease on the resident copy: release records its reader
  };

  Layer& layer_locked(LayerId layer);
  const Layer& layer_locked(LayerId layer) const;
  // Operations that change a layer's host bytes or device copy refuse while a lease reads it.
  void check_not_in_use_locked(const Layer& layer, LayerId id, const char* operation) const;
  void copy_in_locked(const Layer& layer, void* device_dst);
  // Waits (on H2D) for what a placement displaced and forgets the evicted layers' regions.
  void settle_eviction_locked(Eviction& eviction);
  // Settles what the placement evicted, copies the layer into its freshly placed region (held by this
  // fetch, or unheld for a prefetch) and records `copied`. When any of it throws, the region is abandoned
  // before the rethrow.
  void copy_layer_locked(Layer& layer, bool held, Eviction& eviction);
  // After a failed copy or derivation: `copied` after what was enqueued, the hold dropped, the region
  // discarded (so that no fetch serves it). Never throws (it runs while an exception propagates).
  void abandon_region_locked(Layer& layer, bool held, bool deriving) noexcept;
  // After a failed copy or derivation: `copied` on `stream` (H2D, or derive_ once the hook ran), after the
  // part that was enqueued. Never throws (a device that takes no more work enqueued nothing more either).
  void record_after_failed_copy_locked(Layer& layer, StreamHandle stream) noexcept;
  // Resident copies: make the H2D stream wait for the copy's readers, or the host (before freeing).
  void wait_resident_readers_on_h2d_locked(Layer& layer);
  // H2D waits for a pending derivation (fill hook): before its region is written again, or `copied` is
  // recorded on H2D again.
  void wait_derivation_on_h2d_locked(Layer& layer);
  void drop_resident_locked(Layer& layer);
  // A resident layer with a fill hook: its scratch derived into a ring region of its own, placed held (a
  // fetch) or unheld (a prefetch; false when the ring has no room now). The region is kept while current.
  bool derive_resident_locked(LayerId id, Layer& layer, bool held);
  // Whether the layer's scratch region holds what the hook derived from its current resident copy.
  bool resident_scratch_current_locked(const Layer& layer) const;
  void discard_region_locked(Layer& layer);

  Backend& backend_;
  EngineOptions options_;
  Stream h2d_;
  Stream d2h_;
  Stream derive_;  // fill hooks' work: after a ring copy lands, beside the next copy
  PinnedArena arena_;
  DeviceRing ring_;
  EventPool events_;
  std::vector<PinnedBuffer> bounce_;
  std::vector<Event> bounce_done_;
  std::size_t next_bounce_ = 0;
  mutable std::mutex mu_;
  LayerId add_locked(const HostBlock& block, bool owned, std::size_t extra, FillHook on_fill = {});
  static std::size_t footprint(const Layer& layer) { return layer.extra_offset + layer.extra; }

  LayerId next_layer_ = 1;
  std::unordered_map<LayerId, Layer> layers_;
  std::uint64_t next_ticket_ = 1;
  std::unordered_map<std::uint64_t, Outstanding> leases_;
  std::unordered_map<std::uint64_t, Event> downloads_;
  // time_waits: brackets of the consumer-stream waits not yet read, oldest first; spare timed events.
  std::deque<std::pair<Event, Event>> timed_waits_;
  std::vector<Event> timed_spare_;
  void harvest_timed_waits_locked(bool all);
  EngineStats stats_;
};

}  // namespace layerstream
