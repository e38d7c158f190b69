// ParallelFor: the one place kvserve splits work over threads (slabs of a KV block).
#include "kv/parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace kvserve {

void ParallelFor(int threads, uint64_t n, const std::function<void(uint64_t)>& fn) {
  if (threads <= 1 || n <= 1) {
    for (uint64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  const uint64_t workers = std::min<uint64_t>(threads, n);
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  auto run = [&](uint64_t w) {
    // Contiguous ranges keep each thread's writes in one region of the output.
    const uint64_t begin = n * w / workers, end = n * (w + 1) / workers;
    for (uint64_t i = begin; i < end; ++i) fn(i);
  };
  for (uint64_t w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& t : pool) t.join();
}

}  // namespace kvserve
