// Backend contract: copies move the exact bytes, streams run in order, events order streams, and
// allocation failures are reported, not crashed on. Runs on sim and (where present) cuda.
#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

#include "backends.h"
#include "layerstream/check.h"

namespace layerstream::testing {
namespace {

class BackendContract : public BackendTest {};

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * 131u + seed * 7u) ^ (i >> 8));
  return v;
}

TEST_P(BackendContract, RoundTripCopyIsByteExact) {
  Stream s(backend());
  const std::size_t n = 1 << 20;
  auto src = pattern(n, 1);
  PinnedBuffer host(backend(), n, PinMethod::kHostAlloc);
  std::memcpy(host.data(), src.data(), n);
  DeviceBuffer dev(backend(), n);
  backend().memcpy_h2d_async(dev.data(), host.data(), n, s.get());
  EXPECT_EQ(read_back(dev.data(), n, s.get()), src);
}

TEST_P(BackendContract, EventOrdersWorkAcrossStreams) {
  Stream producer(backend()), consumer(backend());
  const std::size_t n = 4 << 20;
  auto src = pattern(n, 2);
  PinnedBuffer host(backend(), n, PinMethod::kHostAlloc);
  std::memcpy(host.data(), src.data(), n);
  DeviceBuffer dev(backend(), n);
  Event copied(backend());
  backend().memcpy_h2d_async(dev.data(), host.data(), n, producer.get());
  copied.record(producer.get());
  backend().stream_wait_event(consumer.get(), copied.get());
  EXPECT_EQ(read_back(dev.data(), n, consumer.get()), src);
  EXPECT_TRUE(copied.query());
}

TEST_P(BackendContract, NeverRecordedEventIsComplete) {
  Event e(backend());
  EXPECT_TRUE(e.query());
  e.synchronize();  // returns at once
}

TEST_P(BackendContract, HostFuncRunsInStreamOrder) {
  Stream s(backend());
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 50; ++i) {
    backend().launch_host_func(s.get(), [&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    });
  }
  backend().stream_synchronize(s.get());
  std::vector<int> expected(50);
  std::iota(expected.begin(), expected.end(), 0);
  EXPECT_EQ(order, expected);
}

TEST_P(BackendContract, MoveOnlyOwnersTransferOwnership) {
  Event a(backend());
  const EventHandle h = a.get();
  Event b(std::move(a));
  EXPECT_FALSE(a);
  EXPECT_EQ(b.get(), h);
  DeviceBuffer d1(backend(), 4096);
  void* p = d1.data();
  DeviceBuffer d2 = std::move(d1);
  EXPECT_EQ(d1.data(), nullptr);
  EXPECT_EQ(d2.data(), p);
}

TEST_P(BackendContract, OversizedDeviceAllocationThrowsWithSize) {
  const auto [free_bytes, total] = backend().device_memory_info();
  try {
    DeviceBuffer huge(backend(), total * 4);
    FAIL() << "allocation of 4x the device memory succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of device memory"), std::string::npos) << e.what();
  }
  DeviceBuffer fine(backend(), 4096);  // the backend keeps working
  EXPECT_NE(fine.data(), nullptr);
}

LS_INSTANTIATE_ON_BACKENDS(BackendContract);

// ---- sim-only properties -------------------------------------------------------------------------------

TEST(SimBackend, WaitKeepsTheCaptureItSawWhenTheEventIsRecordedAgain) {
  SimBackend sim;
  Stream slow(sim), fast(sim), waiter(sim);
  Event e(sim);
  std::atomic<bool> slow_done{false};
  std::atomic<bool> gate{false};
  sim.launch_host_func(slow.get(), [&] {
    while (!gate.load()) std::this_thread::yield();
    slow_done = true;
  });
  e.record(slow.get());
  sim.stream_wait_event(waiter.get(), e.get());
  e.record(fast.get());  // the waiter must still wait for `slow`
  std::atomic<bool> saw_slow_done{false};
  sim.launch_host_func(waiter.get(), [&] { saw_slow_done = slow_done.load(); });
  sim.stream_synchronize(fast.get());
  gate = true;
  sim.stream_synchronize(waiter.get());
  EXPECT_TRUE(saw_slow_done.load());
}

TEST(SimBackend, RefusesPinningBeyondItsCapacity) {
  SimOptions options;
  options.pinned_capacity_bytes = 8192;
  SimBackend sim(options);
  void* a = sim.host_alloc_pinned(8192);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(sim.host_alloc_pinned(1), nullptr);
  PinnedBuffer fallback(sim, 4096, PinMethod::kHostAlloc);
  EXPECT_FALSE(fallback.pinned());
  EXPECT_NE(fallback.data(), nullptr);
  sim.host_free_pinned(a);
  EXPECT_EQ(sim.memory_stats().pinned_bytes, 0u);
}

TEST(SimBackend, RegisterFallsBackToPageableWhenRefused) {
  SimOptions options;
  options.pinned_capacity_bytes = 0;
  SimBackend sim(options);
  PinnedBuffer b(sim, 8192, PinMethod::kRegister);
  EXPECT_FALSE(b.pinned());
  SimOptions generous;
  SimBackend sim2(generous);
  PinnedBuffer c(sim2, 8192, PinMethod::kRegister);
  EXPECT_TRUE(c.pinned());
  EXPECT_EQ(sim2.memory_stats().registered_bytes, 8192u);
  c.reset();
  EXPECT_EQ(sim2.memory_stats().registered_bytes, 0u);
}

TEST(SimBackend, ResourcesAreReturned) {
  SimBackend sim;
  {
    Stream s(sim);
    Event e(sim);
    DeviceBuffer d(sim, 1 << 16);
    PinnedBuffer p(sim, 1 << 16, PinMethod::kHostAlloc);
    EXPECT_EQ(sim.memory_stats().device_bytes, 1u << 16);
    EXPECT_EQ(sim.memory_stats().streams, 1u);
  }
  expect_all_returned(sim);
}

TEST(SimBackend, ScrambledDelayedCopiesStillLandWhole) {
  SimOptions options;
  options.seed = 42;
  options.delay_probability = 0.5;
  options.max_delay_us = 50;
  options.scramble_copies = true;
  SimBackend sim(options);
  Stream s(sim);
  const std::size_t n = 100003;
  auto src = pattern(n, 3);
  DeviceBuffer dev(sim, n);
  std::vector<unsigned char> out(n);
  for (int round = 0; round < 20; ++round) {
    sim.memcpy_h2d_async(dev.data(), src.data(), n, s.get());
    sim.memcpy_d2h_async(out.data(), dev.data(), n, s.get());
  }
  sim.stream_synchronize(s.get());
  EXPECT_EQ(out, src);
  EXPECT_EQ(sim.violation_count(), 0u);
}

}  // namespace
}  // namespace layerstream::testing
