// Storage dtype conversions (f32 <-> f16/bf16). The F16C loops run when the CPU has them (runtime
// dispatch, kvserve/cpu.h); the scalar functions are the reference they are tested against.
#include <cstring>

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

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::kF32;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::kF16;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  return Status::InvalidArgument("unknown dtype '" + std::string(name) + "' (expected f32, f16 or bf16)");
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
// before anything this thread publishes next.
template <bool kStream>
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
  if constexpr (kStream) _mm_sfence();
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

}  // namespace kvserve
