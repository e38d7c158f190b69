// rans stage: bit-exact round trips over every code width and option, a real gain over zstd
// where codes are predictable, and clear errors for corrupted tables and streams.
#include <gtest/gtest.h>

#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

// The quant payload inside a frame (everything after the header, before the checksum).
std::span<const uint8_t> Payload(const ByteBuffer& f) { return ParseFrame(f).value().payload; }

TEST(RansStage, DecodesToTheExactQuantPayload) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 90, 16}, {.seed = 21}).value();
  for (int bits = 1; bits <= 8; ++bits) {
    for (const char* opts : {"tables=channel,predict=token", "tables=part,predict=none", "tables=channel,predict=none",
                             "tables=auto,predict=auto", "tables=part,predict=token"}) {
      const std::string q = "quant(kbits=" + std::to_string(bits) + ",vbits=" + std::to_string(9 - bits) + ",residual=5)";
      const std::string spec = q + "|rans(" + opts + ")";
      ByteBuffer plain = EncodeKv(in, q).value();
      ByteBuffer coded = EncodeKv(in, spec).value();
      KvBlock a, b;
      ASSERT_TRUE(DecodeKv(plain, &a).ok());
      Status st = DecodeKv(coded, &b);
      ASSERT_TRUE(st.ok()) << spec << ": " << st.ToString();
      // Lossless: the decoded tensors are identical bit for bit.
      ASSERT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0) << spec;
    }
  }
}

TEST(RansStage, BeatsZstdOnPredictableCodes) {
  // Synthetic K rotates slowly in its low-frequency channels, so codes repeat along tokens.
  KvBlock in = SynthesizeKv(KvShape{4, 4, 256, 128}, {.seed = 1}).value();
  const size_t zstd = EncodeKv(in, "quant(kbits=3,vbits=3,group=64)|zstd(level=3)").value().size();
  const size_t rans = EncodeKv(in, "quant(kbits=3,vbits=3,group=64)|rans").value().size();
  const size_t plain = EncodeKv(in, "quant(kbits=3,vbits=3,group=64)").value().size();
  EXPECT_LT(rans, zstd);
  EXPECT_LT(double(rans), 0.9 * double(plain));
}

TEST(RansStage, CodesMetadataOfLargeBlocksAndRoundTrips) {
  // Big enough that the fp16 ranges pay for their tables: every metadata context is coded.
  KvBlock in = SynthesizeKv(KvShape{2, 2, 512, 64}, {.seed = 9}).value();
  ByteBuffer coded = EncodeKv(in, "quant(kbits=4,vbits=4)|rans").value();
  const auto p = Payload(coded);
  uint32_t n_code, n_half;
  std::memcpy(&n_code, p.data() + 3, 4);
  std::memcpy(&n_half, p.data() + 7 + n_code, 4);
  ASSERT_EQ(n_half, 8u);
  for (uint32_t k = 0; k < n_half; ++k) EXPECT_EQ(p[11 + n_code + k], 1) << "metadata context " << k;
  KvBlock a, b;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "quant(kbits=4,vbits=4)").value(), &a).ok());
  ASSERT_TRUE(DecodeKv(coded, &b).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
}

class RansCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    KvBlock in = SynthesizeKv(KvShape{1, 2, 64, 16}, {.seed = 3}).value();
    frame_ = EncodeKv(in, "quant(kbits=4,vbits=4)|rans").value();
    payload_at_ = ParseFrame(frame_).value().header.header_len();
  }
  // Changes a payload byte and re-checksums, so only the stage's own checks can catch it.
  Status DecodeWith(size_t payload_offset, uint8_t xor_mask) {
    ByteBuffer f = testing::Rechecksummed(frame_, [&](ByteBuffer& b) { b[payload_at_ + payload_offset] ^= xor_mask; });
    KvBlock out;
    return DecodeKv(f, &out);
  }
  ByteBuffer frame_;
  size_t payload_at_ = 0;
};

TEST_F(RansCorruption, TableStreamAndHeaderErrorsAreClear) {
  // Layout: 3 header bytes, u32 code contexts and their flags, u32 metadata contexts and
  // theirs, u32 table count, then table 0: 1 byte of bits, then varint frequencies.
  const auto p = Payload(frame_);
  uint32_t n_code, n_half;
  std::memcpy(&n_code, p.data() + 3, 4);
  ASSERT_EQ(n_code, 2u);  // K and V of one layer
  std::memcpy(&n_half, p.data() + 7 + n_code, 4);
  ASSERT_EQ(n_half, 4u);  // their minima and steps
  const size_t table0 = 7 + n_code + 4 + n_half + 4;
  Status st = DecodeWith(table0 + 1, 0x01);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("rans table 0"), std::string::npos) << st.message();
  st = DecodeWith(table0, 0x02);
  EXPECT_NE(st.message().find("bits"), std::string::npos) << st.message();
  st = DecodeWith(3, 0x01);  // code context count
  EXPECT_NE(st.message().find("does not match"), std::string::npos) << st.message();
  st = DecodeWith(7, 0x04);  // a context flag that does not exist
  EXPECT_NE(st.message().find("does not fit the strategy"), std::string::npos) << st.message();
  st = DecodeWith(table0 - 4, 0x01);  // table count
  EXPECT_NE(st.message().find("tables, expected"), std::string::npos) << st.message();
  // Every byte of the last 200 (the rANS stream): a clear error or, rarely, a frame whose
  // stream still decodes consistently — never a crash or a silent misread of the states.
  const size_t len = Payload(frame_).size();
  int caught = 0;
  for (size_t i = len - 200; i < len; ++i) caught += !DecodeWith(i, 0x5a).ok();
  EXPECT_GE(caught, 190);
}

TEST_F(RansCorruption, TruncatedPayloadIsRejected) {
  const auto payload = Payload(frame_);
  for (size_t cut : {size_t(3), size_t(40), payload.size() / 2, payload.size() - 1}) {
    ByteBuffer f = testing::Shortened(frame_, Payload(frame_).size() - cut);
    KvBlock out;
    Status st = DecodeKv(f, &out);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << cut << ": " << st.ToString();
  }
}

TEST(RansStage, NeedsSymbols) {
  auto r = ParseStrategy("cast|rans");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'rans' consumes symbols, but stage 1 'cast' produces bytes"), std::string::npos)
      << r.status().message();
  EXPECT_TRUE(ParseStrategy("quant|zstd").ok());  // symbols are bytes to zstd
  EXPECT_FALSE(ParseStrategy("quant|zstd|rans").ok());
}

}  // namespace
}  // namespace kvserve
