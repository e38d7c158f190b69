// dtype conversions: the vectorised paths against the scalar reference, and known values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kvserve/kv.h"
#include "simd_test_util.h"

namespace kvserve {
namespace {

using DTypeTiers = testing::SimdTier;

TEST_P(DTypeTiers, HalfRoundTripsEveryValue) {
  testing::ReportSimdPath("fp16 conversion", HaveF16cConversions(), "F16C/AVX2", "scalar");
  std::vector<uint16_t> all(65536), back(65536);
  std::vector<float> f(65536), fs(65536);
  for (int i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  ConvertToF32(DType::kF16, all.data(), f.data(), all.size());
  scalar::HalfToFloat(all.data(), fs.data(), all.size());
  ConvertFromF32(DType::kF16, f.data(), back.data(), f.size());
  for (int i = 0; i < 65536; ++i) {
    if (std::isnan(fs[i])) {
      EXPECT_TRUE(std::isnan(f[i])) << i;
      continue;
    }
    ASSERT_EQ(std::memcmp(&f[i], &fs[i], 4), 0) << "half " << i;
    ASSERT_EQ(back[i], all[i]) << "half " << i;
  }
}

TEST_P(DTypeTiers, FloatToHalfMatchesScalarReference) {
  // Without F16C the comparison is trivial, but the known values below still check the reference.
  testing::ReportSimdPath("fp16 conversion", HaveF16cConversions(), "F16C/AVX2", "scalar");
  std::mt19937 rng(7);
  std::vector<float> src;
  for (int e = -30; e <= 17; ++e) {
    for (int k = 0; k < 400; ++k) {
      std::uniform_real_distribution<float> u(1.0f, 2.0f);
      src.push_back((k % 2 ? -1.f : 1.f) * std::ldexp(u(rng), e));
    }
  }
  // Exact ties between two halves, and the overflow boundary.
  src.push_back(1.0f + 1.0f / 2048);  // halfway between 1 and the next half: rounds to even (1)
  src.push_back(1.0f + 3.0f / 2048);
  src.push_back(65504.0f);
  src.push_back(65519.99f);
  src.push_back(65520.0f);  // rounds to inf
  src.push_back(std::numeric_limits<float>::infinity());
  src.push_back(0.0f);
  src.push_back(-0.0f);
  std::vector<uint16_t> fast(src.size()), ref(src.size());
  ConvertFromF32(DType::kF16, src.data(), fast.data(), src.size());
  scalar::FloatToHalf(src.data(), ref.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(fast[i], ref[i]) << src[i];
  EXPECT_EQ(FloatToHalf(1.0f + 1.0f / 2048), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3.0f / 2048), 0x3c02);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(5.9604644775390625e-8f), 0x0001);  // smallest subnormal
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(DType, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(FloatToBFloat16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3.0f / 256), 0x3f82);
  std::vector<float> src = {0.1f, -3.5f, 1e30f, -1e-30f}, back(4);
  std::vector<uint16_t> mid(4);
  ConvertFromF32(DType::kBF16, src.data(), mid.data(), 4);
  ConvertToF32(DType::kBF16, mid.data(), back.data(), 4);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(back[i], src[i], std::fabs(src[i]) / 128);
}

TEST_P(DTypeTiers, StreamingConversionEqualsPlain) {
  std::vector<float> src(1003);
  for (size_t i = 0; i < src.size(); ++i) src[i] = std::sin(float(i)) * 100;
  ByteBuffer a(src.size() * 2 + 64), b(src.size() * 2 + 64);
  ConvertFromF32(DType::kF16, src.data(), a.data(), src.size());
  ConvertFromF32Streaming(DType::kF16, src.data(), b.data(), src.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), src.size() * 2), 0);
  ConvertFromF32Streaming(DType::kF16, src.data(), b.data() + 2, src.size());  // unaligned destination
  EXPECT_EQ(std::memcmp(a.data(), b.data() + 2, src.size() * 2), 0);
}

