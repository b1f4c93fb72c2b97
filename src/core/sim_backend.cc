#include "layerstream/sim_backend.h"

#include <algorithm>

#include "layerstream/check.h"
#include "sim_backend_impl.h"

namespace layerstream {

using sim::Completion;
using sim::SimEvent;
using sim::SimStream;
using sim::aligned_free;
using sim::kHostActor;

SimBackend::SimBackend(SimOptions options) : impl_(std::make_unique<Impl>(options)) {}

SimBackend::~SimBackend() {
  std::vector<SimStream*> leftover;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    leftover.assign(impl_->streams.begin(), impl_->streams.end());
  }
  for (SimStream* s : leftover) stream_destroy(StreamHandle{s});
  for (SimEvent* e : impl_->events) delete e;
  for (auto& [p, n] : impl_->device_allocs) aligned_free(p);
  for (auto& [p, n] : impl_->pinned_allocs) aligned_free(p);
}

std::string SimBackend::name() const { return detail::concat("sim:", impl_->options.device); }
int SimBackend::device() const { return impl_->options.device; }

StreamHandle SimBackend::stream_create() {
  auto* s = new SimStream();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s->actor = impl_->next_actor++;
    s->rng.seed(impl_->options.seed * 0x9E3779B97F4A7C15ull + s->actor);
    // A new stream starts after everything the host has seen (like work enqueued after a host sync).
    s->clock = impl_->host_clock;
    impl_->tick(*s);
    impl_->streams.insert(s);
  }
  s->worker = std::thread([this, s] { impl_->run_worker(s); });
  return StreamHandle{s};
}

void SimBackend::stream_destroy(StreamHandle stream) noexcept {
  auto* s = static_cast<SimStream*>(stream.raw);
  if (s == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    s->stopping = true;
    impl_->cv.notify_all();
  }
  s->worker.join();
  std::lock_guard<std::mutex> lock(impl_->mu);
  sim::join(impl_->host_clock, s->clock);
  impl_->streams.erase(s);
  delete s;
}

void SimBackend::stream_synchronize(StreamHandle stream) {
  SimStream* s = Impl::as_stream(stream);
  auto c = std::make_shared<Completion>();
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->tick(*s);
  c->clock = s->clock;
  impl_->enqueue(*s, [this, c] {
    std::lock_guard<std::mutex> l(impl_->mu);
    c->done = true;
    impl_->cv.notify_all();
  });
  impl_->wait_completion(lock, c);
}

void SimBackend::stream_wait_event(StreamHandle stream, EventHandle event) {
  SimStream* s = Impl::as_stream(stream);
  SimEvent* e = Impl::as_event(event);
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::shared_ptr<Completion> c = e->current;
  if (!c) return;  // never recorded: nothing to wait for
  impl_->tick(*s);
  sim::join(s->clock, c->clock);
  impl_->enqueue(*s, [this, c] {
    std::unique_lock<std::mutex> l(impl_->mu);
    impl_->cv.wait(l, [&] { return c->done; });
  });
}

EventHandle SimBackend::event_create() {
  auto* e = new SimEvent();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->events.insert(e);
  return EventHandle{e};
}

void SimBackend::event_destroy(EventHandle event) noexcept {
  auto* e = static_cast<SimEvent*>(event.raw);
  if (e == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->events.erase(e);
  delete e;  // pending records own their Completion; nothing else points at the event
}

void SimBackend::event_record(EventHandle event, StreamHandle stream) {
  SimStream* s = Impl::as_stream(stream);
  SimEvent* e = Impl::as_event(event);
  auto c = std::make_shared<Completion>();
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tick(*s);
  c->clock = s->clock;
  e->current = c;
  impl_->enqueue(*s, [this, c] {
    std::lock_guard<std::mutex> l(impl_->mu);
    c->done = true;
    c->at = std::chrono::steady_clock::now();
    impl_->cv.notify_all();
  });
}

// Every simulated event keeps its completion time; "timed" ones are the same.
EventHandle SimBackend::event_create_timed() { return event_create(); }

double SimBackend::event_elapsed_ms(EventHandle start, EventHandle end) {
  SimEvent* a = Impl::as_event(start);
  SimEvent* b = Impl::as_event(end);
  std::lock_guard<std::mutex> lock(impl_->mu);
  LS_CHECK_ARG(a->current && b->current && a->current->done && b->current->done,
               "event_elapsed_ms: both events must have completed");
  return std::chrono::duration<double, std::milli>(b->current->at - a->current->at).count();
}

bool SimBackend::event_query(EventHandle event) {
  SimEvent* e = Impl::as_event(event);
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!e->current) return true;
  if (!e->current->done) return false;
  sim::join(impl_->host_clock, e->current->clock);
  return true;
}

