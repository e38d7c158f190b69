// rans stage: bit-exact round trips over every code width and option, a real gain over zstd
// where codes are predictable, and clear errors for corrupted tables and streams.
#include <gtest/gtest.h>

#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"
#include "kvserve/thread_pool.h"

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

// Walks a rans payload to its stream directory (the layout at the top of src/codec/rans.cc):
// the offset of n_streams.
size_t StreamDirectoryAt(std::span<const uint8_t> p) {
  size_t at = 3;
  auto u32 = [&] {
    uint32_t v;
    std::memcpy(&v, p.data() + at, 4);
    at += 4;
    return v;
  };
  auto varint = [&] {
    uint32_t v = 0;
    for (int shift = 0;; shift += 7) {
      const uint8_t b = p[at++];
      v |= uint32_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
  };
  at += u32();  // code context flags
  at += u32();  // metadata flags
  const uint32_t n_tables = u32();
  for (uint32_t t = 0; t < n_tables; ++t) {
    const uint32_t a = 1u << p[at++];
    for (uint32_t s = 0; s < a;) {
      if (varint() == 0) s += varint();
      ++s;
    }
  }
  uint64_t raw_len;
  std::memcpy(&raw_len, p.data() + at, 8);
  return at + 8 + raw_len + 8;  // raw bytes, then n_symbols
}

TEST(RansStage, LargeFramesCodeInStreamsThatDoNotDependOnThreads) {
  // Four layers of two heads, 1024 tokens: every (layer, K/V) context holds 2^18 codes, the
  // size after which a stream may end, so each gets a stream; the metadata runs (which do not
  // count towards that size) go with the first.
  KvBlock in = SynthesizeKv(KvShape{4, 2, 1024, 128}, {.seed = 5}).value();
  const std::string spec = "quant(kbits=4,vbits=4)|rans";
  ThreadPool pool(2);
  CodecOptions threaded;
  threaded.pool = &pool;
  ByteBuffer one = EncodeKv(in, spec).value();
  ByteBuffer two = EncodeKv(in, spec, threaded).value();
  ASSERT_EQ(one, two) << "the frame depends on the threads that wrote it";
  // Large enough (1 MiB of streams) that the pool copies them and hashes the frame's chunks.
  ASSERT_GE(one.size(), (size_t{1} << 20) + 4096);
  const auto p = Payload(one);
  const size_t dir = StreamDirectoryAt(p);
  uint32_t n_streams;
  std::memcpy(&n_streams, p.data() + dir, 4);
  EXPECT_EQ(n_streams, 8u);
  // Later streams start at the first section of a context: after the metadata runs and the 64 K
  // sections of layer 0 (32 blocks of 32 tokens for each of 2 heads), then its 32 V sections
  // (16 blocks of 64 tokens for each head).
  const size_t stream_entry = 4 + 32 * 4 + 8;  // first run, final states, length
  uint32_t second_start, third_start;
  std::memcpy(&second_start, p.data() + dir + 4 + 32 * 4 + 8, 4);
  std::memcpy(&third_start, p.data() + dir + 4 + 32 * 4 + 8 + stream_entry, 4);
  uint32_t n_half;
  std::memcpy(&n_half, p.data() + 7 + p[3], 4);
  uint32_t coded_half = 0;
  for (uint32_t k = 0; k < n_half; ++k) coded_half += p[11 + p[3] + k];
  EXPECT_EQ(coded_half, 16u);
  EXPECT_EQ(second_start, coded_half + 64u);
  EXPECT_EQ(third_start, coded_half + 96u);
  // Decoded on one thread or two, the codes are the quantiser's exactly.
  KvBlock a, b, c;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "quant(kbits=4,vbits=4)").value(), &a).ok());
  ASSERT_TRUE(DecodeKv(one, &b).ok());
  ASSERT_TRUE(DecodeKv(one, &c, threaded).ok());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
  EXPECT_EQ(std::memcmp(a.data(), c.data(), a.bytes()), 0);
  // A stream directory that does not fit the runs is refused by name.
  const size_t payload_at = ParseFrame(one).value().header.header_len();
  auto decode_with = [&](size_t offset, uint32_t value) {
    ByteBuffer f = testing::Rechecksummed(one, [&](ByteBuffer& buf) { std::memcpy(buf.data() + payload_at + offset, &value, 4); });
    KvBlock out;
    return DecodeKv(f, &out, threaded);
  };
  Status st = decode_with(dir, 0);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("0 streams for"), std::string::npos) << st.message();
  st = decode_with(dir, 100000);
  EXPECT_NE(st.message().find("100000 streams for"), std::string::npos) << st.message();
  st = decode_with(dir + 4 + 32 * 4 + 8, 0);  // the second stream starting where the first does
  EXPECT_NE(st.message().find("rans stream 1 starts at run 0"), std::string::npos) << st.message();
  st = decode_with(dir + 4 + 32 * 4 + 8, second_start + 1);  // a cut off by one section
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
  // A damaged word inside the last stream (decoded paired with the one before) is caught by
  // its final states, on one thread or two.
  ByteBuffer damaged = testing::Rechecksummed(one, [&](ByteBuffer& buf) { buf[buf.size() - 8 - 5000] ^= 0x5a; });
  for (const CodecOptions& o : {CodecOptions{}, threaded}) {
    KvBlock out;
    st = DecodeKv(damaged, &out, o);
    EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
    EXPECT_NE(st.message().find("rans stream 7"), std::string::npos) << st.message();
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
