// Storage dtype conversions (f32 <-> f16/bf16/e4m3/e5m2). The F16C loops run when the CPU has them
// (runtime dispatch, kvserve/cpu.h); the FP8 conversions are branch-free bit arithmetic, 8 values
// a step with AVX2 and 16 with AVX-512; the scalar functions are the reference they are tested
// against.
#include <cmath>
#include <cstring>
#include <vector>

#include "kvserve/cpu.h"
#include "kvserve/kv.h"

#ifdef KVSERVE_HAVE_AVX2_REGION
#include <immintrin.h>
#define KVSERVE_HAVE_F16C 1
#endif

namespace kvserve {
namespace {
inline uint32_t Bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float FromBits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
}  // namespace

bool HaveF16cConversions() {
#ifdef KVSERVE_HAVE_F16C
  return cpu::Use(cpu::Tier::kAvx2);
#else
  return false;
#endif
}

bool IsFp8(DType dtype) { return dtype == DType::kE4M3 || dtype == DType::kE5M2; }

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kE4M3:
    case DType::kE5M2: return 1;
  }
  return 1;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kE4M3: return "e4m3";
    case DType::kE5M2: return "e5m2";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "e4m3" || name == "fp8_e4m3" || name == "float8_e4m3fn") return DType::kE4M3;
  if (name == "e5m2" || name == "fp8_e5m2" || name == "float8_e5m2") return DType::kE5M2;
  return Status::InvalidArgument("unknown dtype '" + std::string(name) + "' (expected f32, f16, bf16, e4m3 or e5m2)");
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  if (exp == 0) {
    // Zero or subnormal: mant * 2^-24, exact in float.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return FromBits(Bits(v) | sign);
  }
  if (exp == 31) return FromBits(sign | 0x7f800000u | (mant << 13));
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToHalf(float f) {
  uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7fffffffu;
  if (x >= 0x47800000u) {  // |f| >= 65536: inf, or NaN made quiet with its payload's top bits
    if (x > 0x7f800000u) return sign | 0x7e00 | ((x >> 13) & 0x3ff);
    return sign | 0x7c00;
  }
  if (x < 0x38800000u) {
    // Below the smallest normal half: adding 0.5f lines the half's subnormal bits up with the
    // float mantissa's low bits, and the FPU's own rounding gives round-to-nearest-even.
    const float a = FromBits(x) + 0.5f;
    return sign | static_cast<uint16_t>(Bits(a) - 0x3f000000u);
  }
  const uint32_t mant_odd = (x >> 13) & 1;
  x += 0xc8000fffu + mant_odd;  // rebias exponent 127 -> 15 and round half to even
  return sign | static_cast<uint16_t>(x >> 13);
}

float BFloat16ToFloat(uint16_t b) { return FromBits(uint32_t{b} << 16); }

uint16_t FloatToBFloat16(float f) {
  const uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

namespace scalar {
void HalfToFloat(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = kvserve::HalfToFloat(src[i]);
}
void FloatToHalf(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = kvserve::FloatToHalf(src[i]);
}
}  // namespace scalar

namespace {
#ifdef KVSERVE_HAVE_F16C
KVSERVE_BEGIN_AVX2
size_t HalfToFloatF16c(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
    _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(b));
  }
  return i;
}

// kStream: non-temporal stores (dst 16-byte aligned), ending with a fence that orders them
// before anything this thread publishes next unless kFence is false (the caller fences once
// after many short runs).
template <bool kStream, bool kFence = true>
size_t FloatToHalfF16c(const float* src, uint16_t* dst, size_t n) {
  auto store = [&](uint16_t* p, __m128i h) {
    if constexpr (kStream) _mm_stream_si128(reinterpret_cast<__m128i*>(p), h);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  };
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store(dst + i, _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    store(dst + i + 8, _mm256_cvtps_ph(_mm256_loadu_ps(src + i + 8), _MM_FROUND_TO_NEAREST_INT));
  }
  if constexpr (kStream && kFence) _mm_sfence();
  return i;
}
KVSERVE_END_TIER
#endif

void HalfToFloatFast(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#ifdef KVSERVE_HAVE_F16C
  if (cpu::Use(cpu::Tier::kAvx2)) i = HalfToFloatF16c(src, dst, n);
#endif
  scalar::HalfToFloat(src + i, dst + i, n - i);
}

