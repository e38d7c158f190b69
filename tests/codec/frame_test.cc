// Frame verification: every flipped byte and every truncation is caught, lengths cannot force
// large allocations, and each failure says what it is.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zstd.h>

#include <cstring>
#include <filesystem>

#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"
#include "kvserve/thread_pool.h"

namespace kvserve {
namespace {

ByteBuffer SmallFrame(const std::string& spec) {
  KvBlock b = SynthesizeKv(KvShape{2, 2, 12, 8}, {.seed = 9}).value();
  return EncodeKv(b, spec).value();
}

TEST(Frame, HeaderFieldsRoundTrip) {
  KvBlock b = SynthesizeKv(KvShape{2, 3, 12, 8}, {.seed = 9, .dtype = DType::kBF16}).value();
  b.set_token_offset(512);
  ByteBuffer f = EncodeKv(b, "quant(kbits=3)|zstd").value();
  FrameView v = ParseFrame(f).value();
  EXPECT_EQ(v.header.shape, b.shape());
  EXPECT_EQ(v.header.dtype, DType::kBF16);
  EXPECT_EQ(v.header.token_offset, 512u);
  EXPECT_EQ(v.header.spec, CanonicalStrategy("quant(kbits=3)|zstd").value());
  EXPECT_EQ(v.header.frame_len(), f.size());
  EXPECT_EQ(PeekFrameLength(std::span(f).first(kFrameFixedHeader)).value(), f.size());
  KvBlock out;
  ASSERT_TRUE(DecodeKv(f, &out).ok());
  EXPECT_EQ(out.token_offset(), 512u);
  EXPECT_EQ(out.dtype(), DType::kBF16);
}

TEST(Frame, EverySingleByteFlipIsDetected) {
  for (const char* spec : {"none", "quant(kbits=2,vbits=2)|zstd"}) {
    const ByteBuffer good = SmallFrame(spec);
    KvBlock out;
    for (size_t i = 0; i < good.size(); ++i) {
      for (uint8_t mask : {0x01, 0x80, 0xff}) {
        ByteBuffer bad = good;
        bad[i] ^= mask;
        Status st = DecodeKv(bad, &out);
        ASSERT_FALSE(st.ok()) << spec << ": flip at byte " << i << " mask " << int(mask) << " went unnoticed";
      }
    }
  }
}

// Version 3 checksums 256 KiB chunks on their own (so a pool can share the work): a frame of
// several chunks comes out byte for byte the same on one thread and on a pool, and damage in
// any chunk, the last short one included, is caught either way.
TEST(Frame, ChunkedChecksumIsTheSameOnAPoolAndCatchesDamageInEveryChunk) {
  KvBlock b = SynthesizeKv(KvShape{4, 4, 1024, 128}, {.seed = 3}).value();  // 8 MiB of f16
  ThreadPool pool(2);
  CodecOptions on_pool;
  on_pool.pool = &pool;
  const ByteBuffer alone = EncodeKv(b, "none").value();
  ASSERT_EQ(EncodeKv(b, "none", on_pool).value(), alone);
  const size_t chunks = (alone.size() - kFrameChecksumBytes + kFrameChecksumChunk - 1) / kFrameChecksumChunk;
  ASSERT_GT(chunks, 8u);
  ASSERT_NE((alone.size() - kFrameChecksumBytes) % kFrameChecksumChunk, 0u);  // the last chunk is short
  KvBlock out;
  ASSERT_TRUE(DecodeKv(alone, &out, on_pool).ok());
  EXPECT_EQ(out.bytes(), b.bytes());
  EXPECT_EQ(std::memcmp(out.data(), b.data(), b.bytes()), 0);
  for (size_t c = 0; c < chunks; ++c) {
    ByteBuffer bad = alone;
    bad[std::min(bad.size() - kFrameChecksumBytes - 1, c * kFrameChecksumChunk + 4097)] ^= 0x10;
    for (const CodecOptions& o : {CodecOptions{}, on_pool}) {
      const Status st = DecodeKv(bad, &out, o);
      EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << "chunk " << c << ": " << st.ToString();
    }
  }
  // Two chunks swapped keep every chunk hash but not their order.
  ByteBuffer swapped = alone;
  std::swap_ranges(swapped.begin() + kFrameChecksumChunk, swapped.begin() + 2 * kFrameChecksumChunk,
                   swapped.begin() + 2 * kFrameChecksumChunk);
  EXPECT_NE(DecodeKv(swapped, &out).message().find("checksum mismatch"), std::string::npos);
}

// Frames written as version 2 (checksum: XXH3-64 of the bytes) by earlier builds still read.
TEST(Frame, Version2FramesStillRead) {
  KvBlock b = SynthesizeKv(KvShape{2, 2, 12, 8}, {.seed = 9}).value();
  ByteBuffer f;
  FrameHeader h;
  h.version = 2;
  h.dtype = b.dtype();
  h.shape = b.shape();
  h.spec = "none";
  AppendFrameHeader(h, &f);
  f.insert(f.end(), b.data(), b.data() + b.bytes());
  ASSERT_TRUE(FinishFrame(&f, 0).ok());
  ByteBuffer v3 = EncodeKv(b, "none").value();
  ASSERT_EQ(f.size(), v3.size());
  EXPECT_NE(f, v3);  // another version and another checksum
  FrameView v = ParseFrame(f).value();
  EXPECT_EQ(v.header.version, 2);
  KvBlock out;
  ASSERT_TRUE(DecodeKv(f, &out).ok());
  EXPECT_EQ(std::memcmp(out.data(), b.data(), b.bytes()), 0);
  f[f.size() / 2] ^= 1;
  EXPECT_NE(DecodeKv(f, &out).message().find("checksum mismatch"), std::string::npos);
}

TEST(Frame, EveryTruncationIsRejected) {
  const ByteBuffer good = SmallFrame("quant(kbits=4,vbits=2)");
  KvBlock out;
  for (size_t n = 0; n < good.size(); ++n) {
    Status st = DecodeKv(std::span(good).first(n), &out);
    ASSERT_FALSE(st.ok()) << "truncated to " << n;
    if (n >= 6) EXPECT_EQ(st.code(), StatusCode::kCorrupt) << n << ": " << st.message();
  }
  ByteBuffer longer = good;
  longer.push_back(0);
  EXPECT_NE(DecodeKv(longer, &out).message().find("length mismatch"), std::string::npos);
}

TEST(Frame, EachFailureHasItsOwnMessage) {
  const ByteBuffer good = SmallFrame("none");
  KvBlock out;
  ByteBuffer b = good;
  b[0] = 'X';
  EXPECT_NE(DecodeKv(b, &out).message().find("bad magic"), std::string::npos);
  b = good;
  b[4] = 9;
  Status st = DecodeKv(b, &out);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("version 9"), std::string::npos);
  EXPECT_NE(st.message().find("versions 2 to 3"), std::string::npos) << st.message();
  b[4] = 1;
  EXPECT_EQ(DecodeKv(b, &out).code(), StatusCode::kUnsupported);
  b = good;
  b[good.size() / 2] ^= 1;
  EXPECT_NE(DecodeKv(b, &out).message().find("checksum mismatch"), std::string::npos);
  EXPECT_NE(DecodeKv(std::span(good).first(20), &out).message().find("truncated"), std::string::npos);
}

// A frame that is well formed and correctly checksummed but declares an enormous shape must be
// refused from the header alone.
TEST(Frame, HugeDeclaredShapeDoesNotAllocate) {
  ByteBuffer f;
  FrameHeader h;
  h.shape = KvShape{32, 8, 1u << 16, 128};  // 2^31 elements, 4 GiB of f16
  h.dtype = DType::kF16;
  h.spec = "none";
  AppendFrameHeader(h, &f);
  f.push_back(0);
  ASSERT_TRUE(FinishFrame(&f, 0).ok());
  KvBlock out;
  CodecOptions o;
  o.max_decoded_bytes = 1 << 20;
  Status st = DecodeKv(f, &out, o);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.ToString();
  // Under the default limit the identity payload size check refuses it, still before allocating.
  st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
  EXPECT_EQ(out.bytes(), 0u);
  // An oversized payload_len in a short buffer is a truncation, not an allocation.
  ByteBuffer g = SmallFrame("none");
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(g.data() + 32, &huge, 8);
  EXPECT_EQ(DecodeKv(g, &out).code(), StatusCode::kCorrupt);
  EXPECT_FALSE(PeekFrameLength(g).ok());
}

// A zstd payload can declare far more than its frame's shape could ever need (64 MiB of zeros
// compress to a few KiB): the decoder bounds every byte level by the shape and refuses before
// allocating, instead of decompressing and failing at the next stage.
TEST(Frame, ZstdBombIsRefusedByTheShapeBound) {
  const std::string spec = CanonicalStrategy("cast(dtype=f16)|zstd").value();
  const std::vector<uint8_t> zeros(64 << 20, 0);
  ByteBuffer bomb(ZSTD_compressBound(zeros.size()));
  const size_t n = ZSTD_compress(bomb.data(), bomb.size(), zeros.data(), zeros.size(), 1);
  ASSERT_FALSE(ZSTD_isError(n));
  ASSERT_LT(n, 64u << 10);
  ByteBuffer f;
  FrameHeader h;
  h.shape = KvShape{2, 2, 12, 8};  // 384 elements: 768 bytes of f16
  h.dtype = DType::kF32;
  h.spec = spec;
  AppendFrameHeader(h, &f);
  const uint64_t raw = zeros.size();
  f.insert(f.end(), reinterpret_cast<const uint8_t*>(&raw), reinterpret_cast<const uint8_t*>(&raw) + 8);
  f.insert(f.end(), bomb.begin(), bomb.begin() + n);
  ASSERT_TRUE(FinishFrame(&f, 0).ok());
  KvBlock out;
  const Status st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange) << st.ToString();
  EXPECT_NE(st.message().find("zstd payload claims 67108864 bytes"), std::string::npos) << st.ToString();
}