void SimBackend::event_synchronize(EventHandle event) {
  SimEvent* e = Impl::as_event(event);
  std::unique_lock<std::mutex> lock(impl_->mu);
  std::shared_ptr<Completion> c = e->current;
  if (!c) return;
  impl_->wait_completion(lock, c);
}

void SimBackend::memcpy_h2d_async(void* device_dst, const void* host_src, std::size_t bytes,
                                  StreamHandle stream) {
  SimStream* s = Impl::as_stream(stream);
  LS_CHECK_ARG(device_dst != nullptr && host_src != nullptr, "memcpy_h2d_async: null pointer");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->failing_h2d_copies > 0) {
    --impl_->failing_h2d_copies;
    throw Error("memcpy_h2d_async: a copy failure the simulator was asked for (fail_next_h2d_copies)");
  }
  impl_->tick(*s);
  impl_->checker.access(s->actor, s->clock, host_src, bytes, false, "memcpy_h2d source");
  impl_->checker.access(s->actor, s->clock, device_dst, bytes, true, "memcpy_h2d destination");
  impl_->enqueue(*s, [this, s, device_dst, host_src, bytes] {
    impl_->copy_bytes(*s, device_dst, host_src, bytes);
  });
}

void SimBackend::fail_next_h2d_copies(int count) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->failing_h2d_copies = count;
}

void SimBackend::memcpy_d2h_async(void* host_dst, const void* device_src, std::size_t bytes,
                                  StreamHandle stream) {
  SimStream* s = Impl::as_stream(stream);
  LS_CHECK_ARG(host_dst != nullptr && device_src != nullptr, "memcpy_d2h_async: null pointer");
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tick(*s);
  impl_->checker.access(s->actor, s->clock, device_src, bytes, false, "memcpy_d2h source");
  impl_->checker.access(s->actor, s->clock, host_dst, bytes, true, "memcpy_d2h destination");
  impl_->enqueue(*s, [this, s, host_dst, device_src, bytes] {
    impl_->copy_bytes(*s, host_dst, device_src, bytes);
  });
}

void SimBackend::launch_host_func(StreamHandle stream, std::function<void()> fn) {
  SimStream* s = Impl::as_stream(stream);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tick(*s);
  impl_->enqueue(*s, std::move(fn));
}

void SimBackend::annotate_stream_access(StreamHandle stream, const void* ptr, std::size_t bytes,
                                        bool is_write) {
  SimStream* s = Impl::as_stream(stream);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tick(*s);
  impl_->checker.access(s->actor, s->clock, ptr, bytes, is_write,
                        is_write ? "annotated stream write" : "annotated stream read");
}

void SimBackend::annotate_host_access(const void* ptr, std::size_t bytes, bool is_write) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->tick_host();
  impl_->checker.access(kHostActor, impl_->host_clock, ptr, bytes, is_write,
                        is_write ? "host write" : "host read");
}

void SimBackend::synchronize_all() {
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->drain_all(lock);
}

std::vector<std::string> SimBackend::violations() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->checker.violations();
}

std::size_t SimBackend::violation_count() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->checker.race_count();
}

void SimBackend::clear_violations() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->checker.clear_violations();
}

std::uint64_t SimBackend::checked_accesses() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->checker.checked();
}

}  // namespace layerstream
