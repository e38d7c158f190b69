// Pipeline: round trips for every stage and combination, dtype handling, and spec mismatch.
#include <gtest/gtest.h>

#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

struct Case {
  const char* spec;
  bool lossless_from_f16;
  double min_snr_db;  // on synthetic K/V
};

// Combinations of the storage stages across input dtypes; every stage on its own is covered by
// the registry-driven tests in stage_conformance_test.cc.
TEST(Pipeline, CastQuantZstdCombinationsRoundTripInEveryDtype) {
  const Case cases[] = {
      {"none", true, 200},
      {"cast(dtype=f16)", true, 200},
      {"cast(dtype=f16)|zstd(level=1)", true, 200},
      {"cast(dtype=bf16)", false, 40},
      {"cast(dtype=bf16)|zstd", false, 40},
      {"quant(kbits=8,vbits=8)", false, 40},
      {"quant(kbits=8,vbits=8)|zstd", false, 40},
      {"quant(kbits=4,vbits=4,kaxis=token,vaxis=channel)", false, 15},
      {"quant(kbits=2,vbits=2,residual=16)|zstd(level=9)", false, 5},
      {"quant(kbits=1,vbits=1,group=8)", false, 0},
      {"quant(kbits=3,vbits=6)|zstd|zstd", false, 10},
  };
  for (DType dt : {DType::kF16, DType::kF32, DType::kBF16}) {
    KvBlock in = SynthesizeKv(KvShape{2, 3, 70, 16}, {.seed = 12, .dtype = dt}).value();
    for (const Case& c : cases) {
      Pipeline p = Pipeline::Create(c.spec).value();
      ByteBuffer frame;
      ASSERT_TRUE(p.Encode(in, &frame).ok()) << c.spec;
      KvBlock out;
      Status st = p.Decode(frame, &out);
      ASSERT_TRUE(st.ok()) << c.spec << ": " << st.ToString();
      ASSERT_EQ(out.shape(), in.shape());
      ASSERT_EQ(out.dtype(), dt);
      if (c.lossless_from_f16 && dt == DType::kF16) {
        EXPECT_EQ(std::memcmp(in.data(), out.data(), in.bytes()), 0) << c.spec;
      }
      auto cmp = CompareKv(in, out).value();
      // 16-bit storage of f32 input is not exact: 40 dB is what fp16/bf16 rounding leaves.
      const double want = (dt == DType::kF32 && std::string(c.spec) != "none") ? std::min(c.min_snr_db, 40.0)
                                                                               : c.min_snr_db;
      EXPECT_GE(std::min(cmp.k.snr_db, cmp.v.snr_db), want) << c.spec << " " << DTypeName(dt);
    }
  }
}

TEST(Pipeline, NoneFrameIsTheRawBlock) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 4, 8}, {}).value();
  ByteBuffer f = EncodeKv(in, "none").value();
  EXPECT_EQ(f.size(), kFrameFixedHeader + 4 + in.bytes() + kFrameChecksumBytes);
  EXPECT_EQ(std::memcmp(f.data() + kFrameFixedHeader + 4, in.data(), in.bytes()), 0);
}

TEST(Pipeline, ZeroTokenBlockRoundTrips) {
  KvBlock in = KvBlock::Create(KvShape{2, 2, 0, 8}, DType::kF16).value();
  for (const char* spec : {"none", "quant|zstd", "cast"}) {
    KvBlock out;
    ASSERT_TRUE(DecodeKv(EncodeKv(in, spec).value(), &out).ok()) << spec;
    EXPECT_EQ(out.shape().n_token, 0u);
  }
}

TEST(Pipeline, DecodeReusesTheOutputBlock) {
  KvBlock in = SynthesizeKv(KvShape{1, 2, 64, 16}, {}).value();
  Pipeline p = Pipeline::Create("quant").value();
  ByteBuffer f;
  ASSERT_TRUE(p.Encode(in, &f).ok());
  KvBlock out;
  ASSERT_TRUE(p.Decode(f, &out).ok());
  const uint8_t* storage = out.data();
  ASSERT_TRUE(p.Decode(f, &out).ok());
  EXPECT_EQ(out.data(), storage);
}

TEST(Pipeline, RefusesAFrameOfAnotherStrategy) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 8, 8}, {}).value();
  ByteBuffer f = EncodeKv(in, "quant(kbits=2)").value();
  Pipeline p = Pipeline::Create("quant(kbits=4)").value();
  KvBlock out;
  Status st = p.Decode(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("encoded with"), std::string::npos);
  EXPECT_TRUE(DecodeKv(f, &out).ok());  // DecodeKv takes the strategy from the frame
}

TEST(Pipeline, UnknownStrategyIsAClearError) {
  auto p = Pipeline::Create("quant(kbits=2)|gzip");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("unknown stage 'gzip'"), std::string::npos);
}

TEST(CastStage, MalformedPayloadIsRejected) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 8, 8}, {}).value();
  ByteBuffer f = EncodeKv(in, "cast").value();
  f = testing::Shortened(f, 2);  // one element short
  KvBlock out;
  Status st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("cast payload"), std::string::npos) << st.message();
}

TEST(ZstdStage, MalformedPayloadIsRejected) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 64, 8}, {}).value();
  ByteBuffer good = EncodeKv(in, "cast|zstd").value();
  const size_t payload = ParseFrame(good).value().header.header_len();
  KvBlock out;
  // A stored size that disagrees with the zstd frame.
  ByteBuffer f = testing::Rechecksummed(good, [&](ByteBuffer& b) { b[payload] ^= 1; });
  EXPECT_EQ(DecodeKv(f, &out).code(), StatusCode::kCorrupt);
  // A stored size beyond the decode limit.
  const uint64_t huge = uint64_t{1} << 50;
  f = testing::Rechecksummed(good, [&](ByteBuffer& b) { std::memcpy(b.data() + payload, &huge, 8); });
  EXPECT_EQ(DecodeKv(f, &out).code(), StatusCode::kOutOfRange);
  // Garbage inside the zstd stream.
  f = testing::Rechecksummed(good, [&](ByteBuffer& b) { b[payload + 20] ^= 0xff, b[payload + 21] ^= 0xff; });
  EXPECT_FALSE(DecodeKv(f, &out).ok());
}

}  // namespace
}  // namespace kvserve
