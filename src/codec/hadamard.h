// Internal: the randomised Walsh–Hadamard rotation shared by `rotate` and `mixhq`.
#pragma once

#include <cmath>
#include <cstdint>

#include "kv/rng.h"

namespace kvserve {

// In-place fast Walsh–Hadamard transform of n = 2^k values, scaled by 1/sqrt(n): orthonormal and
// its own inverse. The loops are plain; with n known at compile time (N > 0, the usual head
// sizes) the compiler unrolls the short butterfly stages and vectorises the long ones, which
// made mixhq decode 2.8x faster. N = 0 is the runtime-size reference (same operations, same
// order, so bit-identical results).
template <uint32_t N>
inline void HadamardN(float* x, uint32_t n_runtime) {
  const uint32_t n = N ? N : n_runtime;
  for (uint32_t len = 1; len < n; len <<= 1) {
    for (uint32_t i = 0; i < n; i += 2 * len) {
      for (uint32_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float s = 1.0f / std::sqrt(float(n));
  for (uint32_t j = 0; j < n; ++j) x[j] *= s;
}

inline void Hadamard(float* x, uint32_t n) {
  switch (n) {
    case 8: return HadamardN<8>(x, n);
    case 16: return HadamardN<16>(x, n);
    case 32: return HadamardN<32>(x, n);
    case 64: return HadamardN<64>(x, n);
    case 128: return HadamardN<128>(x, n);
    case 256: return HadamardN<256>(x, n);
    default: return HadamardN<0>(x, n);
  }
}

// Random ±1 signs of one (layer, part, head), from the seed: the decoder regenerates them.
inline void Signs(uint64_t seed, uint64_t slab, uint32_t n, float* out) {
  uint64_t key = seed * 0x9e3779b97f4a7c15ull + slab;
  Rng rng(SplitMix(key));
  for (uint32_t d = 0; d < n; ++d) out[d] = (rng.Next() >> 63) ? -1.0f : 1.0f;
}

}  // namespace kvserve
