// Kernels of uniform asymmetric quantisation (see quant_kernels.h): the plain loops, the
// AVX-512/F16C loops (taken when the CPU has them, kvserve/cpu.h), and the fused per-block fp16
// paths the quant stage uses.
#include "codec/quant_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kvserve/cpu.h"
#include "kvserve/kv.h"

#ifdef KVSERVE_HAVE_AVX512_REGION
#include <immintrin.h>
#define KVSERVE_QUANT_AVX512 1
// GCC 12 reports the intrinsics' own _mm512_undefined_*() operands as "may be used
// uninitialized" once they are inlined into lambdas; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace kvserve {
namespace quant {

size_t PackedBytes(size_t n, int bits) { return (n + 7) / 8 * bits; }

namespace {
// Plain plane loops from element j0 on (the SIMD loops below hand them their tails).
template <int W>
void PackPlane(const uint8_t* codes, size_t n8, int shift, uint8_t* out, size_t j0 = 0) {
  constexpr int K = 8 / W;
  constexpr unsigned M = (1u << W) - 1;
  const size_t len = n8 / K;
  for (size_t j = j0; j < len; ++j) {
    unsigned b = 0;
    for (int i = 0; i < K; ++i) b |= ((unsigned(codes[j + i * len]) >> shift) & M) << (i * W);
    out[j] = static_cast<uint8_t>(b);
  }
}
template <int W>
void UnpackPlane(const uint8_t* in, size_t n8, int shift, uint8_t* codes, bool first, size_t j0 = 0) {
  constexpr int K = 8 / W;
  constexpr unsigned M = (1u << W) - 1;
  const size_t len = n8 / K;
  for (int i = 0; i < K; ++i) {
    uint8_t* c = codes + i * len;
    if (first) {
      for (size_t j = j0; j < len; ++j) c[j] = static_cast<uint8_t>(((in[j] >> (i * W)) & M) << shift);
    } else {
      for (size_t j = j0; j < len; ++j) c[j] |= static_cast<uint8_t>(((in[j] >> (i * W)) & M) << shift);
    }
  }
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
// 64 bytes at a time. AVX-512 has no byte shifts: shifting 16-bit lanes and masking each byte to
// its W bits drops whatever crossed over from the neighbouring byte.
template <int W>
void PackPlaneAvx512(const uint8_t* codes, size_t n8, int shift, uint8_t* out) {
  constexpr int K = 8 / W;
  const size_t len = n8 / K;
  const __m512i mask = _mm512_set1_epi8(char((1u << W) - 1));
  const __m128i down = _mm_cvtsi32_si128(shift);
  size_t j = 0;
  for (; j + 64 <= len; j += 64) {
    __m512i b = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(codes + j), down), mask);
    for (int i = 1; i < K; ++i) {
      const __m512i c = _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(codes + j + i * len), down), mask);
      b = _mm512_or_si512(b, _mm512_sll_epi16(c, _mm_cvtsi32_si128(i * W)));
    }
    _mm512_storeu_si512(out + j, b);
  }
  PackPlane<W>(codes, n8, shift, out, j);
}
template <int W>
void UnpackPlaneAvx512(const uint8_t* in, size_t n8, int shift, uint8_t* codes, bool first) {
  constexpr int K = 8 / W;
  const size_t len = n8 / K;
  const __m512i mask = _mm512_set1_epi8(char((1u << W) - 1));
  const __m128i up = _mm_cvtsi32_si128(shift);
  size_t j = 0;
  for (; j + 64 <= len; j += 64) {
    const __m512i b = _mm512_loadu_si512(in + j);
    for (int i = 0; i < K; ++i) {
      __m512i c = _mm512_sll_epi16(_mm512_and_si512(_mm512_srl_epi16(b, _mm_cvtsi32_si128(i * W)), mask), up);
      uint8_t* dst = codes + i * len + j;
      if (!first) c = _mm512_or_si512(c, _mm512_loadu_si512(dst));
      _mm512_storeu_si512(dst, c);
    }
  }
  UnpackPlane<W>(in, n8, shift, codes, first, j);
}
KVSERVE_END_TIER
#endif

// The widest plane loop the CPU runs.
template <int W>
void PackPlaneBest(const uint8_t* codes, size_t n8, int shift, uint8_t* out) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) return PackPlaneAvx512<W>(codes, n8, shift, out);
#endif
  PackPlane<W>(codes, n8, shift, out);
}
template <int W>
void UnpackPlaneBest(const uint8_t* in, size_t n8, int shift, uint8_t* codes, bool first) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) return UnpackPlaneAvx512<W>(in, n8, shift, codes, first);
#endif
  UnpackPlane<W>(in, n8, shift, codes, first);
}
}  // namespace

void PackCodes(const uint8_t* codes, size_t n8, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, n8);
    return;
  }
  int shift = 0;
  if (bits & 4) { PackPlaneBest<4>(codes, n8, shift, out); out += n8 / 2; shift += 4; }
  if (bits & 2) { PackPlaneBest<2>(codes, n8, shift, out); out += n8 / 4; shift += 2; }
  if (bits & 1) { PackPlaneBest<1>(codes, n8, shift, out); }
}

void UnpackCodes(const uint8_t* in, size_t n8, int bits, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, in, n8);
    return;
  }
  int shift = 0;
  bool first = true;
  if (bits & 4) { UnpackPlaneBest<4>(in, n8, shift, codes, first); in += n8 / 2; shift += 4; first = false; }
  if (bits & 2) { UnpackPlaneBest<2>(in, n8, shift, codes, first); in += n8 / 4; shift += 2; first = false; }
  if (bits & 1) { UnpackPlaneBest<1>(in, n8, shift, codes, first); }
}

void PackCodesReference(const uint8_t* codes, size_t n8, int bits, uint8_t* out) {
  // Bit by bit, straight from the layout's definition.
  std::memset(out, 0, PackedBytes(n8, bits));
  if (bits == 8) {
    std::memcpy(out, codes, n8);
    return;
  }
  size_t plane_start = 0;
  int shift = 0;
  for (int w : {4, 2, 1}) {
    if (!(bits & w)) continue;
    const size_t k = 8 / w, len = n8 / k;
    for (size_t v = 0; v < n8; ++v) {
      const size_t j = v % len, i = v / len;
      for (int bit = 0; bit < w; ++bit) {
        if ((codes[v] >> (shift + bit)) & 1) out[plane_start + j] |= uint8_t(1u << (i * w + bit));
      }
    }
    plane_start += len;
    shift += w;
  }
}

