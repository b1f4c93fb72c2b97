#include "layerstream/transfer_engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "layerstream/check.h"
#include "transfer_engine_internal.h"

namespace layerstream {

namespace detail {
std::uint64_t next_fill() {
  static std::atomic<std::uint64_t> counter{0};
  return ++counter;
}
}  // namespace detail

void EngineStats::add_counters(const EngineStats& other) {
#define LAYERSTREAM_ADD(type, name) name += other.name;
  LAYERSTREAM_ENGINE_COUNTERS(LAYERSTREAM_ADD)
#undef LAYERSTREAM_ADD
}

TransferEngine::TransferEngine(Backend& backend, EngineOptions options)
    : backend_(backend),
      options_(options),
      h2d_(backend),
      d2h_(backend),
      derive_(backend),
      arena_(backend, options.arena),
      // h2d_ is built first (declared first): the ring's memory is written on it.
      ring_(backend, options.ring_bytes, options.arena.alignment, options.ring_allocator, h2d_.get(),
            options.ring_policy),
      events_(backend) {
  LS_CHECK_ARG(options_.bounce_buffers >= 1 && options_.bounce_bytes >= 4096,
               "TransferEngine: need at least one bounce buffer of at least 4096 bytes");
}

TransferEngine::~TransferEngine() {
  // Nothing may still read the arena or write the ring when they are freed.
  try {
    backend_.stream_synchronize(h2d_.get());
    backend_.stream_synchronize(d2h_.get());
    backend_.stream_synchronize(derive_.get());
    ring_.synchronize_releases();  // readers on other streams, when the slab goes back to an allocator
    for (auto& [id, layer] : layers_) {
      layer.resident_released.synchronize();
    }
    timed_waits_.clear();  // events of a consumer stream: destroying a pending one is allowed
  } catch (...) {
    // A failing device at teardown: the frees below synchronize implicitly on CUDA anyway.
  }
}

TransferEngine::Layer& TransferEngine::layer_locked(LayerId layer) {
  auto it = layers_.find(layer);
  LS_CHECK_ARG(it != layers_.end(), "unknown layer id ", layer, " (never added, or removed)");
  return it->second;
}

const TransferEngine::Layer& TransferEngine::layer_locked(LayerId layer) const {
  auto it = layers_.find(layer);
  LS_CHECK_ARG(it != layers_.end(), "unknown layer id ", layer, " (never added, or removed)");
  return it->second;
}

void TransferEngine::check_not_in_use_locked(const Layer& layer, LayerId id, const char* operation) const {
  LS_CHECK_ARG(layer.leases == 0, operation, ": layer ", id, " still has ", layer.leases,
               " outstanding lease(s); release them first");
}

LayerId TransferEngine::add_layer(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "add_layer: a layer must have at least one byte");
  LS_CHECK_ARG(bytes <= ring_.capacity(), "a layer of ", bytes,
               " bytes does not fit the device ring of ", ring_.capacity(),
               " bytes; raise ring_bytes to at least the largest layer");
  HostBlock block = arena_.allocate(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  return add_locked(block, true, 0);
}

LayerId TransferEngine::add_external_layer(const HostBlock& block, std::size_t device_extra, FillHook on_fill) {
  LS_CHECK_ARG(block.data != nullptr && block.bytes > 0, "add_external_layer: empty host block");
  const std::size_t offset = scratch_offset(block.bytes, device_extra, options_.arena.alignment);
  LS_CHECK_ARG(offset + device_extra <= ring_.capacity(), "a layer of ", block.bytes, " bytes",
               device_extra != 0 ? detail::concat(" (and ", device_extra, " bytes of scratch)") : std::string(),
               " does not fit the device ring of ", ring_.capacity(),
               " bytes; raise ring_bytes to at least the largest layer");
  LS_CHECK_ARG(!on_fill || device_extra != 0, "add_external_layer: a fill hook derives scratch; ask for some");
  std::lock_guard<std::mutex> lock(mu_);
  return add_locked(block, false, device_extra, std::move(on_fill));
}

LayerId TransferEngine::add_locked(const HostBlock& block, bool owned, std::size_t extra, FillHook on_fill) {
  const LayerId id = next_layer_++;
  Layer& layer = layers_[id];
  layer.block = block;
  layer.copied = events_.take();
  layer.owned = owned;
  layer.extra = extra;
  layer.extra_offset = scratch_offset(block.bytes, extra, options_.arena.alignment);
  layer.on_fill = std::move(on_fill);
  if (layer.on_fill) layer.landed = events_.take();
  return id;
}

std::size_t TransferEngine::device_bytes(LayerId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return footprint(layer_locked(id));
}

std::size_t TransferEngine::prefetch_bytes(LayerId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Layer& layer = layer_locked(id);
  return layer.resident.data() != nullptr && layer.on_fill ? layer.extra : footprint(layer);
}

void TransferEngine::discard_region_locked(Layer& layer) {
  layer.scratch_only = false;
  if (layer.region == 0) return;
  if (ring_.live(layer.region)) {
    Eviction eviction;
    ring_.discard(layer.region, eviction);
    // Every later ring write is on H2D: waiting here orders them all after the region's last readers,
    // and after the derivation that may still write its scratch.
    for (Event& e : eviction.wait_events) backend_.stream_wait_event(h2d_.get(), e.get());
    wait_derivation_on_h2d_locked(layer);
    ring_.recycle(eviction.wait_events);
  }
  layer.region = 0;
  layer.prefetched_unused = false;
}

std::size_t TransferEngine::remove_layer(LayerId id) {
  void* data = nullptr;
  std::size_t resident = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Layer& layer = layer_locked(id);
    check_not_in_use_locked(layer, id, "remove_layer");
    discard_region_locked(layer);
    if (layer.resident.data() != nullptr) resident = layer.block.bytes;  // as stats' resident_bytes counts it
    drop_resident_locked(layer);
    layer.copied.synchronize();  // the last copy from its host bytes is done
    backend_.annotate_host_access(layer.block.data, layer.block.bytes, true);
    if (layer.owned) data = layer.block.data;
    events_.give(std::move(layer.copied));
    if (layer.landed) events_.give(std::move(layer.landed));
    layers_.erase(id);
  }
  if (data != nullptr) arena_.free(data);
  return resident;
}

