// Paged, token-major caches (KvBlock::PagedView, vLLM's per-layer [2, num_blocks, block_size,
// n_head, head_dim] with a block table): every stage encodes from pages exactly as from the dense
// layout, decodes into pages leaving every other row alone, and the layer assembler fills pages.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

constexpr uint32_t kBlockSize = 8, kNumBlocks = 10;
constexpr uint8_t kUntouched = 0xa5;

// An engine's cache: per layer one allocation of [2][kNumBlocks][kBlockSize][H][D], filled with
// kUntouched, and a shuffled block table with room for the tokens (the last page partly used).
struct PagedCache {
  std::vector<std::vector<uint8_t>> layers;
  std::vector<uint32_t> table = {7, 2, 9, 0, 5, 3, 8};
  KvBlock view;

  PagedCache(const KvShape& shape, DType dtype) {
    const uint64_t part = uint64_t{kNumBlocks} * kBlockSize * shape.n_head_kv * shape.head_dim;
    KvPages p;
    for (uint32_t l = 0; l < shape.n_layer; ++l) {
      layers.emplace_back(2 * part * DTypeSize(dtype), kUntouched);
      p.layer_base.push_back(layers.back().data());
    }
    p.part_stride = part;
    p.block_size = kBlockSize;
    p.num_blocks = kNumBlocks;
    p.block_table = table;
    view = KvBlock::PagedView(shape, dtype, std::move(p)).value();
  }
  // Copies a dense block in, slab by slab through the view's own scatter.
  void Fill(const KvBlock& dense) {
    for (uint64_t s = 0; s < dense.shape().n_slab(); ++s) {
      ByteBuffer scratch;
      uint8_t* dst = view.SlabToWrite(s, scratch);
      std::memcpy(dst, dense.slab_at(s), dense.shape().slab_numel() * DTypeSize(dense.dtype()));
      view.WroteSlab(s, dst);
    }
  }
  // Whether every row that no token of the sequence maps to (pages outside the table, the last
  // page's unused rows) still holds kUntouched, and how many such rows there are.
  bool OthersUntouched(const KvShape& shape, size_t* n_rows) const {
    const size_t row = size_t{shape.n_head_kv} * shape.head_dim * DTypeSize(view.dtype());
    std::vector<bool> mapped(kNumBlocks * kBlockSize, false);
    for (uint32_t t = 0; t < shape.n_token; ++t) mapped[table[t / kBlockSize] * kBlockSize + t % kBlockSize] = true;
    bool ok = true;
    *n_rows = 0;
    for (const auto& l : layers)
      for (size_t part = 0; part < 2; ++part)
        for (size_t r = 0; r < mapped.size(); ++r) {
          if (mapped[r]) continue;
          ++*n_rows;
          const uint8_t* p = l.data() + (part * mapped.size() + r) * row;
          for (size_t i = 0; i < row; ++i) ok &= p[i] == kUntouched;
        }
    return ok;
  }
};

bool SameValues(const KvBlock& a, const KvBlock& b) {
  if (!(a.shape() == b.shape()) || a.dtype() != b.dtype()) return false;
  const KvShape& s = a.shape();
  const size_t row = size_t{s.head_dim} * DTypeSize(a.dtype());
  for (uint64_t sl = 0; sl < s.n_slab(); ++sl)
    for (uint32_t t = 0; t < s.n_token; ++t)
      if (std::memcmp(a.TokenRow(sl, t), b.TokenRow(sl, t), row) != 0) return false;
  return true;
}

