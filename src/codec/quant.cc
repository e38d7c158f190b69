// quant(kbits, vbits, kaxis, vaxis, group, residual, boost_layers, boost_bits): asymmetric uniform min-max quantisation,
// 1-8 bits, separately for K and V, KIVI-style: K per channel (groups of `group` tokens share a
// range per channel), V per token (groups of `group` channels share a range per token); the most
// recent `residual` tokens stay fp16. Group sizes larger than the axis are clamped per frame and
// the effective values are recorded in the payload.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/quant_kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define KVSERVE_QUANT_AVX512 1
#endif
#include "codec/stage.h"

namespace kvserve {
namespace quant {

size_t PackedBytes(size_t n, int bits) { return (n + 7) / 8 * bits; }

namespace {
template <int W>
void PackPlane(const uint8_t* codes, size_t n8, int shift, uint8_t* out) {
  constexpr int K = 8 / W;
  constexpr unsigned M = (1u << W) - 1;
  const size_t len = n8 / K;
  for (size_t j = 0; j < len; ++j) {
    unsigned b = 0;
    for (int i = 0; i < K; ++i) b |= ((unsigned(codes[j + i * len]) >> shift) & M) << (i * W);
    out[j] = static_cast<uint8_t>(b);
  }
}
template <int W>
void UnpackPlane(const uint8_t* in, size_t n8, int shift, uint8_t* codes, bool first) {
  constexpr int K = 8 / W;
  constexpr unsigned M = (1u << W) - 1;
  const size_t len = n8 / K;
  for (int i = 0; i < K; ++i) {
    uint8_t* c = codes + i * len;
    if (first) {
      for (size_t j = 0; j < len; ++j) c[j] = static_cast<uint8_t>(((in[j] >> (i * W)) & M) << shift);
    } else {
      for (size_t j = 0; j < len; ++j) c[j] |= static_cast<uint8_t>(((in[j] >> (i * W)) & M) << shift);
    }
  }
}
}  // namespace

void PackCodes(const uint8_t* codes, size_t n8, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, n8);
    return;
  }
  int shift = 0;
  if (bits & 4) { PackPlane<4>(codes, n8, shift, out); out += n8 / 2; shift += 4; }
  if (bits & 2) { PackPlane<2>(codes, n8, shift, out); out += n8 / 4; shift += 2; }
  if (bits & 1) { PackPlane<1>(codes, n8, shift, out); }
}

void UnpackCodes(const uint8_t* in, size_t n8, int bits, uint8_t* codes) {
  if (bits == 8) {
    std::memcpy(codes, in, n8);
    return;
  }
  int shift = 0;
  bool first = true;
  if (bits & 4) { UnpackPlane<4>(in, n8, shift, codes, first); in += n8 / 2; shift += 4; first = false; }
  if (bits & 2) { UnpackPlane<2>(in, n8, shift, codes, first); in += n8 / 4; shift += 2; first = false; }
  if (bits & 1) { UnpackPlane<1>(in, n8, shift, codes, first); }
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
  v = v < 0.f ? 0.f : v;
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
#endif

void ConvertColumnMinMaxF16(const uint16_t* src, size_t rows, size_t n_channel, float* x, float* mn, float* mx) {
#ifdef KVSERVE_QUANT_AVX512
  if (n_channel % 16 == 0 && rows > 0) {
    for (size_t c = 0; c < n_channel; c += 16) {
      __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c)));
      _mm512_storeu_ps(x + c, v);
      __m512 lo = v, hi = v;
      for (size_t r = 1; r < rows; ++r) {
        v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * n_channel + c)));
        _mm512_storeu_ps(x + r * n_channel + c, v);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
      }
      _mm512_storeu_ps(mn + c, lo);
      _mm512_storeu_ps(mx + c, hi);
    }
    return;
  }
