// Synthetic KV generator. Every (layer, head) slab draws from its own stream seeded by
// (seed, layer, part, head), so the result is deterministic and independent of threading.
#include "kvserve/synth.h"

#include <cmath>
#include <vector>

#include "kv/parallel.h"
#include "kv/rng.h"

namespace kvserve {
namespace {

void SynthKeySlab(Rng& rng, uint32_t n_token, uint32_t D, const std::vector<float>& cos_t,
                  const std::vector<float>& sin_t, float* out) {
  const uint32_t n_pair = D / 2;
  // Per-head mean direction; a few persistent outlier pairs, placed among the low-frequency
  // (slowly rotating) pairs where real models' massive key values sit.
  std::vector<float> mean(D);
  for (auto& m : mean) m = 0.5f * rng.Normal();
  const uint32_t n_outlier = std::max<uint32_t>(1, D / 32);
  for (uint32_t o = 0; o < n_outlier; ++o) {
    const uint32_t lo_band = n_pair / 2;
    const uint32_t pair = lo_band + uint32_t(rng.Uniform() * (n_pair - lo_band));
    const float mag = 4.0f + 6.0f * float(rng.Uniform());
    mean[2 * pair] = mag * (rng.Uniform() < 0.5 ? -1.f : 1.f);
    mean[2 * pair + 1] = 0.5f * mag * rng.Normal();
  }
  for (uint32_t t = 0; t < n_token; ++t) {
    float* row = out + size_t{t} * D;
    for (uint32_t i = 0; i < n_pair; ++i) {
      const float a = mean[2 * i] + rng.Normal(), b = mean[2 * i + 1] + rng.Normal();
      const float c = cos_t[size_t{t} * n_pair + i], s = sin_t[size_t{t} * n_pair + i];
      row[2 * i] = a * c - b * s;  // RoPE: rotate pair i by t * theta_i
      row[2 * i + 1] = a * s + b * c;
    }
    if (D % 2) row[D - 1] = mean[D - 1] + rng.Normal();
  }
}

void SynthValueSlab(Rng& rng, uint32_t n_token, uint32_t D, float* out) {
  std::vector<float> mean(D), state(D);
  for (auto& m : mean) m = 0.3f * rng.Normal();
  for (auto& s : state) s = rng.Normal();
  const float rho = 0.9f, innov = std::sqrt(1 - rho * rho);
  for (uint32_t t = 0; t < n_token; ++t) {
    // Outlier tokens: the first (attention-sink) token and ~1% of the rest carry 4-8x magnitude.
    const bool outlier = t == 0 || rng.Uniform() < 0.01;
    const float scale = outlier ? 4.0f + 4.0f * float(rng.Uniform()) : 1.0f;
    float* row = out + size_t{t} * D;
    for (uint32_t d = 0; d < D; ++d) {
      state[d] = rho * state[d] + innov * rng.Normal();
      row[d] = scale * (mean[d] + state[d]);
    }
  }
}

}  // namespace

Result<KvBlock> SynthesizeKv(const KvShape& shape, const SynthOptions& opts) {
  if (opts.fp8_scale != Fp8Scales::Granularity::kNone) {
    if (!IsFp8(opts.dtype)) {
      return Status::InvalidArgument(std::string("FP8 scales per ") + Fp8GranularityName(opts.fp8_scale) + " need an FP8 dtype, not " +
                                     DTypeName(opts.dtype));
    }
    SynthOptions values = opts;
    values.dtype = DType::kF32;
    values.fp8_scale = Fp8Scales::Granularity::kNone;
    KV_ASSIGN_OR_RETURN(KvBlock v, SynthesizeKv(shape, values));
    return ToScaledFp8(v, opts.dtype, opts.fp8_scale);
  }
  KvBlock block;
  KV_RETURN_IF_ERROR(block.Reset(shape, opts.dtype));
  const uint32_t D = shape.head_dim, n_pair = D / 2;
  std::vector<float> cos_t(size_t{shape.n_token} * n_pair), sin_t(cos_t.size());
  for (uint32_t t = 0; t < shape.n_token; ++t) {
    for (uint32_t i = 0; i < n_pair; ++i) {
      const double theta = std::pow(10000.0, -2.0 * i / D);
      cos_t[size_t{t} * n_pair + i] = float(std::cos(t * theta));
      sin_t[size_t{t} * n_pair + i] = float(std::sin(t * theta));
    }
  }
  ParallelFor(opts.pool, shape.n_slab(), [&](uint64_t i) {
    uint64_t key = opts.seed ^ (0x9e3779b97f4a7c15ull * (i + 1));
    Rng rng(SplitMix(key));
    std::vector<float> buf(shape.slab_numel());
    const bool is_v = (i / shape.n_head_kv) % 2;
    if (is_v) SynthValueSlab(rng, shape.n_token, D, buf.data());
    else SynthKeySlab(rng, shape.n_token, D, cos_t, sin_t, buf.data());
    ConvertFromF32(opts.dtype, buf.data(), block.slab_at(i), buf.size());
  });
  return block;
}

}  // namespace kvserve
