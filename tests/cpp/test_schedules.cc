// Randomized schedules under fault injection: thousands of seeded workloads drive the TransferEngine
// through the reader protocol (with prefetches ahead of need, resident layers and layers whose scratch a
// fill hook derives mixed in) on the simulator, with random delays and scrambled copies. Every byte a
// reader sees is compared with the host bytes at fetch time, and the happens-before checker must find no
// race. The broken-protocol tests run the same workloads with a deliberate ordering bug and require the
// checker to catch it, so a green run means something.
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <random>

#include "layerstream/check.h"
#include "layerstream/pinned_arena.h"
#include "layerstream/sim_backend.h"
#include "layerstream/transfer_engine.h"

namespace layerstream {
namespace {

enum class Protocol {
  kCorrect,
  kReleaseOnWrongStream,  // the released event does not cover the read: overwrite races with it
  kSkipWaitReady,         // the reader does not wait for the copy
};

struct Outcome {
  std::uint64_t races = 0;
  std::uint64_t corrupted_reads = 0;
  std::uint64_t reads = 0;
  std::uint64_t checked_accesses = 0;
  std::uint64_t copies = 0;
  std::uint64_t reuse_hits = 0;
  std::uint64_t prefetches = 0;
  std::uint64_t resident_hits = 0;
  std::string first_race;
};

std::vector<unsigned char> content(std::size_t bytes, std::uint64_t layer, std::uint64_t version) {
  std::vector<unsigned char> v(bytes);
  std::uint64_t x = layer * 0x9E3779B97F4A7C15ull + version * 0xBF58476D1CE4E5B9ull + 1;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  return v;
}

// A layer whose scratch a fill hook derives, prefetched (its derivation pending, no lease), then made
// resident, then its former ring room taken by another layer's copy: the resident copy re-records the
// layer's ready event on H2D, which must still cover the derivation (found in review: the next copy raced
// with the derive stream's read and write). Also a lease taken before the resident copy and waited on
// after it must see the scratch derived.
TEST(Schedules, AResidentCopyStillCoversAPendingDerivation) {
  for (bool lease_first : {false, true}) {
    SimOptions sim_options;
    sim_options.delay_probability = 0.5;
    sim_options.max_delay_us = 50;
    SimBackend sim(sim_options);
    {
      EngineOptions options;
      options.ring_bytes = 1 << 16;
      options.arena.chunk_bytes = 1 << 20;
      PinnedArena host(sim);
      TransferEngine engine(sim, options);
      auto hook = [&sim](void* region, void* scratch, StreamHandle stream) {
        sim.annotate_stream_access(stream, region, 4000, false);
        sim.annotate_stream_access(stream, scratch, 8000, true);
      };
      HostBlock a_block = host.allocate(4000);
      HostBlock c_block = host.allocate(60000);
      std::memset(a_block.data, 1, 4000);
      std::memset(c_block.data, 2, 60000);
      const LayerId a = engine.add_external_layer(a_block, 8000, hook);
      const LayerId c = engine.add_external_layer(c_block);
      Stream compute(sim);
      if (lease_first) {
        Lease l = engine.fetch(a);
        ASSERT_TRUE(engine.make_resident(a));
        engine.wait_ready(l, compute.get());
        sim.annotate_stream_access(compute.get(), l.extra, 8000, false);
        engine.release(l, compute.get());
      } else {
        ASSERT_TRUE(engine.prefetch(a));
        ASSERT_TRUE(engine.make_resident(a));
      }
      Lease l = engine.fetch(c);  // lands where a's region and scratch were
      engine.wait_ready(l, compute.get());
      sim.annotate_stream_access(compute.get(), l.data, 60000, false);
      engine.release(l, compute.get());
      sim.synchronize_all();
    }
    EXPECT_EQ(sim.violation_count(), 0u) << (lease_first ? "lease first: " : "prefetched: ")
                                         << (sim.violation_count() ? sim.violations().front() : "");
  }
}

Outcome run_schedule(std::uint64_t seed, Protocol protocol) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::uint64_t lo, std::uint64_t hi) { return lo + rng() % (hi - lo + 1); };

