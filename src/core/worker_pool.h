// A small persistent pool of host worker threads for data-parallel loops (the lossless encoder's), so that a
// model's hundreds of tensors do not each create and join their threads.
//
// Ownership: one process-wide pool (WorkerPool::shared), created on first use, grown on demand, never shrunk.
// Its threads are joined when the process exits (static destruction), after they finish the job in hand.
// After fork() the child has none of the parent's threads: the pool notices the pid change and starts a new
// set in the child (the parent's pool object is abandoned there, never touched: its mutexes may have been
// held at the fork).
//
// Jobs are run one at a time (a second caller waits for the first job to end); the caller's own thread
// takes part, so a job never waits on a worker that is not there. A job must not run another job on the
// same pool (it would wait for itself).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace layerstream {

class WorkerPool {
 public:
  WorkerPool() = default;
  ~WorkerPool();  // shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs fn(worker) on `workers` threads at once (the caller's is worker 0, the pool's are 1..workers-1)
  // and returns when every one has returned. fn shares out the work itself (e.g. an atomic counter); a
  // worker that starts late may find nothing left. The first exception thrown by any fn is rethrown here.
  void run(std::size_t workers, const std::function<void(std::size_t worker)>& fn);

  // Stops and joins the workers (each finishes the job in hand first); later jobs run on the caller alone.
  void shutdown();

  // Threads the pool has started so far (its workers, not the callers).
  std::size_t threads() const;

  // The process's pool (a new one after a fork in the child).
  static WorkerPool& shared();

 private:
  void work_loop(std::uint64_t seen);  // seen: the generation before the first job it may take

  std::mutex run_mutex_;  // one job at a time
  mutable std::mutex mutex_;  // everything below
  std::condition_variable wake_;  // workers: a new job or stop
  std::condition_variable done_;  // the caller: running_ fell to 0
  std::vector<std::thread> threads_;
  std::uint64_t generation_ = 0;  // bumped for each job
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t seats_ = 0;     // workers that may still join the current job
  std::size_t next_seat_ = 0; // the worker index the next one to join gets
  std::size_t running_ = 0;   // workers inside the job now
  std::exception_ptr error_;
  bool stop_ = false;
};

}  // namespace layerstream
