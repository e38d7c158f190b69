// rotate and delta: exact inverses, the properties they are used for, and composition.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "simd_test_util.h"
#include "codec/frame_test_util.h"
#include "codec/hadamard.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

KvBlock RoundTrip(const KvBlock& in, const std::string& spec) {
  KvBlock out;
  auto f = EncodeKv(in, spec);
  EXPECT_TRUE(f.ok()) << spec << ": " << f.status().ToString();
  Status st = DecodeKv(f.value(), &out);
  EXPECT_TRUE(st.ok()) << spec << ": " << st.ToString();
  return out;
}

TEST(Rotate, InverseIsExactUpToFloatError) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 40, 16}, {.seed = 5, .dtype = DType::kF32}).value();
  for (const char* spec : {"rotate", "rotate(parts=k,seed=9)", "rotate(parts=v)", "delta", "delta(anchor=3,parts=k)",
                           "rotate|delta|rotate(seed=2)"}) {
    KvBlock out = RoundTrip(in, spec);
    auto c = CompareKv(in, out).value();
    EXPECT_LT(c.k.max_abs, 2e-5) << spec;
    EXPECT_LT(c.v.max_abs, 2e-5) << spec;
  }
}

using HadamardTiers = testing::SimdTier;

TEST_P(HadamardTiers, KernelsMatchTheRuntimeSizeReferenceBitForBit) {
  testing::ReportSimdPath("hadamard", cpu::Use(cpu::Tier::kAvx512), "AVX-512 in registers", "plain loops");
  for (uint32_t n : {2u, 4u, 8u, 16u, 32u, 64u, 128u, 256u, 512u}) {
    const size_t rows = 5;
    std::vector<float> a(n * rows), b, sign(n), ones(n, 1.0f);
    for (uint32_t i = 0; i < n * rows; ++i) a[i] = std::sin(float(i) * 1.7f) * float(1 + i % 5);
    for (uint32_t i = 0; i < n; ++i) sign[i] = (i * 7 + 3) % 5 < 2 ? -1.0f : 1.0f;
    // The transform alone (signs all +1) and the compile-time-size loops against the reference.
    b = a;
    std::vector<float> fixed = a;
    RotateRows(b.data(), 1, n, ones.data(), false);
    HadamardN<0>(a.data(), n);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0) << n;
    if (n == 128) {
      HadamardN<128>(fixed.data(), n);
      EXPECT_EQ(std::memcmp(a.data(), fixed.data(), n * sizeof(float)), 0);
    }
    // The fused rotation of several rows, both ways, against its steps one by one.
    for (bool inverse : {false, true}) {
      std::vector<float> fused = a, steps = a;
      RotateRows(fused.data(), rows, n, sign.data(), inverse);
      for (size_t r = 0; r < rows; ++r) {
        float* row = steps.data() + r * n;
        if (!inverse)
          for (uint32_t d = 0; d < n; ++d) row[d] *= sign[d];
        HadamardN<0>(row, n);
        if (inverse)
          for (uint32_t d = 0; d < n; ++d) row[d] *= sign[d];
      }
      EXPECT_EQ(std::memcmp(fused.data(), steps.data(), fused.size() * sizeof(float)), 0)
          << n << (inverse ? " inverse" : " forward");
    }
  }
}
INSTANTIATE_TEST_SUITE_P(Tiers, HadamardTiers, testing::AllTiers(), testing::TierParamName);

TEST(Rotate, IsOrthonormalAndSpreadsOutliers) {
  // One head with a single huge channel: after rotation every channel carries 1/sqrt(D) of it.
  KvBlock in = KvBlock::Create(KvShape{1, 1, 4, 16}, DType::kF32).value();  // f32 in: f32 stored
  for (uint32_t t = 0; t < 4; ++t) in.Set(0, KvPart::kKey, 0, t, 3, 100.0f);
  ByteBuffer f = EncodeKv(in, "rotate").value();
  // The payload is the raw rotated f32 tensor (dtype byte first).
  const uint8_t* p = ParseFrame(f).value().payload.data() + 1;
  float row[16];
  std::memcpy(row, p, sizeof row);
  double norm = 0;
  for (float v : row) {
    EXPECT_NEAR(std::fabs(v), 25.0, 1e-4);  // 100 / sqrt(16)
    norm += double(v) * v;
  }
  EXPECT_NEAR(std::sqrt(norm), 100.0, 1e-3);
}