// FP8: every code through the tier's loop equals the arithmetic reference, and every non-NaN code
// comes back from float unchanged.
TEST_P(DTypeTiers, Fp8EveryCodeMatchesTheReference) {
  for (DType dt : {DType::kE4M3, DType::kE5M2}) {
    SCOPED_TRACE(DTypeName(dt));
    std::vector<uint8_t> codes(256), back(256);
    for (int i = 0; i < 256; ++i) codes[i] = uint8_t(i);
    std::vector<float> f(256);
    ConvertToF32(dt, codes.data(), f.data(), 256);
    int nans = 0;
    for (int i = 0; i < 256; ++i) {
      const float ref = scalar::Fp8ToFloatReference(dt, uint8_t(i));
      if (std::isnan(ref)) {
        EXPECT_TRUE(std::isnan(f[i])) << i;
        ++nans;
        continue;
      }
      EXPECT_EQ(f[i], ref) << "code " << i;
      EXPECT_EQ(std::signbit(f[i]), bool(i & 0x80)) << "code " << i;  // -0 included
    }
    EXPECT_EQ(nans, dt == DType::kE4M3 ? 2 : 6);
    ConvertFromF32(dt, f.data(), back.data(), 256);
    for (int i = 0; i < 256; ++i) {
      if (std::isnan(f[i])) {
        EXPECT_TRUE(std::isnan(scalar::Fp8ToFloatReference(dt, back[i]))) << i;
      } else {
        EXPECT_EQ(back[i], i) << "code " << i << " (" << f[i] << ")";
      }
    }
  }
}

// Float to FP8 on values that probe the rounding: every code's neighbourhood (halfway points,
// one float ulp either side), the subnormal range, values past the largest, infinities, NaN, and
// random floats of every magnitude.
TEST_P(DTypeTiers, FloatToFp8MatchesTheReference) {
  std::vector<float> probe = {0.0f, -0.0f, INFINITY, -INFINITY, std::nanf(""), 1e30f, -1e30f, 1e-30f, 448.0f, 464.0f,
                              479.0f, 480.0f, 500.0f, 57344.0f, 61439.0f, 61440.0f, 65536.0f};
  for (DType dt : {DType::kE4M3, DType::kE5M2}) {
    for (int c = 0; c < 255; ++c) {
      const float a = scalar::Fp8ToFloatReference(dt, uint8_t(c)), b = scalar::Fp8ToFloatReference(dt, uint8_t(c + 1));
      if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b) || (c & 0x7f) == 0x7f) continue;
      const float mid = (a + b) / 2;
      probe.insert(probe.end(), {a, mid, std::nextafter(mid, a), std::nextafter(mid, b)});
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 20000; ++i) {
    uint32_t bits = rng();
    float f;
    std::memcpy(&f, &bits, 4);
    probe.push_back(f);
    probe.push_back(std::ldexp(float(rng() % 100000) / 1000.0f, int(rng() % 40) - 30));
  }
  for (DType dt : {DType::kE4M3, DType::kE5M2}) {
    SCOPED_TRACE(DTypeName(dt));
    std::vector<uint8_t> got(probe.size());
    ConvertFromF32(dt, probe.data(), got.data(), probe.size());
    int wrong = 0;
    for (size_t i = 0; i < probe.size() && wrong < 10; ++i) {
      const uint8_t ref = scalar::FloatToFp8Reference(dt, probe[i]);
      if (got[i] != ref) {
        ++wrong;
        ADD_FAILURE() << probe[i] << ": got 0x" << std::hex << int(got[i]) << ", reference 0x" << int(ref);
      }
    }
  }
  // Known values: saturation, infinities, the smallest subnormal, ties to even.
  EXPECT_EQ(FloatToE4M3(1000.0f), 0x7e);
  EXPECT_EQ(FloatToE4M3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToE4M3(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(FloatToE4M3(1.0625f), 0x38);  // halfway between 1 and 1.125: to even (1)
  EXPECT_EQ(E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(FloatToE5M2(1e6f), 0x7b);
  EXPECT_EQ(FloatToE5M2(INFINITY), 0x7c);
  EXPECT_EQ(E5M2ToFloat(0x7b), 57344.0f);
  EXPECT_EQ(FloatToE5M2(std::ldexp(1.0f, -16)), 0x01);
}

// The fused scaled conversions (the fp8 stage's kernels) equal the plain conversion of the product:
// every f16 pattern in, every code out, a few scales.
TEST_P(DTypeTiers, ScaledFp8ConversionsEqualTheirComposition) {
  std::vector<uint16_t> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i) halves[i] = uint16_t(i);
  std::vector<float> f(65536);
  ConvertToF32(DType::kF16, halves.data(), f.data(), f.size());
  for (DType dt : {DType::kE4M3, DType::kE5M2}) {
    // Powers of two (the fp8 stage's scales) take their own path: moves into and out of the
    // subnormal and saturating ranges of both formats.
    for (float mul : {1.0f, 0.37f, 1e-3f, 300.0f, 0.125f, 32.0f, std::ldexp(1.0f, -20), std::ldexp(1.0f, 12), 2.0f}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " x " + std::to_string(mul));
      std::vector<uint8_t> got(f.size()), want(f.size());
      ConvertToFp8Scaled(DType::kF16, halves.data(), mul, dt, got.data(), got.size());
      for (size_t i = 0; i < f.size(); ++i) want[i] = scalar::FloatToFp8Reference(dt, f[i] * mul);
      EXPECT_EQ(got, want);
      std::vector<uint8_t> codes(256);
      for (int i = 0; i < 256; ++i) codes[i] = uint8_t(i);
      std::vector<uint16_t> back(256);
      ConvertFromFp8Scaled(dt, codes.data(), mul, DType::kF16, back.data(), 256);
      for (int i = 0; i < 256; ++i) {
        const float ref = scalar::Fp8ToFloatReference(dt, uint8_t(i)) * mul;
        if (std::isnan(ref)) EXPECT_TRUE(std::isnan(HalfToFloat(back[i]))) << i;
        else EXPECT_EQ(back[i], FloatToHalf(ref)) << "code " << i;
      }
      // Other storage types take the buffered path: the same products.
      std::vector<uint8_t> via_f32(f.size());
      ConvertToFp8Scaled(DType::kF32, f.data(), mul, dt, via_f32.data(), f.size());
      EXPECT_EQ(via_f32, want);
    }
  }
}

