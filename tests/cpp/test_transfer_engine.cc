// TransferEngine: exact bytes, one copy per layer, reuse while in the ring, fresh bytes after a host
// write, exact accounting, error paths, and nothing left behind.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>

#include "backends.h"
#include "layerstream/check.h"
#include "layerstream/sim_backend.h"
#include "layerstream/transfer_engine.h"

namespace layerstream::testing {
namespace {

class TransferEngineTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    compute_ = Stream(backend());
  }

  // A block of `host`'s, filled with a pattern of `seed`, for add_external_layer.
  static HostBlock filled_block(PinnedArena& host, std::size_t bytes, unsigned seed) {
    HostBlock b = host.allocate(bytes);
    auto* p = static_cast<unsigned char*>(b.data);
    for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i * 7u + seed);
    return b;
  }
  static void fill(TransferEngine& engine, LayerId id, unsigned seed) {
    HostBlock b = engine.host_block(id);
    auto* p = static_cast<unsigned char*>(b.data);
    for (std::size_t i = 0; i < b.bytes; ++i) p[i] = static_cast<unsigned char>(i * 31u + seed);
  }
  static std::vector<unsigned char> host_bytes(TransferEngine& engine, LayerId id) {
    HostBlock b = engine.host_block(id);
    const auto* p = static_cast<const unsigned char*>(b.data);
    return std::vector<unsigned char>(p, p + b.bytes);
  }
  // The reader protocol: wait, read on the compute stream, release.
  std::vector<unsigned char> use(TransferEngine& engine, LayerId id, Lease* out = nullptr) {
    Lease l = engine.fetch(id);
    engine.wait_ready(l, compute_.get());
    auto bytes = read_back(engine.device_data(l), l.bytes, compute_.get());
    engine.release(l, compute_.get());
    if (out) *out = l;
    return bytes;
  }

  Stream compute_;
};

EngineOptions small_options(std::size_t ring_bytes) {
  EngineOptions o;
  o.ring_bytes = ring_bytes;
  o.arena.chunk_bytes = 1 << 20;
  return o;
}

TEST_P(TransferEngineTest, FetchDeliversTheExactBytesWithOneCopyPerLayer) {
  TransferEngine engine(backend(), small_options(1 << 20));
  const std::size_t sizes[] = {4096, 100001, 7, 65536};
  std::vector<LayerId> ids;
  for (std::size_t i = 0; i < 4; ++i) {
    ids.push_back(engine.add_layer(sizes[i]));
    fill(engine, ids.back(), static_cast<unsigned>(i));
  }
  for (LayerId id : ids) EXPECT_EQ(use(engine, id), host_bytes(engine, id));
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.copies_h2d, 4u);
  EXPECT_EQ(s.bytes_h2d, 4096u + 100001u + 7u + 65536u);
  EXPECT_EQ(s.arena.bytes_requested, 4096u + 100001u + 7u + 65536u);
  EXPECT_EQ(s.leases_outstanding, 0u);
}

TEST_P(TransferEngineTest, LayerStillInTheRingIsNotCopiedAgain) {
  TransferEngine engine(backend(), small_options(1 << 20));
  LayerId a = engine.add_layer(50000);
  fill(engine, a, 1);
  Lease first, second;
  use(engine, a, &first);
  auto again = use(engine, a, &second);
  EXPECT_TRUE(first.copied);
  EXPECT_FALSE(second.copied);
  EXPECT_EQ(again, host_bytes(engine, a));
  EXPECT_EQ(engine.stats().copies_h2d, 1u);
  EXPECT_EQ(engine.stats().reuse_hits, 1u);
  EXPECT_TRUE(engine.on_device(a));
}

TEST_P(TransferEngineTest, EvictedLayerIsCopiedAgainCorrectly) {
  TransferEngine engine(backend(), small_options(8192));
  LayerId a = engine.add_layer(4096), b = engine.add_layer(4096), c = engine.add_layer(4096);
  fill(engine, a, 1), fill(engine, b, 2), fill(engine, c, 3);
  use(engine, a), use(engine, b), use(engine, c);  // c evicts a
  EXPECT_FALSE(engine.on_device(a));
  EXPECT_EQ(use(engine, a), host_bytes(engine, a));
  EXPECT_EQ(engine.stats().copies_h2d, 4u);
  EXPECT_EQ(engine.stats().evictions, 2u);  // a by c, then b by a
}

TEST_P(TransferEngineTest, HostWriteIsNeverServedStale) {
  TransferEngine engine(backend(), small_options(1 << 20));
  LayerId a = engine.add_layer(10000);
  fill(engine, a, 1);
  use(engine, a);
  engine.begin_host_write(a);
  fill(engine, a, 99);
  EXPECT_FALSE(engine.on_device(a));
  Lease l;
  EXPECT_EQ(use(engine, a, &l), host_bytes(engine, a));
  EXPECT_TRUE(l.copied);
}