#endif
  ConvertToF32(DType::kF16, src, x, rows * n_channel);
  ColumnMinMax(x, rows, n_channel, mn, mx);
}

void RowGroupMinMaxFast(const float* x, size_t rows, size_t n_channel, size_t group, float* mn, float* mx) {
#ifdef KVSERVE_QUANT_AVX512
  if (group % 16 == 0 && n_channel % group == 0) {
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
    return;
  }
#endif
  RowGroupMinMax(x, rows, n_channel, group, mn, mx);
}

void QuantizeColumnsFast(const float* x, size_t rows, size_t n_channel, const float* lo, const float* inv_step,
                         int levels, uint8_t* codes) {
#ifdef KVSERVE_QUANT_AVX512
  if (n_channel % 16 == 0) {
    const __m512 fl = _mm512_set1_ps(float(levels));
    for (size_t r = 0; r < rows; ++r) {
      for (size_t c = 0; c < n_channel; c += 16) {
        const __m512 l = _mm512_loadu_ps(lo + c), inv = _mm512_loadu_ps(inv_step + c);
        const __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + r * n_channel + c), l), inv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * n_channel + c), Codes16(v, fl));
      }
    }
    return;
  }
#endif
  QuantizeColumns(x, rows, n_channel, lo, inv_step, levels, codes);
}

void QuantizeRowGroupsFast(const float* x, size_t rows, size_t n_channel, size_t group, const float* lo,
                           const float* inv_step, int levels, uint8_t* codes) {
#ifdef KVSERVE_QUANT_AVX512
  if (group % 16 == 0 && n_channel % group == 0) {
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
    return;
  }
#endif
  QuantizeRowGroups(x, rows, n_channel, group, lo, inv_step, levels, codes);
}

void DequantizeColumnsF16(const uint8_t* codes, size_t rows, size_t n_channel, const float* lo, const float* step,
                          float* scratch, uint16_t* dst) {
#ifdef KVSERVE_QUANT_AVX512
  if (n_channel % 16 == 0) {
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
    return;
  }
#endif
  DequantizeColumns(codes, rows, n_channel, lo, step, scratch);
  ConvertFromF32Streaming(DType::kF16, scratch, dst, rows * n_channel);
}

void DequantizeRowGroupsF16(const uint8_t* codes, size_t rows, size_t n_channel, size_t group, const float* lo,
                            const float* step, float* scratch, uint16_t* dst) {
#ifdef KVSERVE_QUANT_AVX512
  if (group % 16 == 0 && n_channel % group == 0) {
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
    return;
  }
#endif
  DequantizeRowGroups(codes, rows, n_channel, group, lo, step, scratch);
  ConvertFromF32Streaming(DType::kF16, scratch, dst, rows * n_channel);
}

}  // namespace quant

namespace {

// Tokens per packing block along the token axis (per-token V): only the packing granularity,
// the quantisation groups are per token.
constexpr uint32_t kTokenAxisBlock = 64;
constexpr size_t kPayloadHeader = 24;

struct PartLayout {
  int bits = 4;
  bool channel_axis = true;  // ranges per channel over groups of tokens
  uint32_t group = 32;       // effective: tokens (channel axis) or channels (token axis)
  uint32_t head_dim = 0;
  uint32_t n_quant = 0;      // tokens quantised
  uint32_t residual = 0;     // tokens kept fp16 at the end