void FloatToHalfFast(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#ifdef KVSERVE_HAVE_F16C
  if (cpu::Use(cpu::Tier::kAvx2)) i = FloatToHalfF16c<false>(src, dst, n);
#endif
  scalar::FloatToHalf(src + i, dst + i, n - i);
}
}  // namespace

// ---- FP8 ----
// A format: E exponent bits, M mantissa bits, bias 2^(E-1) - 1; kFn: E4M3FN (no infinities, only
// S.1111.111 is NaN) rather than IEEE-like.
namespace {
template <int E, int M, bool kFn>
struct Fp8 {
  static constexpr int kExpBits = E, kManBits = M;
  static constexpr bool kFnFormat = kFn;
  static constexpr int kBias = (1 << (E - 1)) - 1;
  static constexpr uint32_t kMaxCode = kFn ? 0x7e : uint32_t(((1 << E) - 2) << M | ((1 << M) - 1));
  static constexpr uint32_t kInfCode = kFn ? 0x7e : uint32_t(((1 << E) - 1) << M);  // saturated in E4M3
  static constexpr uint32_t kNanCode = kFn ? 0x7f : uint32_t(((1 << E) - 1) << M | (1 << (M - 1)));
  // Float bits of the smallest normal, 2^(1 - bias), and of the adder whose ulp is the
  // subnormal step 2^(1 - bias - M): a + it rounds a to that step (round to nearest even).
  static constexpr uint32_t kMinNormalBits = uint32_t(127 + 1 - kBias) << 23;
  static constexpr uint32_t kMagicBits = uint32_t(127 + 24 - kBias - M) << 23;
  static constexpr uint32_t kRebias = uint32_t(127 - kBias) << M;

  __attribute__((always_inline)) static inline uint8_t FromFloat(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 24) & 0x80;
    x &= 0x7fffffffu;
    // Normal: round the mantissa to M bits (half to even), then rebias.
    const uint32_t r = x + ((1u << (22 - M)) - 1) + ((x >> (23 - M)) & 1);
    const uint32_t normal = (r >> (23 - M)) - kRebias;
    // Subnormal: the FPU's own rounding of a + magic.
    float a, magic, t;
    std::memcpy(&a, &x, 4);
    const uint32_t mb = kMagicBits;
    std::memcpy(&magic, &mb, 4);
    t = a + magic;
    uint32_t tb;
    std::memcpy(&tb, &t, 4);
    const uint32_t sub = tb - kMagicBits;
    uint32_t code = x < kMinNormalBits ? sub : normal;
    code = (x >= 0x7f800000u || code > kMaxCode) ? kMaxCode : code;  // saturate (infinities below)
    code = x == 0x7f800000u ? kInfCode : code;
    code = x > 0x7f800000u ? kNanCode : code;
    return uint8_t(sign | code);
  }

  __attribute__((always_inline)) static inline float ToFloat(uint8_t b) {
    const uint32_t sign = uint32_t(b & 0x80) << 24;
    const uint32_t mag = b & 0x7f;
    const uint32_t exp = mag >> M, man = mag & ((1u << M) - 1);
    uint32_t bits = (mag << (23 - M)) + (uint32_t(127 - kBias) << 23);
    // Subnormal: man * 2^(1 - bias - M), exact in float.
    const float sub = float(man) * (1.0f / float(1u << (kBias - 1 + M)));
    uint32_t sub_bits;
    std::memcpy(&sub_bits, &sub, 4);
    bits = exp == 0 ? sub_bits : bits;
    if constexpr (kFn) {
      bits = mag == 0x7f ? 0x7fc00000u : bits;
    } else {
      bits = exp == (1u << E) - 1 ? (0x7f800000u | (man << (23 - M))) : bits;
    }
    bits |= sign;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
};
using E4M3 = Fp8<4, 3, true>;
using E5M2 = Fp8<5, 2, false>;

template <typename F>
void Fp8ToFloatLoop(const uint8_t* __restrict src, float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F::ToFloat(src[i]);
}
template <typename F>
void FloatToFp8Loop(const float* __restrict src, uint8_t* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F::FromFloat(src[i]);
}

#ifdef KVSERVE_HAVE_AVX2_REGION
KVSERVE_BEGIN_AVX2
// The same arithmetic as Fp8::FromFloat / ToFloat, 8 values per step, selects as blends (the
// plain loops do not vectorise: the compiler keeps their selects as branches).
template <typename F>
struct Fp8Avx2 {
  static constexpr int M = F::kManBits, E = F::kExpBits;

