// KV block layout, slicing into chunks, error statistics and the synthetic generator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kvserve/kv.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

TEST(KvShape, ValidateNamesTheField) {
  KvShape s{0, 4, 10, 8};
  Status st = s.Validate();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("n_layer=0"), std::string::npos);
  EXPECT_TRUE((KvShape{5, 4, 0, 8}.Validate().ok()));  // an empty prompt is a valid shape
  KvShape huge{4096, 4096, 4096, 4096};
  EXPECT_EQ(huge.Validate().code(), StatusCode::kOutOfRange);
}

TEST(KvBlock, LayoutIsLayerPartHeadTokenDim) {
  KvShape s{2, 3, 5, 4};
  KvBlock b = KvBlock::Create(s, DType::kF32).value();
  b.Set(1, KvPart::kValue, 2, 3, 1, 42.0f);
  const size_t idx = ((((1 * 2 + 1) * 3 + 2) * 5 + 3) * 4 + 1);
  EXPECT_EQ(b.f32()[idx], 42.0f);
  EXPECT_EQ(b.Get(1, KvPart::kValue, 2, 3, 1), 42.0f);
}

TEST(KvBlock, ChunksSplitAndJoinBack) {
  KvBlock b = SynthesizeKv(KvShape{2, 2, 600, 8}).value();
  auto chunks = SplitIntoChunks(b, 256).value();
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[2].shape().n_token, 88u);
  EXPECT_EQ(chunks[1].token_offset(), 256u);
  EXPECT_EQ(chunks[1].Get(1, KvPart::kKey, 1, 0, 3), b.Get(1, KvPart::kKey, 1, 256, 3));
  KvBlock j = JoinChunks(chunks).value();
  ASSERT_EQ(j.bytes(), b.bytes());
  EXPECT_EQ(std::memcmp(j.data(), b.data(), b.bytes()), 0);
  std::swap(chunks[0], chunks[1]);
  EXPECT_FALSE(JoinChunks(chunks).ok());
}

TEST(KvBlock, CompareIdenticalAndPerturbed) {
  KvBlock a = SynthesizeKv(KvShape{1, 1, 16, 8}, {.dtype = DType::kF32}).value();
  KvBlock b = a.ConvertTo(DType::kF32).value();
  auto r = CompareKv(a, b).value();
  EXPECT_EQ(r.k.max_abs, 0);
  EXPECT_EQ(r.k.snr_db, 200);
  EXPECT_NEAR(r.v.cosine, 1.0, 1e-12);
  b.Set(0, KvPart::kValue, 0, 3, 2, b.Get(0, KvPart::kValue, 0, 3, 2) + 0.5f);
  r = CompareKv(a, b).value();
  EXPECT_EQ(r.k.max_abs, 0);
  EXPECT_NEAR(r.v.max_abs, 0.5, 1e-6);
  EXPECT_NEAR(r.v.mean_abs, 0.5 / 128, 1e-6);
  EXPECT_LT(r.v.snr_db, 200);
}