class Paged : public ::testing::Test {
 protected:
  void SetUp() override {
    dense_ = SynthesizeKv(shape_, {.seed = 31}).value();
    dir_ = ::testing::TempDir() + "/kvserve_paged_" + std::to_string(::getpid());
    store_ = std::make_unique<CalibrationStore>(dir_);
    env_.calibration = store_.get();
    LowRankBasis b = FitLowRankBasis({&dense_}).value();
    ASSERT_TRUE(SaveLowRankBasis(b, dir_).ok());
    lowrank_ = "lowrank(rank=8,basis=" + std::to_string(b.id) + ")|quant|rans";
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // One strategy per stage family and data path (identity, raw tensor, bytes, symbols).
  std::vector<std::string> Specs() const {
    return {"none", "rotate", "prune(recent=8,keep=0)", "cast", "cast(dtype=bf16)|zstd", "fpsplit|rans", "fp8|rans",
            "fp8(scale=token)", "quant(kbits=4,vbits=4)|rans", "quant(kbits=3,vbits=2,residual=8)|zstd",
            "mixhq|rans", "rotate|quant|rans", "delta(anchor=4)|quant(kbits=3,vbits=3)|rans",
            "prune(sink=2,recent=8,keep=0.5)|quant|rans", lowrank_};
  }

  // 45 tokens: 6 pages of 8, the last holding 5.
  const KvShape shape_{2, 3, 45, 16};
  KvBlock dense_;
  std::string dir_, lowrank_;
  std::unique_ptr<CalibrationStore> store_;
  CodecEnv env_;
};

TEST_F(Paged, ViewReadsWhatWasScattered) {
  PagedCache cache(shape_, DType::kF16);
  cache.Fill(dense_);
  EXPECT_TRUE(SameValues(cache.view, dense_));
  EXPECT_TRUE(cache.view.is_view() && cache.view.is_paged() && !cache.view.is_dense());
  EXPECT_EQ(cache.view.Get(1, KvPart::kValue, 2, 44, 15), dense_.Get(1, KvPart::kValue, 2, 44, 15));
  // Pages 1, 4, 6 and 8 are not used (the table's 7th entry is spare), and the last page has 3
  // unused rows: all untouched.
  size_t rows = 0;
  EXPECT_TRUE(cache.OthersUntouched(shape_, &rows));
  EXPECT_EQ(rows, shape_.n_layer * 2 * (4 * kBlockSize + 3));
}

TEST_F(Paged, EveryStageEncodesPagesAsTheDenseLayout) {
  PagedCache cache(shape_, DType::kF16);
  cache.Fill(dense_);
  std::set<std::string> covered;
  for (const std::string& spec : Specs()) {
    SCOPED_TRACE(spec);
    const ByteBuffer want = EncodeKv(dense_, spec, {}, env_).value();
    Result<ByteBuffer> got = EncodeKv(cache.view, spec, {}, env_);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got.value(), want);
    for (const StageSpec& st : ParseStrategy(spec).value().stages) covered.insert(st.name);
  }
  for (const StageInfo& info : RegisteredStages()) EXPECT_TRUE(covered.count(info.name)) << info.name << " untested";
}

TEST_F(Paged, FramesDecodeIntoPagesAndLeaveOtherRowsAlone) {
  for (const std::string& spec : Specs()) {
    SCOPED_TRACE(spec);
    const ByteBuffer frame = EncodeKv(dense_, spec, {}, env_).value();
    KvBlock want;
    ASSERT_TRUE(DecodeKv(frame, &want, {}, env_).ok());
    if (want.shape().n_token != shape_.n_token) continue;  // token selection decodes fewer tokens
    PagedCache cache(shape_, DType::kF16);
    Status st = DecodeKv(frame, &cache.view, {}, env_);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(SameValues(cache.view, want));
    size_t rows = 0;
    EXPECT_TRUE(cache.OthersUntouched(shape_, &rows)) << "rows outside the sequence were written";
  }
}

// The fast paths of an engine-sized cache — 64-byte aligned pages, rows of 128 fp16 values, whole
// quantisation blocks, slabs long enough for FP8's lookup table — against the dense layout:
// the same frames, the same decoded rows, nothing written outside the sequence.
TEST(PagedFastPaths, EngineSizedPagesMatchTheDenseLayout) {
  const KvShape shape{2, 2, 120, 128};  // 7.5 pages of 16
  const KvBlock dense = SynthesizeKv(shape, {.seed = 5}).value();
  const uint32_t block_size = 16, num_blocks = 10;
  const std::vector<uint32_t> table = {6, 1, 9, 3, 0, 8, 2, 5};
  const uint64_t part = uint64_t{num_blocks} * block_size * shape.n_head_kv * shape.head_dim;
  auto make = [&](std::vector<ByteBuffer>& memory) {
    KvPages p;
    for (uint32_t l = 0; l < shape.n_layer; ++l) {
      memory.emplace_back(2 * part * 2, uint8_t{0xA5});
      p.layer_base.push_back(memory.back().data());
    }
    p.part_stride = part;
    p.block_size = block_size;
    p.num_blocks = num_blocks;
    p.block_table = table;
    return KvBlock::PagedView(shape, DType::kF16, std::move(p)).value();
  };
  for (const char* spec : {"quant(kbits=4,vbits=4)", "quant(kbits=3,vbits=2)|rans", "quant(kbits=8,vbits=8,kaxis=token)",
                           "quant(kbits=2,vbits=2,residual=8)", "fp8", "fp8(format=e5m2)|rans", "fp8(scale=token)"}) {
    SCOPED_TRACE(spec);
    std::vector<ByteBuffer> src_mem, dst_mem;
    KvBlock src = make(src_mem), dst = make(dst_mem);
    ByteBuffer scratch;
    for (uint64_t sl = 0; sl < shape.n_slab(); ++sl) {
      uint8_t* w = src.SlabToWrite(sl, scratch);
      std::memcpy(w, dense.slab_at(sl), shape.slab_numel() * 2);
      src.WroteSlab(sl, w);
    }
    const ByteBuffer frame = EncodeKv(dense, spec).value();
    EXPECT_EQ(EncodeKv(src, spec).value(), frame);
    KvBlock want;
    ASSERT_TRUE(DecodeKv(frame, &want).ok());
    ASSERT_TRUE(DecodeKv(frame, &dst).ok());
    EXPECT_TRUE(SameValues(dst, want));
    // Rows no token maps to: the pages outside the table and the last page's second half.
    const size_t row = size_t{shape.n_head_kv} * shape.head_dim * 2;
    std::vector<bool> mapped(num_blocks * block_size, false);
    for (uint32_t t = 0; t < shape.n_token; ++t) mapped[table[t / block_size] * block_size + t % block_size] = true;
    for (const ByteBuffer& l : dst_mem)
      for (size_t r = 0; r < 2 * mapped.size(); ++r)
        if (!mapped[r % mapped.size()])
          for (size_t i = 0; i < row; ++i) ASSERT_EQ(l[r * row + i], 0xA5) << "row " << r << " was written";
  }
}

