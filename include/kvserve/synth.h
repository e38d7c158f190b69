// Synthetic KV caches with the structure real LLM caches have (outlier channels and RoPE
// rotation in K, smooth V with outlier tokens), for shapes the shipped models do not have.
// The distribution is documented in docs/SYNTHETIC_KV.md.
#pragma once

#include <cstdint>

#include "kvserve/kv.h"
#include "kvserve/thread_pool.h"

namespace kvserve {

struct SynthOptions {
  uint64_t seed = 1;
  DType dtype = DType::kF16;
  ThreadPool* pool = nullptr;  // null: the calling thread; the result does not depend on it
};

Result<KvBlock> SynthesizeKv(const KvShape& shape, const SynthOptions& opts = {});

}  // namespace kvserve
