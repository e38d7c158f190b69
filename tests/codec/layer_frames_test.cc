// Per-layer frames (the serving path): EncodeLayers tags each frame with its request and layer
// range, LayerAssembler checks the pieces against each other and decodes them straight into the
// caller's memory, in any order, equal to decoding the whole block.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

KvBlock Input() { return SynthesizeKv(KvShape{4, 2, 40, 16}, {.seed = 5}).value(); }

std::vector<ByteBuffer> LayerFrames(const Pipeline& p, const KvBlock& in, uint64_t request, const CodecOptions& base = {}) {
  std::vector<ByteBuffer> frames(in.shape().n_layer);
  CodecOptions o = base;
  o.request_id = request;
  for (uint32_t l = 0; l < in.shape().n_layer; ++l) EXPECT_TRUE(p.EncodeLayers(in, l, 1, &frames[l], o).ok()) << l;
  return frames;
}

TEST(LayerFrames, HeaderNamesRequestAndLayers) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("quant(kbits=4,vbits=4)").value();
  ByteBuffer f;
  CodecOptions o;
  o.request_id = 77;
  ASSERT_TRUE(p.EncodeLayers(in, 1, 2, &f, o).ok());
  FrameView v = ParseFrame(f).value();
  EXPECT_EQ(v.header.request_id, 77u);
  EXPECT_EQ(v.header.layer_begin, 1u);
  EXPECT_EQ(v.header.shape.n_layer, 2u);
  EXPECT_EQ(v.header.n_layer_total, 4u);
  // A whole block is layers [0, n_layer) of itself.
  ASSERT_TRUE(p.Encode(in, &f).ok());
  v = ParseFrame(f).value();
  EXPECT_EQ(v.header.layer_begin, 0u);
  EXPECT_EQ(v.header.n_layer_total, 4u);
  EXPECT_FALSE(p.EncodeLayers(in, 3, 2, &f).ok());
  EXPECT_FALSE(p.EncodeLayers(in, 0, 0, &f).ok());
}

// A connector holds one layer at a time: encoding a copy of that layer alone, told where it sits,
// gives the bytes EncodeLayers gives from the whole block (layer-named stages sliced alike).
TEST(LayerFrames, LayerSliceEqualsLayersOfTheWholeBlock) {
  KvBlock in = Input();
  for (const char* spec : {"none", "quant(kbits=2,vbits=2,boost_layers=2,boost_bits=2)|zstd", "mixhq|rans"}) {
    Pipeline p = Pipeline::Create(spec).value();
    CodecOptions o;
    o.request_id = 3;
    for (uint32_t l = 0; l < in.shape().n_layer; ++l) {
      ByteBuffer from_block, from_slice;
      ASSERT_TRUE(p.EncodeLayers(in, l, 1, &from_block, o).ok());
      KvBlock one = in.LayerView(l, 1).value().ConvertTo(in.dtype()).value();  // an owning copy
      ASSERT_TRUE(p.EncodeLayerSlice(one, l, in.shape().n_layer, &from_slice, o).ok());
      EXPECT_EQ(from_block, from_slice) << spec << " layer " << l;
    }
    ByteBuffer f;
    KvBlock one = in.LayerView(3, 1).value();
    Status st = p.EncodeLayerSlice(one, 3, 3, &f, o);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find("exceed the request's n_layer 3"), std::string::npos) << st.message();
  }
}

