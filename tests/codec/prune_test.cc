// prune stage: what it keeps, the positions it records, and that frames carrying positions are
// verified like the rest of the header.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"
#include "kvserve/thread_pool.h"

namespace kvserve {
namespace {

TEST(Prune, KeepsSinksRecentAndTheBestScoredTokens) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 20, 8}, {.seed = 1}).value();
  in.set_token_offset(100);
  std::vector<float> scores(20, 0.0f);
  scores[7] = 5, scores[11] = 4, scores[3] = 3;  // token 3 is a sink anyway
  CodecOptions o;
  o.token_scores = &scores;
  ByteBuffer f = EncodeKv(in, "prune(sink=2,recent=4,keep=0.15)", o).value();  // 14 in the middle: keep 2
  FrameView v = ParseFrame(f).value();
  EXPECT_EQ(v.header.positions, (std::vector<uint32_t>{100, 101, 107, 111, 116, 117, 118, 119}));
  KvBlock out;
  ASSERT_TRUE(DecodeKv(f, &out).ok());
  EXPECT_EQ(out.shape().n_token, 8u);
  EXPECT_EQ(out.positions(), v.header.positions);
  // Kept tokens are the originals, untouched.
  for (uint32_t j = 0; j < 8; ++j)
    for (uint32_t d = 0; d < 8; ++d)
      EXPECT_EQ(out.Get(1, KvPart::kValue, 1, j, d), in.Get(1, KvPart::kValue, 1, out.positions()[j] - 100, d));
}

TEST(Prune, KeptRowsKeepTheirDtypeAndTheChoiceDoesNotDependOnThreads) {
  KvBlock in = SynthesizeKv(KvShape{3, 2, 300, 16}, {.seed = 4}).value();
  ThreadPool pool(2);
  CodecOptions threaded;
  threaded.pool = &pool;
  for (const char* spec : {"prune(keep=0.3,score=knorm)", "prune(keep=0.3,score=knorm)|quant(kbits=8,vbits=8)"}) {
    ByteBuffer one = EncodeKv(in, spec).value();
    EXPECT_EQ(one, EncodeKv(in, spec, threaded).value()) << spec;
    KvBlock a, b;
    ASSERT_TRUE(DecodeKv(one, &a).ok());
    ASSERT_TRUE(DecodeKv(one, &b, threaded).ok());
    ASSERT_EQ(a.dtype(), DType::kF16);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0) << spec;
  }
  // Alone, the stage stores the kept fp16 rows as they were.
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "prune(keep=0.3,score=knorm)").value(), &out).ok());
  const size_t row = 16 * 2;
  for (uint64_t sl = 0; sl < in.shape().n_slab(); ++sl)
    for (uint32_t j = 0; j < out.shape().n_token; ++j)
      ASSERT_EQ(std::memcmp(out.slab_at(sl) + j * row, in.slab_at(sl) + out.positions()[j] * row, row), 0);
}

TEST(Prune, KeyNormFallbackKeepsTheSmallestKeys) {
  KvBlock in = KvBlock::Create(KvShape{1, 1, 10, 8}, DType::kF32).value();
  for (uint32_t t = 0; t < 10; ++t)
    for (uint32_t d = 0; d < 8; ++d) in.Set(0, KvPart::kKey, 0, t, d, t == 5 ? 0.01f : 1.0f + t);
  ByteBuffer f = EncodeKv(in, "prune(sink=1,recent=1,keep=0.125,score=knorm)").value();  // keep 1 of 8
  EXPECT_EQ(ParseFrame(f).value().header.positions, (std::vector<uint32_t>{0, 5, 9}));
  // score=attn without scores falls back to the same choice.
  EXPECT_EQ(ParseFrame(EncodeKv(in, "prune(sink=1,recent=1,keep=0.125)").value()).value().header.positions,
            ParseFrame(f).value().header.positions);
}

TEST(Prune, ComposesAndRoundTripsPositions) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 100, 16}, {.seed = 3}).value();
  for (const char* spec : {"prune|quant|rans", "rotate|prune(keep=0.3)|quant(kbits=3)|zstd", "prune(keep=0)|mixhq|rans",
                           "prune(keep=1)", "prune(sink=0,recent=0,keep=0.5)|cast"}) {
    auto f = EncodeKv(in, spec);
    ASSERT_TRUE(f.ok()) << spec << ": " << f.status().ToString();
    KvBlock out;
    Status st = DecodeKv(f.value(), &out);
    ASSERT_TRUE(st.ok()) << spec << ": " << st.ToString();
    const FrameView v = ParseFrame(f.value()).value();
    EXPECT_EQ(v.header.shape.n_token, 100u) << spec;  // the header keeps the original shape
    EXPECT_EQ(out.positions(), v.header.positions) << spec;
    EXPECT_EQ(out.shape().n_token, v.header.has_positions ? v.header.positions.size() : 100u) << spec;
  }
}