// Long runs under one scale decode by table lookup on the widest tier: every code, in a run long
// enough for it, at scales whose sign does and does not carry over, equals the reference product.
TEST_P(DTypeTiers, LongScaledFp8RunsEqualTheReferenceProduct) {
  std::vector<uint8_t> codes(8192 + 40);  // every code 32 times, shuffled, and a tail
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t((i * 167 + i / 256) & 0xff);
  for (DType dt : {DType::kE4M3, DType::kE5M2}) {
    for (float mul : {1.0f, 0.37f, 3e-5f, 7000.0f, -2.0f, 0.0f}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " x " + std::to_string(mul));
      std::vector<uint16_t> got(codes.size());
      ConvertFromFp8Scaled(dt, codes.data(), mul, DType::kF16, got.data(), codes.size());
      size_t wrong = 0;
      for (size_t i = 0; i < codes.size() && wrong < 5; ++i) {
        const float ref = scalar::Fp8ToFloatReference(dt, codes[i]) * mul;
        const bool ok = std::isnan(ref) ? std::isnan(HalfToFloat(got[i])) : got[i] == FloatToHalf(ref);
        if (!ok) {
          ++wrong;
          ADD_FAILURE() << "code 0x" << std::hex << int(codes[i]) << " at " << std::dec << i << ": got 0x" << std::hex
                        << got[i] << ", reference 0x" << FloatToHalf(ref);
        }
      }
    }
  }
}