TEST(Rotate, RefusesHeadDimsThatAreNotPowersOfTwo) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 4, 12}, {}).value();
  auto r = EncodeKv(in, "rotate|quant");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("head_dim a power of two, got 12"), std::string::npos) << r.status().message();
}

TEST(Delta, ShrinksRangesOfSlowlyVaryingTokens) {
  // Tokens = a large common offset + small variation: deltas to the anchor are small.
  KvBlock in = KvBlock::Create(KvShape{1, 1, 32, 8}, DType::kF32).value();
  for (uint32_t t = 0; t < 32; ++t)
    for (uint32_t d = 0; d < 8; ++d) in.Set(0, KvPart::kValue, 0, t, d, 50.0f + d + 0.01f * t);
  ByteBuffer f = EncodeKv(in, "delta(anchor=16)").value();
  const uint8_t* p = ParseFrame(f).value().payload.data() + 1;
  // V slab follows the K slab (32 x 8 floats); token 5 of V is now 0.05 everywhere.
  float v5[8];
  std::memcpy(v5, p + (32 * 8 + 5 * 8) * 4, sizeof v5);
  for (float v : v5) EXPECT_NEAR(v, 0.05f, 1e-5);
}

TEST(Transforms, ComposeWithQuantisersAndCoders) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 64, 32}, {.seed = 6}).value();
  for (const char* spec : {"rotate|quant(kbits=4,vbits=4)|rans", "delta|quant(kbits=4,vbits=4)|zstd",
                           "rotate(parts=k)|delta(parts=v)|quant|rans(tables=part)", "rotate|cast"}) {
    KvBlock out = RoundTrip(in, spec);
    auto c = CompareKv(in, out).value();
    EXPECT_GT(c.k.snr_db, 15) << spec;
    EXPECT_GT(c.v.snr_db, 8) << spec;  // delta passes the anchor's error on to its group
  }
}

TEST(Rotate, HelpsPerTokenQuantisationOfSpikyVectors) {
  // Each token has one channel spiking to +-20 over N(0, 1) noise: per-token ranges are set by
  // the spike. Rotation spreads it over all 32 channels, and the ranges shrink.
  KvBlock in = KvBlock::Create(KvShape{1, 1, 256, 32}, DType::kF32).value();
  KvBlock noise = SynthesizeKv(KvShape{1, 1, 256, 32}, {.seed = 8, .dtype = DType::kF32}).value();
  for (uint32_t t = 0; t < 256; ++t)
    for (uint32_t d = 0; d < 32; ++d)
      for (KvPart p : {KvPart::kKey, KvPart::kValue}) {
        const float spike = d == (t * 7) % 32 ? (t % 2 ? 20.0f : -20.0f) : 0.0f;
        in.Set(0, p, 0, t, d, noise.Get(0, KvPart::kValue, 0, t, d) / 4 + spike);
      }
  const std::string q = "quant(kbits=3,vbits=3,kaxis=token,vaxis=token,group=32)";
  const double plain = CompareKv(in, RoundTrip(in, q)).value().v.snr_db;
  const double rotated = CompareKv(in, RoundTrip(in, "rotate|" + q)).value().v.snr_db;
  EXPECT_GT(rotated, plain + 3) << plain << " -> " << rotated;
}

TEST(Transforms, TruncatedRawPayloadIsRejected) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 8, 8}, {}).value();
  ByteBuffer f = EncodeKv(in, "rotate").value();
  f = testing::Shortened(f, 4);
  KvBlock out;
  Status st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("raw tensor payload"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace kvserve