HostBlock TransferEngine::host_block(LayerId layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layer_locked(layer).block;
}

void TransferEngine::begin_host_write(LayerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& layer = layer_locked(id);
  check_not_in_use_locked(layer, id, "begin_host_write");
  discard_region_locked(layer);
  if (layer.resident.data() != nullptr) layer.resident_stale = true;  // recopied at the next fetch
  layer.copied.synchronize();
  backend_.annotate_host_access(layer.block.data, layer.block.bytes, true);
}

bool TransferEngine::on_device(LayerId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Layer& layer = layer_locked(id);
  return layer.resident.data() != nullptr || (layer.region != 0 && ring_.live(layer.region));
}

void TransferEngine::copy_in_locked(const Layer& layer, void* device_dst) {
  if (layer.block.pinned) {
    backend_.memcpy_h2d_async(device_dst, layer.block.data, layer.block.bytes, h2d_.get());
    return;
  }
  // Pageable source: an async copy from it would be staged synchronously by the driver (and is not
  // async at all on some platforms). Stage through our pinned buffers instead, round-robin, waiting only
  // for the previous copy out of the buffer being refilled.
  if (bounce_.empty()) {
    for (int i = 0; i < options_.bounce_buffers; ++i) {
      bounce_.emplace_back(backend_, options_.bounce_bytes, options_.arena.pin_method);
      bounce_done_.push_back(events_.take());
    }
  }
  const char* src = static_cast<const char*>(layer.block.data);
  char* dst = static_cast<char*>(device_dst);
  for (std::size_t done = 0; done < layer.block.bytes;) {
    const std::size_t piece = std::min(options_.bounce_bytes, layer.block.bytes - done);
    PinnedBuffer& buffer = bounce_[next_bounce_];
    Event& free_again = bounce_done_[next_bounce_];
    next_bounce_ = (next_bounce_ + 1) % bounce_.size();
    free_again.synchronize();
    backend_.annotate_host_access(buffer.data(), piece, true);
    std::memcpy(buffer.data(), src + done, piece);
    backend_.memcpy_h2d_async(dst + done, buffer.data(), piece, h2d_.get());
    free_again.record(h2d_.get());
    ++stats_.bounce_chunks;
    done += piece;
  }
}

