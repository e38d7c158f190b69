// fp8 stage: the relative error bound of each format and scale mode, saturation-free scales, NaN,
// compositions, values beyond an fp16 scale, and malformed payloads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

struct Fp8Case {
  const char* spec;
  int man_bits, bias;
  bool per_token;
};

class Fp8Bound : public ::testing::TestWithParam<Fp8Case> {};

// Every value comes back within half an FP8 ulp of itself (relative 2^-(M+1)), or half the
// subnormal step times its scale for values near zero; the scale is the group's largest
// magnitude over the format's largest value, rounded up to fp16.
TEST_P(Fp8Bound, EveryValueWithinHalfAnUlp) {
  const Fp8Case c = GetParam();
  const KvShape shape{2, 2, 50, 16};
  const KvBlock in = SynthesizeKv(shape, {.seed = 8, .dtype = DType::kF32}).value();
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, c.spec).value(), &out).ok());
  ASSERT_EQ(out.dtype(), DType::kF32);
  const float fmax = c.man_bits == 3 ? 448.0f : 57344.0f;
  for (uint32_t l = 0; l < shape.n_layer; ++l)
    for (KvPart p : {KvPart::kKey, KvPart::kValue})
      for (uint32_t h = 0; h < shape.n_head_kv; ++h) {
        float head_max = 0;
        for (uint32_t t = 0; t < shape.n_token; ++t)
          for (uint32_t d = 0; d < shape.head_dim; ++d) head_max = std::max(head_max, std::fabs(in.Get(l, p, h, t, d)));
        for (uint32_t t = 0; t < shape.n_token; ++t) {
          float group_max = head_max;
          if (c.per_token) {
            group_max = 0;
            for (uint32_t d = 0; d < shape.head_dim; ++d) group_max = std::max(group_max, std::fabs(in.Get(l, p, h, t, d)));
          }
          const float scale = HalfToFloat(FloatToHalf(group_max / fmax)) * (1 + 1.0f / 1024);
          for (uint32_t d = 0; d < shape.head_dim; ++d) {
            const float x = in.Get(l, p, h, t, d), y = out.Get(l, p, h, t, d);
            const float bound = std::ldexp(std::fabs(x), -(c.man_bits + 1)) * 1.001f +
                                scale * std::ldexp(1.0f, -c.bias - c.man_bits) + 1e-12f;
            ASSERT_LE(std::fabs(x - y), bound) << c.spec << " layer " << l << " head " << h << " token " << t << " dim " << d;
          }
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Bound,
                         ::testing::Values(Fp8Case{"fp8", 3, 7, false}, Fp8Case{"fp8(scale=token)", 3, 7, true},
                                           Fp8Case{"fp8(format=e5m2)", 2, 15, false},
                                           Fp8Case{"fp8(format=e5m2,scale=token)", 2, 15, true}),
                         [](const ::testing::TestParamInfo<Fp8Case>& i) {
                           return std::string(i.param.man_bits == 3 ? "e4m3" : "e5m2") +
                                  (i.param.per_token ? "_token" : "_head");
                         });

TEST(Fp8Stage, TheLargestValueDoesNotSaturate) {
  KvBlock in = KvBlock::Create(KvShape{1, 1, 4, 8}, DType::kF32).value();
  for (uint32_t d = 0; d < 8; ++d) in.Set(0, KvPart::kKey, 0, 0, d, 0.001f * (d + 1));
  in.Set(0, KvPart::kKey, 0, 3, 5, -123.456f);
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "fp8").value(), &out).ok());
  EXPECT_NEAR(out.Get(0, KvPart::kKey, 0, 3, 5), -123.456f, 123.456f / 16);
  // An all-zero slab (V here) has scale 0 and decodes to zeros.
  EXPECT_EQ(out.Get(0, KvPart::kValue, 0, 2, 2), 0.0f);
}

TEST(Fp8Stage, ComposesWithRotateAndTheEntropyCoders) {
  const KvBlock in = SynthesizeKv(KvShape{2, 4, 64, 32}, {.seed = 12}).value();
  const ByteBuffer plain = EncodeKv(in, "fp8").value();
  for (const char* spec : {"fp8|rans", "fp8|zstd", "rotate|fp8|rans", "fp8(format=e5m2,scale=token)|rans"}) {
    const ByteBuffer frame = EncodeKv(in, spec).value();
    KvBlock out;
    ASSERT_TRUE(DecodeKv(frame, &out).ok()) << spec;
    const KvCompareResult c = CompareKv(in, out).value();
    EXPECT_GT(std::min(c.k.snr_db, c.v.snr_db), 15.0) << spec;
    if (std::string(spec) == "fp8|rans") EXPECT_LT(frame.size(), plain.size()) << "rans must code the FP8 symbols";
  }
}

TEST(Fp8Stage, NanStaysNan) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 8, 8}, {.seed = 2, .dtype = DType::kF32}).value();
  in.Set(0, KvPart::kKey, 0, 3, 3, NAN);
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "fp8").value(), &out).ok());
  EXPECT_TRUE(std::isnan(out.Get(0, KvPart::kKey, 0, 3, 3)));
  EXPECT_TRUE(std::isfinite(out.Get(0, KvPart::kKey, 0, 3, 4)));
}

TEST(Fp8Stage, RefusesAValueBeyondAnFp16Scale) {
  KvBlock in = KvBlock::Create(KvShape{2, 2, 4, 8}, DType::kF32).value();
  in.Set(1, KvPart::kValue, 1, 2, 3, 1e12f);
  Result<ByteBuffer> r = EncodeKv(in, "fp8");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("layer 1 V head 1"), std::string::npos) << r.status().ToString();
}

TEST(Fp8Stage, RefusesAPayloadThatDisagreesWithItsSpec) {
  const KvBlock in = SynthesizeKv(KvShape{1, 2, 8, 8}, {.seed = 3}).value();
  const ByteBuffer frame = EncodeKv(in, "fp8").value();
  const FrameView v = ParseFrame(frame).value();
  const size_t at = v.payload.data() - frame.data();
  KvBlock out;
  ByteBuffer format = testing::Rechecksummed(frame, [&](ByteBuffer& b) { b[at + 1] = uint8_t(DType::kE5M2); });
  EXPECT_EQ(DecodeKv(format, &out).code(), StatusCode::kCorrupt);
  ByteBuffer mode = testing::Rechecksummed(frame, [&](ByteBuffer& b) { b[at + 2] = 1; });
  EXPECT_EQ(DecodeKv(mode, &out).code(), StatusCode::kCorrupt);
  EXPECT_EQ(DecodeKv(testing::Shortened(frame, 3), &out).code(), StatusCode::kCorrupt);
}

}  // namespace
}  // namespace kvserve
