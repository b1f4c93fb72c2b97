// The persistent host worker pool (src/core/worker_pool.h): every job's work done, its threads reused from
// job to job, errors passed to the caller, and a working pool again in a forked child.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <set>
#include <stdexcept>
#include <vector>

#if !defined(_WIN32)
#include <sys/wait.h>
#include <unistd.h>
#endif

#include "layerstream/lossless.h"
#include "worker_pool.h"

namespace layerstream {
namespace {

// Runs `items` units of work on `workers` threads; returns how many were done (each exactly once or the
// count is off) and the worker indices that took part.
std::size_t run_items(WorkerPool& pool, std::size_t workers, std::size_t items, std::set<std::size_t>* who) {
  std::atomic<std::size_t> next{0}, done{0};
  std::mutex m;
  pool.run(workers, [&](std::size_t worker) {
    {
      std::lock_guard<std::mutex> lock(m);
      EXPECT_TRUE(who->insert(worker).second) << "worker " << worker << " twice in one job";
    }
    for (std::size_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) done.fetch_add(1);
  });
  return done.load();
}

TEST(WorkerPool, DoesEveryJobsWorkAndReusesItsThreads) {
  WorkerPool pool;
  for (int job = 0; job < 200; ++job) {
    std::set<std::size_t> who;
    EXPECT_EQ(run_items(pool, 4, 1000, &who), 1000u);
    EXPECT_EQ(who.count(0), 1u);  // the caller always takes part
    EXPECT_LT(*who.rbegin(), 4u);
  }
  EXPECT_EQ(pool.threads(), 3u);  // started once, not per job
  std::set<std::size_t> who;
  EXPECT_EQ(run_items(pool, 2, 10, &who), 10u);
  EXPECT_EQ(pool.threads(), 3u);  // a smaller job: no new threads, none lost
  who.clear();
  EXPECT_EQ(run_items(pool, 1, 10, &who), 10u);  // one worker: the caller alone
  EXPECT_EQ(who, std::set<std::size_t>{0});
}

TEST(WorkerPool, ManyMoreThreadsThanCores) {
  WorkerPool pool;
  for (std::size_t workers : {64u, 3u, 65u}) {
    std::set<std::size_t> who;
    EXPECT_EQ(run_items(pool, workers, 100000, &who), 100000u);
    EXPECT_LT(*who.rbegin(), workers);
  }
  EXPECT_EQ(pool.threads(), 64u);
}

TEST(WorkerPool, AWorkersErrorReachesTheCallerAndThePoolGoesOn) {
  WorkerPool pool;
  std::atomic<int> calls{0};
  EXPECT_THROW(pool.run(8,
                        [&](std::size_t) {
                          calls.fetch_add(1);
                          throw std::runtime_error("boom");
                        }),
               std::runtime_error);
  EXPECT_GE(calls.load(), 1);
  std::set<std::size_t> who;
  EXPECT_EQ(run_items(pool, 8, 500, &who), 500u);
}

TEST(WorkerPool, ShutdownJoinsAndLaterJobsRunOnTheCaller) {
  WorkerPool pool;
  std::set<std::size_t> who;
  EXPECT_EQ(run_items(pool, 4, 100, &who), 100u);
  pool.shutdown();
  EXPECT_EQ(pool.threads(), 0u);
  who.clear();
  EXPECT_EQ(run_items(pool, 4, 100, &who), 100u);
  EXPECT_EQ(who, std::set<std::size_t>{0});
}

#if !defined(_WIN32)
TEST(WorkerPool, TheSharedPoolWorksAgainInAForkedChild) {
  // The parent's pool has threads when it forks; the child has none of them and must not wait on them.
  std::set<std::size_t> who;
  ASSERT_EQ(run_items(WorkerPool::shared(), 4, 1000, &who), 1000u);
  ASSERT_GE(WorkerPool::shared().threads(), 3u);
  std::vector<std::uint16_t> v((std::size_t{4} << 16) + 3);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint16_t>(i * 2654435761u >> 7);
  lossless_set_threads(4);
  const LosslessSpec spec = lossless_plan(v.data(), v.size());
  std::vector<std::uint8_t> want(spec.bytes());
  lossless_encode(spec, v.data(), want.data());
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    alarm(30);  // a hang ends the child (the parent then sees a signal, not exit 0)
    int status = 0;
    WorkerPool& pool = WorkerPool::shared();
    std::atomic<std::size_t> done{0};
    pool.run(4, [&](std::size_t) { done.fetch_add(1); });
    if (done.load() < 1 || pool.threads() != 3) status = 2;
    const LosslessSpec again = lossless_plan(v.data(), v.size());
    std::vector<std::uint8_t> got(again.bytes());
    lossless_encode(again, v.data(), got.data());
    if (got != want) status = 3;
    _exit(status);
  }
  lossless_set_threads(0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << "): a hang on the parent's threads?";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}
#endif

}  // namespace
}  // namespace layerstream
