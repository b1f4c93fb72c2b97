// The process's persistent host worker pool (see worker_pool.h).
#include "worker_pool.h"

#include <algorithm>
#include <system_error>

#if defined(_WIN32)
#include <process.h>
#else
#include <unistd.h>
#endif

namespace layerstream {

namespace {

long current_pid() {
#if defined(_WIN32)
  return static_cast<long>(_getpid());
#else
  return static_cast<long>(getpid());
#endif
}

// Owns the shared pool of this process. At exit it stops and joins the workers (they finish the job in hand
// first) but leaves the object: a job still running on another thread at exit can then end without touching
// freed memory. A pool inherited through fork() is never touched in the child.
struct SharedPool {
  std::mutex mutex;  // held only to look up or replace `pool`
  WorkerPool* pool = nullptr;
  long pid = 0;

  ~SharedPool() {
#if !defined(_WIN32)  // Windows: joining under the loader lock at DLL unload deadlocks; ExitProcess ends them
    if (pool != nullptr && pid == current_pid()) pool->shutdown();
#endif
  }
};

SharedPool& shared_pool() {
  static SharedPool holder;
  return holder;
}

}  // namespace

WorkerPool::~WorkerPool() { shutdown(); }

void WorkerPool::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return;  // stopped already
    stop_ = true;
    threads.swap(threads_);
  }
  wake_.notify_all();
  for (auto& t : threads) t.join();
}

std::size_t WorkerPool::threads() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return threads_.size();
}

void WorkerPool::run(std::size_t workers, const std::function<void(std::size_t)>& fn) {
  if (workers <= 1) {
    fn(0);
    return;
  }
  std::lock_guard<std::mutex> one_job(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) {
      workers = 1;  // at exit: the caller alone
    } else {
      try {
        // A new worker starts from the generation before this job's, so it takes part in it.
        while (threads_.size() + 1 < workers) threads_.emplace_back([this, g = generation_] { work_loop(g); });
      } catch (const std::system_error&) {
        // No more threads to be had: the job runs on those there are.
      }
      workers = std::min(workers, threads_.size() + 1);
      job_ = &fn;
      seats_ = workers - 1;
      next_seat_ = 1;
      error_ = nullptr;
      ++generation_;
    }
  }
  if (workers > 1) wake_.notify_all();
  std::exception_ptr error;
  try {
    fn(0);
  } catch (...) {
    error = std::current_exception();
  }
  if (workers <= 1) {
    if (error) std::rethrow_exception(error);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  seats_ = 0;  // a worker that has not woken yet stays out: `fn` is the caller's and is about to go
  done_.wait(lock, [this] { return running_ == 0; });
  job_ = nullptr;
  if (!error) error = error_;
  error_ = nullptr;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

void WorkerPool::work_loop(std::uint64_t seen) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (seats_ == 0) continue;  // this job has all the workers it asked for
    --seats_;
    const std::size_t me = next_seat_++;
    ++running_;
    const auto* job = job_;
    lock.unlock();
    try {
      (*job)(me);
    } catch (...) {
      lock.lock();
      if (!error_) error_ = std::current_exception();
      lock.unlock();
    }
    lock.lock();
    if (--running_ == 0) done_.notify_all();
  }
}

WorkerPool& WorkerPool::shared() {
  SharedPool& holder = shared_pool();
  std::lock_guard<std::mutex> lock(holder.mutex);
  const long pid = current_pid();
  if (holder.pool == nullptr || holder.pid != pid) {
    // First use, or the first in a forked child: the parent's pool has no threads here and its mutexes may
    // have been held at the fork, so it is left as it is (a leak of one small object per fork).
    holder.pool = new WorkerPool();
    holder.pid = pid;
  }
  return *holder.pool;
}

}  // namespace layerstream