bool GroupRange(float min, float max, int levels, uint16_t* lo_h, uint16_t* step_h, float* lo, float* step) {
  uint16_t h = FloatToHalf(min);
  if (HalfToFloat(h) > min) h = (h & 0x8000) ? uint16_t(h + 1) : (h == 0 ? uint16_t(0x8001) : uint16_t(h - 1));
  const float lo_f = HalfToFloat(h);
  if (!std::isfinite(lo_f) || !std::isfinite(max)) return false;
  const float s = (max - lo_f) / static_cast<float>(levels);
  uint16_t sh = FloatToHalf(s);
  if (HalfToFloat(sh) < s) sh = uint16_t(sh + 1);
  const float step_f = HalfToFloat(sh);
  if (!std::isfinite(step_f)) return false;
  *lo_h = h;
  *step_h = sh;
  *lo = lo_f;
  *step = step_f;
  return true;
}

size_t GroupRanges(const float* mn, const float* mx, size_t m, int levels, uint16_t* lo_h, uint16_t* step_h,
                   float* lo, float* step, float* inv_step) {
  // Same arithmetic as GroupRange, one pass per step over contiguous arrays.
  ConvertFromF32(DType::kF16, mn, lo_h, m);
  ConvertToF32(DType::kF16, lo_h, lo, m);
  for (size_t i = 0; i < m; ++i) {
    const uint16_t h = lo_h[i];
    const uint16_t down = (h & 0x8000) ? uint16_t(h + 1) : (h == 0 ? uint16_t(0x8001) : uint16_t(h - 1));
    lo_h[i] = lo[i] > mn[i] ? down : h;
  }
  ConvertToF32(DType::kF16, lo_h, lo, m);
  const float fl = static_cast<float>(levels);
  for (size_t i = 0; i < m; ++i) inv_step[i] = (mx[i] - lo[i]) / fl;  // the exact step, for now
  ConvertFromF32(DType::kF16, inv_step, step_h, m);
  ConvertToF32(DType::kF16, step_h, step, m);
  for (size_t i = 0; i < m; ++i) step_h[i] = step[i] < inv_step[i] ? uint16_t(step_h[i] + 1) : step_h[i];
  ConvertToF32(DType::kF16, step_h, step, m);
  unsigned bad = 0;
  for (size_t i = 0; i < m; ++i) {
    bad |= ((lo_h[i] & 0x7c00) == 0x7c00) | ((step_h[i] & 0x7c00) == 0x7c00) | !(mx[i] <= 65504.0f);
    inv_step[i] = step[i] > 0 ? 1.0f / step[i] : 0.0f;
  }
  if (bad) {
    for (size_t i = 0; i < m; ++i) {
      if ((lo_h[i] & 0x7c00) == 0x7c00 || (step_h[i] & 0x7c00) == 0x7c00 || !(mx[i] <= 65504.0f)) return i;
    }
  }
  return m;
}

void ColumnMinMax(const float* x, size_t rows, size_t n_channel, float* mn, float* mx) {
  for (size_t c = 0; c < n_channel; ++c) mn[c] = mx[c] = x[c];
  for (size_t r = 1; r < rows; ++r) {
    const float* row = x + r * n_channel;
    for (size_t c = 0; c < n_channel; ++c) {
      mn[c] = row[c] < mn[c] ? row[c] : mn[c];
      mx[c] = row[c] > mx[c] ? row[c] : mx[c];
    }
  }
}

void RowGroupMinMax(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx) {
  const size_t n_group = (n_channel + group - 1) / group;
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * n_channel;
    for (size_t g = 0; g < n_group; ++g) {
      const size_t c0 = g * group, c1 = std::min(n_channel, c0 + group);
      float lo = row[c0], hi = row[c0];
#pragma omp simd reduction(min : lo) reduction(max : hi)
      for (size_t c = c0; c < c1; ++c) {
        lo = row[c] < lo ? row[c] : lo;
        hi = row[c] > hi ? row[c] : hi;
      }
      mn[r * n_group + g] = lo;
      mx[r * n_group + g] = hi;
    }
  }
}

namespace {
inline uint8_t Code(float v, float fl) {
  v = v >= 0.f ? v : 0.f;  // NaN (a NaN value past the first row leaves its group's range finite) codes as 0
  v = v > fl ? fl : v;
  return static_cast<uint8_t>(static_cast<int>(std::nearbyint(v)));  // ties to even, as SIMD converts
}
}  // namespace

void QuantizeColumns(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                     int levels, uint8_t* codes) {
  const float fl = static_cast<float>(levels);
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * n_channel;
    uint8_t* out = codes + r * n_channel;
    for (size_t c = 0; c < n_channel; ++c) out[c] = Code((row[c] - lo[c]) * inv_step[c], fl);
  }
}

void QuantizeRowGroups(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                       const float* inv_step, int levels, uint8_t* codes) {
  const float fl = static_cast<float>(levels);
  const size_t n_group = (n_channel + group - 1) / group;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < n_group; ++g) {
      const size_t c0 = g * group, c1 = std::min(n_channel, c0 + group);
      const float l = lo[r * n_group + g], inv = inv_step[r * n_group + g];
      const float* row = x + r * n_channel;
      uint8_t* out = codes + r * n_channel;
      for (size_t c = c0; c < c1; ++c) out[c] = Code((row[c] - l) * inv, fl);
    }
  }
}

void DequantizeColumns(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                       float* x) {
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* in = codes + r * n_channel;
    float* row = x + r * n_channel;
    for (size_t c = 0; c < n_channel; ++c) row[c] = lo[c] + static_cast<float>(in[c]) * step[c];
  }
}