Lease TransferEngine::fetch(LayerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& layer = layer_locked(id);
  ++stats_.fetches;
  Lease lease;
  lease.layer = id;
  lease.bytes = layer.block.bytes;
  lease.ready = layer.copied.get();

  if (layer.resident.data() != nullptr) {
    if (layer.resident_stale) {
      wait_resident_readers_on_h2d_locked(layer);
      wait_derivation_on_h2d_locked(layer);
      try {
        copy_in_locked(layer, layer.resident.data());
      } catch (...) {
        // Still stale (copied again at the next fetch); `copied` after the part enqueued, for whoever frees it.
        record_after_failed_copy_locked(layer, h2d_.get());
        throw;
      }
      layer.copied.record(h2d_.get());
      ++stats_.copies_h2d;
      stats_.bytes_h2d += layer.block.bytes;
      layer.resident_stale = false;
      layer.resident_fill = detail::next_fill();
      lease.copied = true;
    }
    ++stats_.resident_hits;
    lease.data = layer.resident.data();
    lease.fill = layer.resident_fill;
    RegionId scratch = 0;
    if (layer.on_fill) {
      // Its scratch: derived ahead (a prefetch), still in the ring from an earlier use, or derived now.
      if (resident_scratch_current_locked(layer)) {
        ring_.hold(layer.region);
        if (layer.prefetched_unused) ++stats_.prefetch_hits;
        scratch = layer.region;
      } else if (derive_resident_locked(id, layer, /*held=*/true)) {
        scratch = layer.region;
      }
      layer.prefetched_unused = false;
    }
    if (scratch != 0) {
      lease.extra = ring_.info(scratch).data;
      lease.extra_bytes = layer.extra;
      lease.fill = layer.fill;
    }
    lease.ticket = next_ticket_++;
    leases_.emplace(lease.ticket, Outstanding{id, scratch, /*resident=*/true});
    ++layer.leases;
    return lease;
  }
  if (layer.region != 0 && ring_.live(layer.region)) {
    ring_.hold(layer.region);
    ++stats_.reuse_hits;
    if (layer.prefetched_unused) ++stats_.prefetch_hits;
  } else {
    Eviction eviction;
    layer.region = ring_.place(footprint(layer), id, eviction);
    copy_layer_locked(layer, /*held=*/true, eviction);
    lease.copied = true;
  }
  layer.prefetched_unused = false;
  lease.data = ring_.info(layer.region).data;
  lease.fill = layer.fill;
  if (layer.extra != 0) {
    lease.extra = static_cast<char*>(lease.data) + layer.extra_offset;
    lease.extra_bytes = layer.extra;
  }
  lease.ticket = next_ticket_++;
  leases_.emplace(lease.ticket, Outstanding{id, layer.region});
  ++layer.leases;
  return lease;
}

bool TransferEngine::prefetch(LayerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& layer = layer_locked(id);
  if (layer.resident.data() != nullptr) {
    if (!layer.on_fill || resident_scratch_current_locked(layer)) return false;
    if (!derive_resident_locked(id, layer, /*held=*/false)) return false;
    layer.prefetched_unused = true;
    ++stats_.prefetches;
    return true;
  }
  if (layer.region != 0 && ring_.live(layer.region)) return false;
  Eviction eviction;
  const RegionId region = ring_.try_place_unheld(footprint(layer), id, eviction);
  if (region == 0) return false;  // held regions leave no room now; the fetch will copy on demand
  layer.region = region;
  copy_layer_locked(layer, /*held=*/false, eviction);
  layer.prefetched_unused = true;
  ++stats_.prefetches;
  return true;
}