  SimOptions sim_options;
  sim_options.seed = seed;
  sim_options.delay_probability = 0.25;
  sim_options.max_delay_us = 20;
  sim_options.scramble_copies = true;
  const bool pageable = pick(0, 7) == 0;
  if (pageable) sim_options.pinned_capacity_bytes = 2 * 1024;  // bounce buffers only

  SimBackend sim(sim_options);
  std::vector<Stream> consumers;
  const std::size_t consumer_count = pick(1, 2);
  for (std::size_t i = 0; i < consumer_count; ++i) consumers.emplace_back(sim);
  Stream liar(sim);

  struct Layer {
    LayerId id;
    std::size_t bytes;
    std::uint64_t version;
    bool derived;  // registered with scratch of its own size and a fill hook that derives it
  };
  std::vector<Layer> layers;
  const std::size_t layer_count = pick(2, 10);
  std::vector<std::size_t> sizes;
  for (std::size_t i = 0; i < layer_count; ++i) {
    sizes.push_back(pick(0, 3) == 0 ? 256 * pick(1, 8) : pick(1, 2000));
  }
  const std::size_t largest = *std::max_element(sizes.begin(), sizes.end());
  std::size_t total = 0;
  for (std::size_t s : sizes) total += (s + 255) / 256 * 256;
  // A derived layer takes its bytes and as much scratch: its region up to twice the largest plain one.
  const bool with_derived = pick(0, 1) == 0;
  const std::size_t largest_region = (with_derived ? 2 : 1) * ((largest + 255) / 256 * 256);