TEST_P(TransferEngineTest, MisuseIsReportedAndTheEngineKeepsWorking) {
  TransferEngine engine(backend(), small_options(8192));
  LayerId a = engine.add_layer(1000);
  fill(engine, a, 5);
  Lease l = engine.fetch(a);
  EXPECT_THROW(engine.remove_layer(a), InvalidArgument);      // lease outstanding
  EXPECT_THROW(engine.begin_host_write(a), InvalidArgument);  // device copy in use
  engine.release(l, compute_.get());
  try {
    engine.device_data(l);
    FAIL() << "use after release was not caught";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("use after release"), std::string::npos) << e.what();
  }
  EXPECT_THROW(engine.release(l, compute_.get()), InvalidArgument);  // double release
  EXPECT_THROW(engine.wait_ready(l, compute_.get()), InvalidArgument);
  EXPECT_THROW(engine.fetch(12345), InvalidArgument);                // unknown layer
  EXPECT_THROW(engine.add_layer(8193), InvalidArgument);             // larger than the ring
  EXPECT_THROW(engine.add_layer(0), InvalidArgument);
  EXPECT_THROW(engine.wait_download(777), InvalidArgument);
  EXPECT_EQ(use(engine, a), host_bytes(engine, a));  // still fine
  engine.remove_layer(a);
  EXPECT_THROW(engine.fetch(a), InvalidArgument);
}

TEST_P(TransferEngineTest, DownloadsLandAfterTheProducersWork) {
  TransferEngine engine(backend(), small_options(1 << 20));
  LayerId a = engine.add_layer(30000);
  fill(engine, a, 7);
  Lease l = engine.fetch(a);
  engine.wait_ready(l, compute_.get());
  PinnedBuffer out1(backend(), 30000, PinMethod::kHostAlloc);
  PinnedBuffer out2(backend(), 30000, PinMethod::kHostAlloc);
  const std::uint64_t t1 = engine.download(out1.data(), l.data, 30000, compute_.get());
  engine.download(out2.data(), l.data, 30000, compute_.get());
  EXPECT_EQ(engine.stats().downloads_pending, 2u);
  engine.wait_download(t1);
  EXPECT_EQ(std::memcmp(out1.data(), host_bytes(engine, a).data(), 30000), 0);
  engine.sync_downloads();
  EXPECT_EQ(std::memcmp(out2.data(), host_bytes(engine, a).data(), 30000), 0);
  engine.release(l, compute_.get());
  EXPECT_EQ(engine.stats().bytes_d2h, 60000u);
  EXPECT_EQ(engine.stats().downloads_pending, 0u);
}

TEST_P(TransferEngineTest, PrefetchedLayerIsFetchedWithoutASecondCopy) {
  TransferEngine engine(backend(), small_options(16384));
  LayerId a = engine.add_layer(4096), b = engine.add_layer(4096);
  fill(engine, a, 1), fill(engine, b, 2);
  EXPECT_TRUE(engine.prefetch(a));
  EXPECT_FALSE(engine.prefetch(a));  // already in the ring
  Lease l;
  EXPECT_EQ(use(engine, a, &l), host_bytes(engine, a));
  EXPECT_FALSE(l.copied);
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.prefetches, 1u);
  EXPECT_EQ(s.prefetch_hits, 1u);
  EXPECT_EQ(s.copies_h2d, 1u);
  EXPECT_EQ(s.bytes_h2d, 4096u);
}

TEST_P(TransferEngineTest, PrefetchNeverDisplacesHeldRegionsAndCountsWaste) {
  TransferEngine engine(backend(), small_options(8192));
  LayerId a = engine.add_layer(4096), b = engine.add_layer(4096), c = engine.add_layer(4096);
  fill(engine, a, 1), fill(engine, b, 2), fill(engine, c, 3);
  Lease la = engine.fetch(a);
  Lease lb = engine.fetch(b);
  EXPECT_FALSE(engine.prefetch(c));  // the ring is full of held regions: no copy, no error
  engine.release(lb, compute_.get());
  engine.release(la, compute_.get());
  EXPECT_TRUE(engine.prefetch(c));   // evicts a (released)
  EXPECT_TRUE(engine.prefetch(a));   // evicts b
  EXPECT_TRUE(engine.prefetch(b));   // evicts c, which was never used
  EXPECT_EQ(engine.stats().prefetch_wasted, 1u);
  EXPECT_EQ(use(engine, b), host_bytes(engine, b));
  EXPECT_EQ(use(engine, a), host_bytes(engine, a));
  EXPECT_EQ(engine.stats().prefetch_hits, 2u);
}