  // 8 floats to 8 codes, in the low 8 bytes.
  static inline __m128i Encode(__m256 v) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), one = _mm256_set1_epi32(1);
    const __m256i round = _mm256_set1_epi32((1 << (22 - M)) - 1), rebias = _mm256_set1_epi32(int(F::kRebias));
    const __m256i magic = _mm256_set1_epi32(int(F::kMagicBits)), min_normal = _mm256_set1_epi32(int(F::kMinNormalBits));
    const __m256i max_code = _mm256_set1_epi32(int(F::kMaxCode)), inf_code = _mm256_set1_epi32(int(F::kInfCode));
    const __m256i nan_code = _mm256_set1_epi32(int(F::kNanCode)), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i max_finite = _mm256_set1_epi32(0x7f7fffff), sign_bit = _mm256_set1_epi32(0x80);
    // Byte 0 of each 32-bit lane into the first 4 bytes of its 128-bit half, then both halves'
    // first dwords together.
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0);
    __m256i x = _mm256_castps_si256(v);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(x, 24), sign_bit);
    x = _mm256_and_si256(x, abs_mask);
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(x, round), _mm256_and_si256(_mm256_srli_epi32(x, 23 - M), one));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(r, 23 - M), rebias);
    const __m256 t = _mm256_add_ps(_mm256_castsi256_ps(x), _mm256_castsi256_ps(magic));
    const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(t), magic);
    __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(min_normal, x));
    const __m256i over = _mm256_or_si256(_mm256_cmpgt_epi32(code, max_code), _mm256_cmpgt_epi32(x, max_finite));
    code = _mm256_blendv_epi8(code, max_code, over);
    code = _mm256_blendv_epi8(code, inf_code, _mm256_cmpeq_epi32(x, inf));
    code = _mm256_blendv_epi8(code, nan_code, _mm256_cmpgt_epi32(x, inf));
    code = _mm256_or_si256(code, sign);
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(code, pick), join));
  }

  // The 8 codes at src to 8 floats.
  static inline __m256 Decode(const uint8_t* src) {
    const __m256i sign_bit = _mm256_set1_epi32(0x80), mag_mask = _mm256_set1_epi32(0x7f);
    const __m256i man_mask = _mm256_set1_epi32((1 << M) - 1), zero = _mm256_setzero_si256();
    const __m256i rebias = _mm256_set1_epi32(int(uint32_t(127 - F::kBias) << 23));
    const __m256 sub_scale = _mm256_set1_ps(1.0f / float(1u << (F::kBias - 1 + M)));
    const __m256i top_exp = _mm256_set1_epi32((1 << E) - 1), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i nan = _mm256_set1_epi32(0x7fc00000);
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, sign_bit), 24);
    const __m256i mag = _mm256_and_si256(b, mag_mask);
    const __m256i exp = _mm256_srli_epi32(mag, M), man = _mm256_and_si256(mag, man_mask);
    __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - M), rebias);
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(man), sub_scale);
    bits = _mm256_blendv_epi8(bits, _mm256_castps_si256(sub), _mm256_cmpeq_epi32(exp, zero));
    if constexpr (F::kFnFormat) {
      bits = _mm256_blendv_epi8(bits, nan, _mm256_cmpeq_epi32(mag, mag_mask));
    } else {
      const __m256i special = _mm256_or_si256(inf, _mm256_slli_epi32(man, 23 - M));
      bits = _mm256_blendv_epi8(bits, special, _mm256_cmpeq_epi32(exp, top_exp));
    }
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
  }

  static size_t FromFloat(const float* src, uint8_t* dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), Encode(_mm256_loadu_ps(src + i)));
    return i;
  }
  static size_t ToFloat(const uint8_t* src, float* dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, Decode(src + i));
    return i;
  }
  // Fused with f16 and a scale: the codec's common case, without a float buffer in between.
  static size_t FromHalfScaled(const uint16_t* src, float mul, uint8_t* dst, size_t n) {
    const __m256 m = _mm256_set1_ps(mul);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), m);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), Encode(v));
    }
    return i;
  }
  // kStream: non-temporal stores to a 16-byte aligned dst, not fenced (a paged cache's rows,
  // where a plain store's line read costs most; the caller fences after its last row).
  template <bool kStream = false>
  static size_t ToHalfScaled(const uint8_t* src, float mul, uint16_t* dst, size_t n) {
    const __m256 m = _mm256_set1_ps(mul);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(Decode(src + i), m), _MM_FROUND_TO_NEAREST_INT);
      if constexpr (kStream) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), h);
      else _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
    }
    return i;
  }
};
KVSERVE_END_TIER
#endif

