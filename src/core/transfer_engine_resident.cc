// TransferEngine (transfer_engine.h): resident layers, kept in device memory of their own instead of the
// ring (the VRAM budget's choice), and how they give that memory back (eviction, memory pressure).
#include "layerstream/transfer_engine.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "layerstream/check.h"
#include "transfer_engine_internal.h"

namespace layerstream {

bool TransferEngine::make_resident(LayerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& layer = layer_locked(id);
  if (layer.resident.data() != nullptr) return true;
  try {
    layer.resident = DeviceBuffer(backend_, layer.block.bytes, options_.ring_allocator, h2d_.get());
  } catch (const Error&) {
    return false;  // out of device memory: the layer keeps streaming
  }
  try {
    wait_derivation_on_h2d_locked(layer);
    copy_in_locked(layer, layer.resident.data());
    layer.copied.record(h2d_.get());
  } catch (...) {
    // Not resident: a copy that could not be issued leaves no memory that a fetch would serve. The memory
    // goes back to an allocator that does not order it after H2D (drop_resident_locked), so the host waits
    // for whatever part of the copy was enqueued first.
    record_after_failed_copy_locked(layer, h2d_.get());
    try {
      layer.copied.synchronize();
    } catch (...) {  // the device fails every call now: nothing it runs can still write the buffer
    }
    layer.resident.reset();
    throw;
  }
  ++stats_.copies_h2d;
  stats_.bytes_h2d += layer.block.bytes;
  layer.resident_stale = false;
  layer.resident_fill = detail::next_fill();
  if (layer.leases == 0) discard_region_locked(layer);  // its ring copy is not needed any more
  ++stats_.resident_layers;
  stats_.resident_bytes += layer.block.bytes;
  return true;
}

void TransferEngine::evict_resident(LayerId id) {
  std::lock_guard<std::mutex> lock(mu_);
  Layer& layer = layer_locked(id);
  check_not_in_use_locked(layer, id, "evict_resident");
  drop_resident_locked(layer);
}

std::size_t TransferEngine::yield_resident(std::size_t want, std::vector<LayerId>* given) {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return 0;
  std::vector<std::pair<LayerId, Layer*>> idle;
  for (auto& [id, layer] : layers_) {
    if (layer.resident.data() != nullptr && layer.leases == 0) idle.emplace_back(id, &layer);
  }
  // Largest first: the fewest layers go back to streaming for the bytes asked (ties by id: the same layers
  // every time, whatever the map's order).
  std::sort(idle.begin(), idle.end(), [](const auto& a, const auto& b) {
    return a.second->block.bytes != b.second->block.bytes ? a.second->block.bytes > b.second->block.bytes
                                                          : a.first < b.first;
  });
  std::size_t freed = 0;
  for (auto& [id, layer] : idle) {
    if (freed >= want) break;
    freed += layer->block.bytes;
    drop_resident_locked(*layer);
    if (given != nullptr) given->push_back(id);
  }
  return freed;
}

bool TransferEngine::resident(LayerId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return layer_locked(id).resident.data() != nullptr;
}

bool TransferEngine::resident_scratch_current_locked(const Layer& layer) const {
  return layer.scratch_only && layer.region != 0 && ring_.live(layer.region) && !layer.resident_stale &&
         layer.derived_from == layer.resident_fill;
}

bool TransferEngine::derive_resident_locked(LayerId id, Layer& layer, bool held) {
  if (layer.region != 0 && ring_.live(layer.region)) {
    // A ring copy from before the layer became resident, or an outdated scratch: replaced only when no
    // lease reads it (a held region stays; the reader then decodes on its own, as without a region).
    if (!layer.scratch_only || layer.leases != 0) return false;
    discard_region_locked(layer);
  }
  Eviction eviction;
  // Unheld placement never throws for want of room: with none, the reader decodes on its own.
  const RegionId region = ring_.try_place_unheld(layer.extra, id, eviction);
  if (region == 0) return false;
  if (held) ring_.hold(region);
  layer.region = region;
  layer.scratch_only = true;
  bool deriving = false;
  try {
    // H2D waits for the readers of what the placement displaced; the derivation waits for H2D there, which
    // also orders it after every copy into the resident buffer.
    settle_eviction_locked(eviction);
    layer.landed.record(h2d_.get());
    backend_.stream_wait_event(derive_.get(), layer.landed.get());
    deriving = true;
    layer.on_fill(layer.resident.data(), ring_.info(region).data, derive_.get());
    layer.copied.record(derive_.get());
  } catch (...) {
    abandon_region_locked(layer, held, deriving);
    throw;
  }
  layer.fill = detail::next_fill();
  layer.derived_from = layer.resident_fill;
  return true;
}

void TransferEngine::drop_resident_locked(Layer& layer) {
  if (layer.resident.data() == nullptr) return;
  if (layer.scratch_only) discard_region_locked(layer);  // derived from the copy that goes: never a ring copy
  // The memory may go straight back to an allocator that does not synchronize: wait for every reader
  // and for the copies into it first.
  layer.resident_released.synchronize();
  std::vector<Event> done;
  layer.resident_released.move_events_to(done);
  events_.give(done);
  layer.copied.synchronize();
  --stats_.resident_layers;
  stats_.resident_bytes -= layer.block.bytes;
  layer.resident.reset();
  layer.resident_stale = false;
}

}  // namespace layerstream