void TransferEngine::wait_derivation_on_h2d_locked(Layer& layer) {
  // For a layer with a fill hook, `copied` names the last derivation on the derive stream. H2D waits for it
  // before a copy overwrites the region the derivation reads and writes (eviction, discard), and before
  // `copied` is recorded on H2D again (a resident copy), which must still cover it for the region's reuse
  // and for leases still waiting.
  if (layer.on_fill) backend_.stream_wait_event(h2d_.get(), layer.copied.get());
}

void TransferEngine::wait_resident_readers_on_h2d_locked(Layer& layer) {
  layer.resident_released.wait_on(backend_, h2d_.get());
}

void TransferEngine::settle_eviction_locked(Eviction& eviction) {
  for (LayerId owner : eviction.owners) {
    auto it = layers_.find(owner);
    if (it == layers_.end()) continue;
    it->second.region = 0;
    it->second.scratch_only = false;
    // A derivation (fill hook) may still read the region and write its scratch, with no reader yet to
    // wait for (a prefetch never used): the next write waits for it.
    wait_derivation_on_h2d_locked(it->second);
    if (it->second.prefetched_unused) ++stats_.prefetch_wasted;
    it->second.prefetched_unused = false;
  }
  stats_.evictions += eviction.owners.size();
  for (Event& e : eviction.wait_events) backend_.stream_wait_event(h2d_.get(), e.get());
  ring_.recycle(eviction.wait_events);
}

void TransferEngine::copy_layer_locked(Layer& layer, bool held, Eviction& eviction) {
  char* region = static_cast<char*>(ring_.info(layer.region).data);
  bool deriving = false;
  try {
    settle_eviction_locked(eviction);
    copy_in_locked(layer, region);
    layer.fill = detail::next_fill();
    if (layer.on_fill) {
      // The derivation on its own stream: H2D goes on to the next copy while it runs.
      layer.landed.record(h2d_.get());
      backend_.stream_wait_event(derive_.get(), layer.landed.get());
      deriving = true;
      layer.on_fill(region, region + layer.extra_offset, derive_.get());
      layer.copied.record(derive_.get());
    } else {
      layer.copied.record(h2d_.get());
    }
  } catch (...) {
    abandon_region_locked(layer, held, deriving);
    throw;
  }
  ++stats_.copies_h2d;
  stats_.bytes_h2d += layer.block.bytes;
}

void TransferEngine::record_after_failed_copy_locked(Layer& layer, StreamHandle stream) noexcept {
  try {
    layer.copied.record(stream);
  } catch (...) {
    // The device no longer takes work: nothing was enqueued after the failure either.
  }
}

void TransferEngine::abandon_region_locked(Layer& layer, bool held, bool deriving) noexcept {
  // A copy or a derivation that could not be enqueued (a failed CUDA call, a hook that threw): the region
  // does not hold the layer's bytes, so no fetch may find it. `copied` is recorded after whatever part was
  // enqueued, so that the region's next writer waits for it (discard_region_locked); then the hold this
  // fetch took is dropped and the region discarded. The caller rethrows: the layer call fails with the
  // cause, and the next fetch copies again. Nothing is logged here (a log sink may take the GIL, and mu_
  // is held); what failed is the rethrown error.
  record_after_failed_copy_locked(layer, deriving ? derive_.get() : h2d_.get());
  try {
    if (held) ring_.release(layer.region, h2d_.get());
    discard_region_locked(layer);
  } catch (...) {
    // Nothing more can be enqueued: the region stays out of use (placement skips it if still held).
    layer.region = 0;
    layer.prefetched_unused = false;
  }
}

