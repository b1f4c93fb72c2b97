#include "layerstream/sim_backend.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#ifdef _WIN32
#include <malloc.h>
#endif

#include "layerstream/alignment.h"
#include "layerstream/check.h"
#include "race_checker.h"

namespace layerstream {

namespace {

constexpr std::size_t kHostActor = 0;
constexpr std::size_t kAlignment = kBlockAlignment;

// One record of an event: done once the stream that recorded it reaches that point. Waits hold on to the
// record they saw, so re-recording the event never releases an earlier waiter early.
struct Completion {
  bool done = false;
  sim::VectorClock clock;  // the recording stream's clock at the record
  std::chrono::steady_clock::time_point at;  // when the stream reached it (host time)
};

struct SimEvent {
  std::shared_ptr<Completion> current;
};

struct SimStream {
  std::size_t actor = 0;
  sim::VectorClock clock;
  std::deque<std::function<void()>> queue;
  bool busy = false;
  bool stopping = false;
  std::mt19937_64 rng;
  std::thread worker;
};

// Aligned host memory standing in for device and pinned allocations (MSVC has no std::aligned_alloc).
void* aligned_allocate(std::size_t bytes) {
  const std::size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
#ifdef _WIN32
  return _aligned_malloc(rounded, kAlignment);
#else
  return std::aligned_alloc(kAlignment, rounded);
#endif
}

void aligned_free(void* p) {
#ifdef _WIN32
  _aligned_free(p);
#else
  std::free(p);
#endif
}

void spin_for_us(unsigned us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

}  // namespace

struct SimBackend::Impl {
  explicit Impl(SimOptions o) : options(o) {}

  SimOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;  // signalled on any completion or queue change
  std::set<SimStream*> streams;
  std::set<SimEvent*> events;
  std::size_t next_actor = 1;
  sim::VectorClock host_clock{0};
  sim::RaceChecker checker;
  std::map<void*, std::size_t> device_allocs;
  std::map<void*, std::size_t> pinned_allocs;
  int failing_h2d_copies = 0;  // fail_next_h2d_copies
  std::map<void*, std::size_t> registered;
  std::size_t device_bytes = 0;
  std::size_t device_peak = 0;  // since reset_device_peak()
  std::function<bool(std::size_t)> pressure_hook;
  std::size_t pinned_bytes = 0;  // allocated + registered, against pinned_capacity_bytes

  static SimStream* as_stream(StreamHandle h) {
    LS_CHECK_ARG(h, "sim backend: null stream handle");
    return static_cast<SimStream*>(h.raw);
  }
  static SimEvent* as_event(EventHandle h) {
    LS_CHECK_ARG(h, "sim backend: null event handle");
    return static_cast<SimEvent*>(h.raw);
  }

  // Called for every operation enqueued on `s` (caller holds mu). The operation is a new epoch of `s`,
  // and it happens after everything the host did or learned before enqueuing it: host writes before
  // an async copy are visible to the copy, and work the host has waited for is done before it.
  void tick(SimStream& s) {
    sim::join(s.clock, host_clock);
    if (s.clock.size() <= s.actor) s.clock.resize(s.actor + 1, 0);
    ++s.clock[s.actor];
  }
  void tick_host() { ++host_clock[kHostActor]; }

  void enqueue(SimStream& s, std::function<void()> op) {  // caller holds mu
    s.queue.push_back(std::move(op));
    cv.notify_all();
  }

  void maybe_delay(SimStream& s) {
    if (options.delay_probability <= 0.0 || options.max_delay_us == 0) return;
    std::uniform_real_distribution<double> coin(0.0, 1.0);
    std::uniform_int_distribution<unsigned> us(0, options.max_delay_us);
    double c;
    unsigned wait;
    {
      std::lock_guard<std::mutex> lock(mu);  // the rng belongs to the stream; mu keeps tsan quiet
      c = coin(s.rng);
      wait = us(s.rng);
    }
    if (c < options.delay_probability) spin_for_us(wait);
  }