#ifdef KVSERVE_HAVE_AVX512_REGION
KVSERVE_BEGIN_AVX512
// Fp8Avx2's arithmetic, 16 values per step, with compare masks instead of blends and vpmovdb
// for the packing.
template <typename F>
struct Fp8Avx512 {
  static constexpr int M = F::kManBits, E = F::kExpBits;

  static inline __m128i Encode(__m512 v) {
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), one = _mm512_set1_epi32(1);
    const __m512i round = _mm512_set1_epi32((1 << (22 - M)) - 1), rebias = _mm512_set1_epi32(int(F::kRebias));
    const __m512i magic = _mm512_set1_epi32(int(F::kMagicBits)), min_normal = _mm512_set1_epi32(int(F::kMinNormalBits));
    const __m512i max_code = _mm512_set1_epi32(int(F::kMaxCode)), inf_code = _mm512_set1_epi32(int(F::kInfCode));
    const __m512i nan_code = _mm512_set1_epi32(int(F::kNanCode)), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i max_finite = _mm512_set1_epi32(0x7f7fffff), sign_bit = _mm512_set1_epi32(0x80);
    __m512i x = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(x, 24), sign_bit);
    x = _mm512_and_si512(x, abs_mask);
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, round), _mm512_and_si512(_mm512_srli_epi32(x, 23 - M), one));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(r, 23 - M), rebias);
    const __m512 t = _mm512_add_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(magic));
    const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(t), magic);
    __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmplt_epu32_mask(x, min_normal), sub);
    const __mmask16 over = _mm512_cmpgt_epi32_mask(code, max_code) | _mm512_cmpgt_epu32_mask(x, max_finite);
    code = _mm512_mask_mov_epi32(code, over, max_code);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpeq_epi32_mask(x, inf), inf_code);
    code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epu32_mask(x, inf), nan_code);
    return _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign));
  }

  static inline __m512 Decode(const uint8_t* src) {
    const __m512i sign_bit = _mm512_set1_epi32(0x80), mag_mask = _mm512_set1_epi32(0x7f);
    const __m512i man_mask = _mm512_set1_epi32((1 << M) - 1), zero = _mm512_setzero_si512();
    const __m512i rebias = _mm512_set1_epi32(int(uint32_t(127 - F::kBias) << 23));
    const __m512 sub_scale = _mm512_set1_ps(1.0f / float(1u << (F::kBias - 1 + M)));
    const __m512i top_exp = _mm512_set1_epi32((1 << E) - 1), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i nan = _mm512_set1_epi32(0x7fc00000);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, sign_bit), 24);
    const __m512i mag = _mm512_and_si512(b, mag_mask);
    const __m512i exp = _mm512_srli_epi32(mag, M), man = _mm512_and_si512(mag, man_mask);
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - M), rebias);
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(man), sub_scale);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(exp, zero), _mm512_castps_si512(sub));
    if constexpr (F::kFnFormat) {
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, mag_mask), nan);
    } else {
      const __m512i special = _mm512_or_si512(inf, _mm512_slli_epi32(man, 23 - M));
      bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(exp, top_exp), special);
    }
    return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
  }

  static size_t FromFloat(const float* src, uint8_t* dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), Encode(_mm512_loadu_ps(src + i)));
    return i;
  }
  static size_t ToFloat(const uint8_t* src, float* dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, Decode(src + i));
    return i;
  }
  static size_t FromHalfScaled(const uint16_t* src, float mul, uint8_t* dst, size_t n) {
    const __m512 m = _mm512_set1_ps(mul);
    uint32_t mb;
    std::memcpy(&mb, &mul, 4);
    size_t i = 0;
    // A power-of-two multiplier (the fp8 stage picks such scales) takes the 16-bit lane path.
    if ((mb & 0x807fffffu) == 0 && (mb >> 23) != 0 && (mb >> 23) != 255) i = FromHalfPow2(src, int(mb >> 23) - 127, m, dst, n);
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), m);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), Encode(v));
    }
    return i;
  }
  // f16 times 2^j on 16-bit lanes, 32 values a step: the product's exponent is the f16 one moved
  // by j, so its code is the f16 bits rebiased and rounded to M mantissa bits (to nearest even,
  // the carry running into the exponent), saturating — the float path's result, at a quarter of
  // its instructions per value. A step with a lane this does not cover (an f16 subnormal,
  // infinity or NaN, or a product in the FP8 subnormal range) goes through the float path
  // (`m` = 2^j) instead. Returns how many values it did (all whole steps).
  static size_t FromHalfPow2(const uint16_t* src, int j, __m512 m, uint8_t* dst, size_t n) {
    constexpr int kShift = 10 - M;
    const int delta = j + F::kBias - 15;  // from an f16 exponent field to the FP8 one
    // Beyond these every value saturates or is subnormal: the float path's business.
    if (delta < -29 || delta > 29) return 0;
    // Lanes done here: |h| in [lo, 0x7bff] (a normal f16 whose product is a normal FP8 or more),
    // and zeros. Exponents past 31 are capped (their codes saturate whatever the mantissa).
    const uint16_t lo = uint16_t(std::max(1, 1 - delta) << 10);
    const uint16_t cap = uint16_t(std::min(0x7bff, ((31 - delta) << 10) | 0x3ff));
    const __m512i lo_v = _mm512_set1_epi16(int16_t(lo)), span = _mm512_set1_epi16(int16_t(0x7bff - lo));
    const __m512i cap_v = _mm512_set1_epi16(int16_t(cap)), rebias = _mm512_set1_epi16(int16_t(uint16_t(delta << 10)));
    const __m512i abs_mask = _mm512_set1_epi16(0x7fff), one = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
    const __m512i round = _mm512_set1_epi16((1 << (kShift - 1)) - 1), max_code = _mm512_set1_epi16(int16_t(F::kMaxCode));
    const __m512i sign_bit = _mm512_set1_epi16(0x80);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512i h = _mm512_loadu_si512(src + i);
      const __m512i a = _mm512_and_si512(h, abs_mask);
      const __mmask32 is_zero = _mm512_cmpeq_epi16_mask(a, zero);
      const __mmask32 fast = _mm512_cmple_epu16_mask(_mm512_sub_epi16(a, lo_v), span);
      if ((is_zero | fast) != 0xffffffffu) {
        for (size_t k = i; k < i + 32; k += 16) {
          const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k))), m);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), Encode(v));
        }
        continue;
      }
      const __m512i x = _mm512_add_epi16(_mm512_min_epu16(a, cap_v), rebias);
      const __m512i r = _mm512_add_epi16(x, _mm512_add_epi16(round, _mm512_and_si512(_mm512_srli_epi16(x, kShift), one)));
      __m512i code = _mm512_maskz_mov_epi16(~is_zero, _mm512_min_epu16(_mm512_srli_epi16(r, kShift), max_code));
      code = _mm512_ternarylogic_epi32(code, _mm512_srli_epi16(h, 8), sign_bit, 0xf8);  // code | (h >> 8 & 0x80)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi16_epi8(code));
    }
    return i;
  }

  static size_t ToHalfScaled(const uint8_t* src, float mul, uint16_t* dst, size_t n) {
    const __m512 m = _mm512_set1_ps(mul);
    size_t i = 0;
    if (n >= kTableMin) i = ToHalfByTable(src, m, dst, n);
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(Decode(src + i), m), _MM_FROUND_TO_NEAREST_INT);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
    }
    return i;
  }

  // Long runs under one scale (a head's slab) by lookup: the 256 results are computed once by the
  // loop above's own arithmetic, so every output has the same bits; the 128 of the non-negative
  // codes fill four registers, two two-source word permutes and a select on bit 6 look up 32 codes
  // at once, and the sign bit is OR-ed in. That takes a third of the arithmetic's instructions per
  // value. A table where the sign does not simply carry over (a negative or NaN-making scale) is
  // left to the arithmetic: returns 0.
  static constexpr size_t kTableMin = 2048;
  struct HalfTable {
    __m512i t0, t1, t2, t3;
  };
  // False when the sign does not simply carry over (a negative or NaN-making scale).
  static bool BuildHalfTable(__m512 m, HalfTable* t) {
    alignas(64) uint8_t codes[256];
    alignas(64) uint16_t table[256];
    for (int c = 0; c < 256; ++c) codes[c] = uint8_t(c);
    for (int c = 0; c < 256; c += 16) {
      const __m256i h = _mm512_cvtps_ph(_mm512_mul_ps(Decode(codes + c), m), _MM_FROUND_TO_NEAREST_INT);
      _mm256_store_si256(reinterpret_cast<__m256i*>(table + c), h);
    }
    for (int c = 0; c < 128; ++c) {
      if (table[c | 0x80] != (table[c] | 0x8000)) return false;
    }
    t->t0 = _mm512_load_si512(table), t->t1 = _mm512_load_si512(table + 32);
    t->t2 = _mm512_load_si512(table + 64), t->t3 = _mm512_load_si512(table + 96);
    return true;
  }
  // Looks up n (a multiple of 32, or fewer done) codes; returns how many. kStream: non-temporal
  // stores to a 64-byte aligned dst (rows on a page row's stride, where a store's line read costs
  // most; a dense run keeps plain stores, which measured faster there).
  template <bool kStream = false>
  static size_t LookUpHalf(const HalfTable& t, const uint8_t* src, uint16_t* dst, size_t n) {
    const __m512i bit6 = _mm512_set1_epi16(0x40), sign = _mm512_set1_epi16(0x80);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m512i idx = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      const __m512i lo = _mm512_permutex2var_epi16(t.t0, idx, t.t1);  // codes 0..63 (bits 0-5 of idx)
      const __m512i hi = _mm512_permutex2var_epi16(t.t2, idx, t.t3);  // codes 64..127
      __m512i r = _mm512_mask_mov_epi16(lo, _mm512_test_epi16_mask(idx, bit6), hi);
      r = _mm512_or_si512(r, _mm512_slli_epi16(_mm512_and_si512(idx, sign), 8));
      if constexpr (kStream) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), r);
      else _mm512_storeu_si512(dst + i, r);
    }
    return i;
  }
  static size_t ToHalfByTable(const uint8_t* src, __m512 m, uint16_t* dst, size_t n) {
    HalfTable t;
    return BuildHalfTable(m, &t) ? LookUpHalf(t, src, dst, n) : 0;
  }
  // Rows of row_len values, each to its own address, under one table; false where the table
  // does not apply (nothing written).
  static bool ToHalfRowsByTable(const uint8_t* src, float mul, uint8_t* const* rows, size_t n_rows, size_t row_len) {
    HalfTable t;
    if (row_len % 32 != 0 || !BuildHalfTable(_mm512_set1_ps(mul), &t)) return false;
    for (size_t r = 0; r < n_rows; ++r) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(rows[r]);
      if (reinterpret_cast<uintptr_t>(dst) % 64 == 0) LookUpHalf<true>(t, src + r * row_len, dst, row_len);
      else LookUpHalf(t, src + r * row_len, dst, row_len);
    }
    _mm_sfence();
    return true;
  }
};
KVSERVE_END_TIER
#endif

