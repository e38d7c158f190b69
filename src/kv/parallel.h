// Internal: the loop helper codec stages and the synthesizer use over a caller's ThreadPool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "kvserve/thread_pool.h"

namespace kvserve {

// Runs fn(i) for i in [0, n) on `pool` (null: on the calling thread alone), in contiguous
// ranges. Results must not depend on how many threads ran them.
inline void ParallelFor(ThreadPool* pool, uint64_t n, const std::function<void(uint64_t)>& fn) {
  if (pool == nullptr) {
    for (uint64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  pool->ParallelFor(n, fn);
}

// The pool for a loop over `bytes` of memory-bound work (hashing, copying): none below 1 MiB,
// where waking a worker costs more than the work it takes over.
inline ThreadPool* PoolForBytes(ThreadPool* pool, uint64_t bytes) { return bytes < (uint64_t{1} << 20) ? nullptr : pool; }

}  // namespace kvserve