void DequantizeRowGroups(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                         const float* step, float* x) {
  const size_t n_group = (n_channel + group - 1) / group;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < n_group; ++g) {
      const size_t c0 = g * group, c1 = std::min(n_channel, c0 + group);
      const float l = lo[r * n_group + g], s = step[r * n_group + g];
      const uint8_t* in = codes + r * n_channel;
      float* row = x + r * n_channel;
      for (size_t c = c0; c < c1; ++c) row[c] = l + static_cast<float>(in[c]) * s;
    }
  }
}


#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
inline void StoreHalf16(uint16_t* dst, __m256i h, bool stream) {
  if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
}
inline __m128i Codes16(__m512 v, __m512 fl) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), fl);
  return _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(v));
}
}  // namespace
KVSERVE_END_TIER
#endif

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
void RowGroupMinMaxFastAvx512(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx) {
  const size_t n_group = n_channel / group;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < n_group; ++g) {
      const float* p = x + r * n_channel + g * group;
      __m512 lo = _mm512_loadu_ps(p), hi = lo;
      for (size_t c = 16; c < group; c += 16) {
        const __m512 v = _mm512_loadu_ps(p + c);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
      }
      mn[r * n_group + g] = _mm512_reduce_min_ps(lo);
      mx[r * n_group + g] = _mm512_reduce_max_ps(hi);
    }
  }
}
}  // namespace
KVSERVE_END_TIER
#endif

void RowGroupMinMaxFast(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && group % 16 == 0 && n_channel % group == 0) {
    return RowGroupMinMaxFastAvx512(x, rows, n_channel, group, mn, mx);
  }
#endif
  RowGroupMinMax(x, rows, n_channel, group, mn, mx);
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
void QuantizeColumnsFastAvx512(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                               int levels, uint8_t* codes) {
  const __m512 fl = _mm512_set1_ps(float(levels));
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < n_channel; c += 16) {
      const __m512 l = _mm512_loadu_ps(lo + c), inv = _mm512_loadu_ps(inv_step + c);
      const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + r * n_channel + c), l), inv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * n_channel + c), Codes16(v, fl));
    }
  }
}
}  // namespace
KVSERVE_END_TIER
#endif

void QuantizeColumnsFast(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                         int levels, uint8_t* codes) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && n_channel % 16 == 0) {
    return QuantizeColumnsFastAvx512(x, rows, n_channel, lo, inv_step, levels, codes);
  }
#endif
  QuantizeColumns(x, rows, n_channel, lo, inv_step, levels, codes);
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
void QuantizeRowGroupsFastAvx512(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                                 const float* inv_step, int levels, uint8_t* codes) {
  const __m512 fl = _mm512_set1_ps(float(levels));
  const size_t n_group = n_channel / group;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < n_group; ++g) {
      const __m512 l = _mm512_set1_ps(lo[r * n_group + g]), inv = _mm512_set1_ps(inv_step[r * n_group + g]);
      const size_t base = r * n_channel + g * group;
      for (size_t c = 0; c < group; c += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + base + c), l), inv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + base + c), Codes16(v, fl));
      }
    }
  }
}
}  // namespace
KVSERVE_END_TIER
#endif

void QuantizeRowGroupsFast(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                           const float* inv_step, int levels, uint8_t* codes) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && group % 16 == 0 && n_channel % group == 0) {
    return QuantizeRowGroupsFastAvx512(x, rows, n_channel, group, lo, inv_step, levels, codes);
  }
#endif
  QuantizeRowGroups(x, rows, n_channel, group, lo, inv_step, levels, codes);
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
void DequantizeColumnsF16Avx512(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                                float* scratch, uint16_t* dst) {
  const bool stream = (reinterpret_cast<uintptr_t>(dst) & 31) == 0;
  // Row-major order: streaming stores must fill whole cache lines in sequence.
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < n_channel; c += 16) {
      const __m512 l = _mm512_loadu_ps(lo + c), st = _mm512_loadu_ps(step + c);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * n_channel + c));
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), st, l);
      StoreHalf16(dst + r * n_channel + c, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), stream);
    }
  }
  _mm_sfence();
}
}  // namespace
KVSERVE_END_TIER
#endif

void DequantizeColumnsF16(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                          float* scratch, uint16_t* dst) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && n_channel % 16 == 0) {
    return DequantizeColumnsF16Avx512(codes, rows, n_channel, lo, step, scratch, dst);
  }
#endif
  DequantizeColumns(codes, rows, n_channel, lo, step, scratch);
  ConvertFromF32Streaming(DType::kF16, scratch, dst, rows * n_channel);
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
namespace {
void DequantizeRowGroupsF16Avx512(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                                  const float* step, float* scratch, uint16_t* dst) {
  const bool stream = (reinterpret_cast<uintptr_t>(dst) & 31) == 0;
  const size_t n_group = n_channel / group;
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < n_group; ++g) {
      const __m512 l = _mm512_set1_ps(lo[r * n_group + g]), st = _mm512_set1_ps(step[r * n_group + g]);
      const size_t base = r * n_channel + g * group;
      for (size_t c = 0; c < group; c += 16) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + base + c));
        const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), st, l);
        StoreHalf16(dst + base + c, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT), stream);
      }
    }
  }
  _mm_sfence();
}
}  // namespace
KVSERVE_END_TIER
#endif

void DequantizeRowGroupsF16(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                            const float* step, float* scratch, uint16_t* dst) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && group % 16 == 0 && n_channel % group == 0) {
    return DequantizeRowGroupsF16Avx512(codes, rows, n_channel, group, lo, step, scratch, dst);
  }
#endif
  DequantizeRowGroups(codes, rows, n_channel, group, lo, step, scratch);
  ConvertFromF32Streaming(DType::kF16, scratch, dst, rows * n_channel);
}


void BlockScratch::Reserve(size_t n_values, size_t m) {
  if (x.size() < n_values + 8) x.resize(n_values + 8), codes.resize(n_values + 8);
  if (mn.size() < m) {
    mn.resize(m), mx.resize(m), lo.resize(m), step.resize(m), inv.resize(m), lo_h.resize(m), step_h.resize(m);
  }
}

size_t BlockMetaCount(size_t rows, size_t n_channel, size_t group) {
  return group == 0 ? n_channel : rows * ((n_channel + group - 1) / group);
}

size_t BlockBytes(size_t rows, size_t n_channel, size_t group, int bits) {
  return BlockMetaCount(rows, n_channel, group) * 4 + PackedBytes(rows * n_channel, bits);
}

