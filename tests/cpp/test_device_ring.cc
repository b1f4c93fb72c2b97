// DeviceRing: in-order placement, eviction hands back the released events, held regions are never
// overwritten, and misuse is reported.
#include "backends.h"
#include "layerstream/check.h"
#include "layerstream/device_ring.h"

namespace layerstream::testing {
namespace {

class DeviceRingTest : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    consumer_ = Stream(backend());
  }
  Stream consumer_;
};

TEST_P(DeviceRingTest, RegionsAreHandedOutInOrderAndWrap) {
  DeviceRing ring(backend(), 4096, 256);
  Eviction ev;
  std::vector<std::size_t> offsets;
  for (int i = 0; i < 6; ++i) {
    RegionId r = ring.place(1000, static_cast<std::uint64_t>(i), ev);
    offsets.push_back(ring.info(r).offset);
    ring.release(r, consumer_.get());
  }
  // 1000 bytes round to 1024: four fit, the fifth wraps to 0 and evicts owner 0.
  EXPECT_EQ(offsets, (std::vector<std::size_t>{0, 1024, 2048, 3072, 0, 1024}));
  EXPECT_EQ(ev.owners, (std::vector<std::uint64_t>{0, 1}));
  EXPECT_EQ(ev.wait_events.size(), 2u);  // one released event per evicted region
}

TEST_P(DeviceRingTest, HeldRegionsAreSkippedNeverOverwritten) {
  DeviceRing ring(backend(), 4096, 256);
  Eviction ev;
  RegionId a = ring.place(1024, 1, ev);  // held
  RegionId b = ring.place(1024, 2, ev);
  ring.release(b, consumer_.get());
  RegionId c = ring.place(2048, 3, ev);  // fills the rest
  ring.release(c, consumer_.get());
  RegionId d = ring.place(1024, 4, ev);  // wraps, must skip `a` at 0 and take b's place
  EXPECT_EQ(ring.info(d).offset, 1024u);
  EXPECT_TRUE(ring.live(a));
  EXPECT_FALSE(ring.live(b));
  EXPECT_EQ(ev.owners, (std::vector<std::uint64_t>{2}));
  ring.release(a, consumer_.get());
  ring.release(d, consumer_.get());
}

// Where the order of use turns round (a forward's last layer is the backward's first), the
// least-recently-used policy places the next region where the region released first was; first-in,
// first-out takes the oldest placed, whose reader comes last. Held regions are skipped by both.
TEST_P(DeviceRingTest, LeastRecentlyUsedTakesTheRegionReleasedFirst) {
  for (RingPolicy policy : {RingPolicy::kFifo, RingPolicy::kLeastRecentlyUsed}) {
    DeviceRing ring(backend(), 4096, 256, {}, {}, policy);
    Eviction ev;
    std::vector<RegionId> r;
    for (std::uint64_t owner = 1; owner <= 4; ++owner) r.push_back(ring.place(1024, owner, ev));
    for (int i = 3; i >= 0; --i) ring.release(r[static_cast<std::size_t>(i)], consumer_.get());  // 4, 3, 2, 1
    const RegionId e = ring.place(1024, 5, ev);
    const bool lru = policy == RingPolicy::kLeastRecentlyUsed;
    EXPECT_EQ(ring.info(e).offset, lru ? 3072u : 0u);
    EXPECT_EQ(ev.owners, (std::vector<std::uint64_t>{lru ? 4u : 1u}));
    // Owner 3 (released second) is next for LRU; hold it and the span after it is taken instead.
    ring.hold(r[2]);
    ring.release(e, consumer_.get());
    const RegionId f = ring.place(2048, 6, ev);
    EXPECT_TRUE(ring.live(r[2]));
    if (lru) {  // 0-2047 holds owners 1 and 2 (released last and third); 2048 is held: only 0 fits
      EXPECT_EQ(ring.info(f).offset, 0u);
      EXPECT_EQ(ev.owners, (std::vector<std::uint64_t>{4, 1, 2}));
    }
    ring.release(r[2], consumer_.get());
    ring.release(f, consumer_.get());
  }
}