// Runs `simd` (the widest kernels of the format the tier allows, returning how many values they
// did), and `rest` for what is left.
template <typename Simd, typename Rest>
void Fp8Dispatch(DType fp8, Simd simd, Rest rest) {
  size_t done = 0;
#ifdef KVSERVE_HAVE_AVX512_REGION
  if (cpu::Use(cpu::Tier::kAvx512)) {
    done = fp8 == DType::kE4M3 ? simd(Fp8Avx512<E4M3>{}) : simd(Fp8Avx512<E5M2>{});
  } else
#endif
#ifdef KVSERVE_HAVE_AVX2_REGION
  if (cpu::Use(cpu::Tier::kAvx2)) {
    done = fp8 == DType::kE4M3 ? simd(Fp8Avx2<E4M3>{}) : simd(Fp8Avx2<E5M2>{});
  }
#endif
  (void)simd;
  fp8 == DType::kE4M3 ? rest(E4M3{}, done) : rest(E5M2{}, done);
}

void Fp8ToFloatFast(DType dtype, const uint8_t* src, float* dst, size_t n) {
  Fp8Dispatch(
      dtype, [&](auto k) { return k.ToFloat(src, dst, n); },
      [&](auto f, size_t i) { Fp8ToFloatLoop<decltype(f)>(src + i, dst + i, n - i); });
}
void FloatToFp8Fast(DType dtype, const float* src, uint8_t* dst, size_t n) {
  Fp8Dispatch(
      dtype, [&](auto k) { return k.FromFloat(src, dst, n); },
      [&](auto f, size_t i) { FloatToFp8Loop<decltype(f)>(src + i, dst + i, n - i); });
}
}  // namespace

