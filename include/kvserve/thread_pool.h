// ThreadPool: the reusable workers kvserve's parallel loops run on. The caller owns it (one per
// process or per server) and passes it in through options; no library code starts threads of
// its own per call.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve {

// Thread-safe: any number of threads may call ParallelFor on one pool at once; their ranges
// queue and a waiting caller runs queued work itself, so nested or concurrent loops never
// deadlock.
class ThreadPool {
 public:
  // n_threads counts the calling thread: ThreadPool(1) starts no worker; values < 1 mean 1.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Threads that run a loop's ranges, the caller's included.
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) and returns when all have run. The range is cut into at
  // most min(size(), max_parts) contiguous parts (max_parts <= 0: size()); the caller runs one.
  void ParallelFor(uint64_t n, const std::function<void(uint64_t)>& fn, int max_parts = 0);

 private:
  void WorkerLoop();
  bool RunOne(std::unique_lock<std::mutex>& lock);

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvserve
