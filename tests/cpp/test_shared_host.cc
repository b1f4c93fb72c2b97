// SharedHostSegment: one host copy shared by the processes of a host (two mappings in one process stand
// for two processes here; tests/python/test_shared_host.py runs real separate processes).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "layerstream/check.h"
#include "layerstream/shared_host.h"
#include "layerstream/sim_backend.h"

namespace layerstream {
namespace {

std::string unique_name(const char* what) {
  static int counter = 0;
  return "/ls-gtest-" + std::to_string(::getpid()) + "-" + what + "-" + std::to_string(++counter);
}

bool name_exists(const std::string& name) { return ::access(("/dev/shm" + name).c_str(), F_OK) == 0; }

std::vector<unsigned char> pattern(std::size_t n) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 7 + 3);
  return v;
}

TEST(SharedHost, FollowersMapTheLeadersBytesAndTheLastOneRemovesTheName) {
  auto backend = std::make_unique<SimBackend>();
  const std::string name = unique_name("basic");
  const std::size_t bytes = 100000;
  const auto data = pattern(bytes);
  auto leader = SharedHostSegment::create(*backend, name, bytes, /*followers=*/2);
  ASSERT_NE(leader->data(), nullptr);
  std::memcpy(leader->data(), data.data(), bytes);
  leader->mark_ready();
  EXPECT_TRUE(leader->pinned());
  auto first = SharedHostSegment::open(*backend, name, bytes, 5.0);
  EXPECT_TRUE(name_exists(name));  // one follower still to come
  auto second = SharedHostSegment::open(*backend, name, bytes, 5.0);
  EXPECT_FALSE(name_exists(name));  // everyone has it mapped: nothing left in /dev/shm
  for (const auto* seg : {first.get(), second.get()}) {
    ASSERT_NE(seg->data(), nullptr);
    EXPECT_NE(seg->data(), leader->data());  // a mapping of its own, the same memory
    EXPECT_EQ(std::memcmp(seg->data(), data.data(), bytes), 0);
    EXPECT_TRUE(seg->pinned());
    EXPECT_FALSE(seg->leader());
  }
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first->data()) % 4096, 0u);
  leader.reset();
  first.reset();
  EXPECT_EQ(std::memcmp(second->data(), data.data(), bytes), 0);  // the memory lives while mapped
  second.reset();
  EXPECT_EQ(backend->memory_stats().pinned_bytes, 0u);  // every registration undone
}

TEST(SharedHost, AFollowerWaitsForALeaderThatComesLater) {
  auto backend = std::make_unique<SimBackend>();
  const std::string name = unique_name("late");
  const auto data = pattern(5000);
  std::unique_ptr<SharedHostSegment> follower;
  std::thread waiter([&] { follower = SharedHostSegment::open(*backend, name, data.size(), 10.0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto leader = SharedHostSegment::create(*backend, name, data.size(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // created, not yet filled: still waiting
  std::memcpy(leader->data(), data.data(), data.size());
  leader->mark_ready();
  waiter.join();
  ASSERT_NE(follower, nullptr);
  EXPECT_EQ(std::memcmp(follower->data(), data.data(), data.size()), 0);
  EXPECT_FALSE(name_exists(name));
}

TEST(SharedHost, NoLeaderIsATimeoutThatSaysWhatToDo) {
  auto backend = std::make_unique<SimBackend>();
  try {
    SharedHostSegment::open(*backend, unique_name("missing"), 4096, 0.05);
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("waited 0.05 s"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("LAYERSTREAM_SHARE_HOST=0"), std::string::npos) << e.what();
  }
}

TEST(SharedHost, ADifferentSizeMeansADifferentModelAndIsRefused) {
  auto backend = std::make_unique<SimBackend>();
  const std::string name = unique_name("size");
  auto leader = SharedHostSegment::create(*backend, name, 4096, 1);
  leader->mark_ready();
  EXPECT_THROW(SharedHostSegment::open(*backend, name, 8192, 1.0), Error);
}

TEST(SharedHost, AnExistingNameIsRefusedAndLeftAlone) {
  auto backend = std::make_unique<SimBackend>();
  const std::string name = unique_name("twice");
  auto leader = SharedHostSegment::create(*backend, name, 4096, 1);
  EXPECT_THROW(SharedHostSegment::create(*backend, name, 4096, 1), Error);
  EXPECT_TRUE(name_exists(name));
  leader.reset();  // the leader removes its name when no follower came
  EXPECT_FALSE(name_exists(name));
}

TEST(SharedHost, MemoryTheHostRefusesIsSaidToTheFollowersWhoThenKeepTheirOwn) {
  // A petabyte: /dev/shm refuses to reserve it. The leader gets no data, and so do the followers (they
  // fall back to a copy of their own instead of waiting or crashing on first touch).
  auto backend = std::make_unique<SimBackend>();
  const std::string name = unique_name("refused");
  const std::size_t bytes = std::size_t{1} << 50;
  auto leader = SharedHostSegment::create(*backend, name, bytes, 1);
  EXPECT_EQ(leader->data(), nullptr);
  auto follower = SharedHostSegment::open(*backend, name, bytes, 1.0);
  EXPECT_EQ(follower->data(), nullptr);
  EXPECT_FALSE(name_exists(name));
}

}  // namespace
}  // namespace layerstream