TEST(KvBlock, ViewsAreNonOwningAndStrided) {
  const KvShape s{2, 2, 3, 4};
  std::vector<uint16_t> mem(size_t(s.n_slab()) * 5 * 4, 0);  // room for 5 tokens per slab
  KvBlock v = KvBlock::View(s, DType::kF16, mem.data(), 5 * 4).value();
  EXPECT_TRUE(v.is_view());
  EXPECT_FALSE(v.is_dense());
  v.Set(1, KvPart::kValue, 1, 2, 3, 1.5f);
  EXPECT_EQ(HalfToFloat(mem[(7 * 5 + 2) * 4 + 3]), 1.5f);  // slab (1, V, 1) = 7, token 2, dim 3
  KvBlock layer1 = v.LayerView(1, 1).value();
  EXPECT_EQ(layer1.shape().n_layer, 1u);
  EXPECT_EQ(layer1.Get(0, KvPart::kValue, 1, 2, 3), 1.5f);
  KvBlock dense = v.ConvertTo(DType::kF32).value();
  EXPECT_FALSE(dense.is_view());
  EXPECT_EQ(dense.Get(1, KvPart::kValue, 1, 2, 3), 1.5f);
  // A view holds its own shape and dtype only.
  EXPECT_TRUE(v.Reset(s, DType::kF16).ok());
  EXPECT_FALSE(v.Reset(KvShape{2, 2, 4, 4}, DType::kF16).ok());
  EXPECT_FALSE(v.Reset(s, DType::kF32).ok());
  EXPECT_FALSE(KvBlock::View(s, DType::kF16, mem.data(), 11).ok());  // stride below a slab
  EXPECT_FALSE(KvBlock::View(s, DType::kF16, nullptr).ok());
  EXPECT_FALSE(v.LayerView(1, 2).ok());
  // Copies of a view are views of the same memory.
  KvBlock copy = v;
  copy.Set(0, KvPart::kKey, 0, 0, 0, 2.0f);
  EXPECT_EQ(v.Get(0, KvPart::kKey, 0, 0, 0), 2.0f);
}

TEST(ResultDeathTest, ValueOfAnErrorStopsWithItsMessageInsteadOfThrowing) {
  Result<int> r = Status::InvalidArgument("the field x=3 is bad");
  EXPECT_DEATH((void)r.value(), "Result::value\\(\\) called on an error: invalid argument: the field x=3 is bad");
  EXPECT_EQ(r.status().message(), "the field x=3 is bad");
}

TEST(Synth, DeterministicAndThreadIndependent) {
  KvShape s{4, 2, 64, 16};
  ThreadPool pool(2);
  KvBlock a = SynthesizeKv(s, {.seed = 3}).value();
  KvBlock b = SynthesizeKv(s, {.seed = 3, .pool = &pool}).value();
  KvBlock c = SynthesizeKv(s, {.seed = 4}).value();
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.bytes()), 0);
}

TEST(Synth, KeysHaveOutlierChannelsAndValuesAreSmooth) {
  KvShape s{1, 1, 512, 128};
  KvBlock b = SynthesizeKv(s, {.seed = 1, .dtype = DType::kF32}).value();
  // K: the largest per-channel RMS is several times the median one (persistent outliers).
  std::vector<double> rms(128, 0);
  for (uint32_t t = 0; t < 512; ++t)
    for (uint32_t d = 0; d < 128; ++d) rms[d] += std::pow(b.Get(0, KvPart::kKey, 0, t, d), 2);
  std::vector<double> sorted = rms;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_GT(std::sqrt(sorted.back() / sorted[64]), 3.0);
  // V: strong lag-1 autocorrelation along tokens (AR(1), rho 0.9) once the mean is removed.
  double num = 0, den = 0;
  for (uint32_t d = 0; d < 128; ++d) {
    double mean = 0;
    for (uint32_t t = 1; t < 512; ++t) mean += b.Get(0, KvPart::kValue, 0, t, d);
    mean /= 511;
    for (uint32_t t = 2; t < 512; ++t) {
      const double x0 = b.Get(0, KvPart::kValue, 0, t - 1, d) - mean, x1 = b.Get(0, KvPart::kValue, 0, t, d) - mean;
      num += x0 * x1;
      den += x0 * x0;
    }
  }
  EXPECT_GT(num / den, 0.6);
}

TEST(ShapePreset, KnownAndUnknown) {
  EXPECT_EQ(ShapePreset("llama3-8b", 7).value(), (KvShape{32, 8, 7, 128}));
  EXPECT_EQ(ShapePreset("stories260k", 7).value(), (KvShape{5, 4, 7, 8}));
  EXPECT_FALSE(ShapePreset("gpt5", 7).ok());
}

}  // namespace
}  // namespace kvserve