TEST_F(Paged, QuantEncodesPagesOfEveryDtypeAsTheDenseLayout) {
  // quant codes a paged cache a (layer, K/V) part at a time, all heads' page rows together: the
  // fused loop reads fp16/f32 rows where they lie, other dtypes gather each head's block first;
  // both give the dense layout's frame, with a partly used last page and fp16 residual tokens.
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    const KvBlock dense = dense_.ConvertTo(dt).value();
    PagedCache cache(shape_, dt);
    cache.Fill(dense);
    for (const char* spec : {"quant(kbits=4,vbits=4)", "quant(kbits=3,vbits=2,residual=8)",
                             "quant(kbits=8,vbits=8,kaxis=token,vaxis=channel,group=16)", "quant(kbits=2,vbits=2,residual=45)"}) {
      SCOPED_TRACE(std::string(DTypeName(dt)) + " " + spec);
      EXPECT_EQ(EncodeKv(cache.view, spec).value(), EncodeKv(dense, spec).value());
    }
  }
}

TEST_F(Paged, QuantNamesTheHeadWhoseRangeDoesNotFitInPages) {
  KvBlock dense = dense_.ConvertTo(DType::kF32).value();
  dense.Set(1, KvPart::kValue, 2, 17, 3, 1e30f);
  PagedCache cache(shape_, DType::kF32);
  cache.Fill(dense);
  Result<ByteBuffer> got = EncodeKv(cache.view, "quant(kbits=4,vbits=4)");
  ASSERT_FALSE(got.ok());
  EXPECT_NE(got.status().message().find("layer 1 V head 2"), std::string::npos) << got.status().ToString();
  EXPECT_EQ(got.status().ToString(), EncodeKv(dense, "quant(kbits=4,vbits=4)").status().ToString());
}

TEST_F(Paged, LayerFramesAssembleIntoPages) {
  const std::string spec = "quant(kbits=4,vbits=4)|rans";
  PagedCache src(shape_, DType::kF16);
  src.Fill(dense_);
  PagedCache dst(shape_, DType::kF16);
  LayerAssembler assembler(9, &dst.view, env_);
  KvBlock want;
  ASSERT_TRUE(DecodeKv(EncodeKv(dense_, spec, {}, env_).value(), &want, {}, env_).ok());
  const Pipeline p = Pipeline::Create(spec, env_).value();
  CodecOptions o;
  o.request_id = 9;
  for (uint32_t l = shape_.n_layer; l-- > 0;) {  // out of order
    ByteBuffer frame, dense_frame;
    ASSERT_TRUE(p.EncodeLayers(src.view, l, 1, &frame, o).ok());
    ASSERT_TRUE(p.EncodeLayers(dense_, l, 1, &dense_frame, o).ok());
    EXPECT_EQ(frame, dense_frame);
    ASSERT_TRUE(assembler.Add(frame).ok());
  }
  EXPECT_TRUE(assembler.complete());
  EXPECT_TRUE(SameValues(dst.view, want));
}

TEST(PagedView, RefusesATableThatDoesNotCoverTheTokens) {
  std::vector<uint8_t> mem(2 * 4 * 8 * 2 * 16 * 2);
  KvPages p;
  p.layer_base = {mem.data()};
  p.part_stride = 4 * 8 * 2 * 16;
  p.block_size = 8;
  p.num_blocks = 4;
  p.block_table = {0, 1};
  EXPECT_FALSE(KvBlock::PagedView(KvShape{1, 2, 17, 16}, DType::kF16, p).ok());  // 17 tokens need 3 pages
  p.block_table = {0, 1, 4};
  Result<KvBlock> r = KvBlock::PagedView(KvShape{1, 2, 17, 16}, DType::kF16, p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("num_blocks=4"), std::string::npos) << r.status().ToString();
  p.block_table = {0, 1, 3};
  p.layer_base = {nullptr};
  EXPECT_FALSE(KvBlock::PagedView(KvShape{1, 2, 17, 16}, DType::kF16, p).ok());
  p.layer_base = {mem.data(), mem.data()};
  EXPECT_FALSE(KvBlock::PagedView(KvShape{1, 2, 17, 16}, DType::kF16, p).ok());  // two bases for one layer
  p.layer_base = {mem.data()};
  EXPECT_TRUE(KvBlock::PagedView(KvShape{1, 2, 17, 16}, DType::kF16, p).ok());
}

}  // namespace
}  // namespace kvserve