  int levels() const { return (1 << bits) - 1; }
  uint32_t block_tokens() const { return channel_axis ? group : kTokenAxisBlock; }
  size_t n_group_per_row() const { return (head_dim + group - 1) / group; }
  size_t meta_count(uint32_t bt) const { return channel_axis ? head_dim : bt * n_group_per_row(); }
  size_t block_bytes(uint32_t bt) const {
    return meta_count(bt) * 4 + quant::PackedBytes(size_t{bt} * head_dim, bits);
  }
  size_t slab_bytes() const {
    size_t total = 0;
    const uint32_t b = block_tokens();
    if (n_quant > 0) total += size_t{n_quant / b} * block_bytes(b) + (n_quant % b ? block_bytes(n_quant % b) : 0);
    return total + size_t{residual} * head_dim * 2;
  }
};

struct Scratch {
  std::vector<float> x, mn, mx, lo, step, inv;
  std::vector<uint16_t> lo_h, step_h;
  ByteBuffer codes;
  void Reserve(const PartLayout& p) {
    const size_t n = size_t{p.block_tokens()} * p.head_dim + 8;
    x.resize(n);
    codes.resize(n);
    const size_t m = p.meta_count(p.block_tokens());
    mn.resize(m), mx.resize(m), lo.resize(m), step.resize(m), inv.resize(m), lo_h.resize(m), step_h.resize(m);
  }
};

Status EncodeSlab(const uint8_t* src, DType dt, const PartLayout& p, uint8_t* dst, Scratch& s) {
  const size_t es = DTypeSize(dt), D = p.head_dim;
  s.Reserve(p);
  for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
    const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
    const size_t n = size_t{bt} * D, n8 = (n + 7) & ~size_t{7};
    const size_t m = p.meta_count(bt);
    const uint8_t* block = src + t0 * D * es;
    if (p.channel_axis && dt == DType::kF16) {
      quant::ConvertColumnMinMaxF16(reinterpret_cast<const uint16_t*>(block), bt, D, s.x.data(), s.mn.data(),
                                    s.mx.data());
    } else {
      ConvertToF32(dt, block, s.x.data(), n);
      if (p.channel_axis) quant::ColumnMinMax(s.x.data(), bt, D, s.mn.data(), s.mx.data());
      else quant::RowGroupMinMaxFast(s.x.data(), bt, D, p.group, s.mn.data(), s.mx.data());
    }
    const size_t bad = quant::GroupRanges(s.mn.data(), s.mx.data(), m, p.levels(), s.lo_h.data(), s.step_h.data(),
                                          s.lo.data(), s.step.data(), s.inv.data());
    if (bad < m) {
      return Status::InvalidArgument("value range [" + std::to_string(s.mn[bad]) + ", " + std::to_string(s.mx[bad]) +
                                     "] of a group does not fit fp16 quantisation metadata");
    }
    if (p.channel_axis) {
      quant::QuantizeColumnsFast(s.x.data(), bt, D, s.lo.data(), s.inv.data(), p.levels(), s.codes.data());
    } else {
      quant::QuantizeRowGroupsFast(s.x.data(), bt, D, p.group, s.lo.data(), s.inv.data(), p.levels(),
                                   s.codes.data());
    }
    std::memset(s.codes.data() + n, 0, n8 - n);
    std::memcpy(dst, s.lo_h.data(), m * 2);
    std::memcpy(dst + m * 2, s.step_h.data(), m * 2);
    quant::PackCodes(s.codes.data(), n8, p.bits, dst + m * 4);
    dst += p.block_bytes(bt);
  }
  const size_t nr = size_t{p.residual} * D;
  if (nr > 0) {
    const uint8_t* r = src + size_t{p.n_quant} * D * es;
    if (dt == DType::kF16) {
      std::memcpy(dst, r, nr * 2);
    } else {
      s.x.resize(std::max(s.x.size(), nr));
      ConvertToF32(dt, r, s.x.data(), nr);
      ConvertFromF32(DType::kF16, s.x.data(), dst, nr);
    }
  }
  return Status::Ok();
}