void ConvertToFp8Scaled(DType src_dtype, const void* src, float mul, DType fp8, uint8_t* dst, size_t n) {
  if (n == 0) return;  // an empty prompt: its buffers may be null
  if (src_dtype == DType::kF16) {
    const uint16_t* h = static_cast<const uint16_t*>(src);
    Fp8Dispatch(
        fp8, [&](auto k) { return HaveF16cConversions() ? k.FromHalfScaled(h, mul, dst, n) : 0; },
        [&](auto f, size_t i) {
          for (; i < n; ++i) dst[i] = decltype(f)::FromFloat(HalfToFloat(h[i]) * mul);
        });
    return;
  }
  thread_local std::vector<float> buf;
  buf.resize(n);
  ConvertToF32(src_dtype, src, buf.data(), n);
  for (size_t i = 0; i < n; ++i) buf[i] *= mul;
  ConvertFromF32(fp8, buf.data(), dst, n);
}

void ConvertFromFp8Scaled(DType fp8, const uint8_t* src, float mul, DType dst_dtype, void* dst, size_t n) {
  if (n == 0) return;
  if (dst_dtype == DType::kF16) {
    uint16_t* h = static_cast<uint16_t*>(dst);
    Fp8Dispatch(
        fp8, [&](auto k) { return HaveF16cConversions() ? k.ToHalfScaled(src, mul, h, n) : 0; },
        [&](auto f, size_t i) {
          for (; i < n; ++i) h[i] = FloatToHalf(decltype(f)::ToFloat(src[i]) * mul);
        });
    return;
  }
  thread_local std::vector<float> buf;
  buf.resize(n);
  ConvertToF32(fp8, src, buf.data(), n);
  for (size_t i = 0; i < n; ++i) buf[i] *= mul;
  ConvertFromF32(dst_dtype, buf.data(), dst, n);
}