namespace {

// Metadata, then the codes (zero padded to a multiple of 8) packed.
void WriteBlock(size_t m, size_t n, int bits, bool reference, uint8_t* dst, BlockScratch& s) {
  const size_t n8 = (n + 7) & ~size_t{7};
  std::memset(s.codes.data() + n, 0, n8 - n);
  std::memcpy(dst, s.lo_h.data(), m * 2);
  std::memcpy(dst + m * 2, s.step_h.data(), m * 2);
  if (reference) PackCodesReference(s.codes.data(), n8, bits, dst + m * 4);
  else PackCodes(s.codes.data(), n8, bits, dst + m * 4);
}

// The float path from s.x (the block converted): min/max, ranges, codes, pack. `reference`
// picks the plain kernels.
size_t EncodeFloatBlock(size_t rows, size_t D, size_t group, int bits, uint8_t* dst, BlockScratch& s, bool reference) {
  const size_t n = rows * D, m = BlockMetaCount(rows, D, group);
  const int levels = (1 << bits) - 1;
  if (group == 0) ColumnMinMax(s.x.data(), rows, D, s.mn.data(), s.mx.data());
  else if (reference) RowGroupMinMax(s.x.data(), rows, D, group, s.mn.data(), s.mx.data());
  else RowGroupMinMaxFast(s.x.data(), rows, D, group, s.mn.data(), s.mx.data());
  const size_t bad =
      GroupRanges(s.mn.data(), s.mx.data(), m, levels, s.lo_h.data(), s.step_h.data(), s.lo.data(), s.step.data(),
                  s.inv.data());
  if (bad < m) return bad;
  if (group == 0) {
    if (reference) QuantizeColumns(s.x.data(), rows, D, s.lo.data(), s.inv.data(), levels, s.codes.data());
    else QuantizeColumnsFast(s.x.data(), rows, D, s.lo.data(), s.inv.data(), levels, s.codes.data());
  } else {
    if (reference) QuantizeRowGroups(s.x.data(), rows, D, group, s.lo.data(), s.inv.data(), levels, s.codes.data());
    else QuantizeRowGroupsFast(s.x.data(), rows, D, group, s.lo.data(), s.inv.data(), levels, s.codes.data());
  }
  WriteBlock(m, n, bits, reference, dst, s);
  return m;
}

size_t EncodeBlockComposed(const void* src, DType dt, size_t rows, size_t D, size_t group, int bits, uint8_t* dst,
                           BlockScratch& s, bool reference) {
  s.Reserve(rows * D, BlockMetaCount(rows, D, group));
  ConvertToF32(dt, src, s.x.data(), rows * D);
  return EncodeFloatBlock(rows, D, group, bits, dst, s, reference);
}

// Reads the metadata into float lo/step and unpacks the codes.
void ReadBlock(const uint8_t* src, size_t m, size_t n, int bits, BlockScratch& s) {
  std::memcpy(s.lo_h.data(), src, m * 2);
  std::memcpy(s.step_h.data(), src + m * 2, m * 2);
  ConvertToF32(DType::kF16, s.lo_h.data(), s.lo.data(), m);
  ConvertToF32(DType::kF16, s.step_h.data(), s.step.data(), m);
  UnpackCodes(src + m * 4, (n + 7) & ~size_t{7}, bits, s.codes.data());
}

void DecodeBlockComposed(const uint8_t* src, size_t rows, size_t D, size_t group, int bits, DType dt, void* dst,
                         BlockScratch& s, bool reference) {
  const size_t n = rows * D, m = BlockMetaCount(rows, D, group);
  s.Reserve(n, m);
  ReadBlock(src, m, n, bits, s);
  if (!reference && dt == DType::kF16) {
    uint16_t* o = static_cast<uint16_t*>(dst);
    if (group == 0) DequantizeColumnsF16(s.codes.data(), rows, D, s.lo.data(), s.step.data(), s.x.data(), o);
    else DequantizeRowGroupsF16(s.codes.data(), rows, D, group, s.lo.data(), s.step.data(), s.x.data(), o);
    return;
  }
  if (group == 0) DequantizeColumns(s.codes.data(), rows, D, s.lo.data(), s.step.data(), s.x.data());
  else DequantizeRowGroups(s.codes.data(), rows, D, group, s.lo.data(), s.step.data(), s.x.data());
  if (reference) ConvertFromF32(dt, s.x.data(), dst, n);
  else ConvertFromF32Streaming(dt, s.x.data(), dst, n);
}

// Asks for the next block's lines ahead of its min/max pass: the code pass between two blocks'
// reads is long enough for the hardware prefetcher to lose the stream, and the next block (the
// next one in the slab, or the next slab, which follows it in memory) then starts on misses.
// Where the code pass is QuantizePackPlane, it asks, a share per plane row, so the loads
// overlap its arithmetic (quant4 encode 7.2 -> 10.0 GB/s against asking during the min/max
// pass, which is waiting on memory already: docs/results/codec_speed.md); the other widths ask
// row by row during the min/max pass (`ahead`). A prefetch past the end of the tensor is harmless.
inline void Prefetch(const void* p, size_t bytes) {
  const char* b = static_cast<const char*>(p);
  for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(b + i);
}

// Asks for bytes [from, from + len) of a paged block's next rows taken as one sequence (the
// fused kernel's code pass and the float path's row conversions alike). Out of
// line (inlined into the code pass's loop it cost the dense encode 20%), and kept out of the
// compiler's interprocedural analysis: a function that only prefetches looks free of effects, and
// its calls were deleted.
[[gnu::noipa]] void AskRows(const NextRows& next, size_t from, size_t len) {
  const size_t rb = next.row_bytes;
  for (const size_t end = from + len; from < end;) {
    const size_t r = from / rb, o = from % rb, n = std::min(rb - o, end - from);
    Prefetch(next.rows[r] + o, n);
    from += n;
  }
}

#ifdef KVSERVE_QUANT_AVX512
KVSERVE_BEGIN_AVX512
// 16 source values as floats: fp16 (the KV cache) or f32 (the output of a transform stage).
inline __m512 Load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

bool FusedWidthsFit(size_t D, size_t group) { return D % 16 == 0 && (group == 0 || (group % 16 == 0 && D % group == 0)); }

// Where an encode's source rows lie: a dense block (row r at p + r * D, the next block right
// after it), or rows anywhere (a paged cache's, read where they lie; nothing known after them).
template <typename T>
struct DenseRowsOf {
  static constexpr bool kDense = true;
  const T* p;
  size_t D;
  const T* operator[](size_t r) const { return p + r * D; }
};
template <typename T>
struct RowPointers {
  static constexpr bool kDense = false;
  const T* const* p;
  const T* operator[](size_t r) const { return p[r]; }
};

// Column min/max of N stripes of 16 channels from channel c, row by row: the source streams in
// memory order (a stripe-by-stripe walk strides across rows and stalls on every line) while the
// 2N accumulators stay in registers; the converted values go to x for the code pass.
template <int N, typename Rows>
void ColumnMinMaxStripes(const Rows& src, size_t c, float* x, size_t rows, size_t D, float* mn, float* mx, bool ahead) {
  __m512 lo[N], hi[N];
  for (int k = 0; k < N; ++k) lo[k] = hi[k] = Load16(src[0] + c + 16 * k), _mm512_storeu_ps(x + 16 * k, lo[k]);
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(src[0])>>;
  if constexpr (Rows::kDense) {
    if (ahead) Prefetch(src[rows] + c, N * 16 * sizeof(T));
  }
  for (size_t r = 1; r < rows; ++r) {
    if constexpr (Rows::kDense) {
      if (ahead) Prefetch(src[rows + r] + c, N * 16 * sizeof(T));
    }
    const T* row = src[r] + c;
    for (int k = 0; k < N; ++k) {
      const __m512 v = Load16(row + 16 * k);
      _mm512_storeu_ps(x + r * D + 16 * k, v);
      lo[k] = _mm512_min_ps(v, lo[k]);
      hi[k] = _mm512_max_ps(v, hi[k]);
    }
  }
  for (int k = 0; k < N; ++k) _mm512_storeu_ps(mn + 16 * k, lo[k]), _mm512_storeu_ps(mx + 16 * k, hi[k]);
}

// Min and max of four groups at once: v[k] holds group k's 16 partial results. Two 256-bit and
// two 128-bit folds interleave the groups, so 4 groups cost what one _mm512_reduce_* pair does.
// Returns lanes 0..3 = groups 0..3.
template <bool kMin>
inline __m512 MinOrMax(__m512 a, __m512 b) {
  return kMin ? _mm512_min_ps(a, b) : _mm512_max_ps(a, b);
}
template <bool kMin>
inline __m128 Fold4(__m512 g0, __m512 g1, __m512 g2, __m512 g3) {
  constexpr auto op = MinOrMax<kMin>;
  // [g0 lo8 | g1 lo8] vs [g0 hi8 | g1 hi8] -> 8 lanes of g0, 8 of g1.
  const __m512 m01 = op(_mm512_shuffle_f32x4(g0, g1, 0x44), _mm512_shuffle_f32x4(g0, g1, 0xEE));
  const __m512 m23 = op(_mm512_shuffle_f32x4(g2, g3, 0x44), _mm512_shuffle_f32x4(g2, g3, 0xEE));
  // 128-bit lanes: g0, g1, g2, g3, four values each.
  __m512 m = op(_mm512_shuffle_f32x4(m01, m23, 0x88), _mm512_shuffle_f32x4(m01, m23, 0xDD));
  m = op(m, _mm512_permute_ps(m, 0x4E));
  m = op(m, _mm512_permute_ps(m, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), m));
}