void DecodeSlab(const uint8_t* src, const PartLayout& p, DType dt, uint8_t* dst, Scratch& s) {
  const size_t es = DTypeSize(dt), D = p.head_dim;
  s.Reserve(p);
  for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
    const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
    const size_t n = size_t{bt} * D, n8 = (n + 7) & ~size_t{7};
    const size_t m = p.meta_count(bt);
    std::memcpy(s.lo_h.data(), src, m * 2);
    std::memcpy(s.step_h.data(), src + m * 2, m * 2);
    ConvertToF32(DType::kF16, s.lo_h.data(), s.lo.data(), m);
    ConvertToF32(DType::kF16, s.step_h.data(), s.step.data(), m);
    quant::UnpackCodes(src + m * 4, n8, p.bits, s.codes.data());
    uint8_t* out = dst + t0 * D * es;
    if (dt == DType::kF16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      if (p.channel_axis) quant::DequantizeColumnsF16(s.codes.data(), bt, D, s.lo.data(), s.step.data(), s.x.data(), o);
      else quant::DequantizeRowGroupsF16(s.codes.data(), bt, D, p.group, s.lo.data(), s.step.data(), s.x.data(), o);
      src += p.block_bytes(bt);
      continue;
    }
    if (p.channel_axis) {
      quant::DequantizeColumns(s.codes.data(), bt, D, s.lo.data(), s.step.data(), s.x.data());
    } else {
      quant::DequantizeRowGroups(s.codes.data(), bt, D, p.group, s.lo.data(), s.step.data(), s.x.data());
    }
    ConvertFromF32Streaming(dt, s.x.data(), out, n);
    src += p.block_bytes(bt);
  }
  const size_t nr = size_t{p.residual} * D;
  if (nr > 0) {
    uint8_t* r = dst + size_t{p.n_quant} * D * es;
    if (dt == DType::kF16) {
      std::memcpy(r, src, nr * 2);
    } else {
      s.x.resize(std::max(s.x.size(), nr));
      ConvertToF32(DType::kF16, src, s.x.data(), nr);
      ConvertFromF32(dt, s.x.data(), r, nr);
    }
  }
}

class QuantStage final : public Stage {
 public:
  QuantStage(int kbits, int vbits, bool k_channel, bool v_channel, uint32_t group, uint32_t residual,
             uint32_t boost_layers, int boost_bits)
      : kbits_(kbits), vbits_(vbits), k_channel_(k_channel), v_channel_(v_channel), group_(group), residual_(residual),
        boost_layers_(boost_layers), boost_bits_(boost_bits) {}

  // Layout of one slab's part; the first boost_layers layers get boost_bits more (CacheGen gives
  // shallow layers more bits: their errors propagate through every later layer).
  PartLayout Layout(KvPart part, const KvShape& shape, uint32_t layer) const {
    PartLayout p;
    const bool k = part == KvPart::kKey;
    p.bits = std::min(8, (k ? kbits_ : vbits_) + (layer < boost_layers_ ? boost_bits_ : 0));
    p.channel_axis = k ? k_channel_ : v_channel_;
    p.head_dim = shape.head_dim;
    p.residual = std::min(residual_, shape.n_token);
    p.n_quant = shape.n_token - p.residual;
    p.group = p.channel_axis ? std::max<uint32_t>(1, std::min(group_, p.n_quant)) : std::min(group_, shape.head_dim);
    return p;
  }
  PartLayout SlabLayout(uint64_t i, const KvShape& shape) const {
    return Layout((i / shape.n_head_kv) % 2 ? KvPart::kValue : KvPart::kKey, shape, uint32_t(i / (2 * shape.n_head_kv)));
  }

  // Byte offset of every slab (after the payload header), slabs ordered [layer][K|V][head]; the
  // last entry is the total.
  std::vector<size_t> SlabOffsets(const KvShape& shape) const {
    std::vector<size_t> off(shape.n_slab() + 1, 0);
    for (uint64_t i = 0; i < shape.n_slab(); ++i) off[i + 1] = off[i] + SlabLayout(i, shape).slab_bytes();
    return off;
  }