TEST_P(TransferEngineTest, ResidentLayerIsCopiedOnceAndStaysFresh) {
  TransferEngine engine(backend(), small_options(8192));
  LayerId a = engine.add_layer(6000), b = engine.add_layer(4096), c = engine.add_layer(4096);
  fill(engine, a, 1), fill(engine, b, 2), fill(engine, c, 3);
  ASSERT_TRUE(engine.make_resident(a));
  EXPECT_TRUE(engine.make_resident(a));  // already
  for (int round = 0; round < 3; ++round) {  // b and c take turns in the ring; a never moves
    EXPECT_EQ(use(engine, b), host_bytes(engine, b));
    EXPECT_EQ(use(engine, c), host_bytes(engine, c));
    Lease l;
    EXPECT_EQ(use(engine, a, &l), host_bytes(engine, a));
    EXPECT_FALSE(l.copied);
  }
  EXPECT_EQ(engine.stats().resident_hits, 3u);
  EXPECT_EQ(engine.stats().resident_bytes, 6000u);
  engine.begin_host_write(a);  // new host bytes: the next fetch copies again, into the same memory
  fill(engine, a, 77);
  Lease l;
  EXPECT_EQ(use(engine, a, &l), host_bytes(engine, a));
  EXPECT_TRUE(l.copied);
  EXPECT_TRUE(engine.on_device(a));
  engine.evict_resident(a);
  EXPECT_FALSE(engine.resident(a));
  EXPECT_EQ(engine.stats().resident_layers, 0u);
  EXPECT_EQ(use(engine, a), host_bytes(engine, a));  // streams again
  // Removing a layer says what resident memory went with it (its model freed: the budget plans again).
  ASSERT_TRUE(engine.make_resident(b));
  EXPECT_EQ(engine.remove_layer(b), 4096u);
  EXPECT_EQ(engine.remove_layer(a), 0u);
  EXPECT_EQ(engine.stats().resident_bytes, 0u);
}

// A layer's scratch (what a reader derives from its bytes, e.g. dequantized weights) sits after its bytes
// in the same region, is never overlapped by another layer's region, and keeps what the reader wrote
// while the region stays put; Lease::fill says when it does (same fill) and when it does not (a new copy).
TEST_P(TransferEngineTest, ScratchFollowsTheLayerAndFillNamesTheCopy) {
  TransferEngine engine(backend(), small_options(1 << 16));
  PinnedArena host(backend());
  auto external = [&](std::size_t bytes, unsigned seed) { return filled_block(host, bytes, seed); };
  const HostBlock block_a = external(1000, 1);
  const LayerId a = engine.add_external_layer(block_a, 3000);
  const LayerId b = engine.add_external_layer(external(31000, 2));
  const LayerId c = engine.add_external_layer(external(31000, 3));
  EXPECT_EQ(engine.device_bytes(a), 1024u + 3000u);  // the bytes at the ring's alignment, then the scratch
  EXPECT_EQ(engine.device_bytes(b), 31000u);

  const std::vector<unsigned char> derived(3000, 0x5A);
  Lease first = engine.fetch(a);
  engine.wait_ready(first, compute_.get());
  ASSERT_NE(first.extra, nullptr);
  EXPECT_EQ(static_cast<char*>(first.extra), static_cast<char*>(first.data) + 1024);
  EXPECT_EQ(first.extra_bytes, 3000u);
  EXPECT_NE(first.fill, 0u);
  backend().memcpy_h2d_async(first.extra, derived.data(), derived.size(), compute_.get());
  EXPECT_EQ(read_back(first.data, 1000, compute_.get()),
            std::vector<unsigned char>(static_cast<unsigned char*>(block_a.data),
                                       static_cast<unsigned char*>(block_a.data) + 1000));
  engine.release(first, compute_.get());

  Lease again = engine.fetch(a);  // still in the ring: same fill, the scratch as the reader left it
  engine.wait_ready(again, compute_.get());
  EXPECT_FALSE(again.copied);
  EXPECT_EQ(again.fill, first.fill);
  EXPECT_EQ(read_back(again.extra, 3000, compute_.get()), derived);
  engine.release(again, compute_.get());

  Lease lb;
  use(engine, b, &lb);  // placed after a's scratch, not over it
  EXPECT_GE(static_cast<char*>(lb.data), static_cast<char*>(first.extra) + 3000);
  EXPECT_EQ(lb.extra, nullptr);
  use(engine, c);  // the ring wraps: a's region (and its scratch) goes
  Lease later;
  EXPECT_EQ(use(engine, a, &later), std::vector<unsigned char>(static_cast<unsigned char*>(block_a.data),
                                                              static_cast<unsigned char*>(block_a.data) + 1000));
  EXPECT_TRUE(later.copied);
  EXPECT_NE(later.fill, first.fill);

  ASSERT_TRUE(engine.make_resident(a));  // resident copies hold the bytes only
  Lease resident;
  use(engine, a, &resident);
  EXPECT_EQ(resident.extra, nullptr);
  EXPECT_NE(resident.fill, later.fill);

  // Bytes and scratch must fit the ring together.
  try {
    engine.add_external_layer(external(1000, 4), 1 << 16);
    FAIL() << "a layer whose scratch does not fit the ring was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bytes of scratch"), std::string::npos) << e.what();
  }
  engine.remove_layer(a), engine.remove_layer(b), engine.remove_layer(c);
  backend().stream_synchronize(compute_.get());
  if (sim() != nullptr) EXPECT_EQ(sim()->violation_count(), 0u);
}

// A fill hook derives the scratch on the H2D stream after every copy into a ring region, before the copy's
// ready event: a consumer that waits for the lease sees it. A reuse of the region does not call it again;
// a new copy does, and so does a resident copy's first use (below).
TEST_P(TransferEngineTest, FillHookDerivesTheScratchBeforeTheLeaseIsReady) {
  TransferEngine engine(backend(), small_options(1 << 16));
  PinnedArena host(backend());
  auto external = [&](std::size_t bytes, unsigned seed) { return filled_block(host, bytes, seed); };
  PinnedBuffer derived(backend(), 3000, PinMethod::kHostAlloc);
  std::memset(derived.data(), 0x3C, 3000);
  int calls = 0;
  void* last_region = nullptr;
  void* last_scratch = nullptr;
  const LayerId a = engine.add_external_layer(external(1000, 1), 3000, [&](void* region, void* scratch, StreamHandle h2d) {
    ++calls;
    last_region = region;
    last_scratch = scratch;
    backend().memcpy_h2d_async(scratch, derived.data(), 3000, h2d);
  });
  const LayerId c = engine.add_external_layer(external(62000, 2));
  const std::vector<unsigned char> expected(3000, 0x3C);

  Lease first = engine.fetch(a);
  engine.wait_ready(first, compute_.get());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(last_region, first.data);
  EXPECT_EQ(last_scratch, first.extra);
  EXPECT_EQ(read_back(first.extra, 3000, compute_.get()), expected);
  engine.release(first, compute_.get());

  Lease again = engine.fetch(a);  // reused: nothing derived again
  engine.wait_ready(again, compute_.get());
  EXPECT_FALSE(again.copied);
  EXPECT_EQ(calls, 1);
  engine.release(again, compute_.get());

  use(engine, c);  // a's region goes
  Lease later;
  use(engine, a, &later);
  EXPECT_TRUE(later.copied);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(last_scratch, later.extra);

  ASSERT_TRUE(engine.make_resident(a));  // its scratch is derived from the resident copy, in a region of its own
  Lease resident;
  use(engine, a, &resident);
  ASSERT_NE(resident.extra, nullptr);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(last_region, resident.data);
  EXPECT_EQ(last_scratch, resident.extra);

  // A hook derives scratch: a layer with none cannot have one.
  EXPECT_THROW(engine.add_external_layer(external(100, 3), 0, [](void*, void*, StreamHandle) {}), InvalidArgument);
}

// A resident layer with a fill hook: the hook derives its scratch from the resident copy into a ring region
// of the scratch's size, ahead of use when the layer is prefetched (a packed weight decoded beside the
// compute), and the lease hands out the resident bytes with that scratch. The region is kept while current;
// after the ring takes it, a fetch derives again; after a host write, the recopy is derived again; where the
// ring has no room, the lease has no scratch (the reader derives on its own) and nothing fails; given back,
// the layer streams with the scratch after its bytes again. The race checker sees every order.
TEST_P(TransferEngineTest, AResidentLayersScratchIsDerivedFromItsResidentCopyAheadOfUse) {
  const std::size_t ring = 1 << 16;
  TransferEngine engine(backend(), small_options(ring));
  PinnedArena host(backend());
  PinnedBuffer derived(backend(), 3000, PinMethod::kHostAlloc);
  int calls = 0;
  void* last_region = nullptr;
  void* last_scratch = nullptr;
  const HostBlock block = filled_block(host, 1000, 1);
  auto bytes_of = [&] {
    return std::vector<unsigned char>(static_cast<unsigned char*>(block.data),
                                      static_cast<unsigned char*>(block.data) + 1000);
  };
  const LayerId a = engine.add_external_layer(block, 3000, [&](void* region, void* scratch, StreamHandle stream) {
    ++calls;
    last_region = region;
    last_scratch = scratch;
    backend().annotate_stream_access(stream, region, 1000, false);
    backend().memcpy_h2d_async(scratch, derived.data(), 3000, stream);
  });
  const LayerId whole = engine.add_external_layer(filled_block(host, ring, 2));  // takes the whole ring
  std::memset(derived.data(), 0x3C, 3000);
  const std::vector<unsigned char> first_derivation(3000, 0x3C);
  ASSERT_TRUE(engine.make_resident(a));
  EXPECT_EQ(engine.prefetch_bytes(a), 3000u);
  EXPECT_EQ(engine.prefetch_bytes(whole), ring);

  const std::uint64_t prefetches = engine.stats().prefetches;
  EXPECT_TRUE(engine.prefetch(a));  // derived ahead
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(engine.prefetch(a));  // still current
  EXPECT_EQ(engine.stats().prefetches, prefetches + 1);
  Lease l = engine.fetch(a);
  engine.wait_ready(l, compute_.get());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(last_region, l.data);
  ASSERT_NE(l.extra, nullptr);
  EXPECT_EQ(last_scratch, l.extra);
  EXPECT_EQ(l.extra_bytes, 3000u);
  EXPECT_EQ(engine.device_data(l), l.data);  // the resident copy, not the scratch region
  EXPECT_EQ(read_back(l.data, 1000, compute_.get()), bytes_of());
  EXPECT_EQ(read_back(l.extra, 3000, compute_.get()), first_derivation);
  engine.release(l, compute_.get());
  EXPECT_EQ(engine.stats().prefetch_hits, 1u);
  Lease again;
  use(engine, a, &again);  // the region is still there: nothing derived again
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(again.extra, l.extra);
  EXPECT_EQ(again.fill, l.fill);

  Lease held = engine.fetch(whole);  // the ring takes the scratch region and is then wholly held
  engine.wait_ready(held, compute_.get());
  Lease without;
  EXPECT_EQ(use(engine, a, &without), bytes_of());  // no room: the resident bytes without scratch
  EXPECT_EQ(without.extra, nullptr);
  EXPECT_EQ(calls, 1);
  engine.release(held, compute_.get());

  std::memset(derived.data(), 0x4B, 3000);
  Lease rederived;
  use(engine, a, &rederived);  // room again: derived at the fetch
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(read_back(rederived.extra, 3000, compute_.get()), std::vector<unsigned char>(3000, 0x4B));

  engine.begin_host_write(a);  // new host bytes: recopied into the resident memory and derived again
  std::memset(block.data, 0x21, 1000);
  std::memset(derived.data(), 0x5D, 3000);
  Lease fresh;
  EXPECT_EQ(use(engine, a, &fresh), bytes_of());
  EXPECT_TRUE(fresh.copied);
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(read_back(fresh.extra, 3000, compute_.get()), std::vector<unsigned char>(3000, 0x5D));

  engine.evict_resident(a);  // streams again: bytes and scratch in one region
  Lease streamed;
  EXPECT_EQ(use(engine, a, &streamed), bytes_of());
  EXPECT_TRUE(streamed.copied);
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(static_cast<char*>(streamed.extra), static_cast<char*>(streamed.data) + 1024);
  EXPECT_EQ(engine.prefetch_bytes(a), 1024u + 3000u);
  EXPECT_EQ(engine.stats().leases_outstanding, 0u);
  engine.remove_layer(a), engine.remove_layer(whole);
  if (auto* sim = dynamic_cast<SimBackend*>(&backend())) {
    sim->synchronize_all();
    EXPECT_EQ(sim->violation_count(), 0u);
    for (const std::string& v : sim->violations()) ADD_FAILURE() << v;
  }
}