// The quantise pass and the pack of one plane of width W (every code has W bits) together:
// plane byte j holds the codes of rows r + i * rows/k (k = 8/W codes per byte, i < k) at bits
// i*W, so the k rows' codes of 16 channels make 16 bytes. Codes as QuantizeColumnsFast /
// QuantizeRowGroupsFast compute them; ranges per channel (kChannel, lo/inv indexed by channel)
// or per row and group of `group` channels. Needs rows % k == 0. Asks for next_bytes at next, or
// (a paged block) of next_rows.
template <int W, bool kChannel>
void QuantizePackPlane(const float* x, size_t rows, size_t D, size_t group, const float* lo, const float* inv,
                       int levels, uint8_t* out, const char* next, size_t next_bytes, const NextRows* next_rows) {
  constexpr int K = 8 / W;
  const size_t plane_rows = rows / K, ng = D / group;
  const __m512 fl = _mm512_set1_ps(float(levels));
  // The next block's lines (see Prefetch), an equal share of whole lines per plane row.
  const size_t share = (next_bytes / plane_rows + 63) & ~size_t{63};
  for (size_t r = 0; r < plane_rows; ++r) {
    if (r * share < next_bytes) {
      const size_t len = std::min(share, next_bytes - r * share);
      if (next_rows) AskRows(*next_rows, r * share, len);
      else Prefetch(next + r * share, len);
    }
    for (size_t g = 0; g < ng; ++g) {
      for (size_t c = g * group; c < (g + 1) * group; c += 16) {
        __m128i packed = _mm_setzero_si128();
        for (int i = 0; i < K; ++i) {
          const size_t row = r + i * plane_rows;
          __m512 l, iv;
          if constexpr (kChannel) {
            l = _mm512_loadu_ps(lo + c), iv = _mm512_loadu_ps(inv + c);
          } else {
            l = _mm512_set1_ps(lo[row * ng + g]), iv = _mm512_set1_ps(inv[row * ng + g]);
          }
          const __m128i q = Codes16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + row * D + c), l), iv), fl);
          // Codes fit W bits, so shifting 16-bit lanes moves nothing across a byte.
          packed = _mm_or_si128(packed, _mm_sll_epi16(q, _mm_cvtsi32_si128(i * W)));
        }
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * D + c), packed);
      }
    }
  }
}

