// ThreadPool: fixed workers over one queue; a loop's caller helps drain the queue while it waits.
#include "kvserve/thread_pool.h"

#include <algorithm>

namespace kvserve {

ThreadPool::ThreadPool(int n_threads) {
  for (int i = 1; i < n_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

bool ThreadPool::RunOne(std::unique_lock<std::mutex>& lock) {
  if (queue_.empty()) return false;
  std::function<void()> job = std::move(queue_.front());
  queue_.pop_front();
  lock.unlock();
  job();
  lock.lock();
  return true;
}

void ThreadPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    RunOne(lock);
  }
}

void ThreadPool::ParallelFor(uint64_t n, const std::function<void(uint64_t)>& fn, int max_parts) {
  const int limit = max_parts <= 0 ? size() : std::min(max_parts, size());
  const uint64_t parts = std::min<uint64_t>(std::max(1, limit), n);
  if (parts <= 1) {
    for (uint64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Contiguous ranges keep each thread's writes in one region of the output.
  auto range = [&fn, n, parts](uint64_t w) {
    const uint64_t begin = n * w / parts, end = n * (w + 1) / parts;
    for (uint64_t i = begin; i < end; ++i) fn(i);
  };
  uint64_t pending = parts - 1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (uint64_t w = 1; w < parts; ++w) {
      queue_.emplace_back([this, &range, &pending, w] {
        range(w);
        std::lock_guard<std::mutex> l(mu_);
        if (--pending == 0) done_cv_.notify_all();
      });
    }
  }
  work_cv_.notify_all();
  range(0);
  std::unique_lock<std::mutex> lock(mu_);
  while (pending > 0) {
    if (!RunOne(lock)) done_cv_.wait(lock, [&] { return pending == 0 || !queue_.empty(); });
  }
}

}  // namespace kvserve