// A fill hook that throws (the decode kernel failed to launch) after its region was placed and copied
// into: the fetch (or prefetch) fails with the hook's error, no region is left held or findable, and the
// next fetch copies and derives again. Before, the region stayed held by a lease nobody had (the ring
// shrank for good) and the next fetch reused it with its scratch never derived.
TEST_P(TransferEngineTest, AFillHookThatThrowsLeavesNoRegionBehindAndTheNextFetchCopiesAgain) {
  const std::size_t ring = 1 << 16;
  TransferEngine engine(backend(), small_options(ring));
  PinnedArena host(backend());
  PinnedBuffer derived(backend(), 3000, PinMethod::kHostAlloc);
  std::memset(derived.data(), 0x3C, 3000);
  int calls = 0;
  bool fail = true;
  const HostBlock block = filled_block(host, 1000, 1);
  const std::vector<unsigned char> bytes(static_cast<unsigned char*>(block.data),
                                         static_cast<unsigned char*>(block.data) + 1000);
  const LayerId a = engine.add_external_layer(block, 3000, [&](void*, void* scratch, StreamHandle stream) {
    ++calls;
    if (fail) throw Error("the decode kernel could not be launched");
    backend().memcpy_h2d_async(scratch, derived.data(), 3000, stream);
  });
  // As large as the ring: it fits only where no region is held.
  const LayerId whole = engine.add_external_layer(filled_block(host, ring, 2));
  const std::vector<unsigned char> expected(3000, 0x3C);

  for (bool prefetch : {false, true}) {
    try {
      if (prefetch) {
        engine.prefetch(a);
      } else {
        engine.fetch(a);
      }
      FAIL() << "the hook's error was not raised";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("could not be launched"), std::string::npos) << e.what();
    }
    EXPECT_EQ(engine.stats().leases_outstanding, 0u);
    EXPECT_FALSE(engine.on_device(a));
    use(engine, whole);  // the failed region is neither held nor in the way
    fail = false;
    const int before = calls;
    Lease again = engine.fetch(a);
    engine.wait_ready(again, compute_.get());
    EXPECT_TRUE(again.copied);
    EXPECT_EQ(calls, before + 1);
    EXPECT_EQ(read_back(again.data, 1000, compute_.get()), bytes);
    EXPECT_EQ(read_back(again.extra, 3000, compute_.get()), expected);
    engine.release(again, compute_.get());
    use(engine, whole);  // a's region goes
    fail = true;
  }
  EXPECT_EQ(engine.stats().leases_outstanding, 0u);
}

// A fill hook that enqueued part of its derivation on the derive stream and then threw: the region's next
// writer must wait for that part (the abandoned region's `copied` is recorded on the derive stream, not on
// H2D). The race checker sees the scratch written on the derive stream and then overwritten by the next
// copy into the same ring memory; recorded on H2D instead, it reports the race.
TEST_P(TransferEngineTest, AHookThatThrowsAfterEnqueuingWorkIsWaitedForBeforeTheMemoryIsReused) {
  auto* sim = dynamic_cast<SimBackend*>(&backend());
  if (sim == nullptr) GTEST_SKIP() << "the simulator's race checker sees the order";
  const std::size_t ring = 1 << 16;
  TransferEngine engine(backend(), small_options(ring));
  PinnedArena host(backend());
  PinnedBuffer derived(backend(), 3000, PinMethod::kHostAlloc);
  std::memset(derived.data(), 0x5A, 3000);
  const LayerId a = engine.add_external_layer(filled_block(host, 1000, 1), 3000,
                                              [&](void*, void* scratch, StreamHandle stream) {
                                                backend().memcpy_h2d_async(scratch, derived.data(), 3000, stream);
                                                throw Error("the second kernel could not be launched");
                                              });
  const LayerId whole = engine.add_external_layer(filled_block(host, ring, 2));
  EXPECT_THROW(engine.fetch(a), Error);
  EXPECT_FALSE(engine.on_device(a));
  use(engine, whole);  // over the memory the derivation wrote
  sim->synchronize_all();
  EXPECT_EQ(sim->violation_count(), 0u);
  for (const std::string& v : sim->violations()) ADD_FAILURE() << v;
}