void ConvertFromFp8ScaledRows(DType fp8, const uint8_t* src, float mul, DType dst_dtype, uint8_t* const* dst_rows,
                              size_t n_rows, size_t row_len) {
#ifdef KVSERVE_HAVE_AVX512_REGION
  if (dst_dtype == DType::kF16 && HaveF16cConversions() && cpu::Use(cpu::Tier::kAvx512) &&
      n_rows * row_len >= Fp8Avx512<E4M3>::kTableMin) {
    const bool done = fp8 == DType::kE4M3 ? Fp8Avx512<E4M3>::ToHalfRowsByTable(src, mul, dst_rows, n_rows, row_len)
                                          : Fp8Avx512<E5M2>::ToHalfRowsByTable(src, mul, dst_rows, n_rows, row_len);
    if (done) return;
  }
#endif
#ifdef KVSERVE_HAVE_AVX2_REGION
  // Streamed under one fence where the rows are many (a head's slab under one scale); a row at a
  // time (a scale per token) would fence every row, which measured half the speed of plain stores.
  if (dst_dtype == DType::kF16 && HaveF16cConversions() && !cpu::Use(cpu::Tier::kAvx512) && cpu::Use(cpu::Tier::kAvx2) &&
      row_len % 8 == 0 && n_rows * row_len >= 2048) {
    for (size_t r = 0; r < n_rows; ++r) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(dst_rows[r]);
      if (reinterpret_cast<uintptr_t>(dst) % 16 != 0) {
        ConvertFromFp8Scaled(fp8, src + r * row_len, mul, dst_dtype, dst, row_len);
      } else if (fp8 == DType::kE4M3) {
        Fp8Avx2<E4M3>::ToHalfScaled<true>(src + r * row_len, mul, dst, row_len);
      } else {
        Fp8Avx2<E5M2>::ToHalfScaled<true>(src + r * row_len, mul, dst, row_len);
      }
    }
    _mm_sfence();
    return;
  }
#endif
  for (size_t r = 0; r < n_rows; ++r) ConvertFromFp8Scaled(fp8, src + r * row_len, mul, dst_dtype, dst_rows[r], row_len);
}

float E4M3ToFloat(uint8_t b) { return E4M3::ToFloat(b); }
uint8_t FloatToE4M3(float f) { return E4M3::FromFloat(f); }
float E5M2ToFloat(uint8_t b) { return E5M2::ToFloat(b); }
uint8_t FloatToE5M2(float f) { return E5M2::FromFloat(f); }