// For each strategy: layer frames assembled in reverse order equal the whole-block decode.
TEST(LayerFrames, AssembledLayersEqualTheWholeBlock) {
  KvBlock in = Input();
  for (const char* spec : {"none", "cast(dtype=bf16)", "quant(kbits=3,vbits=2,residual=5)|rans",
                           "quant(kbits=2,vbits=2,boost_layers=2,boost_bits=2)|zstd", "delta|quant", "mixhq|rans", "mixhq(heads=auto)",
                           "rotate|quant(kbits=3)"}) {
    Pipeline p = Pipeline::Create(spec).value();
    KvBlock whole;
    ByteBuffer f;
    ASSERT_TRUE(p.Encode(in, &f).ok());
    ASSERT_TRUE(p.Decode(f, &whole).ok());
    std::vector<ByteBuffer> frames = LayerFrames(p, in, 9);
    KvBlock dest = KvBlock::Create(in.shape(), in.dtype()).value();
    LayerAssembler a(9, &dest);
    for (size_t l = frames.size(); l-- > 0;) {
      Status st = a.Add(frames[l]);
      ASSERT_TRUE(st.ok()) << spec << ": " << st.ToString();
    }
    EXPECT_TRUE(a.complete());
    ASSERT_EQ(dest.bytes(), whole.bytes());
    EXPECT_EQ(std::memcmp(dest.data(), whole.data(), whole.bytes()), 0) << spec;
  }
}

TEST(LayerFrames, BoostedLayersKeepTheirBitsWhenSentAlone) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("quant(kbits=2,vbits=2,boost_layers=1,boost_bits=4)").value();
  std::vector<ByteBuffer> frames = LayerFrames(p, in, 1);
  // Layer 0 is boosted (6 bits), the others are not: its frame is the largest, and its spec says so.
  EXPECT_GT(frames[0].size(), frames[1].size() * 3 / 2);
  EXPECT_NE(ParseFrame(frames[0])->header.spec.find("boost_layers=1"), std::string::npos);
  EXPECT_NE(ParseFrame(frames[2])->header.spec.find("boost_layers=0"), std::string::npos);
}

TEST(LayerFrames, MixHqLayersGetTheirLimitsFromTheWholeRequest) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("mixhq(lo_frac=0.5)|rans").value();
  KvBlock whole;
  ByteBuffer f;
  ASSERT_TRUE(p.Encode(in, &f).ok());
  ASSERT_TRUE(p.Decode(f, &whole).ok());
  KvBlock dest = KvBlock::Create(in.shape(), in.dtype()).value();
  LayerAssembler a(3, &dest);
  for (const ByteBuffer& fr : LayerFrames(p, in, 3)) ASSERT_TRUE(a.Add(fr).ok());
  ASSERT_TRUE(a.complete());
  // Same limits per slab: errors of the same size as the whole-block encoding.
  const double whole_err = CompareKv(in, whole)->k.mean_abs, layer_err = CompareKv(in, dest)->k.mean_abs;
  EXPECT_NEAR(layer_err, whole_err, 0.25 * whole_err);
}

TEST(LayerFrames, DecodeIntoAStridedViewOfTheCallersCache) {
  KvBlock in = Input();
  const KvShape s = in.shape();
  const uint32_t capacity = 64;  // a cache with room for more tokens than the prompt
  std::vector<float> cache(size_t(s.n_slab()) * capacity * s.head_dim, -7.0f);
  KvBlock view = KvBlock::View(s, DType::kF32, cache.data(), uint64_t(capacity) * s.head_dim).value();
  Pipeline p = Pipeline::Create("quant(kbits=8,vbits=8)").value();
  LayerAssembler a(4, &view);
  for (const ByteBuffer& fr : LayerFrames(p, in, 4)) ASSERT_TRUE(a.Add(fr).ok());
  ASSERT_TRUE(a.complete());
  // Decoded in place, in the view's dtype; the slots past the prompt are untouched.
  KvBlock whole;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, p.spec()).value(), &whole).ok());
  for (uint64_t sl = 0; sl < s.n_slab(); ++sl) {
    const float* row = cache.data() + sl * capacity * s.head_dim;
    for (uint32_t t = 0; t < s.n_token; ++t)
      for (uint32_t d = 0; d < s.head_dim; ++d)
        // The view is f32, the whole-block decode fp16: equal up to fp16 rounding.
        ASSERT_NEAR(row[t * s.head_dim + d], whole.Get(uint32_t(sl / 4), KvPart((sl / 2) % 2), uint32_t(sl % 2), t, d),
                    1e-3 * std::fabs(row[t * s.head_dim + d]) + 1e-6);
    for (size_t i = size_t(s.n_token) * s.head_dim; i < size_t(capacity) * s.head_dim; ++i) ASSERT_EQ(row[i], -7.0f);
  }
  // The same view reads back as a block: layer views and dense copies see the same values.
  KvBlock copy = view.ConvertTo(DType::kF32).value();
  EXPECT_TRUE(copy.is_dense());
  EXPECT_EQ(copy.Get(3, KvPart::kValue, 1, 39, 15), view.Get(3, KvPart::kValue, 1, 39, 15));
}

