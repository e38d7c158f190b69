// Internal: run a loop body over threads in contiguous index ranges.
#pragma once

#include <cstdint>
#include <functional>

namespace kvserve {

// Runs fn(i) for i in [0, n) on up to `threads` threads (the caller's included); each thread
// takes one contiguous range. Results must not depend on the thread count.
void ParallelFor(int threads, uint64_t n, const std::function<void(uint64_t)>& fn);

}  // namespace kvserve