namespace scalar {
float Fp8ToFloatReference(DType dtype, uint8_t b) {
  const bool fn = dtype == DType::kE4M3;
  const int E = fn ? 4 : 5, M = fn ? 3 : 2, bias = (1 << (E - 1)) - 1;
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b & 0x7f) >> M, man = b & ((1 << M) - 1);
  if (fn && (b & 0x7f) == 0x7f) return std::nanf("");
  if (!fn && exp == (1 << E) - 1) return man == 0 ? sign * INFINITY : std::nanf("");
  if (exp == 0) return sign * std::ldexp(float(man), 1 - bias - M);
  return sign * std::ldexp(float((1 << M) + man), exp - bias - M);
}

uint8_t FloatToFp8Reference(DType dtype, float f) {
  const bool fn = dtype == DType::kE4M3;
  const int E = fn ? 4 : 5, M = fn ? 3 : 2, bias = (1 << (E - 1)) - 1;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const uint8_t max_code = fn ? 0x7e : uint8_t(((1 << E) - 2) << M | ((1 << M) - 1));
  if (std::isnan(f)) return sign | (fn ? 0x7f : uint8_t(((1 << E) - 1) << M | (1 << (M - 1))));
  const float a = std::fabs(f);
  if (std::isinf(a)) return sign | (fn ? max_code : uint8_t(((1 << E) - 1) << M));
  if (a < std::ldexp(1.0f, 1 - bias)) {  // subnormal: multiples of 2^(1 - bias - M)
    return sign | uint8_t(std::nearbyint(std::ldexp(a, bias - 1 + M)));
  }
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  const int unbiased = e - 1;
  long q = std::lrint(std::ldexp(a, M - unbiased));  // in [2^M, 2^(M+1)], ties to even
  int ex = unbiased + bias;
  if (q == (1L << (M + 1))) {
    q >>= 1;
    ++ex;
  }
  const int code = (ex << M) | int(q - (1L << M));
  return sign | uint8_t(code > max_code ? max_code : code);
}
}  // namespace scalar

void ConvertToF32(DType src_dtype, const void* src, float* dst, size_t n) {
  switch (src_dtype) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kF16: HalfToFloatFast(static_cast<const uint16_t*>(src), dst, n); return;
    case DType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      uint32_t* d = reinterpret_cast<uint32_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = uint32_t{s[i]} << 16;
      return;
    }
    case DType::kE4M3:
    case DType::kE5M2: Fp8ToFloatFast(src_dtype, static_cast<const uint8_t*>(src), dst, n); return;
  }
}

void ConvertFromF32(DType dst_dtype, const float* src, void* dst, size_t n) {
  switch (dst_dtype) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kF16: FloatToHalfFast(src, static_cast<uint16_t*>(dst), n); return;
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBFloat16(src[i]);
      return;
    }
    case DType::kE4M3:
    case DType::kE5M2: FloatToFp8Fast(dst_dtype, src, static_cast<uint8_t*>(dst), n); return;
  }
}

void ConvertFromF32Streaming(DType dst_dtype, const float* src, void* dst, size_t n) {
#ifdef KVSERVE_HAVE_F16C
  if (dst_dtype == DType::kF16 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0 && cpu::Use(cpu::Tier::kAvx2)) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    const size_t i = FloatToHalfF16c<true>(src, d, n);
    scalar::FloatToHalf(src + i, d + i, n - i);
    return;
  }
#endif
  ConvertFromF32(dst_dtype, src, dst, n);
}

void ConvertFromF32StreamingRows(DType dst_dtype, const float* src, size_t row_len, uint8_t* const* rows,
                                 size_t n_rows) {
#ifdef KVSERVE_HAVE_F16C
  if (dst_dtype == DType::kF16 && cpu::Use(cpu::Tier::kAvx2)) {
    bool streamed = false;
    for (size_t r = 0; r < n_rows; ++r) {
      uint16_t* d = reinterpret_cast<uint16_t*>(rows[r]);
      const float* s = src + r * row_len;
      size_t i = 0;
      if ((reinterpret_cast<uintptr_t>(d) & 15) == 0) {
        i = FloatToHalfF16c<true, false>(s, d, row_len);
        streamed = true;
      }
      scalar::FloatToHalf(s + i, d + i, row_len - i);
    }
    if (streamed) _mm_sfence();
    return;
  }
#endif
  for (size_t r = 0; r < n_rows; ++r) ConvertFromF32(dst_dtype, src + r * row_len, rows[r], row_len);
}

}  // namespace kvserve