  EngineOptions options;
  // Two layers are held at once at most; 3x the largest layer guarantees room for the second whatever
  // the offset of the first. Sometimes there is room for every layer.
  options.ring_bytes = 3 * largest_region + 256 * pick(0, total / 256);
  options.arena.chunk_bytes = 4096;
  options.bounce_bytes = 4096;
  options.bounce_buffers = static_cast<int>(pick(1, 3));
  options.ring_policy = pick(0, 1) == 0 ? RingPolicy::kFifo : RingPolicy::kLeastRecentlyUsed;
  Outcome outcome;
  std::deque<std::vector<unsigned char>> seen;      // read back by the consumers
  std::deque<std::vector<unsigned char>> expected;  // host bytes at fetch time
  {
    // Drains every stream before `seen` can go away, also when a check throws mid-schedule.
    struct DrainOnExit {
      SimBackend& sim;
      ~DrainOnExit() { sim.synchronize_all(); }
    } drain{sim};
    PinnedArena outside(sim);  // the derived layers' host blocks, which the engine does not own
    TransferEngine engine(sim, options);
    std::uint64_t next_layer_tag = 0;
    // The derivation: each scratch byte is its region byte XOR 0x5A, on the stream the engine gives.
    auto hook = [&sim](std::size_t bytes) {
      return [&sim, bytes](void* region, void* scratch, StreamHandle stream) {
        sim.annotate_stream_access(stream, region, bytes, false);
        sim.annotate_stream_access(stream, scratch, bytes, true);
        sim.launch_host_func(stream, [region, scratch, bytes] {
          for (std::size_t i = 0; i < bytes; ++i) {
            static_cast<unsigned char*>(scratch)[i] = static_cast<unsigned char>(
                static_cast<const unsigned char*>(region)[i] ^ 0x5A);
          }
        });
      };
    };
    auto add = [&](std::size_t bytes) {
      const bool derived = with_derived && pick(0, 1) == 0;
      const LayerId id = derived ? engine.add_external_layer(outside.allocate(bytes), bytes, hook(bytes))
                                 : engine.add_layer(bytes);
      Layer l{id, bytes, next_layer_tag++ * 1000, derived};
      auto data = content(bytes, l.id, l.version);
      std::memcpy(engine.host_block(l.id).data, data.data(), bytes);
      layers.push_back(l);
    };
    for (std::size_t s : sizes) add(s);


    auto read = [&](const Lease& lease, const Layer& layer, StreamHandle consumer) {
      if (protocol != Protocol::kSkipWaitReady) engine.wait_ready(lease, consumer);
      seen.emplace_back(lease.bytes);
      expected.push_back(content(layer.bytes, layer.id, layer.version));
      sim.memcpy_d2h_async(seen.back().data(), engine.device_data(lease), lease.bytes, consumer);
      if (layer.derived && lease.extra != nullptr) {  // a ring copy: its scratch is derived (resident: none)
        seen.emplace_back(layer.bytes);
        expected.push_back(content(layer.bytes, layer.id, layer.version));
        for (auto& b : expected.back()) b ^= 0x5A;
        sim.memcpy_d2h_async(seen.back().data(), lease.extra, layer.bytes, consumer);
      }
    };
    auto release = [&](const Lease& lease, StreamHandle consumer) {
      engine.release(lease, protocol == Protocol::kReleaseOnWrongStream ? liar.get() : consumer);
    };

    const int ops = static_cast<int>(pick(20, 50));
    for (int op = 0; op < ops; ++op) {
      const std::uint64_t what = pick(0, 99);
      StreamHandle consumer = consumers[pick(0, consumer_count - 1)].get();
      if (what < 65) {
        const Layer& layer = layers[pick(0, layers.size() - 1)];
        Lease lease = engine.fetch(layer.id);
        read(lease, layer, consumer);
        release(lease, consumer);
      } else if (what < 85 && layers.size() >= 2) {
        const std::size_t i = pick(0, layers.size() - 1);
        const std::size_t j = (i + pick(1, layers.size() - 1)) % layers.size();
        Lease a = engine.fetch(layers[i].id);
        Lease b = engine.fetch(layers[j].id);
        if (pick(0, 7) == 0) engine.yield_resident(pick(1, 2 * largest));  // pressure while two are held
        read(a, layers[i], consumer);
        read(b, layers[j], consumer);
        release(b, consumer);
        release(a, consumer);
      } else if (what < 88) {
        engine.prefetch(layers[pick(0, layers.size() - 1)].id);  // ahead of need; may be evicted unused
      } else if (what < 90) {
        const LayerId id = layers[pick(0, layers.size() - 1)].id;  // residency comes and goes
        if (pick(0, 2) == 0) {
          engine.yield_resident(pick(1, 2 * largest));  // memory pressure: idle resident copies go
        } else if (engine.resident(id)) {
          engine.evict_resident(id);
        } else {
          engine.make_resident(id);
        }
      } else if (what < 95) {
        Layer& layer = layers[pick(0, layers.size() - 1)];
        engine.begin_host_write(layer.id);
        ++layer.version;
        auto data = content(layer.bytes, layer.id, layer.version);
        std::memcpy(engine.host_block(layer.id).data, data.data(), layer.bytes);
      } else {
        const std::size_t i = pick(0, layers.size() - 1);
        void* outside_block = layers[i].derived ? engine.host_block(layers[i].id).data : nullptr;
        engine.remove_layer(layers[i].id);
        if (outside_block != nullptr) outside.free(outside_block);
        layers.erase(layers.begin() + static_cast<std::ptrdiff_t>(i));
        add(pick(1, largest));
      }
    }
    sim.synchronize_all();
    for (std::size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] != expected[i]) ++outcome.corrupted_reads;
    }
    outcome.reads = seen.size();
    const EngineStats stats = engine.stats();
    outcome.copies = stats.copies_h2d;
    outcome.reuse_hits = stats.reuse_hits;
    outcome.prefetches = stats.prefetches;
    outcome.resident_hits = stats.resident_hits;
  }
  outcome.races = sim.violation_count();
  outcome.checked_accesses = sim.checked_accesses();
  if (outcome.races) outcome.first_race = sim.violations().front();
  const SimMemoryStats leftover = sim.memory_stats();
  EXPECT_EQ(leftover.device_bytes, 0u) << "seed " << seed;
  EXPECT_EQ(leftover.pinned_bytes, 0u) << "seed " << seed;
  return outcome;
}

