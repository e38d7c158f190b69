// The Walsh–Hadamard kernels of hadamard.h: the plain loops and an AVX-512 kernel that holds a
// whole vector (16 to 256 values) in registers, taken when the CPU has it (kvserve/cpu.h).
#include "codec/hadamard.h"

#include "kvserve/cpu.h"

#ifdef KVSERVE_HAVE_AVX512_REGION
#include <immintrin.h>
// GCC 12 reports the intrinsics' own _mm512_undefined_*() operands as "may be used
// uninitialized" once they are inlined; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace kvserve {

namespace {

void HadamardPlain(float* x, uint32_t n) {
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

void RotateRowsPlain(float* x, size_t rows, uint32_t n, const float* sign, bool inverse) {
  for (size_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    if (!inverse)
      for (uint32_t d = 0; d < n; ++d) row[d] *= sign[d];
    HadamardPlain(row, n);
    if (inverse)
      for (uint32_t d = 0; d < n; ++d) row[d] *= sign[d];
  }
}

#ifdef KVSERVE_HAVE_AVX512_REGION
KVSERVE_BEGIN_AVX512
// One butterfly stage of stride len < 16 inside a register: `t` holds each lane's partner
// (lane ^ len). A lane without the len bit is the pair's first: a + b = v + t; one with it is
// the second: a - b = t - v.
inline __m512 ButterflyIn(__m512 v, __m512 t, __mmask16 second) {
  return _mm512_mask_sub_ps(_mm512_add_ps(v, t), second, t, v);
}

// Vectors of K * 16 values, all in registers: four in-register stages, then log2(K) stages
// across registers, then the scale.
template <int K>
void RotateRowsAvx512(float* x, size_t rows, const float* sign, bool inverse) {
  constexpr uint32_t n = K * 16;
  const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(float(n)));
  __m512 sg[K];
  for (int k = 0; k < K; ++k) sg[k] = _mm512_loadu_ps(sign + 16 * k);
  for (size_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    __m512 v[K];
    for (int k = 0; k < K; ++k) {
      v[k] = _mm512_loadu_ps(row + 16 * k);
      if (!inverse) v[k] = _mm512_mul_ps(v[k], sg[k]);
      v[k] = ButterflyIn(v[k], _mm512_permute_ps(v[k], 0xB1), 0xAAAA);           // len 1
      v[k] = ButterflyIn(v[k], _mm512_permute_ps(v[k], 0x4E), 0xCCCC);           // len 2
      v[k] = ButterflyIn(v[k], _mm512_shuffle_f32x4(v[k], v[k], 0xB1), 0xF0F0);  // len 4
      v[k] = ButterflyIn(v[k], _mm512_shuffle_f32x4(v[k], v[k], 0x4E), 0xFF00);  // len 8
    }
    for (int len = 1; len < K; len <<= 1) {  // stride 16 * len
      for (int i = 0; i < K; i += 2 * len) {
        for (int j = i; j < i + len; ++j) {
          const __m512 a = v[j], b = v[j + len];
          v[j] = _mm512_add_ps(a, b);
          v[j + len] = _mm512_sub_ps(a, b);
        }
      }
    }
    for (int k = 0; k < K; ++k) {
      v[k] = _mm512_mul_ps(v[k], scale);
      if (inverse) v[k] = _mm512_mul_ps(v[k], sg[k]);
      _mm512_storeu_ps(row + 16 * k, v[k]);
    }
  }
}

// Whether the kernel ran (n from 16 to 256).
bool RotateRowsBest(float* x, size_t rows, uint32_t n, const float* sign, bool inverse) {
  switch (n) {
    case 16: RotateRowsAvx512<1>(x, rows, sign, inverse); return true;
    case 32: RotateRowsAvx512<2>(x, rows, sign, inverse); return true;
    case 64: RotateRowsAvx512<4>(x, rows, sign, inverse); return true;
    case 128: RotateRowsAvx512<8>(x, rows, sign, inverse); return true;
    case 256: RotateRowsAvx512<16>(x, rows, sign, inverse); return true;
    default: return false;
  }
}
KVSERVE_END_TIER
#endif

}  // namespace

void RotateRows(float* x, size_t rows, uint32_t n, const float* sign, bool inverse) {
#ifdef KVSERVE_HAVE_AVX512_REGION
  if (cpu::Use(cpu::Tier::kAvx512) && RotateRowsBest(x, rows, n, sign, inverse)) return;
#endif
  RotateRowsPlain(x, rows, n, sign, inverse);
}

}  // namespace kvserve
