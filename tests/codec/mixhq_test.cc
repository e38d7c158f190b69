// mixhq stage: per-head levels from the spec, the error bound of symmetric absmax levels, head
// lists, composition with rans, and malformed payloads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

const KvShape kShape{2, 2, 70, 16};  // 4 (layer, head) pairs

KvBlock Decode(const ByteBuffer& f) {
  KvBlock out;
  Status st = DecodeKv(f, &out);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return out;
}

// Mean squared error of one (layer, part, head) slab.
double SlabMse(const KvBlock& a, const KvBlock& b, uint32_t l, KvPart p, uint32_t h) {
  double e = 0;
  for (uint32_t t = 0; t < a.shape().n_token; ++t)
    for (uint32_t d = 0; d < a.shape().head_dim; ++d) e += std::pow(a.Get(l, p, h, t, d) - b.Get(l, p, h, t, d), 2);
  return e / (a.shape().n_token * a.shape().head_dim);
}

TEST(MixHq, FineHeadsGetSmallerErrors) {
  KvBlock in = SynthesizeKv(kShape, {.seed = 2, .dtype = DType::kF32}).value();
  // Heads are numbered layer * n_head_kv + head: 1 = (0, 1), 2 = (1, 0).
  KvBlock out = Decode(EncodeKv(in, "mixhq(heads=1.2,kfine=40,vfine=40,kcoarse=3,vcoarse=3)").value());
  for (KvPart p : {KvPart::kKey, KvPart::kValue}) {
    EXPECT_LT(SlabMse(in, out, 0, p, 1) * 20, SlabMse(in, out, 0, p, 0));
    EXPECT_LT(SlabMse(in, out, 1, p, 0) * 20, SlabMse(in, out, 1, p, 1));
  }
}

TEST(MixHq, ExplicitLevelsPerSlabKeepTheirOrder) {
  // Slabs are [layer][K|V][head]: 8 of them here. Order and repeats are kept by the parser.
  EXPECT_NE(CanonicalStrategy("mixhq(levels=40.3.3.40.3.3.3.3)").value().find("levels=40.3.3.40.3.3.3.3"),
            std::string::npos);
  KvBlock in = SynthesizeKv(kShape, {.seed = 2, .dtype = DType::kF32}).value();
  KvBlock out = Decode(EncodeKv(in, "mixhq(levels=40.3.3.40.3.3.3.3)").value());
  EXPECT_LT(SlabMse(in, out, 0, KvPart::kKey, 0) * 20, SlabMse(in, out, 0, KvPart::kKey, 1));
  EXPECT_LT(SlabMse(in, out, 0, KvPart::kValue, 1) * 20, SlabMse(in, out, 0, KvPart::kValue, 0));
  EXPECT_LT(SlabMse(in, out, 0, KvPart::kValue, 1) * 20, SlabMse(in, out, 1, KvPart::kValue, 1));
  // Lossless through rans, whose statistics are split by code width.
  KvBlock coded = Decode(EncodeKv(in, "mixhq(levels=40.3.3.40.3.3.3.3)|rans").value());
  EXPECT_EQ(std::memcmp(coded.data(), out.data(), out.bytes()), 0);
  auto wrong = EncodeKv(in, "mixhq(levels=3.3.3)");
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("levels lists 3 limits, but the block has 8"), std::string::npos)
      << wrong.status().message();
  EXPECT_FALSE(ParseStrategy("mixhq(levels=3.0.3)").ok());  // limits are 1..127
}

