// EventPool: reusable events, so that the hot path never creates or destroys one.
//
// An event may go back to the pool as soon as every wait on it has been *enqueued* (a stream wait keeps
// the capture it saw when it was enqueued), or once the host has observed it complete.
// Ownership: events taken from the pool belong to the taker until given back; the pool owns the rest.
// Thread-safety: none; owners serialize access.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "layerstream/backend.h"

namespace layerstream {

class EventPool {
 public:
  explicit EventPool(Backend& backend) : backend_(backend) {}

  Event take() {
    if (spare_.empty()) {
      ++created_;
      return Event(backend_);
    }
    Event e = std::move(spare_.back());
    spare_.pop_back();
    return e;
  }
  void give(Event&& event) { spare_.push_back(std::move(event)); }
  void give(std::vector<Event>& events) {
    for (Event& e : events) spare_.push_back(std::move(e));
    events.clear();
  }
  // Events ever created by this pool (tests check it stays bounded).
  std::size_t created() const { return created_; }

 private:
  Backend& backend_;
  std::vector<Event> spare_;
  std::size_t created_ = 0;
};

// The readers of one piece of device memory, as the last "released" event recorded on each consumer
// stream. A later release on the same stream re-records that stream's event (stream order makes the
// older capture redundant), so this holds one event per distinct consumer stream.
class ReleaseRecord {
 public:
  void record(StreamHandle consumer, EventPool& pool) {
    for (auto& [stream, event] : entries_) {
      if (stream == consumer) {
        event.record(consumer);
        return;
      }
    }
    entries_.emplace_back(consumer, pool.take());
    entries_.back().second.record(consumer);
  }
  // Makes `stream` wait (on the device) for every recorded reader.
  void wait_on(Backend& backend, StreamHandle stream) const {
    for (const auto& [consumer, event] : entries_) backend.stream_wait_event(stream, event.get());
  }
  // Blocks the host until every recorded reader is done.
  void synchronize() const {
    for (const auto& [consumer, event] : entries_) event.synchronize();
  }
  // Hands the events over (to wait on them, then recycle them) and forgets them.
  void move_events_to(std::vector<Event>& out) {
    for (auto& [consumer, event] : entries_) out.push_back(std::move(event));
    entries_.clear();
  }

 private:
  std::vector<std::pair<StreamHandle, Event>> entries_;
};

}  // namespace layerstream