  void run_worker(SimStream* s) {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return !s->queue.empty() || s->stopping; });
      if (s->queue.empty()) return;  // stopping and drained
      auto op = std::move(s->queue.front());
      s->queue.pop_front();
      s->busy = true;
      lock.unlock();
      maybe_delay(*s);
      op();
      lock.lock();
      s->busy = false;
      cv.notify_all();
    }
  }

  // The copy itself, run on the stream's thread. Scrambled copies land in shuffled pieces.
  void copy_bytes(SimStream& s, void* dst, const void* src, std::size_t bytes) {
    if (!options.scramble_copies || bytes < 2) {
      std::memcpy(dst, src, bytes);
      return;
    }
    std::vector<std::size_t> cuts;
    std::vector<std::size_t> order;
    {
      std::lock_guard<std::mutex> lock(mu);
      std::uniform_int_distribution<std::size_t> pieces_dist(2, 8);
      const std::size_t pieces = std::min<std::size_t>(pieces_dist(s.rng), bytes);
      std::uniform_int_distribution<std::size_t> cut_dist(1, bytes - 1);
      std::set<std::size_t> unique_cuts;
      while (unique_cuts.size() + 1 < pieces) unique_cuts.insert(cut_dist(s.rng));
      cuts.push_back(0);
      cuts.insert(cuts.end(), unique_cuts.begin(), unique_cuts.end());
      cuts.push_back(bytes);
      order.resize(cuts.size() - 1);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), s.rng);
    }
    for (std::size_t i : order) {
      std::memcpy(static_cast<char*>(dst) + cuts[i], static_cast<const char*>(src) + cuts[i],
                  cuts[i + 1] - cuts[i]);
      std::this_thread::yield();
    }
  }

  // Waits for every stream to drain, then joins the host clock with every stream's. Caller holds lock.
  void drain_all(std::unique_lock<std::mutex>& lock) {
    cv.wait(lock, [&] {
      for (SimStream* s : streams) {
        if (!s->queue.empty() || s->busy) return false;
      }
      return true;
    });
    for (SimStream* s : streams) sim::join(host_clock, s->clock);
  }

  void wait_completion(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Completion>& c) {
    cv.wait(lock, [&] { return c->done; });
    sim::join(host_clock, c->clock);
  }
};

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

void* SimBackend::host_alloc_pinned(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "host_alloc_pinned: size must be positive");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->pinned_bytes + bytes > impl_->options.pinned_capacity_bytes) return nullptr;
  void* p = aligned_allocate(bytes);
  if (p == nullptr) return nullptr;
  impl_->pinned_allocs[p] = bytes;
  impl_->pinned_bytes += bytes;
  return p;
}

void SimBackend::host_free_pinned(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->pinned_allocs.find(ptr);
  if (it == impl_->pinned_allocs.end()) return;
  impl_->drain_all(lock);  // cudaFreeHost synchronizes the device
  impl_->checker.forget(ptr, it->second);
  impl_->pinned_bytes -= it->second;
  impl_->pinned_allocs.erase(it);
  aligned_free(ptr);
}

bool SimBackend::host_register(void* ptr, std::size_t bytes, bool /*read_only*/) {
  LS_CHECK_ARG(ptr != nullptr && bytes > 0, "host_register: empty range");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->pinned_bytes + bytes > impl_->options.pinned_capacity_bytes) return false;
  impl_->registered[ptr] = bytes;
  impl_->pinned_bytes += bytes;
  return true;
}

void SimBackend::host_unregister(void* ptr) noexcept {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->registered.find(ptr);
  if (it == impl_->registered.end()) return;
  impl_->drain_all(lock);
  impl_->checker.forget(ptr, it->second);
  impl_->pinned_bytes -= it->second;
  impl_->registered.erase(it);
}

void* SimBackend::device_alloc(std::size_t bytes) {
  LS_CHECK_ARG(bytes > 0, "device_alloc: size must be positive");
  std::function<bool(std::size_t)> hook;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1 && !(hook && hook(bytes))) return nullptr;  // outside the lock: the hook frees memory
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->device_bytes + bytes > impl_->options.device_capacity_bytes) {
      hook = impl_->pressure_hook;
      continue;
    }
    void* p = aligned_allocate(bytes);
    if (p == nullptr) return nullptr;
    impl_->device_allocs[p] = bytes;
    impl_->device_bytes += bytes;
    impl_->device_peak = std::max(impl_->device_peak, impl_->device_bytes);
    return p;
  }
  return nullptr;
}

void SimBackend::set_memory_pressure_hook(std::function<bool(std::size_t bytes)> hook) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pressure_hook = std::move(hook);
}

std::size_t SimBackend::device_peak_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->device_peak;
}

void SimBackend::reset_device_peak() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->device_peak = impl_->device_bytes;
}

void SimBackend::device_free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->device_allocs.find(ptr);
  if (it == impl_->device_allocs.end()) return;
  impl_->drain_all(lock);  // cudaFree synchronizes the device
  impl_->checker.forget(ptr, it->second);
  impl_->device_bytes -= it->second;
  impl_->device_allocs.erase(it);
  aligned_free(ptr);
}

std::pair<std::size_t, std::size_t> SimBackend::device_memory_info() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return {impl_->options.device_capacity_bytes - impl_->device_bytes,
          impl_->options.device_capacity_bytes};
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

SimMemoryStats SimBackend::memory_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  SimMemoryStats s;
  for (auto& [p, n] : impl_->device_allocs) s.device_bytes += n;
  for (auto& [p, n] : impl_->pinned_allocs) s.pinned_bytes += n;
  for (auto& [p, n] : impl_->registered) s.registered_bytes += n;
  s.streams = impl_->streams.size();
  s.events = impl_->events.size();
  return s;
}

}  // namespace layerstream