TEST(MixHq, ErrorWithinHalfAScalePerRotatedValue) {
  // The rotation is orthonormal, so a row's error norm equals its rotated-domain error norm,
  // at most sqrt(D) * scale / 2 with scale = absmax / m of the rotated row (V, per token).
  KvBlock in = SynthesizeKv(kShape, {.seed = 4, .dtype = DType::kF32}).value();
  const int m = 5;
  KvBlock out = Decode(EncodeKv(in, "mixhq(lo_frac=1,vcoarse=5,kcoarse=5)").value());
  for (uint32_t t = 0; t < kShape.n_token; ++t) {
    double err = 0, norm = 0;
    for (uint32_t d = 0; d < 16; ++d) {
      err += std::pow(in.Get(1, KvPart::kValue, 1, t, d) - out.Get(1, KvPart::kValue, 1, t, d), 2);
      norm += std::pow(in.Get(1, KvPart::kValue, 1, t, d), 2);
    }
    // absmax of the rotated row <= its L2 norm; fp16 rounding of the scale adds 0.1%.
    EXPECT_LE(std::sqrt(err), std::sqrt(16.0) * std::sqrt(norm) / m / 2 * 1.001 + 1e-6) << t;
  }
}

TEST(MixHq, HeadListsAreCanonicalAndChecked) {
  const std::string c = CanonicalStrategy("mixhq(heads=3.1.3)").value();
  EXPECT_NE(c.find(",heads=1.3,"), std::string::npos) << c;  // sorted, without repeats
  EXPECT_EQ(CanonicalStrategy(c).value(), c);
  auto bad = ParseStrategy("mixhq(heads=1.x)");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("is not 'auto' or a list of integers"), std::string::npos);
  KvBlock in = SynthesizeKv(kShape, {}).value();
  auto r = EncodeKv(in, "mixhq(heads=9)");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("lists head 9, but the block has 4"), std::string::npos) << r.status().message();
}

TEST(MixHq, LoFracChoosesThatShareAtRandomAndLevelsAreRecorded) {
  KvBlock in = SynthesizeKv(KvShape{4, 5, 20, 8}, {}).value();  // 20 heads
  ByteBuffer f = EncodeKv(in, "mixhq(lo_frac=0.75,seed=3)").value();
  auto view = ParseFrame(f).value();
  // Levels per slab, after the 12-byte stage header: 5 of 20 heads fine (K limit 12, V limit 8).
  const uint8_t* m = view.payload.data() + 12;
  int fine_k = 0;
  for (uint32_t s = 0; s < 40; ++s) {
    const bool v = (s / 5) % 2;
    EXPECT_TRUE(m[s] == (v ? 8 : 12) || m[s] == (v ? 4 : 6)) << s;
    fine_k += !v && m[s] == 12;
  }
  EXPECT_EQ(fine_k, 5);
}

TEST(MixHq, LayerAndTokenBudgets) {
  KvBlock in = SynthesizeKv(kShape, {.seed = 12, .dtype = DType::kF32}).value();
  // boost_layers=1: both heads of layer 0 are fine even with every other head coarse.
  ByteBuffer f = EncodeKv(in, "mixhq(lo_frac=1,boost_layers=1)").value();
  const uint8_t* m = ParseFrame(f).value().payload.data() + 12;
  EXPECT_EQ(std::vector<uint8_t>(m, m + 8), (std::vector<uint8_t>{12, 12, 8, 8, 6, 6, 4, 4}));
  // sink=16: in coarse heads the first 16 tokens decode as finely as in fine heads.
  KvBlock plain, sunk;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "mixhq(lo_frac=1,kcoarse=2,vcoarse=2,group=16)").value(), &plain).ok());
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "mixhq(lo_frac=1,kcoarse=2,vcoarse=2,group=16,sink=16)").value(), &sunk).ok());
  auto err = [&](const KvBlock& out, uint32_t t0, uint32_t t1) {
    double e = 0;
    for (KvPart p : {KvPart::kKey, KvPart::kValue})
      for (uint32_t t = t0; t < t1; ++t)
        for (uint32_t d = 0; d < 16; ++d) e += std::fabs(in.Get(1, p, 0, t, d) - out.Get(1, p, 0, t, d));
    return e;
  };
  EXPECT_LT(err(sunk, 0, 16) * 3, err(plain, 0, 16));
  EXPECT_NEAR(err(sunk, 32, 70), err(plain, 32, 70), 1e-3 * err(plain, 32, 70));  // the rest is untouched
  // The budgets compose with the entropy coder (fine and coarse blocks keep separate tables).
  KvBlock coded;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "mixhq(lo_frac=1,kcoarse=2,vcoarse=2,group=16,sink=16)|rans").value(), &coded).ok());
  EXPECT_EQ(std::memcmp(coded.data(), sunk.data(), sunk.bytes()), 0);
}

TEST(MixHq, ComposesWithRansLosslessly) {
  KvBlock in = SynthesizeKv(kShape, {.seed = 9}).value();
  for (const char* spec : {"mixhq", "mixhq(heads=0.3,kfine=100,vfine=60)", "mixhq(lo_frac=0.5,group=7)"}) {
    KvBlock plain = Decode(EncodeKv(in, spec).value());
    KvBlock coded = Decode(EncodeKv(in, std::string(spec) + "|rans").value());
    EXPECT_EQ(std::memcmp(plain.data(), coded.data(), plain.bytes()), 0) << spec;
  }
  // On a block large enough to amortise its frequency tables, the coder shrinks the codes.
  KvBlock big = SynthesizeKv(KvShape{2, 2, 512, 16}, {.seed = 9}).value();
  EXPECT_LT(EncodeKv(big, "mixhq|rans").value().size(), EncodeKv(big, "mixhq").value().size());
}

// A NaN among the values (the maxima skip it) codes a defined level, the same every time, and
// decodes finite; the slabs without it code as they do without it. Found by the frame fuzzer:
// the NaN quotient was converted to int before the clamp, which is undefined.
TEST(MixHq, ANanValueCodesADefinedLevelAndLeavesOtherSlabsAlone) {
  const KvBlock clean = SynthesizeKv(kShape, {.seed = 4, .dtype = DType::kF32}).value();
  KvBlock in = clean;
  in.Set(0, KvPart::kValue, 1, 5, 3, std::nanf(""));
  in.Set(1, KvPart::kKey, 0, 9, 7, std::nanf(""));
  const ByteBuffer a = EncodeKv(in, "mixhq").value();
  EXPECT_EQ(a, EncodeKv(in, "mixhq").value());
  const KvBlock out = Decode(a), want = Decode(EncodeKv(clean, "mixhq").value());
  for (uint32_t l = 0; l < kShape.n_layer; ++l)
    for (KvPart p : {KvPart::kKey, KvPart::kValue})
      for (uint32_t h = 0; h < kShape.n_head_kv; ++h) {
        const bool has_nan = (l == 0 && p == KvPart::kValue && h == 1) || (l == 1 && p == KvPart::kKey && h == 0);
        for (uint32_t t = 0; t < kShape.n_token; ++t)
          for (uint32_t d = 0; d < kShape.head_dim; ++d) {
            const float got = out.Get(l, p, h, t, d);
            ASSERT_TRUE(std::isfinite(got)) << l << " " << int(p) << " " << h << " " << t << " " << d;
            if (!has_nan) ASSERT_EQ(got, want.Get(l, p, h, t, d)) << l << " " << int(p) << " " << h << " " << t << " " << d;
          }
      }
}

TEST(MixHq, MalformedPayloadIsRejected) {
  KvBlock in = SynthesizeKv(kShape, {}).value();
  ByteBuffer f = EncodeKv(in, "mixhq").value();
  const size_t at = ParseFrame(f).value().header.header_len();
  f = testing::Rechecksummed(f, [&](ByteBuffer& b) { b[at + 12] ^= 1; });  // the level of slab 0
  KvBlock out;
  Status st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("levels per head"), std::string::npos) << st.message();
  EXPECT_FALSE(EncodeKv(SynthesizeKv(KvShape{1, 1, 8, 12}, {}).value(), "mixhq").ok());  // head_dim 12
}

}  // namespace
}  // namespace kvserve