// A region placed ahead of need (unheld) is not the least recently used before anyone has read it.
TEST_P(DeviceRingTest, LeastRecentlyUsedKeepsAPrefetchedRegionUntilItIsRead) {
  DeviceRing ring(backend(), 3072, 256, {}, {}, RingPolicy::kLeastRecentlyUsed);
  Eviction ev;
  const RegionId a = ring.place(1024, 1, ev);
  const RegionId ahead = ring.try_place_unheld(1024, 2, ev);  // placed before a is released
  ring.release(a, consumer_.get());
  const RegionId c = ring.place(1024, 3, ev);  // the free third
  ring.release(c, consumer_.get());
  const RegionId d = ring.place(1024, 4, ev);  // a (released first), not the unread prefetch
  EXPECT_TRUE(ring.live(ahead));
  EXPECT_FALSE(ring.live(a));
  EXPECT_EQ(ring.info(d).offset, 0u);
  ring.hold(ahead);  // read now: from here on it ages like any region
  ring.release(ahead, consumer_.get());
  ring.release(d, consumer_.get());
  const RegionId e = ring.place(1024, 5, ev);  // c was released before ahead and d
  EXPECT_EQ(ring.info(e).offset, 2048u);
  EXPECT_EQ(ev.owners, (std::vector<std::uint64_t>{1, 3}));
  ring.release(e, consumer_.get());
}

TEST_P(DeviceRingTest, FullOfHeldRegionsIsAnErrorNotAHang) {
  DeviceRing ring(backend(), 4096, 256);
  Eviction ev;
  RegionId a = ring.place(2048, 1, ev);
  RegionId b = ring.place(2048, 2, ev);
  try {
    ring.place(1024, 3, ev);
    FAIL() << "placed a region over held ones";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("still held"), std::string::npos) << e.what();
  }
  ring.release(a, consumer_.get());
  RegionId c = ring.place(1024, 3, ev);  // works again once something is released
  EXPECT_EQ(ring.info(c).offset, 0u);
  ring.release(b, consumer_.get());
  ring.release(c, consumer_.get());
}

TEST_P(DeviceRingTest, OversizedRegionIsAnInvalidArgument) {
  DeviceRing ring(backend(), 4096, 256);
  Eviction ev;
  EXPECT_THROW(ring.place(4097, 1, ev), InvalidArgument);
  EXPECT_THROW(ring.place(0, 1, ev), InvalidArgument);
  EXPECT_THROW(DeviceRing(backend(), 100, 256), InvalidArgument);
}

TEST_P(DeviceRingTest, ReleaseMisuseIsReported) {
  DeviceRing ring(backend(), 4096, 256);
  Eviction ev;
  RegionId a = ring.place(1024, 1, ev);
  ring.release(a, consumer_.get());
  EXPECT_THROW(ring.release(a, consumer_.get()), InvalidArgument);  // more releases than holds
  EXPECT_THROW(ring.release(9999, consumer_.get()), InvalidArgument);
  EXPECT_THROW(ring.hold(9999), InvalidArgument);
  ring.hold(a);
  EXPECT_THROW(ring.discard(a, ev), InvalidArgument);  // held
  ring.release(a, consumer_.get());
  ring.discard(a, ev);
  EXPECT_FALSE(ring.live(a));
}

TEST_P(DeviceRingTest, EventsArePooledAndBounded) {
  DeviceRing ring(backend(), 8192, 256);
  Stream second(backend());
  for (int i = 0; i < 2000; ++i) {
    Eviction ev;
    RegionId r = ring.place(1024 + static_cast<std::size_t>(i % 5) * 256, i, ev);
    ring.release(r, consumer_.get());
    ring.hold(r);
    ring.release(r, second.get());  // two consumer streams: two events per region at most
    ring.recycle(ev.wait_events);
  }
  EXPECT_LT(ring.events_created(), 40u);
}

LS_INSTANTIATE_ON_BACKENDS(DeviceRingTest);

}  // namespace
}  // namespace layerstream::testing
