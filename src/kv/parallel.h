// Internal: the loop helper codec stages and the synthesizer use over a caller's ThreadPool.
#pragma once

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

}  // namespace kvserve