void TransferEngine::wait_ready(const Lease& lease, StreamHandle consumer) {
  LS_CHECK_ARG(consumer, "wait_ready: null consumer stream");
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK_ARG(leases_.count(lease.ticket) != 0, "wait_ready: lease ", lease.ticket, " of layer ",
               lease.layer, " is not outstanding (already released, or never fetched)");
  if (!options_.time_waits) {
    backend_.stream_wait_event(consumer, lease.ready);
    return;
  }
  // The consumer stream reaches `before`, waits for the copy, then reaches `after`: the time between the
  // two is how long it waited (zero when the copy had landed). Read later, once `after` is done.
  harvest_timed_waits_locked(false);
  auto take = [&] {
    if (timed_spare_.empty()) return Event(backend_, /*timed=*/true);
    Event e = std::move(timed_spare_.back());
    timed_spare_.pop_back();
    return e;
  };
  Event before = take(), after = take();
  before.record(consumer);
  backend_.stream_wait_event(consumer, lease.ready);
  after.record(consumer);
  timed_waits_.emplace_back(std::move(before), std::move(after));
}

void TransferEngine::harvest_timed_waits_locked(bool all) {
  while (!timed_waits_.empty()) {
    auto& [before, after] = timed_waits_.front();
    if (all) {
      after.synchronize();
    } else if (!after.query()) {
      break;  // the rest were recorded later on the same stream(s): not done either, most likely
    }
    const double ms = backend_.event_elapsed_ms(before.get(), after.get());
    stats_.copy_wait_us += static_cast<std::uint64_t>(ms * 1000.0 + 0.5);
    ++stats_.copy_waits_timed;
    timed_spare_.push_back(std::move(before));
    timed_spare_.push_back(std::move(after));
    timed_waits_.pop_front();
  }
}

void TransferEngine::wait_ready_host(const Lease& lease) {
  std::lock_guard<std::mutex> lock(mu_);
  LS_CHECK_ARG(leases_.count(lease.ticket) != 0, "wait_ready_host: lease ", lease.ticket, " of layer ",
               lease.layer, " is not outstanding (already released, or never fetched)");
  if (!options_.time_waits) {
    backend_.event_synchronize(lease.ready);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  backend_.event_synchronize(lease.ready);
  stats_.copy_wait_us += static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count());
  ++stats_.copy_waits_timed;
}

void* TransferEngine::device_data(const Lease& lease) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease.ticket);
  LS_CHECK_ARG(it != leases_.end(), "use after release: lease ", lease.ticket, " of layer ",
               lease.layer, " was already released; fetch the layer again");
  return it->second.resident || it->second.region == 0 ? lease.data : ring_.info(it->second.region).data;
}

void TransferEngine::release(const Lease& lease, StreamHandle consumer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = leases_.find(lease.ticket);
  LS_CHECK_ARG(it != leases_.end(), "release: lease ", lease.ticket, " of layer ", lease.layer,
               " was already released (or never fetched)");
  LS_CHECK_ARG(consumer, "release: null consumer stream");
  auto layer = layers_.find(it->second.layer);
  if (it->second.region != 0) ring_.release(it->second.region, consumer);
  if (it->second.resident && layer != layers_.end()) {
    // A resident layer: remember this reader, so that a recopy or a free waits for it.
    layer->second.resident_released.record(consumer, events_);
  }
  if (layer != layers_.end()) --layer->second.leases;
  leases_.erase(it);
}

EngineStats TransferEngine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  const_cast<TransferEngine*>(this)->harvest_timed_waits_locked(false);  // counters only; no waiting
  EngineStats s = stats_;
  s.layers = layers_.size();
  s.leases_outstanding = leases_.size();
  s.downloads_pending = downloads_.size();
  s.ring_capacity = ring_.capacity();
  s.ring_bytes_live = ring_.bytes_live();
  s.arena = arena_.stats();
  return s;
}

}  // namespace layerstream