// A copy that cannot be issued (the simulator fails the call, as a failed cudaMemcpyAsync would): the
// fetch, the prefetch and the resident copy each fail with its error and leave nothing that a later fetch
// would serve; the next ones copy and deliver the exact bytes.
TEST_P(TransferEngineTest, ACopyThatCannotBeIssuedLeavesNothingAFetchWouldServe) {
  auto* sim = dynamic_cast<SimBackend*>(&backend());
  if (sim == nullptr) GTEST_SKIP() << "the simulator injects the failure";
  const std::size_t ring = 1 << 16;
  TransferEngine engine(backend(), small_options(ring));
  const LayerId a = engine.add_layer(5000);
  const LayerId whole = engine.add_layer(ring);
  fill(engine, a, 3);
  fill(engine, whole, 4);
  sim->fail_next_h2d_copies(1);
  EXPECT_THROW(engine.fetch(a), Error);
  EXPECT_FALSE(engine.on_device(a));
  EXPECT_EQ(use(engine, whole), host_bytes(engine, whole));  // nothing held in the ring
  sim->fail_next_h2d_copies(1);
  EXPECT_THROW(engine.prefetch(a), Error);
  EXPECT_FALSE(engine.on_device(a));
  Lease l;
  EXPECT_EQ(use(engine, a, &l), host_bytes(engine, a));
  EXPECT_TRUE(l.copied);
  sim->fail_next_h2d_copies(1);
  EXPECT_THROW(engine.make_resident(a), Error);
  EXPECT_FALSE(engine.resident(a));
  EXPECT_EQ(engine.stats().resident_layers, 0u);
  EXPECT_EQ(use(engine, whole), host_bytes(engine, whole));
  ASSERT_TRUE(engine.make_resident(a));
  EXPECT_EQ(use(engine, a), host_bytes(engine, a));
  EXPECT_EQ(engine.stats().leases_outstanding, 0u);
  sim->synchronize_all();
  EXPECT_EQ(sim->violation_count(), 0u);
}

LS_INSTANTIATE_ON_BACKENDS(TransferEngineTest);

TEST(TransferEngineSim, ResidencyThatDoesNotFitIsRefusedAndNothingChanges) {
  SimOptions sim_options;
  sim_options.device_capacity_bytes = 16384 + 4096;  // the ring and one small layer
  SimBackend sim(sim_options);
  TransferEngine engine(sim, small_options(16384));
  LayerId small = engine.add_layer(4096), big = engine.add_layer(8192);
  EXPECT_TRUE(engine.make_resident(small));
  EXPECT_FALSE(engine.make_resident(big));
  EXPECT_FALSE(engine.resident(big));
  Stream compute(sim);
  Lease l = engine.fetch(big);
  engine.wait_ready(l, compute.get());
  engine.release(l, compute.get());
  EXPECT_TRUE(l.copied);
}

// Memory pressure: an allocation beside the engine that does not fit gets the memory of resident copies
// that no lease holds, largest first, after their last readers; a held one stays; the layers stream again
// with the exact bytes, and the race checker finds nothing unordered. Without the yield it would fail.
TEST(TransferEngineSim, ResidentCopiesAreGivenBackUnderMemoryPressure) {
  SimOptions sim_options;
  sim_options.device_capacity_bytes = 16384 + 4096 + 8192 + 6000;  // the ring, three resident layers
  sim_options.scramble_copies = true;
  SimBackend sim(sim_options);
  Stream compute(sim);
  TransferEngine engine(sim, small_options(16384));
  const LayerId small = engine.add_layer(4096), big = engine.add_layer(8192), mid = engine.add_layer(6000);
  for (LayerId id : {small, big, mid}) {
    HostBlock block = engine.host_block(id);
    std::memset(block.data, static_cast<int>(id * 17), block.bytes);
  }
  for (LayerId id : {small, big, mid}) ASSERT_TRUE(engine.make_resident(id));
  EXPECT_EQ(sim.device_alloc(4096), nullptr);  // full, and no hook yet

  std::size_t yielded = 0;
  sim.set_memory_pressure_hook([&](std::size_t bytes) {
    const std::size_t freed = engine.yield_resident(bytes);
    yielded += freed;
    return freed > 0;
  });
  // A reader still holds `small` (its kernels queued on compute): it must not be given back.
  Lease held = engine.fetch(small);
  engine.wait_ready(held, compute.get());
  std::vector<unsigned char> seen(4096);
  sim.memcpy_d2h_async(seen.data(), engine.device_data(held), seen.size(), compute.get());
  void* user = sim.device_alloc(5000);  // needs one layer's memory: the largest idle one goes
  ASSERT_NE(user, nullptr);
  EXPECT_EQ(yielded, 8192u);
  EXPECT_FALSE(engine.resident(big));
  EXPECT_TRUE(engine.resident(small));
  EXPECT_TRUE(engine.resident(mid));
  engine.release(held, compute.get());
  EXPECT_EQ(engine.stats().resident_bytes, 4096u + 6000u);
  // More than every idle copy frees: all of them go, and the allocation still fails (nothing else to give).
  EXPECT_EQ(sim.device_alloc(64 << 10), nullptr);
  EXPECT_EQ(engine.stats().resident_layers, 0u);
  for (LayerId id : {small, big, mid}) {
    Lease l = engine.fetch(id);
    engine.wait_ready(l, compute.get());
    std::vector<unsigned char> out(l.bytes);
    sim.memcpy_d2h_async(out.data(), engine.device_data(l), l.bytes, compute.get());
    engine.release(l, compute.get());
    sim.stream_synchronize(compute.get());
    EXPECT_EQ(out, std::vector<unsigned char>(l.bytes, static_cast<unsigned char>(id * 17)));
  }
  sim.set_memory_pressure_hook({});
  sim.device_free(user);
  sim.synchronize_all();
  EXPECT_EQ(sim.violation_count(), 0u) << (sim.violations().empty() ? "" : sim.violations().front());
}

