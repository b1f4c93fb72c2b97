// SimBackend's state (sim_backend.h), shared by its source files: sim_backend.cc (streams, events,
// copies, the race checker) and sim_memory.cc (simulated device and pinned memory). Not a public header.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/sim_backend.h"
#include "race_checker.h"

namespace layerstream {
namespace sim {

constexpr std::size_t kHostActor = 0;

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

// Aligned host memory standing in for device and pinned allocations (sim_memory.cc).
void* aligned_allocate(std::size_t bytes);
void aligned_free(void* p);

inline void spin_for_us(unsigned us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

}  // namespace sim

struct SimBackend::Impl {
  explicit Impl(SimOptions o) : options(o) {}

  SimOptions options;
  mutable std::mutex mu;
  std::condition_variable cv;  // signalled on any completion or queue change
  std::set<sim::SimStream*> streams;
  std::set<sim::SimEvent*> events;
  std::size_t next_actor = 1;
  sim::VectorClock host_clock{0};
  sim::RaceChecker checker;
  std::map<void*, std::size_t> device_allocs;
  std::map<void*, std::size_t> pinned_allocs;
  int failing_h2d_copies = 0;  // fail_next_h2d_copies
  std::map<void*, std::size_t> registered;
  std::size_t device_bytes = 0;
  std::size_t device_peak = 0;  // since reset_device_peak()
  CyclePeaks cycles;            // fed by device_alloc and device_free
  std::function<bool(std::size_t)> pressure_hook;
  std::size_t pinned_bytes = 0;  // allocated + registered, against pinned_capacity_bytes

  static sim::SimStream* as_stream(StreamHandle h) {
    LS_CHECK_ARG(h, "sim backend: null stream handle");
    return static_cast<sim::SimStream*>(h.raw);
  }
  static sim::SimEvent* as_event(EventHandle h) {
    LS_CHECK_ARG(h, "sim backend: null event handle");
    return static_cast<sim::SimEvent*>(h.raw);
  }

  // Called for every operation enqueued on `s` (caller holds mu). The operation is a new epoch of `s`,
  // and it happens after everything the host did or learned before enqueuing it: host writes before
  // an async copy are visible to the copy, and work the host has waited for is done before it.
  void tick(sim::SimStream& s) {
    sim::join(s.clock, host_clock);
    if (s.clock.size() <= s.actor) s.clock.resize(s.actor + 1, 0);
    ++s.clock[s.actor];
  }
  void tick_host() { ++host_clock[sim::kHostActor]; }

  void enqueue(sim::SimStream& s, std::function<void()> op) {  // caller holds mu
    s.queue.push_back(std::move(op));
    cv.notify_all();
  }

  void maybe_delay(sim::SimStream& s) {
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
    if (c < options.delay_probability) sim::spin_for_us(wait);
  }

  void run_worker(sim::SimStream* s) {
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
  void copy_bytes(sim::SimStream& s, void* dst, const void* src, std::size_t bytes) {
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
      for (sim::SimStream* s : streams) {
        if (!s->queue.empty() || s->busy) return false;
      }
      return true;
    });
    for (sim::SimStream* s : streams) sim::join(host_clock, s->clock);
  }

  void wait_completion(std::unique_lock<std::mutex>& lock, const std::shared_ptr<sim::Completion>& c) {
    cv.wait(lock, [&] { return c->done; });
    sim::join(host_clock, c->clock);
  }
};

}  // namespace layerstream