// The plain kernels' arithmetic in the same order (min/max keep the old value on NaN as the
// plain comparisons do; codes are (x - lo) * inv rounded to nearest even), so the bytes equal.
// The source (fp16 or f32) is copied once as floats into scratch (L1) that the code pass reads back.
template <typename T, typename Rows>
size_t EncodeBlockAvx512(const Rows& src, size_t rows, size_t D, size_t group, int bits, uint8_t* dst, BlockScratch& s,
                         const NextRows* next_rows) {
  const size_t n = rows * D, m = BlockMetaCount(rows, D, group);
  const int levels = (1 << bits) - 1;
  s.Reserve(n, m);
  float* x = s.x.data();
  float* mn = s.mn.data();
  float* mx = s.mx.data();
  // Single-plane widths whose rows line up with the plane quantise straight into packed bytes
  // (QuantizePackPlane, which asks for the next block itself); the others ask here.
  const bool packs = (bits == 1 || bits == 2 || bits == 4 || bits == 8) && rows % (8 / bits) == 0;
  if (group == 0) {
    for (size_t c = 0; c < D; c += 128) {
      switch (std::min<size_t>(8, (D - c) / 16)) {
        case 1: ColumnMinMaxStripes<1>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 2: ColumnMinMaxStripes<2>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 3: ColumnMinMaxStripes<3>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 4: ColumnMinMaxStripes<4>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 5: ColumnMinMaxStripes<5>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 6: ColumnMinMaxStripes<6>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        case 7: ColumnMinMaxStripes<7>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
        default: ColumnMinMaxStripes<8>(src, c, x + c, rows, D, mn + c, mx + c, !packs); break;
      }
    }
  } else {
    const size_t ng = D / group;
    // Group g's 16 partial minima/maxima (over its 16-lane stripes), folded 4 groups at a time.
    // Group g's values: v0 in the source row, xg in x.
    auto partial = [&](const T* v0, float* xg, __m512* lo, __m512* hi) {
      *lo = Load16(v0), *hi = *lo;
      _mm512_storeu_ps(xg, *lo);
      for (size_t c = 16; c < group; c += 16) {
        const __m512 v = Load16(v0 + c);
        _mm512_storeu_ps(xg + c, v);
        *lo = _mm512_min_ps(v, *lo);
        *hi = _mm512_max_ps(v, *hi);
      }
    };
    for (size_t r = 0; r < rows; ++r) {
      if constexpr (Rows::kDense) {
        if (!packs) Prefetch(src[rows + r], D * sizeof(T));
      }
      const T* row = src[r];
      float* xr = x + r * D;
      size_t g = 0;
      for (; g + 4 <= ng; g += 4) {
        __m512 l0, l1, l2, l3, h0, h1, h2, h3;
        const size_t c = g * group;
        partial(row + c, xr + c, &l0, &h0);
        partial(row + c + group, xr + c + group, &l1, &h1);
        partial(row + c + 2 * group, xr + c + 2 * group, &l2, &h2);
        partial(row + c + 3 * group, xr + c + 3 * group, &l3, &h3);
        _mm_storeu_ps(mn + r * ng + g, Fold4<true>(l0, l1, l2, l3));
        _mm_storeu_ps(mx + r * ng + g, Fold4<false>(h0, h1, h2, h3));
      }
      for (; g < ng; ++g) {  // groups past the last four
        __m512 l, h;
        partial(row + g * group, xr + g * group, &l, &h);
        mn[r * ng + g] = _mm512_reduce_min_ps(l);
        mx[r * ng + g] = _mm512_reduce_max_ps(h);
      }
    }
  }
  const size_t bad =
      GroupRanges(mn, mx, m, levels, s.lo_h.data(), s.step_h.data(), s.lo.data(), s.step.data(), s.inv.data());
  if (bad < m) return bad;
  // Validated ranges in hand: single-plane widths whose rows line up with the plane quantise
  // straight into packed bytes; the others run the unfused path's quantise and pack passes.
  const float* lo = s.lo.data();
  const float* inv = s.inv.data();
  auto fused = [&](auto plane_bits) {
    constexpr int W = decltype(plane_bits)::value;
    std::memcpy(dst, s.lo_h.data(), m * 2);
    std::memcpy(dst + m * 2, s.step_h.data(), m * 2);
    // A dense block asks for the block after it; rows elsewhere only for what next_rows names.
    const char* next = nullptr;
    size_t next_bytes = 0;
    if (next_rows) next_bytes = next_rows->n_rows * next_rows->row_bytes;
    else if constexpr (Rows::kDense) next = reinterpret_cast<const char*>(src[rows]), next_bytes = rows * D * sizeof(T);
    if (group == 0) QuantizePackPlane<W, true>(x, rows, D, D, lo, inv, levels, dst + m * 4, next, next_bytes, next_rows);
    else QuantizePackPlane<W, false>(x, rows, D, group, lo, inv, levels, dst + m * 4, next, next_bytes, next_rows);
    return m;
  };
  if (packs) {
    switch (bits) {
      case 1: return fused(std::integral_constant<int, 1>{});
      case 2: return fused(std::integral_constant<int, 2>{});
      case 4: return fused(std::integral_constant<int, 4>{});
      default: return fused(std::integral_constant<int, 8>{});
    }
  }
  if (group == 0)
    QuantizeColumnsFast(x, rows, D, lo, inv, levels, s.codes.data());
  else
    QuantizeRowGroupsFast(x, rows, D, group, lo, inv, levels, s.codes.data());
  WriteBlock(m, n, bits, false, dst, s);
  return m;
}

// Row r's codes of plane p (width w, k = 8/w codes per byte) are the bits [i*w, i*w + w) of
// the bytes of row r % (rows/k), with i = r / (rows/k): the plane layout when rows is a
// multiple of k, so every row's codes are 16-byte loads and shifts in registers.
template <int kBits>
bool PlanesAlign(size_t rows) {
  return kBits == 8 || ((!(kBits & 4) || rows % 2 == 0) && (!(kBits & 2) || rows % 4 == 0) &&
                        (!(kBits & 1) || rows % 8 == 0));
}

