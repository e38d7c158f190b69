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
  // With an FP8 dtype: scale per (layer, K/V) or per head as an engine would (ToScaledFp8);
  // kNone stores the values unscaled.
  Fp8Scales::Granularity fp8_scale = Fp8Scales::Granularity::kNone;
  ThreadPool* pool = nullptr;  // null: the calling thread; the result does not depend on it
};

Result<KvBlock> SynthesizeKv(const KvShape& shape, const SynthOptions& opts = {});

}  // namespace kvserve