// A yield that cannot take the engine's lock (the engine's own thread is the one allocating) gives nothing
// back instead of waiting for itself.
TEST(TransferEngineSim, AYieldFromInsideTheEnginesOwnAllocationGivesNothingAndDoesNotDeadlock) {
  SimOptions sim_options;
  sim_options.device_capacity_bytes = 16384 + 4096;
  SimBackend sim(sim_options);
  TransferEngine* self = nullptr;
  std::size_t yielded_inside = 1;
  EngineOptions options = small_options(16384);
  options.ring_allocator.allocate = [&](std::size_t bytes, StreamHandle) -> void* {
    if (self != nullptr) yielded_inside = self->yield_resident(bytes);  // under the engine's lock
    return sim.device_alloc(bytes);
  };
  options.ring_allocator.deallocate = [&](void* p) { sim.device_free(p); };
  TransferEngine engine(sim, options);
  self = &engine;
  const LayerId a = engine.add_layer(4096), b = engine.add_layer(4096);
  ASSERT_TRUE(engine.make_resident(a));
  EXPECT_FALSE(engine.make_resident(b));  // no room; the yield inside could not run
  EXPECT_EQ(yielded_inside, 0u);
  EXPECT_TRUE(engine.resident(a));
}

// A stream-ordered allocator (PyTorch's caching allocator) may give a stream memory that another stream
// freed with its last use still queued: it is free in the asking stream's order only. The engine must ask
// for its ring and its resident copies on the stream that writes them (H2D). This allocator plays the
// caching allocator: asked for the compute stream, it returns a block whose last write, queued on the
// compute stream, is still unordered with the other streams. The race checker sees whether a copy of the
// engine lands on such a block; the twin at the end shows that it would.
TEST(TransferEngineSim, RingAndResidentMemoryAreTakenInTheCopyStreamsOrder) {
  SimBackend sim;
  Stream compute(sim);
  std::vector<unsigned char> queued_use(1 << 16, 0xAB);
  auto freed_by_compute = [&](std::size_t bytes) {
    void* p = sim.device_alloc(bytes);
    sim.memcpy_h2d_async(p, queued_use.data(), std::min(bytes, queued_use.size()), compute.get());
    return p;
  };
  std::vector<StreamHandle> asked;
  EngineOptions options = small_options(16384);
  options.ring_allocator.allocate = [&](std::size_t bytes, StreamHandle stream) -> void* {
    asked.push_back(stream);
    return stream == compute.get() ? freed_by_compute(bytes) : sim.device_alloc(bytes);
  };
  options.ring_allocator.deallocate = [&](void* p) { sim.device_free(p); };
  {
    TransferEngine engine(sim, options);
    const LayerId a = engine.add_layer(4096), b = engine.add_layer(6000);
    for (LayerId id : {a, b}) {
      HostBlock block = engine.host_block(id);
      std::memset(block.data, static_cast<int>(id), block.bytes);
    }
    ASSERT_TRUE(engine.make_resident(b));
    for (LayerId id : {a, b}) {
      Lease l = engine.fetch(id);
      engine.wait_ready(l, compute.get());
      engine.release(l, compute.get());
    }
    ASSERT_EQ(asked.size(), 2u);  // the ring, then b's resident copy
    for (StreamHandle stream : asked) EXPECT_EQ(stream, engine.h2d_stream());
  }
  sim.synchronize_all();
  EXPECT_EQ(sim.violation_count(), 0u) << (sim.violations().empty() ? "" : sim.violations().front());

  // The twin: a copy on another stream into memory taken in the compute stream's order races.
  Stream copy(sim);
  void* p = freed_by_compute(4096);
  std::vector<unsigned char> bytes(4096, 1);
  sim.memcpy_h2d_async(p, bytes.data(), bytes.size(), copy.get());
  sim.synchronize_all();
  EXPECT_GT(sim.violation_count(), 0u);
  sim.device_free(p);
}