// Out: uint16_t (fp16 destination) or float (the f32 input of a transform stage).
// `row_out`, when given, is where each row goes instead of dst + r * D (a paged cache's rows): they
// get non-temporal stores where 64-byte aligned, since such rows are a page row's stride apart and
// a plain store's line read is most of the cost there.
template <int kBits, bool kChannel, typename Out>
void DecodeBlockAvx512(const uint8_t* src, size_t rows, size_t D, size_t group, Out* dst, BlockScratch& s,
                       Out* const* row_out = nullptr) {
  const size_t n = rows * D, m = BlockMetaCount(rows, D, group);
  std::memcpy(s.lo_h.data(), src, m * 2);
  std::memcpy(s.step_h.data(), src + m * 2, m * 2);
  ConvertToF32(DType::kF16, s.lo_h.data(), s.lo.data(), m);
  ConvertToF32(DType::kF16, s.step_h.data(), s.step.data(), m);
  const uint8_t* codes = src + m * 4;
  constexpr int kWidth[3] = {kBits & 4, kBits & 2, kBits & 1};
  const uint8_t* plane[3] = {};
  size_t plane_rows[3] = {};
  {
    size_t off = 0;
    for (int p = 0; p < 3; ++p) {
      if (!kWidth[p] || kBits == 8) continue;
      plane[p] = codes + off;
      plane_rows[p] = rows / (8 / kWidth[p]);
      off += n / (8 / kWidth[p]);
    }
  }
  // Plain stores, not streaming ones: on the 2-core EPYC VM of docs/results/codec_speed.md
  // streaming stores made this loop 20-50% slower (fp16 4-bit decode 11.7 -> 14-15.8 GB/s
  // without them, 128 MiB block, memcpy 15-17 GB/s in the same runs).
  constexpr bool kF32 = std::is_same_v<Out, float>;
  const size_t ng = kChannel ? 0 : D / group;
  // Local pointers: stores through __m256i may alias anything, including the scratch vectors.
  const float* lo = s.lo.data();
  const float* step = s.step.data();
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* row_bytes[3] = {};
    __m128i down[3] = {};
    for (int p = 0; p < 3; ++p) {
      if (!plane[p]) continue;
      row_bytes[p] = plane[p] + (r % plane_rows[p]) * D;
      down[p] = _mm_cvtsi32_si128(int(r / plane_rows[p]) * kWidth[p]);
    }
    // Codes of row r, channels c..c+15, as 32-bit lanes.
    auto codes16 = [&](size_t c) {
      if constexpr (kBits == 8) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * D + c)));
      } else {
        __m512i code = _mm512_setzero_si512();
        int shift = 0;
        for (int p = 0; p < 3; ++p) {
          if (!kWidth[p]) continue;
          __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_bytes[p] + c)));
          v = _mm512_and_si512(_mm512_srl_epi32(v, down[p]), _mm512_set1_epi32((1 << kWidth[p]) - 1));
          code = _mm512_or_si512(code, _mm512_slli_epi32(v, shift));
          shift += kWidth[p];
        }
        return code;
      }
    };
    // 16 dequantised values from channel c on; c advances by 16 per call within a row (the
    // row-group index follows without a division).
    size_t g = 0, g_end = group;
    auto value16 = [&](size_t c) {
      __m512 l, st;
      if constexpr (kChannel) {
        l = _mm512_loadu_ps(lo + c), st = _mm512_loadu_ps(step + c);
      } else {
        if (c >= g_end) ++g, g_end += group;
        l = _mm512_set1_ps(lo[r * ng + g]), st = _mm512_set1_ps(step[r * ng + g]);
      }
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes16(c)), st, l);
    };
    auto half16 = [&](size_t c) { return _mm512_cvtps_ph(value16(c), _MM_FROUND_TO_NEAREST_INT); };
    Out* out = row_out ? row_out[r] : dst + r * D;
    if constexpr (kF32) {
      for (size_t c = 0; c < D; c += 16) _mm512_storeu_ps(out + c, value16(c));
    } else if (D % 32 == 0) {
      const bool stream = row_out && reinterpret_cast<uintptr_t>(out) % 64 == 0;
      for (size_t c = 0; c < D; c += 32) {  // 64-byte stores
        const __m256i a = half16(c), b = half16(c + 16);
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
        if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + c), v);
        else _mm512_storeu_si512(out + c, v);
      }
    } else {
      for (size_t c = 0; c < D; c += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), half16(c));
    }
  }
}

template <int kBits>
bool DecodeBlockFused(const uint8_t* src, size_t rows, size_t D, size_t group, DType dt, void* dst, BlockScratch& s,
                      uint8_t* const* row_out = nullptr) {
  if (!PlanesAlign<kBits>(rows)) return false;
  if (row_out) {  // fp16 rows only (the caller checked)
    uint16_t* const* o = reinterpret_cast<uint16_t* const*>(row_out);
    if (group == 0) DecodeBlockAvx512<kBits, true, uint16_t>(src, rows, D, group, nullptr, s, o);
    else DecodeBlockAvx512<kBits, false, uint16_t>(src, rows, D, group, nullptr, s, o);
    return true;
  }
  if (dt == DType::kF16) {
    uint16_t* o = static_cast<uint16_t*>(dst);
    if (group == 0) DecodeBlockAvx512<kBits, true>(src, rows, D, group, o, s);
    else DecodeBlockAvx512<kBits, false>(src, rows, D, group, o, s);
  } else {
    float* o = static_cast<float*>(dst);
    if (group == 0) DecodeBlockAvx512<kBits, true>(src, rows, D, group, o, s);
    else DecodeBlockAvx512<kBits, false>(src, rows, D, group, o, s);
  }
  return true;
}
KVSERVE_END_TIER
#endif

}  // namespace

size_t EncodeBlock(const void* src, DType dt, size_t rows, size_t n_channel, size_t group, int bits, uint8_t* dst,
                   BlockScratch& s, const NextRows* next) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && FusedWidthsFit(n_channel, group) && rows > 0) {
    if (dt == DType::kF16) {
      const DenseRowsOf<uint16_t> rows_of{static_cast<const uint16_t*>(src), n_channel};
      return EncodeBlockAvx512<uint16_t>(rows_of, rows, n_channel, group, bits, dst, s, next);
    }
    if (dt == DType::kF32) {
      const DenseRowsOf<float> rows_of{static_cast<const float*>(src), n_channel};
      return EncodeBlockAvx512<float>(rows_of, rows, n_channel, group, bits, dst, s, next);
    }
  }
#else
  (void)next;
#endif
  return EncodeBlockComposed(src, dt, rows, n_channel, group, bits, dst, s, false);
}