  uint16_t EffectiveBoostLayers(const KvShape& shape) const {
    return uint16_t(boost_bits_ ? std::min<uint32_t>(boost_layers_, shape.n_layer) : 0);
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& shape = t.shape();
    const PartLayout kl = Layout(KvPart::kKey, shape, 0), vl = Layout(KvPart::kValue, shape, 0);
    const std::vector<size_t> off = SlabOffsets(shape);
    const size_t start = out.bytes->size();
    out.bytes->resize(start + kPayloadHeader + off.back());
    uint8_t* hdr = out.bytes->data() + start;
    hdr[0] = 1;
    hdr[1] = static_cast<uint8_t>(kbits_);
    hdr[2] = static_cast<uint8_t>(vbits_);
    hdr[3] = k_channel_ ? 0 : 1;
    hdr[4] = v_channel_ ? 0 : 1;
    hdr[5] = static_cast<uint8_t>(boost_bits_);
    const uint16_t boost = EffectiveBoostLayers(shape);
    std::memcpy(hdr + 6, &boost, 2);
    std::memcpy(hdr + 8, &kl.group, 4);
    std::memcpy(hdr + 12, &vl.group, 4);
    std::memcpy(hdr + 16, &kl.residual, 4);
    std::memcpy(hdr + 20, &shape.n_token, 4);
    uint8_t* body = hdr + kPayloadHeader;
    std::vector<Status> errors(shape.n_slab());
    ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t i) {
      thread_local Scratch scratch;
      errors[i] = EncodeSlab(t.slab_at(i), t.dtype(), SlabLayout(i, shape), body + off[i], scratch);
    });
    for (uint64_t i = 0; i < errors.size(); ++i) {
      if (!errors[i].ok()) {
        const uint64_t h = shape.n_head_kv;
        return errors[i].WithContext("layer " + std::to_string(i / (2 * h)) + ((i / h) % 2 ? " V" : " K") + " head " +
                                     std::to_string(i % h));
      }
    }
    return Status::Ok();
  }

  std::vector<CodeSection> CodeSections(const KvShape& shape) const override {
    const std::vector<size_t> offs = SlabOffsets(shape);
    std::vector<CodeSection> out;
    for (uint64_t i = 0; i < shape.n_slab(); ++i) {
      const uint64_t part = (i / shape.n_head_kv) % 2, layer = i / (2 * shape.n_head_kv);
      const PartLayout p = SlabLayout(i, shape);
      uint64_t off = kPayloadHeader + offs[i];
      for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
        const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
        const size_t n8 = (size_t{bt} * p.head_dim + 7) & ~size_t{7};
        const uint32_t m = uint32_t(p.meta_count(bt)), ctx = uint32_t(layer * 2 + part);
        // Minima, then steps, then the codes: each kind of value gets its own statistics.
        out.push_back({off, m, 16, 1, ctx * 2, CodeSection::Kind::kHalf});
        out.push_back({off + m * 2, m, 16, 1, ctx * 2 + 1, CodeSection::Kind::kHalf});
        out.push_back({off + m * 4, uint32_t(n8), uint8_t(p.bits), p.head_dim, ctx});
        off += p.block_bytes(bt);
      }
    }
    return out;
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const KvShape& shape = t.shape();
    const PartLayout kl = Layout(KvPart::kKey, shape, 0), vl = Layout(KvPart::kValue, shape, 0);
    const std::vector<size_t> off = SlabOffsets(shape);
    const size_t want = kPayloadHeader + off.back();
    if (in.bytes.size() != want) {
      return Status::Corrupt("quant payload is " + std::to_string(in.bytes.size()) + " bytes, shape " +
                             shape.ToString() + " needs " + std::to_string(want));
    }
    const uint8_t* hdr = in.bytes.data();
    uint32_t kg, vg, res, nt;
    uint16_t boost;
    std::memcpy(&boost, hdr + 6, 2);
    std::memcpy(&kg, hdr + 8, 4);
    std::memcpy(&vg, hdr + 12, 4);
    std::memcpy(&res, hdr + 16, 4);
    std::memcpy(&nt, hdr + 20, 4);
    if (hdr[0] != 1 || hdr[1] != kbits_ || hdr[2] != vbits_ || hdr[3] != (k_channel_ ? 0 : 1) ||
        hdr[4] != (v_channel_ ? 0 : 1) || hdr[5] != boost_bits_ || boost != EffectiveBoostLayers(shape) ||
        kg != kl.group || vg != vl.group || res != kl.residual || nt != shape.n_token) {
      return Status::Corrupt("quant payload header does not match the frame's strategy and shape");
    }
    const uint8_t* body = hdr + kPayloadHeader;
    ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t i) {
      thread_local Scratch scratch;
      DecodeSlab(body + off[i], SlabLayout(i, shape), t.dtype(), t.slab_at(i), scratch);
    });
    return Status::Ok();
  }

 private:
  int kbits_, vbits_;
  bool k_channel_, v_channel_;
  uint32_t group_, residual_;
  uint32_t boost_layers_;
  int boost_bits_;
};

