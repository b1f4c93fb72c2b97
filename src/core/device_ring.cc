#include "layerstream/device_ring.h"

#include <algorithm>

#include "layerstream/check.h"

namespace layerstream {

namespace {
std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
bool overlaps(std::size_t a, std::size_t a_len, std::size_t b, std::size_t b_len) {
  return a < b + b_len && b < a + a_len;
}
}  // namespace

DeviceRing::DeviceRing(Backend& backend, std::size_t capacity_bytes, std::size_t alignment,
                       DeviceAllocator allocator, StreamHandle writer, RingPolicy policy)
    : capacity_(capacity_bytes / alignment * alignment),
      alignment_(alignment),
      policy_(policy),
      events_(backend) {
  LS_CHECK_ARG(alignment >= 1 && (alignment & (alignment - 1)) == 0,
               "DeviceRing: alignment must be a power of two, got ", alignment);
  LS_CHECK_ARG(capacity_ > 0, "DeviceRing: capacity must be at least one alignment unit (",
               alignment, " bytes), got ", capacity_bytes);
  memory_ = DeviceBuffer(backend, capacity_, std::move(allocator), writer);
}

void DeviceRing::evict(std::map<RegionId, Region>::iterator it, Eviction& eviction) {
  it->second.released.move_events_to(eviction.wait_events);
  eviction.owners.push_back(it->second.owner);
  regions_.erase(it);
}

RegionId DeviceRing::place(std::size_t bytes, std::uint64_t owner, Eviction& eviction) {
  return place_impl(bytes, owner, eviction, 1, true);
}

RegionId DeviceRing::try_place_unheld(std::size_t bytes, std::uint64_t owner, Eviction& eviction) {
  return place_impl(bytes, owner, eviction, 0, false);
}

RegionId DeviceRing::place_impl(std::size_t bytes, std::uint64_t owner, Eviction& eviction, int holds,
                                bool throw_when_full) {
  LS_CHECK_ARG(bytes > 0, "DeviceRing::place: size must be positive");
  const std::size_t rounded = round_up(bytes, alignment_);
  LS_CHECK_ARG(rounded <= capacity_, "a layer of ", bytes, " bytes does not fit the device ring of ",
               capacity_, " bytes; raise the ring size to at least the largest layer");

  std::size_t pos = 0;
  const bool found = policy_ == RingPolicy::kFifo ? find_fifo(rounded, pos) : find_lru(rounded, pos);
  if (!found) {
    if (!throw_when_full) return 0;
    std::size_t held_bytes = 0, held_regions = 0;
    for (const auto& [id, r] : regions_) {
      if (r.holds > 0) held_bytes += r.bytes, ++held_regions;
    }
    LS_FAIL("the device ring (", capacity_, " bytes) has no room for ", bytes, " bytes: ", held_regions,
            " regions (", held_bytes,
            " bytes) are still held by fetches that were not released; release layers after use "
            "or enlarge the ring");
  }

  for (auto it = regions_.begin(); it != regions_.end();) {
    auto next = std::next(it);
    if (overlaps(pos, rounded, it->second.offset, it->second.bytes)) evict(it, eviction);
    it = next;
  }

  const RegionId id = next_id_++;
  // A prefetched region (placed unheld) counts as used most recently until its first reader holds it: its
  // use is ahead, and taking it back first would throw the copy away.
  regions_.emplace(id, Region{pos, rounded, owner, holds, {}, holds > 0 ? ++tick_ : kNotYetUsed});
  head_ = pos + rounded == capacity_ ? 0 : pos + rounded;
  return id;
}

bool DeviceRing::find_fifo(std::size_t rounded, std::size_t& pos) const {
  pos = head_ + rounded <= capacity_ ? head_ : 0;
  std::size_t scanned = 0;
  for (;;) {
    // The held region overlapping the candidate range that ends last: skip past it.
    std::size_t skip_to = 0;
    bool blocked = false;
    for (const auto& [id, r] : regions_) {
      if (r.holds > 0 && overlaps(pos, rounded, r.offset, r.bytes)) {
        skip_to = std::max(skip_to, r.offset + r.bytes);
        blocked = true;
      }
    }
    if (!blocked) return true;
    scanned += skip_to - pos;
    pos = skip_to;
    if (pos + rounded > capacity_) {
      scanned += capacity_ - pos;
      pos = 0;
    }
    if (scanned > capacity_ + rounded) return false;
  }
}

bool DeviceRing::find_lru(std::size_t rounded, std::size_t& pos) const {
  // Regions by offset; a span [p, p + rounded) overlaps a run of them. Candidate starts: the head (what
  // kFifo would try first), 0, and every region's start and end.
  std::vector<const Region*> by_offset;
  by_offset.reserve(regions_.size());
  for (const auto& [id, r] : regions_) by_offset.push_back(&r);
  std::sort(by_offset.begin(), by_offset.end(), [](const Region* a, const Region* b) { return a->offset < b->offset; });
  std::vector<std::size_t> starts = {head_, 0};
  for (const Region* r : by_offset) {
    starts.push_back(r->offset);
    starts.push_back(r->offset + r->bytes);
  }
  bool found = false;
  std::uint64_t best = 0;
  for (std::size_t p : starts) {
    if (p + rounded > capacity_) continue;
    // The first region that ends after p, then every one that starts before the span's end.
    auto it = std::lower_bound(by_offset.begin(), by_offset.end(), p,
                               [](const Region* r, std::size_t at) { return r->offset + r->bytes <= at; });
    std::uint64_t newest = 0;
    bool held = false;
    for (; it != by_offset.end() && (*it)->offset < p + rounded; ++it) {
      if ((*it)->holds > 0) {
        held = true;
        break;
      }
      newest = std::max(newest, (*it)->last_use);
    }
    if (held) continue;
    // The span whose newest region is the oldest; on a tie the first candidate (the head) wins.
    if (!found || newest < best) {
      found = true;
      best = newest;
      pos = p;
    }
  }
  return found;
}

void DeviceRing::hold(RegionId region) {
  auto it = regions_.find(region);
  LS_CHECK_ARG(it != regions_.end(), "DeviceRing::hold: region ", region, " is not live");
  ++it->second.holds;
  if (it->second.last_use == kNotYetUsed) it->second.last_use = ++tick_;
}

void DeviceRing::release(RegionId region, StreamHandle consumer) {
  auto it = regions_.find(region);
  LS_CHECK_ARG(it != regions_.end(), "DeviceRing::release: region ", region,
               " is not live (released after it was evicted?)");
  LS_CHECK_ARG(it->second.holds > 0, "DeviceRing::release: region ", region,
               " is not held (released more often than fetched)");
  LS_CHECK_ARG(consumer, "DeviceRing::release: null consumer stream");
  it->second.released.record(consumer, events_);
  --it->second.holds;
  it->second.last_use = ++tick_;
}

void DeviceRing::discard(RegionId region, Eviction& eviction) {
  auto it = regions_.find(region);
  LS_CHECK_ARG(it != regions_.end(), "DeviceRing::discard: region ", region, " is not live");
  LS_CHECK_ARG(it->second.holds == 0, "DeviceRing::discard: region ", region, " is held ",
               it->second.holds, " time(s); release it first");
  evict(it, eviction);
}

void DeviceRing::synchronize_releases() {
  for (auto& [id, r] : regions_) {
    r.released.synchronize();
  }
}

RegionInfo DeviceRing::info(RegionId region) const {
  auto it = regions_.find(region);
  LS_CHECK_ARG(it != regions_.end(), "DeviceRing::info: region ", region, " is not live");
  const Region& r = it->second;
  return RegionInfo{region, static_cast<char*>(memory_.data()) + r.offset, r.offset, r.bytes, r.owner,
                    r.holds};
}

std::size_t DeviceRing::bytes_live() const {
  std::size_t total = 0;
  for (const auto& [id, r] : regions_) total += r.bytes;
  return total;
}

}  // namespace layerstream