size_t EncodeBlockFromRows(const uint8_t* const* row_in, DType dt, size_t rows, size_t n_channel, size_t group, int bits,
                           uint8_t* dst, BlockScratch& s, const NextRows* next) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && FusedWidthsFit(n_channel, group) && rows > 0) {
    if (dt == DType::kF16) {
      const RowPointers<uint16_t> rows_of{reinterpret_cast<const uint16_t* const*>(row_in)};
      return EncodeBlockAvx512<uint16_t>(rows_of, rows, n_channel, group, bits, dst, s, next);
    }
    if (dt == DType::kF32) {
      const RowPointers<float> rows_of{reinterpret_cast<const float* const*>(row_in)};
      return EncodeBlockAvx512<float>(rows_of, rows, n_channel, group, bits, dst, s, next);
    }
  }
#endif
  // Elsewhere: each row converted to float where it lies (no gathered copy), a share of `next`
  // asked for after each, then the float path.
  s.Reserve(rows * n_channel, BlockMetaCount(rows, n_channel, group));
  const size_t next_bytes = next ? next->n_rows * next->row_bytes : 0;
  for (size_t r = 0; r < rows; ++r) {
    ConvertToF32(dt, row_in[r], s.x.data() + r * n_channel, n_channel);
    const size_t from = next_bytes * r / rows;
    if (next_bytes) AskRows(*next, from, next_bytes * (r + 1) / rows - from);
  }
  return EncodeFloatBlock(rows, n_channel, group, bits, dst, s, false);
}

void DecodeBlock(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt, void* dst,
                 BlockScratch& s) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && (dt == DType::kF16 || dt == DType::kF32) && FusedWidthsFit(n_channel, group)) {
    s.Reserve(rows * n_channel, BlockMetaCount(rows, n_channel, group));
    bool done = false;
    switch (bits) {
      case 1: done = DecodeBlockFused<1>(src, rows, n_channel, group, dt, dst, s); break;
      case 2: done = DecodeBlockFused<2>(src, rows, n_channel, group, dt, dst, s); break;
      case 3: done = DecodeBlockFused<3>(src, rows, n_channel, group, dt, dst, s); break;
      case 4: done = DecodeBlockFused<4>(src, rows, n_channel, group, dt, dst, s); break;
      case 5: done = DecodeBlockFused<5>(src, rows, n_channel, group, dt, dst, s); break;
      case 6: done = DecodeBlockFused<6>(src, rows, n_channel, group, dt, dst, s); break;
      case 7: done = DecodeBlockFused<7>(src, rows, n_channel, group, dt, dst, s); break;
      case 8: done = DecodeBlockFused<8>(src, rows, n_channel, group, dt, dst, s); break;
    }
    if (done) return;
  }
#endif
  DecodeBlockComposed(src, rows, n_channel, group, bits, dt, dst, s, false);
}

void DecodeBlockToRows(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt,
                       uint8_t* const* row_out, BlockScratch& s) {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512) && dt == DType::kF16 && FusedWidthsFit(n_channel, group)) {
    s.Reserve(rows * n_channel, BlockMetaCount(rows, n_channel, group));
    bool done = false;
    switch (bits) {
      case 1: done = DecodeBlockFused<1>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 2: done = DecodeBlockFused<2>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 3: done = DecodeBlockFused<3>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 4: done = DecodeBlockFused<4>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 5: done = DecodeBlockFused<5>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 6: done = DecodeBlockFused<6>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 7: done = DecodeBlockFused<7>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
      case 8: done = DecodeBlockFused<8>(src, rows, n_channel, group, dt, nullptr, s, row_out); break;
    }
    if (done) return;
  }
  if (cpu::Use(cpu::Tier::kAvx512)) {
    // What DecodeBlock writes on this tier (its fused f32 loop and AVX-512 fp16 dequantiser
    // round as they do, not as the float path below), copied row by row: rare here (bf16, f32,
    // widths or row counts the fused loop does not take).
    thread_local std::vector<uint8_t> block;
    const size_t row_bytes = n_channel * DTypeSize(dt);
    block.resize(rows * row_bytes);
    DecodeBlock(src, rows, n_channel, group, bits, dt, block.data(), s);
    for (size_t r = 0; r < rows; ++r) std::memcpy(row_out[r], block.data() + r * row_bytes, row_bytes);
    return;
  }
#endif
  // Elsewhere: dequantise the block to floats (in cache) and convert each row into its page with
  // non-temporal stores — what DecodeBlock computes on these tiers. Decoding into a block buffer
  // first would stream it out of cache with the dense path's stores, only to read it back
  // (paged/dense decode 0.56 on AVX2, docs/results/paged.md).
  const size_t m = BlockMetaCount(rows, n_channel, group);
  s.Reserve(rows * n_channel, m);
  ReadBlock(src, m, rows * n_channel, bits, s);
  if (group == 0) DequantizeColumns(s.codes.data(), rows, n_channel, s.lo.data(), s.step.data(), s.x.data());
  else DequantizeRowGroups(s.codes.data(), rows, n_channel, group, s.lo.data(), s.step.data(), s.x.data());
  ConvertFromF32StreamingRows(dt, s.x.data(), n_channel, row_out, rows);
}

size_t EncodeBlockReference(const void* src, DType dt, size_t rows, size_t n_channel, size_t group, int bits,
                            uint8_t* dst, BlockScratch& s) {
  return EncodeBlockComposed(src, dt, rows, n_channel, group, bits, dst, s, true);
}

void DecodeBlockReference(const uint8_t* src, size_t rows, size_t n_channel, size_t group, int bits, DType dt,
                          void* dst, BlockScratch& s) {
  DecodeBlockComposed(src, rows, n_channel, group, bits, dt, dst, s, true);
}

void StreamFence() {
#ifdef KVSERVE_QUANT_AVX512
  if (cpu::Use(cpu::Tier::kAvx512)) _mm_sfence();
#endif
}

bool HaveAvx512Kernels() {
#ifdef KVSERVE_QUANT_AVX512
  return cpu::Use(cpu::Tier::kAvx512);
#else
  return false;
#endif
}

}  // namespace quant
}  // namespace kvserve