TEST(LayerFrames, PiecesThatDoNotBelongAreRefused) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("quant").value();
  std::vector<ByteBuffer> frames = LayerFrames(p, in, 5);
  KvBlock dest = KvBlock::Create(in.shape(), in.dtype()).value();
  LayerAssembler a(5, &dest);
  ASSERT_TRUE(a.Add(frames[0]).ok());
  // Another request's layer.
  std::vector<ByteBuffer> other = LayerFrames(p, in, 6);
  Status st = a.Add(other[1]);
  EXPECT_NE(st.message().find("belongs to request 6, not 5"), std::string::npos) << st.ToString();
  // The same layer twice.
  st = a.Add(frames[0]);
  EXPECT_NE(st.message().find("arrived twice"), std::string::npos) << st.ToString();
  // Other tokens (a later chunk of the same request).
  KvBlock later = in;
  later.set_token_offset(256);
  ByteBuffer f;
  CodecOptions o;
  o.request_id = 5;
  ASSERT_TRUE(p.EncodeLayers(later, 1, 1, &f, o).ok());
  st = a.Add(f);
  EXPECT_NE(st.message().find("other tokens"), std::string::npos) << st.ToString();
  // A request of another depth.
  KvBlock deeper = SynthesizeKv(KvShape{6, 2, 40, 16}, {.seed = 5}).value();
  ASSERT_TRUE(p.EncodeLayers(deeper, 1, 1, &f, o).ok());
  st = a.Add(f);
  EXPECT_NE(st.message().find("6-layer request"), std::string::npos) << st.ToString();
  // A damaged frame: the checksum, before anything is decoded.
  ByteBuffer bad = frames[2];
  bad[bad.size() / 2] ^= 4;
  EXPECT_EQ(a.Add(bad).code(), StatusCode::kCorrupt);
  EXPECT_EQ(a.layers_done(), 1u);
  for (uint32_t l = 1; l < 4; ++l) ASSERT_TRUE(a.Add(frames[l]).ok()) << l;
  EXPECT_TRUE(a.complete());
}

TEST(LayerFrames, TokenSelectionNeedsScoresSoEveryLayerKeepsTheSameTokens) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("prune(sink=2,recent=4,keep=0.5)|quant").value();
  ByteBuffer f;
  Status st = p.EncodeLayers(in, 0, 1, &f);
  EXPECT_NE(st.message().find("need token scores"), std::string::npos) << st.ToString();
  std::vector<float> scores(in.shape().n_token);
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = float((i * 7) % 13);
  CodecOptions o;
  o.token_scores = &scores;
  std::vector<ByteBuffer> frames = LayerFrames(p, in, 2, o);
  const uint32_t kept = ParseFrame(frames[0])->header.positions.size();
  KvShape s = in.shape();
  s.n_token = kept;
  KvBlock dest = KvBlock::Create(s, in.dtype()).value();
  LayerAssembler a(2, &dest);
  for (const ByteBuffer& fr : frames) ASSERT_TRUE(a.Add(fr).ok());
  EXPECT_EQ(a.positions(), ParseFrame(frames[0])->header.positions);
  EXPECT_EQ(dest.positions(), a.positions());
}

TEST(LayerFrames, LowRankIsEncodedWhole) {
  KvBlock in = Input();
  Pipeline p = Pipeline::Create("lowrank(rank=4,basis=1)").value();
  ByteBuffer f;
  EXPECT_EQ(p.EncodeLayers(in, 0, 1, &f).code(), StatusCode::kUnsupported);
}

}  // namespace
}  // namespace kvserve
