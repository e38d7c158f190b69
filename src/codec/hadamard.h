// Internal: the randomised Walsh–Hadamard rotation shared by `rotate` and `mixhq`.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kv/rng.h"

namespace kvserve {

// In-place fast Walsh–Hadamard transform of n = 2^k values, scaled by 1/sqrt(n): orthonormal and
// its own inverse. The plain loops, the reference of the SIMD kernel (hadamard.cc); with n known
// at compile time (N > 0) the compiler unrolls the short butterfly stages. N = 0 is the
// runtime-size version (same operations, same order, so bit-identical results).
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

// `rows` consecutive vectors of n values with random signs `sign` (n of them, ±1): forward
// multiplies each vector by the signs, then transforms (the rotation); inverse transforms, then
// multiplies (its exact inverse up to float error). On the widest kernel the CPU runs; every
// path computes each butterfly as the plain loops do, so all give the bits of those steps done
// one by one with HadamardN.
void RotateRows(float* x, size_t rows, uint32_t n, const float* sign, bool inverse);

// Random ±1 signs of one (layer, part, head), from the seed: the decoder regenerates them.
inline void Signs(uint64_t seed, uint64_t slab, uint32_t n, float* out) {
  uint64_t key = seed * 0x9e3779b97f4a7c15ull + slab;
  Rng rng(SplitMix(key));
  for (uint32_t d = 0; d < n; ++d) out[d] = (rng.Next() >> 63) ? -1.0f : 1.0f;
}

}  // namespace kvserve