constexpr std::uint64_t kBlocks = 10;
constexpr std::uint64_t kSchedulesPerBlock = 1024;  // 10,240 schedules per run

class Schedules : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(Schedules, NoRaceAndNoCorruptionUnderFaultInjection) {
  Outcome total;
  std::uint64_t schedules = 0;
  for (std::uint64_t k = 0; k < kSchedulesPerBlock; ++k) {
    const std::uint64_t seed = GetParam() * kSchedulesPerBlock + k;
    const Outcome o = run_schedule(seed, Protocol::kCorrect);
    ASSERT_EQ(o.races, 0u) << "seed " << seed << ": " << o.first_race;
    ASSERT_EQ(o.corrupted_reads, 0u) << "seed " << seed;
    total.reads += o.reads;
    total.checked_accesses += o.checked_accesses;
    total.copies += o.copies;
    total.reuse_hits += o.reuse_hits;
    total.prefetches += o.prefetches;
    total.resident_hits += o.resident_hits;
    ++schedules;
  }
  // The schedules did real work: reads, copies, reuse, and the checker examined every access.
  EXPECT_EQ(schedules, kSchedulesPerBlock);
  EXPECT_GT(total.reads, 20 * kSchedulesPerBlock);
  EXPECT_GT(total.copies, 5 * kSchedulesPerBlock);
  EXPECT_GT(total.reuse_hits, kSchedulesPerBlock);
  EXPECT_GT(total.prefetches, kSchedulesPerBlock / 8);
  EXPECT_GT(total.resident_hits, kSchedulesPerBlock / 4);
  EXPECT_GT(total.checked_accesses, 2 * total.reads);
  std::printf("block %llu: %llu schedules, %llu reads, %llu copies, %llu reuse hits, %llu accesses "
              "checked, 0 races, 0 corrupted reads\n",
              static_cast<unsigned long long>(GetParam()), static_cast<unsigned long long>(schedules),
              static_cast<unsigned long long>(total.reads), static_cast<unsigned long long>(total.copies),
              static_cast<unsigned long long>(total.reuse_hits),
              static_cast<unsigned long long>(total.checked_accesses));
}

INSTANTIATE_TEST_SUITE_P(FaultInjected, Schedules, ::testing::Range<std::uint64_t>(0, kBlocks));

TEST(BrokenProtocol, ReleaseOnTheWrongStreamIsCaught) {
  std::uint64_t schedules_with_races = 0, corrupted = 0;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    const Outcome o = run_schedule(seed, Protocol::kReleaseOnWrongStream);
    schedules_with_races += o.races > 0;
    corrupted += o.corrupted_reads;
  }
  // Every schedule that overwrites a region after a read is flagged, whatever the timing; most do.
  EXPECT_GT(schedules_with_races, 50u);
  std::printf("broken release: %llu of 200 schedules flagged, %llu reads corrupted in fact\n",
              static_cast<unsigned long long>(schedules_with_races),
              static_cast<unsigned long long>(corrupted));
}

TEST(BrokenProtocol, ReaderThatSkipsTheReadyEventIsCaught) {
  std::uint64_t schedules_with_races = 0;
  for (std::uint64_t seed = 0; seed < 200; ++seed) {
    schedules_with_races += run_schedule(seed, Protocol::kSkipWaitReady).races > 0;
  }
  EXPECT_EQ(schedules_with_races, 200u);
}

}  // namespace
}  // namespace layerstream