// ---- sim-only: fallback staging and teardown -----------------------------------------------------------

TEST(TransferEngineSim, PageableLayersAreStagedThroughBounceBuffers) {
  SimOptions sim_options;
  sim_options.pinned_capacity_bytes = 2 * 4096;  // only the bounce buffers can be pinned
  sim_options.scramble_copies = true;
  SimBackend sim(sim_options);
  Stream compute(sim);
  EngineOptions options = small_options(1 << 20);
  options.bounce_bytes = 4096;
  TransferEngine engine(sim, options);
  LayerId a = engine.add_layer(50000);
  ASSERT_FALSE(engine.host_block(a).pinned);
  auto* p = static_cast<unsigned char*>(engine.host_block(a).data);
  for (std::size_t i = 0; i < 50000; ++i) p[i] = static_cast<unsigned char>(i ^ (i >> 7));
  Lease l = engine.fetch(a);
  engine.wait_ready(l, compute.get());
  std::vector<unsigned char> out(50000);
  sim.memcpy_d2h_async(out.data(), engine.device_data(l), 50000, compute.get());
  engine.release(l, compute.get());
  sim.stream_synchronize(compute.get());
  EXPECT_EQ(std::memcmp(out.data(), p, 50000), 0);
  EXPECT_EQ(engine.stats().bounce_chunks, 13u);  // ceil(50000 / 4096)
  EXPECT_EQ(sim.violation_count(), 0u) << sim.violations().front();
}

TEST(EngineStatsTest, AddCountersSumsEveryCounterAndNoGauge) {
  EngineStats a, b;
  b.fetches = 1, b.copies_h2d = 2, b.bytes_h2d = 3, b.reuse_hits = 4, b.prefetches = 5;
  b.prefetch_hits = 6, b.prefetch_wasted = 7, b.resident_hits = 8, b.evictions = 9;
  b.bounce_chunks = 10, b.downloads = 11, b.bytes_d2h = 12, b.layers = 13, b.resident_bytes = 14;
  a.add_counters(b);
  a.add_counters(b);
  EXPECT_EQ(a.fetches + a.copies_h2d + a.bytes_h2d + a.reuse_hits + a.prefetches + a.prefetch_hits +
                a.prefetch_wasted + a.resident_hits + a.evictions + a.bounce_chunks + a.downloads +
                a.bytes_d2h,
            2u * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9 + 10 + 11 + 12));
  EXPECT_EQ(a.prefetch_wasted, 14u);
  EXPECT_EQ(a.resident_hits, 16u);
  EXPECT_EQ(a.layers, 0u);          // gauges describe one engine: not summed
  EXPECT_EQ(a.resident_bytes, 0u);
}

TEST(TransferEngineSim, TeardownReturnsEveryResource) {
  SimBackend sim;
  {
    Stream compute(sim);
    TransferEngine engine(sim, small_options(1 << 16));
    for (int i = 0; i < 10; ++i) {
      LayerId id = engine.add_layer(3000 + static_cast<std::size_t>(i));
      Lease l = engine.fetch(id);
      engine.wait_ready(l, compute.get());
      engine.release(l, compute.get());
      if (i % 2) engine.remove_layer(id);
    }
    EXPECT_GT(sim.memory_stats().device_bytes, 0u);
    EXPECT_GT(sim.memory_stats().pinned_bytes, 0u);
  }
  expect_all_returned(sim);
}

TEST(TransferEngineSim, RemovingEveryLayerReturnsTheHostMemory) {
  SimBackend sim;
  TransferEngine engine(sim, small_options(1 << 16));
  std::vector<LayerId> ids;
  for (int i = 0; i < 20; ++i) ids.push_back(engine.add_layer(5000));
  EXPECT_GT(engine.stats().arena.bytes_held, 0u);
  for (LayerId id : ids) engine.remove_layer(id);
  EXPECT_EQ(engine.stats().arena.bytes_held, 0u);
  EXPECT_EQ(engine.stats().layers, 0u);
}

TEST_P(TransferEngineTest, TimedWaitsMeasureHowLongTheConsumerWaitedForCopies) {
  EngineOptions options = small_options(1 << 20);
  options.time_waits = true;
  TransferEngine engine(backend(), options);
  const LayerId id = engine.add_layer(256 << 10);
  fill(engine, id, 3);
  // The first use copies (the consumer waits for the bus); the second is served from the ring.
  EXPECT_EQ(use(engine, id), host_bytes(engine, id));
  EXPECT_EQ(use(engine, id), host_bytes(engine, id));
  backend().stream_synchronize(compute_.get());
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.copy_waits_timed, 2u);
  EXPECT_LT(s.copy_wait_us, 10u * 1000 * 1000);  // a sane figure, not garbage
  // Off (the default): nothing measured.
  TransferEngine plain(backend(), small_options(1 << 20));
  const LayerId other = plain.add_layer(4096);
  fill(plain, other, 4);
  EXPECT_EQ(use(plain, other), host_bytes(plain, other));
  EXPECT_EQ(plain.stats().copy_waits_timed, 0u);
}

}  // namespace
}  // namespace layerstream::testing