// Rows written to their own addresses (a paged cache) equal the contiguous conversion, for rows
// the table takes (a multiple of 32 values) and rows it does not.
TEST_P(DTypeTiers, ScaledFp8RowsEqualTheContiguousConversion) {
  for (size_t row_len : {size_t{128}, size_t{40}}) {
    const size_t n_rows = 64, n = n_rows * row_len;
    std::vector<uint8_t> codes(n);
    for (size_t i = 0; i < n; ++i) codes[i] = uint8_t((i * 89 + 7) & 0xff);
    for (DType dt : {DType::kE4M3, DType::kE5M2}) {
      for (float mul : {0.37f, -2.0f}) {
        std::vector<uint16_t> want(n), pages(2 * n, 0xAAAA);
        ConvertFromFp8Scaled(dt, codes.data(), mul, DType::kF16, want.data(), n);
        std::vector<uint8_t*> rows(n_rows);
        for (size_t r = 0; r < n_rows; ++r)  // every other row slot, in reverse order
          rows[r] = reinterpret_cast<uint8_t*>(pages.data() + (2 * (n_rows - 1 - r)) * row_len);
        ConvertFromFp8ScaledRows(dt, codes.data(), mul, DType::kF16, rows.data(), n_rows, row_len);
        for (size_t r = 0; r < n_rows; ++r) {
          ASSERT_EQ(std::memcmp(rows[r], want.data() + r * row_len, 2 * row_len), 0) << "row " << r << " of " << row_len;
          const uint16_t* gap = pages.data() + (2 * (n_rows - 1 - r) + 1) * row_len;
          ASSERT_EQ(gap[0], 0xAAAA) << "a row wrote past its end";
        }
      }
    }
  }
}

// Float rows converted to their own addresses (a paged cache's rows, streamed where aligned)
// equal the contiguous conversion, for every storage type, aligned and misaligned rows.
TEST_P(DTypeTiers, FloatRowsEqualTheContiguousConversion) {
  const size_t n_rows = 24;
  for (size_t row_len : {size_t{128}, size_t{40}, size_t{7}}) {
    const size_t n = n_rows * row_len;
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = float(int(i * 37 % 1001) - 500) * 0.0173f;
    for (DType dt : {DType::kF16, DType::kBF16, DType::kF32, DType::kE4M3}) {
      for (size_t shift : {size_t{0}, size_t{1}}) {
        SCOPED_TRACE(std::string(DTypeName(dt)) + " rows of " + std::to_string(row_len) + " shifted " +
                     std::to_string(shift));
        const size_t es = DTypeSize(dt), row = row_len * es;
        std::vector<uint8_t> want(n * es), pages(2 * n * es + 64 + es, 0xAA);
        ConvertFromF32(dt, x.data(), want.data(), n);
        uint8_t* base = pages.data() + (64 - reinterpret_cast<uintptr_t>(pages.data()) % 64) % 64 + shift * es;
        std::vector<uint8_t*> rows(n_rows);
        for (size_t r = 0; r < n_rows; ++r) rows[r] = base + 2 * (n_rows - 1 - r) * row;  // reversed, a row apart
        ConvertFromF32StreamingRows(dt, x.data(), row_len, rows.data(), n_rows);
        for (size_t r = 0; r < n_rows; ++r) {
          ASSERT_EQ(std::memcmp(rows[r], want.data() + r * row, row), 0) << "row " << r;
          ASSERT_EQ(rows[r][row], 0xAA) << "row " << r << " wrote past its end";
        }
      }
    }
  }
}

TEST(DType, ParseNames) {
  EXPECT_EQ(ParseDType("f16").value(), DType::kF16);
  EXPECT_EQ(ParseDType("bf16").value(), DType::kBF16);
  EXPECT_EQ(ParseDType("f32").value(), DType::kF32);
  EXPECT_EQ(ParseDType("e4m3").value(), DType::kE4M3);
  EXPECT_EQ(ParseDType("float8_e4m3fn").value(), DType::kE4M3);
  EXPECT_EQ(ParseDType("fp8_e5m2").value(), DType::kE5M2);
  EXPECT_EQ(DTypeSize(DType::kE5M2), 1u);
  auto bad = ParseDType("f8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'f8'"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Tiers, DTypeTiers, testing::AllTiers(), testing::TierParamName);

}  // namespace
}  // namespace kvserve