Result<std::unique_ptr<Stage>> MakeQuant(const StageSpec& spec, const CodecEnv&) {
  return std::unique_ptr<Stage>(new QuantStage(
      static_cast<int>(spec.GetInt("kbits")), static_cast<int>(spec.GetInt("vbits")), spec.Get("kaxis") == "channel",
      spec.Get("vaxis") == "channel", static_cast<uint32_t>(spec.GetInt("group")),
      static_cast<uint32_t>(spec.GetInt("residual")), static_cast<uint32_t>(spec.GetInt("boost_layers")),
      static_cast<int>(spec.GetInt("boost_bits"))));
}

}  // namespace

StageRegistration QuantStageRegistration() {
  StageInfo info;
  info.name = "quant";
  info.summary = "asymmetric min-max quantisation, K and V separately, bit-packed (KIVI-style axes)";
  info.input = DataKind::kTensor;
  info.output = DataKind::kSymbols;
  using T = ParamSpec::Type;
  info.params = {
      {"kbits", T::kInt, 1, 8, {}, "4", "bits per K value", ParamSpec::Scale::kStep},
      {"vbits", T::kInt, 1, 8, {}, "4", "bits per V value", ParamSpec::Scale::kStep},
      {"kaxis", T::kEnum, 0, 0, {"channel", "token"}, "channel",
       "K ranges per channel (over a group of tokens) or per token (over a group of channels)"},
      {"vaxis", T::kEnum, 0, 0, {"channel", "token"}, "token", "V ranges, as kaxis"},
      {"group", T::kInt, 1, 65536, {}, "32", "values sharing one range along the grouped axis (clamped to it)", ParamSpec::Scale::kLog},
      {"residual", T::kInt, 0, 1 << 20, {}, "0", "most recent tokens kept in fp16", ParamSpec::Scale::kLog1p},
      {"boost_layers", T::kInt, 0, 4096, {}, "0", "first layers that get boost_bits more (CacheGen-style)"},
      {"boost_bits", T::kInt, 0, 7, {}, "1", "extra bits of the boosted layers (capped at 8)"},
  };
  return {info, &MakeQuant,
          [](const StageSpec& spec, const KvShape&, uint32_t layer_begin, uint32_t n_layers) -> Result<StageSpec> {
            StageSpec out = spec;
            const int64_t boosted = spec.GetInt("boost_layers") - int64_t(layer_begin);
            out.Set("boost_layers", std::to_string(std::clamp<int64_t>(boosted, 0, n_layers)));
            return out;
          }};
}

}  // namespace kvserve

namespace kvserve::quant {
#ifdef KVSERVE_QUANT_AVX512
bool HaveAvx512Kernels() { return true; }
#else
bool HaveAvx512Kernels() { return false; }
#endif
}  // namespace kvserve::quant
