// DeviceRing: one preallocated slab of device memory, handed out as variable-size regions in ring order.
//
// A region holds the packed weights of one layer while they are on the device. Regions are placed at
// the ring's head, which moves forward and wraps; placing a region evicts the regions it overlaps. No
// allocation goes through a caching allocator after construction.
//
// Where a region goes (RingPolicy): kFifo at the head, evicting the oldest regions; kLeastRecentlyUsed
// over the span whose most recently used region was used longest ago (a region is used when placed and
// when released; one placed ahead of need, unheld, counts as the newest until it is first held), so that
// where the order of use turns round (the backward after a forward: the block used last is reused first
// and done first) the next copy takes the memory freed first instead of waiting for the oldest region's
// readers. For a stream of layers each used once in order the two agree.
//
// Ownership and lifetime of a region:
//   placed   -> the caller copies into it on its copy stream and records `ready` after the copy;
//   held     -> hold count > 0: readers are using it; it is never evicted while held;
//   released -> each release(region, consumer stream) records a "released" event on that stream after
//               the reader's work; the region stays cached (a later fetch of the same layer may hold it
//               again without copying) until the head comes round;
//   evicted  -> place() returns the released events of every region it overwrote. The caller MUST make
//               its copy stream wait on all of them before writing: that is the rule that a region is
//               never rewritten before its last reader is done. The wait happens on the device (no host
//               blocking), so eviction costs nothing on the host.
//
// Streams: the ring records and hands out events but never enqueues copies itself.
// Thread-safety: none; the owner (TransferEngine) serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "layerstream/alignment.h"
#include "layerstream/backend.h"
#include "layerstream/event_pool.h"

namespace layerstream {

using RegionId = std::uint64_t;

struct RegionInfo {
  RegionId id = 0;
  void* data = nullptr;
  std::size_t offset = 0;
  std::size_t bytes = 0;
  std::uint64_t owner = 0;  // the tag given at place(), e.g. a layer id
  int holds = 0;
};

// What a place() displaced: the caller waits on `wait_events` on its copy stream and forgets `owners`.
struct Eviction {
  std::vector<Event> wait_events;
  std::vector<std::uint64_t> owners;
};

enum class RingPolicy { kFifo, kLeastRecentlyUsed };

class DeviceRing {
 public:
  // With an `allocator`, `writer` is the stream that copies into the ring (see DeviceAllocator).
  DeviceRing(Backend& backend, std::size_t capacity_bytes, std::size_t alignment = kBlockAlignment,
             DeviceAllocator allocator = {}, StreamHandle writer = {}, RingPolicy policy = RingPolicy::kFifo);
  DeviceRing(const DeviceRing&) = delete;
  DeviceRing& operator=(const DeviceRing&) = delete;

  // Places a region of `bytes` for `owner`, held once. Evicted regions are reported in `eviction`.
  // Throws InvalidArgument when `bytes` exceeds the capacity, Error when held regions leave no room.
  RegionId place(std::size_t bytes, std::uint64_t owner, Eviction& eviction);
  // Like place(), but the region starts unheld (a prefetch nobody reads yet), and when held regions leave
  // no room it places nothing and returns 0 instead of throwing.
  RegionId try_place_unheld(std::size_t bytes, std::uint64_t owner, Eviction& eviction);
  // Adds a hold to a live region (a reader reusing cached bytes).
  void hold(RegionId region);
  // Drops one hold; `consumer` is the stream whose work read the region. Throws InvalidArgument when
  // the region is not live or not held (a release without a matching fetch).
  void release(RegionId region, StreamHandle consumer);
  // Drops a region that is not held, handing back its events as an eviction would (for a layer whose
  // host bytes changed). Throws InvalidArgument when the region is held.
  void discard(RegionId region, Eviction& eviction);

  // Blocks the host until every recorded release has completed (before the slab is freed).
  void synchronize_releases();

  bool live(RegionId region) const { return regions_.count(region) != 0; }
  RegionInfo info(RegionId region) const;
  std::size_t capacity() const { return capacity_; }
  std::size_t bytes_live() const;
  std::size_t regions_live() const { return regions_.size(); }
  // Events created so far (they are pooled and reused; tests check the pool stays bounded).
  std::size_t events_created() const { return events_.created(); }
  // Takes back the events of an Eviction once the caller has enqueued its waits on them.
  void recycle(std::vector<Event>& events) { events_.give(events); }

 private:
  struct Region {
    std::size_t offset;
    std::size_t bytes;
    std::uint64_t owner;
    int holds;
    ReleaseRecord released;
    std::uint64_t last_use = 0;  // tick of its placement or latest release; kNotYetUsed: prefetched, not read
  };
  static constexpr std::uint64_t kNotYetUsed = ~std::uint64_t{0};

  void evict(std::map<RegionId, Region>::iterator it, Eviction& eviction);
  RegionId place_impl(std::size_t bytes, std::uint64_t owner, Eviction& eviction, int holds,
                      bool throw_when_full);
  // kFifo: the first position from the head on that no held region overlaps. kLeastRecentlyUsed: see the
  // header comment. Returns false when held regions leave no room.
  bool find_fifo(std::size_t rounded, std::size_t& pos) const;
  bool find_lru(std::size_t rounded, std::size_t& pos) const;

  std::size_t capacity_;
  std::size_t alignment_;
  DeviceBuffer memory_;
  RingPolicy policy_;
  std::size_t head_ = 0;
  std::uint64_t tick_ = 0;
  RegionId next_id_ = 1;
  std::map<RegionId, Region> regions_;
  EventPool events_;
};

}  // namespace layerstream
