// The race checker must be able to fail: each broken ordering below is caught, each fixed twin is not.
#include <gtest/gtest.h>

#include <vector>

#include "layerstream/sim_backend.h"
#include "race_checker.h"

namespace layerstream {
namespace {

struct Fixture {
  SimBackend sim;
  Stream copy{sim}, compute{sim};
  DeviceBuffer region{sim, 4096};
  std::vector<unsigned char> host = std::vector<unsigned char>(4096, 7);
  std::vector<unsigned char> out = std::vector<unsigned char>(4096, 0);
};

TEST(RaceChecker, CatchesAWriteOverARegionStillBeingRead) {
  Fixture f;
  Event ready(f.sim);
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  ready.record(f.copy.get());
  f.sim.stream_wait_event(f.compute.get(), ready.get());
  f.sim.memcpy_d2h_async(f.out.data(), f.region.data(), 4096, f.compute.get());  // the reader
  // Broken: the next copy into the region does not wait for the reader.
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  f.sim.synchronize_all();
  ASSERT_GE(f.sim.violation_count(), 1u);
  EXPECT_NE(f.sim.violations().front().find("memcpy_h2d destination"), std::string::npos)
      << f.sim.violations().front();
}

TEST(RaceChecker, AcceptsTheSameScheduleWithTheReleasedEvent) {
  Fixture f;
  Event ready(f.sim), released(f.sim);
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  ready.record(f.copy.get());
  f.sim.stream_wait_event(f.compute.get(), ready.get());
  f.sim.memcpy_d2h_async(f.out.data(), f.region.data(), 4096, f.compute.get());
  released.record(f.compute.get());
  f.sim.stream_wait_event(f.copy.get(), released.get());
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  f.sim.synchronize_all();
  EXPECT_EQ(f.sim.violation_count(), 0u) << f.sim.violations().front();
}

TEST(RaceChecker, CatchesAReaderThatDoesNotWaitForTheCopy) {
  Fixture f;
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  f.sim.annotate_stream_access(f.compute.get(), f.region.data(), 4096, false);  // no wait on ready
  f.sim.synchronize_all();
  EXPECT_EQ(f.sim.violation_count(), 1u);
}

TEST(RaceChecker, CatchesAHostWriteUnderAnInFlightCopy) {
  Fixture f;
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  f.sim.annotate_host_access(f.host.data(), 4096, true);  // host overwrites the source too early
  EXPECT_EQ(f.sim.violation_count(), 1u);
  f.sim.clear_violations();

  Event copied(f.sim);
  f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
  copied.record(f.copy.get());
  copied.synchronize();
  f.sim.annotate_host_access(f.host.data(), 4096, true);
  EXPECT_EQ(f.sim.violation_count(), 0u);
}

TEST(RaceChecker, StreamOrderAndReadsAloneNeverRace) {
  Fixture f;
  for (int i = 0; i < 10; ++i) {
    f.sim.memcpy_h2d_async(f.region.data(), f.host.data(), 4096, f.copy.get());
    f.sim.memcpy_d2h_async(f.out.data(), f.region.data(), 4096, f.copy.get());
  }
  f.sim.annotate_stream_access(f.compute.get(), f.host.data(), 4096, false);  // read vs read
  f.sim.synchronize_all();
  EXPECT_EQ(f.sim.violation_count(), 0u);
}

TEST(RaceChecker, PartialOverlapIsARace) {
  Fixture f;
  char* base = static_cast<char*>(f.region.data());
  f.sim.annotate_stream_access(f.compute.get(), base + 1000, 100, false);
  f.sim.memcpy_h2d_async(base + 1099, f.host.data(), 10, f.copy.get());  // one byte overlaps
  f.sim.memcpy_h2d_async(base + 1100, f.host.data(), 10, f.copy.get());  // adjacent: fine
  f.sim.synchronize_all();
  EXPECT_EQ(f.sim.violation_count(), 1u);
}

TEST(RaceChecker, VerdictDoesNotDependOnTiming) {
  std::vector<std::size_t> counts;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    SimOptions options;
    options.seed = seed;
    options.delay_probability = 0.7;
    options.max_delay_us = 30;
    SimBackend sim(options);
    Stream a(sim), b(sim);
    DeviceBuffer d(sim, 1024);
    std::vector<unsigned char> h(1024, 1), o(1024);
    for (int i = 0; i < 5; ++i) {
      sim.memcpy_h2d_async(d.data(), h.data(), 1024, a.get());
      sim.memcpy_d2h_async(o.data(), d.data(), 1024, b.get());
    }
    sim.synchronize_all();
    counts.push_back(sim.violation_count());
  }
  for (std::size_t c : counts) EXPECT_EQ(c, counts.front());
  EXPECT_GT(counts.front(), 0u);
}

TEST(RaceCheckerUnit, SupersededAccessesArePruned) {
  sim::RaceChecker checker;
  sim::VectorClock clock{0, 0};
  std::vector<char> mem(64);
  for (int i = 1; i <= 1000; ++i) {
    clock[1] = i;
    checker.access(1, clock, mem.data(), 64, true, "write");
  }
  EXPECT_EQ(checker.race_count(), 0u);
  EXPECT_EQ(checker.checked(), 1000u);
  // A read by an actor that has seen only the first write races with the last one.
  sim::VectorClock stale{0, 1, 5};
  checker.access(2, stale, mem.data(), 8, false, "read");
  EXPECT_EQ(checker.race_count(), 1u);
}

}  // namespace
}  // namespace layerstream