// A block decoded from a pruned frame is a block like any other: written to a KV file, encoded
// with a strategy that selects nothing, and decoded, it keeps its tokens' positions. Selecting
// it again, or two selections in one strategy, is refused with the reason.
TEST(Prune, SelectedBlocksReencodeWithTheirPositions) {
  KvBlock in = SynthesizeKv(KvShape{2, 2, 100, 16}, {.seed = 3}).value();
  in.set_token_offset(40);
  KvBlock pruned;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "prune(keep=0.2,recent=8)").value(), &pruned).ok());
  ASSERT_FALSE(pruned.positions().empty());
  for (const char* spec : {"none", "quant|zstd", "cast(dtype=f16)", "rotate|quant(kbits=8,vbits=8)"}) {
    auto f = EncodeKv(pruned, spec);
    ASSERT_TRUE(f.ok()) << spec << ": " << f.status().ToString();
    KvBlock back;
    ASSERT_TRUE(DecodeKv(f.value(), &back).ok()) << spec;
    EXPECT_EQ(back.positions(), pruned.positions()) << spec;
    EXPECT_EQ(back.token_offset(), 40u) << spec;
    EXPECT_EQ(back.shape(), pruned.shape()) << spec;
  }
  const std::string path = ::testing::TempDir() + "/kvserve_pruned.kvf";
  ASSERT_TRUE(WriteKvFile(path, pruned).ok());
  KvBlock read = ReadKvFile(path).value();
  EXPECT_EQ(read.positions(), pruned.positions());
  EXPECT_EQ(std::memcmp(read.data(), pruned.data(), pruned.bytes()), 0);
  std::remove(path.c_str());

  auto again = EncodeKv(pruned, "prune(recent=2)|quant");
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("already selected"), std::string::npos) << again.status().message();
  auto twice = ParseStrategy("prune|prune(keep=0.3)|quant");
  ASSERT_FALSE(twice.ok());
  EXPECT_NE(twice.status().message().find("at most one token-selection stage"), std::string::npos)
      << twice.status().message();
}

// Positions are 32-bit: a block whose tokens run past 2^32 is refused at encode, and a frame
// claiming such tokens is refused at decode, instead of wrapping positions.
TEST(Prune, TokenOffsetsNear32BitsAreRefusedNotWrapped) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 30, 8}, {}).value();
  in.set_token_offset(0xFFFFFFF0u);
  for (const char* spec : {"prune(sink=1,recent=1,keep=0.5)", "none", "quant"}) {
    auto f = EncodeKv(in, spec);
    ASSERT_FALSE(f.ok()) << spec;
    EXPECT_EQ(f.status().code(), StatusCode::kOutOfRange) << f.status().ToString();
  }
  in.set_token_offset(0xFFFFFFFFu - 30);  // the last token at 2^32 - 2: fits
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "prune(sink=1,recent=1,keep=0.5)").value(), &out).ok());
  EXPECT_EQ(out.positions().back(), 0xFFFFFFFFu - 1);
  ByteBuffer f = EncodeKv(in, "quant").value();
  ByteBuffer patched = testing::Rechecksummed(f, [](ByteBuffer& b) {
    const uint32_t offset = 0xFFFFFFF0u;
    std::memcpy(b.data() + 28, &offset, 4);
  });
  const Status st = DecodeKv(patched, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("overflow 32-bit positions"), std::string::npos) << st.message();
}

TEST(Prune, TamperedPositionsAreRejected) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 30, 8}, {}).value();
  ByteBuffer good = EncodeKv(in, "prune(sink=1,recent=1,keep=0.5)").value();
  const size_t spec_len = ParseFrame(good).value().header.spec.size();
  const size_t pos_at = kFrameFixedHeader + spec_len + 4;
  auto decode_patched = [&](size_t at, uint32_t value) {
    ByteBuffer f = testing::Rechecksummed(good, [&](ByteBuffer& b) { std::memcpy(b.data() + at, &value, 4); });
    KvBlock out;
    return DecodeKv(f, &out);
  };
  Status st = decode_patched(pos_at + 4, 0);  // second position before the first's successor
  EXPECT_NE(st.message().find("not increasing"), std::string::npos) << st.message();
  const size_t n_kept = ParseFrame(good).value().header.positions.size();
  st = decode_patched(pos_at + 4 * (n_kept - 1), 1000);  // the last one beyond the block
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("keeps"), std::string::npos) << st.message();
  st = decode_patched(pos_at - 4, 3);  // count disagrees with header_len
  EXPECT_NE(st.message().find("header_len"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace kvserve