// The header stores the spec with a 16-bit length and decoders refuse more than kFrameMaxSpec
// bytes: a longer spec is refused when the pipeline is made, never written and then refused by
// its own decoder (or, above 65535 bytes, stored truncated).
TEST(Frame, SpecsBeyondTheFrameLimitAreRefusedAtEncode) {
  std::string spec = "quant";
  while (spec.size() <= kFrameMaxSpec) spec += "|zstd";
  auto p = Pipeline::Create(spec);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("above the frame limit of 4096"), std::string::npos) << p.status().message();
  while (spec.size() <= 70000) spec += "|zstd";
  KvBlock b = SynthesizeKv(KvShape{1, 1, 8, 8}, {}).value();
  auto f = EncodeKv(b, spec);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
}

TEST(Frame, FileWriteIsAtomicAndReadBack) {
  const std::string dir = ::testing::TempDir() + "/kvserve_frame_test";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/x.kvf";
  KvBlock b = SynthesizeKv(KvShape{1, 2, 5, 8}, {}).value();
  ASSERT_TRUE(WriteKvFile(path, b).ok());
  KvBlock r = ReadKvFile(path).value();
  EXPECT_EQ(std::memcmp(r.data(), b.data(), b.bytes()), 0);
  for (const auto& e : std::filesystem::directory_iterator(dir)) EXPECT_EQ(e.path().filename(), "x.kvf");
  // Writing into a missing folder fails cleanly and leaves nothing behind.
  Status st = WriteKvFile(dir + "/missing/y.kvf", b);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  auto missing = ReadKvFile(dir + "/nope.kvf");
  EXPECT_EQ(missing.status().code(), StatusCode::kIoError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvserve
