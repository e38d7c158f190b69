// An engine's FP8 cache with its scales (per tensor, per head): the block carries them, frames
// carry them, decoders convert codes to their destination's scales, and every stage codes such a
// cache as well as it codes the values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

using G = Fp8Scales::Granularity;

KvBlock Values(uint32_t n_token = 64) {
  // Heads of very different magnitude, as real caches have: head h of layer l is scaled by 4^(h - l).
  KvBlock b = SynthesizeKv(KvShape{2, 3, n_token, 16}, {.seed = 7, .dtype = DType::kF32}).value();
  for (uint64_t s = 0; s < b.shape().n_slab(); ++s) {
    const uint32_t h = s % 3, l = uint32_t(s / 6);
    float* x = reinterpret_cast<float*>(b.slab_at(s));
    for (uint64_t i = 0; i < b.shape().slab_numel(); ++i) x[i] *= std::pow(4.0f, float(h) - float(l));
  }
  return b;
}

TEST(Fp8Scales, SettingThemChecksDtypeCountAndValues) {
  KvBlock f16 = KvBlock::Create(KvShape{2, 3, 4, 8}, DType::kF16).value();
  Status st = f16.set_fp8_scales({G::kTensor, std::vector<float>(4, 1.0f)});
  EXPECT_NE(st.message().find("f16 block"), std::string::npos) << st.ToString();
  KvBlock fp8 = KvBlock::Create(KvShape{2, 3, 4, 8}, DType::kE4M3).value();
  st = fp8.set_fp8_scales({G::kHead, std::vector<float>(4, 1.0f)});
  EXPECT_NE(st.message().find("hold 4 values"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("needs 12"), std::string::npos) << st.ToString();
  std::vector<float> bad(4, 1.0f);
  bad[2] = 0.0f;
  st = fp8.set_fp8_scales({G::kTensor, bad});
  EXPECT_NE(st.message().find("FP8 scale 2"), std::string::npos) << st.ToString();
  bad[2] = NAN;
  EXPECT_FALSE(fp8.set_fp8_scales({G::kTensor, bad}).ok());
  EXPECT_TRUE(fp8.set_fp8_scales({G::kTensor, {1, 2, 3, 4}}).ok());
  EXPECT_EQ(fp8.fp8_scales().ForSlab(fp8.shape(), 4), 2.0f);  // layer 0, V, head 1
  EXPECT_FALSE(ParseFp8Granularity("channel").ok());
  EXPECT_EQ(ParseFp8Granularity("head").value(), G::kHead);
}

TEST(Fp8Scales, ToScaledFp8MapsEachGroupsLargestValueToTheFormatsLargest) {
  const KvBlock v = Values();
  for (DType fp8 : {DType::kE4M3, DType::kE5M2}) {
    for (G g : {G::kTensor, G::kHead}) {
      const KvBlock q = ToScaledFp8(v, fp8, g).value();
      ASSERT_EQ(q.fp8_scales().granularity, g);
      ASSERT_EQ(q.fp8_scales().scale.size(), Fp8Scales::Count(g, v.shape()));
      const float largest = fp8 == DType::kE4M3 ? 448.0f : 57344.0f;
      const double rel = fp8 == DType::kE4M3 ? 1.0 / 16 : 1.0 / 8;  // half an ulp of 3 / 2 mantissa bits
      std::vector<float> amax(q.fp8_scales().scale.size(), 0.0f);
      const KvShape& sh = v.shape();
      for (uint32_t l = 0; l < sh.n_layer; ++l)
        for (KvPart p : {KvPart::kKey, KvPart::kValue})
          for (uint32_t h = 0; h < sh.n_head_kv; ++h)
            for (uint32_t t = 0; t < sh.n_token; ++t)
              for (uint32_t d = 0; d < sh.head_dim; ++d) {
                const float x = v.Get(l, p, h, t, d), y = q.Get(l, p, h, t, d);
                const uint64_t s = sh.slab_index(l, p, h);
                const float scale = q.fp8_scales().ForSlab(sh, s);
                // Relative half-ulp bound above the subnormal range, absolute below it.
                const double tiny = scale * (fp8 == DType::kE4M3 ? std::ldexp(1.0, -9) : std::ldexp(1.0, -16));
                ASSERT_LE(std::fabs(x - y), std::max(rel * std::fabs(x), double(tiny)) * 1.0001) << x << " " << y;
                float& m = amax[g == G::kHead ? s : s / sh.n_head_kv];
                m = std::max(m, std::fabs(x));
              }
      for (size_t i = 0; i < amax.size(); ++i) EXPECT_FLOAT_EQ(q.fp8_scales().scale[i], amax[i] / largest);
    }
  }
  EXPECT_FALSE(ToScaledFp8(v, DType::kF16, G::kHead).ok());
  // Layer and token views carry their part of the scales.
  const KvBlock q = ToScaledFp8(v, DType::kE4M3, G::kHead).value();
  const KvBlock layer1 = q.LayerView(1, 1).value();
  EXPECT_EQ(layer1.fp8_scales().scale, std::vector<float>(q.fp8_scales().scale.begin() + 6, q.fp8_scales().scale.end()));
  EXPECT_EQ(q.SliceTokens(3, 10).value().fp8_scales(), q.fp8_scales());
  EXPECT_EQ(q.ConvertTo(DType::kE4M3).value().fp8_scales(), q.fp8_scales());
  EXPECT_TRUE(q.ConvertTo(DType::kF32).value().fp8_scales().empty());
  EXPECT_FLOAT_EQ(q.ConvertTo(DType::kF32).value().Get(1, KvPart::kValue, 2, 5, 3), q.Get(1, KvPart::kValue, 2, 5, 3));
}

TEST(Fp8Scales, SynthesizedCachesAreScaledAsAskedAndFilesKeepTheScales) {
  SynthOptions o{.seed = 3, .dtype = DType::kE5M2, .fp8_scale = G::kTensor};
  const KvBlock b = SynthesizeKv(KvShape{3, 2, 20, 8}, o).value();
  EXPECT_EQ(b.fp8_scales().scale.size(), 6u);
  o.dtype = DType::kBF16;
  EXPECT_FALSE(SynthesizeKv(KvShape{3, 2, 20, 8}, o).ok());
  const std::string path = ::testing::TempDir() + "/fp8_scales_test.kvf";
  ASSERT_TRUE(WriteKvFile(path, b).ok());
  const KvBlock r = ReadKvFile(path).value();
  EXPECT_EQ(r.fp8_scales(), b.fp8_scales());
  EXPECT_EQ(std::memcmp(r.data(), b.data(), b.bytes()), 0);
}

// Strategies over every kind of stage: identity, casts, lossless, scaled FP8, quantisers with and
// without transforms and entropy coders, head-wise mixed precision, token selection.
class ScaledCache : public ::testing::TestWithParam<std::string> {};

TEST_P(ScaledCache, FramesCarryTheScalesAndDecodeToTheValues) {
  const KvBlock v = Values();
  const KvBlock q = ToScaledFp8(v, DType::kE4M3, G::kHead).value();
  const ByteBuffer frame = EncodeKv(q, GetParam()).value();
  const FrameView fv = ParseFrame(frame).value();
  EXPECT_EQ(fv.header.fp8_scales, q.fp8_scales());
  // An owning block takes the frame's scales.
  KvBlock owned;
  ASSERT_TRUE(DecodeKv(frame, &owned).ok());
  EXPECT_EQ(owned.dtype(), DType::kE4M3);
  EXPECT_EQ(owned.fp8_scales(), q.fp8_scales());
  // An f32 view receives the values; they match the owning block's codes times their scales.
  KvBlock dense = KvBlock::Create(owned.shape(), DType::kF32).value();
  KvBlock f32_view = KvBlock::View(owned.shape(), DType::kF32, dense.data()).value();
  ASSERT_TRUE(DecodeKv(frame, &f32_view).ok());
  const KvShape& sh = owned.shape();
  for (uint64_t s = 0; s < sh.n_slab(); ++s) {
    const float* got = reinterpret_cast<const float*>(f32_view.slab_at(s));
    const float scale = owned.fp8_scales().ForSlab(sh, s);
    for (uint64_t i = 0; i < sh.slab_numel(); ++i) {
      // Stages decode into f32 directly there (no FP8 rounding), so allow the FP8 step.
      const float code_value = E4M3ToFloat(owned.slab_at(s)[i]) * scale;
      ASSERT_LE(std::fabs(got[i] - code_value), std::fabs(code_value) / 8 + scale * 0.002f + 1e-30f) << s << " " << i;
    }
  }
  // Quality against the values the cache stands for, per part; heads of every magnitude count.
  if (!owned.positions().empty()) return;  // selection keeps fewer tokens; its quality is prune's own tests'
  const KvCompareResult cmp = CompareKv(v, f32_view).value();
  EXPECT_GT(cmp.k.cosine, 0.97) << GetParam();
  EXPECT_GT(cmp.v.cosine, 0.97) << GetParam();
}

TEST_P(ScaledCache, AViewWithOtherScalesGetsItsOwnCodes) {
  const KvBlock q = ToScaledFp8(Values(), DType::kE4M3, G::kTensor).value();
  const ByteBuffer frame = EncodeKv(q, GetParam()).value();
  KvBlock owned;
  ASSERT_TRUE(DecodeKv(frame, &owned).ok());
  // The destination engine keeps scales twice as large (and one equal): codes become half the value.
  Fp8Scales dst = q.fp8_scales();
  for (size_t i = 1; i < dst.scale.size(); ++i) dst.scale[i] *= 2;
  KvBlock mem = KvBlock::Create(owned.shape(), DType::kE4M3).value();
  KvBlock view = KvBlock::View(owned.shape(), DType::kE4M3, mem.data()).value();
  ASSERT_TRUE(view.set_fp8_scales(dst).ok());
  ASSERT_TRUE(DecodeKv(frame, &view).ok());
  EXPECT_EQ(view.fp8_scales(), dst);  // a view keeps its own
  const KvShape& sh = owned.shape();
  for (uint64_t s = 0; s < sh.n_slab(); ++s) {
    for (uint64_t i = 0; i < sh.slab_numel(); ++i) {
      const float want = E4M3ToFloat(owned.slab_at(s)[i]) * q.fp8_scales().ForSlab(sh, s);
      const float got = E4M3ToFloat(view.slab_at(s)[i]) * dst.ForSlab(sh, s);
      if (s / sh.n_head_kv == 0) ASSERT_EQ(view.slab_at(s)[i], owned.slab_at(s)[i]);  // equal scale: untouched
      ASSERT_LE(std::fabs(got - want), std::fabs(want) / 16 + dst.ForSlab(sh, s) * 0.002f) << s << " " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, ScaledCache,
                         ::testing::Values("none", "cast(dtype=f16)", "fpsplit(dtype=e4m3)|rans", "fp8|rans",
                                           "quant(kbits=8,vbits=8)|zstd", "rotate|quant(kbits=8,vbits=8)|rans",
                                           "mixhq(lo_frac=0.5)|rans", "prune(keep=0.5)|quant(kbits=8,vbits=8)|rans"),
                         [](const auto& info) { return "s" + std::to_string(info.index); });

TEST(Fp8Scales, LosslessStrategiesKeepEveryCodeAndTheScales) {
  const KvBlock q = ToScaledFp8(Values(), DType::kE5M2, G::kHead).value();
  for (const char* spec : {"none", "fpsplit(dtype=e5m2)|rans", "fpsplit(dtype=e5m2)|zstd"}) {
    KvBlock out;
    ASSERT_TRUE(DecodeKv(EncodeKv(q, spec).value(), &out).ok()) << spec;
    EXPECT_EQ(out.fp8_scales(), q.fp8_scales()) << spec;
    EXPECT_EQ(std::memcmp(out.data(), q.data(), q.bytes()), 0) << spec;
  }
}

TEST(Fp8Scales, TokenSelectionRanksTokensByValueNotByCode) {
  // The key-norm score sums heads: on codes a head with a small scale would weigh as much as one
  // with a large scale. Selection on the scaled cache keeps what selection on its values keeps.
  const KvBlock v = Values(96);
  const KvBlock q = ToScaledFp8(v, DType::kE4M3, G::kHead).value();
  const std::string spec = "prune(keep=0.5,score=knorm)|quant(kbits=8,vbits=8)";
  KvBlock from_codes, from_values;
  ASSERT_TRUE(DecodeKv(EncodeKv(q, spec).value(), &from_codes).ok());
  ASSERT_TRUE(DecodeKv(EncodeKv(q.ConvertTo(DType::kF32).value(), spec).value(), &from_values).ok());
  EXPECT_EQ(from_codes.positions(), from_values.positions());
}

TEST(Fp8Scales, LayerFramesAssembleIntoAnEnginesCacheWithItsScales) {
  const KvBlock q = ToScaledFp8(Values(), DType::kE4M3, G::kTensor).value();
  KvBlock mem = KvBlock::Create(q.shape(), DType::kE4M3).value();
  KvBlock dest = KvBlock::View(q.shape(), DType::kE4M3, mem.data()).value();
  ASSERT_TRUE(dest.set_fp8_scales(q.fp8_scales()).ok());
  const Pipeline p = Pipeline::Create("fpsplit(dtype=e4m3)|rans").value();
  LayerAssembler as(9, &dest);
  for (uint32_t l : {1u, 0u}) {
    ByteBuffer f;
    CodecOptions o;
    o.request_id = 9;
    ASSERT_TRUE(p.EncodeLayers(q, l, 1, &f, o).ok());
    EXPECT_EQ(ParseFrame(f).value().header.fp8_scales.scale.size(), 2u);
    ASSERT_TRUE(as.Add(f).ok());
  }
  ASSERT_TRUE(as.complete());
  EXPECT_EQ(std::memcmp(mem.data(), q.data(), q.bytes()), 0);
}

TEST(Fp8Scales, PagedCachesCarryScalesBothWays) {
  const KvBlock q = ToScaledFp8(Values(40), DType::kE4M3, G::kHead).value();
  const KvShape& sh = q.shape();
  const uint32_t block_size = 16, num_blocks = 5;
  const std::vector<uint32_t> table = {3, 0, 4};
  std::vector<std::vector<uint8_t>> layers(sh.n_layer, std::vector<uint8_t>(2ull * num_blocks * block_size * sh.n_head_kv * sh.head_dim));
  auto paged = [&]() {
    KvPages p;
    for (auto& l : layers) p.layer_base.push_back(l.data());
    p.part_stride = uint64_t{num_blocks} * block_size * sh.n_head_kv * sh.head_dim;
    p.block_size = block_size;
    p.num_blocks = num_blocks;
    p.block_table = table;
    return KvBlock::PagedView(sh, DType::kE4M3, std::move(p)).value();
  };
  // Decoding into pages whose scales are twice the frame's halves every code there; values stay.
  KvBlock dst = paged();
  Fp8Scales twice = q.fp8_scales();
  for (float& s : twice.scale) s *= 2;
  ASSERT_TRUE(dst.set_fp8_scales(twice).ok());
  const ByteBuffer frame = EncodeKv(q, "none").value();
  ASSERT_TRUE(DecodeKv(frame, &dst).ok());
  for (uint32_t h = 0; h < sh.n_head_kv; ++h)
    for (uint32_t t = 0; t < sh.n_token; t += 7) {
      const float want = q.Get(1, KvPart::kValue, h, t, 5);
      const float ulp_floor = twice.ForSlab(sh, sh.slab_index(1, KvPart::kValue, h)) * std::ldexp(1.0f, -9);
      EXPECT_NEAR(dst.Get(1, KvPart::kValue, h, t, 5), want, std::fabs(want) / 16 + ulp_floor);
    }
  // Encoding from the pages gives the dense block's frame for the same codes and scales.
  KvBlock src = paged();
  ASSERT_TRUE(src.set_fp8_scales(q.fp8_scales()).ok());
  ASSERT_TRUE(DecodeKv(frame, &src).ok());
  EXPECT_EQ(EncodeKv(src, "fp8|rans").value(), EncodeKv(q, "fp8|rans").value());
}

TEST(Fp8Scales, MalformedScaleSectionsAreRefused) {
  const KvBlock q = ToScaledFp8(Values(8), DType::kE4M3, G::kTensor).value();
  const ByteBuffer good = EncodeKv(q, "none").value();
  ASSERT_TRUE(ParseFrame(good).ok());
  const FrameView v = ParseFrame(good).value();
  const size_t at = kFrameFixedHeader + v.header.spec.size();  // no positions: the scales follow the spec
  auto refused = [&](auto edit, const std::string& says) {
    const ByteBuffer bad = testing::Rechecksummed(good, edit);
    const auto r = ParseFrame(bad);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().ToString();
  };
  refused([&](ByteBuffer& f) { f[at] = 3; }, "granularity 3");
  refused([&](ByteBuffer& f) { f[at + 2] = 1; }, "granularity");
  refused([&](ByteBuffer& f) { const float z = -1; std::memcpy(&f[at + 8 + 4], &z, 4); }, "FP8 scale 1");
  refused([&](ByteBuffer& f) { f[at] = 2; }, "needs 12");  // per head needs more values than were written
  refused([&](ByteBuffer& f) { f[8] = uint8_t(DType::kF16); }, "for dtype f16");
  refused([&](ByteBuffer& f) { f[9] = 0; }, "header_len");  // the section without its flag
  refused([&](ByteBuffer& f) { f[9] = 6; }, "reserved");
}

}  // namespace
}  // namespace kvserve
