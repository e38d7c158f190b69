// quant stage: packing layout, SIMD kernels against scalar references, the half-step error bound,
// residual window, group clamping, and malformed payloads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "simd_test_util.h"
#include "codec/quant_kernels.h"
#include "codec/frame_test_util.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

using QuantPackTiers = testing::SimdTier;
using QuantKernelTiers = testing::SimdTier;

TEST_P(QuantPackTiers, MatchesReferenceAndRoundTripsForEveryWidth) {
  std::mt19937 rng(5);
  for (int bits = 1; bits <= 8; ++bits) {
    for (size_t n : {8u, 64u, 1024u, 4096u + 8}) {
      std::vector<uint8_t> codes(n), fast(quant::PackedBytes(n, bits)), ref(fast.size()), back(n);
      for (auto& c : codes) c = uint8_t(rng() & ((1u << bits) - 1));
      quant::PackCodes(codes.data(), n, bits, fast.data());
      quant::PackCodesReference(codes.data(), n, bits, ref.data());
      ASSERT_EQ(fast, ref) << "bits " << bits << " n " << n;
      quant::UnpackCodes(fast.data(), n, bits, back.data());
      ASSERT_EQ(back, codes) << "bits " << bits << " n " << n;
      EXPECT_EQ(fast.size(), n * bits / 8);
    }
  }
}

TEST_P(QuantKernelTiers, FastPathsEqualPlainOnes) {
  // The fast kernels differ from the plain ones without AVX-512 too (fused, reordered loops).
  testing::ReportSimdPath("quant kernels", quant::HaveAvx512Kernels(), "AVX-512/F16C", "portable loops");
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0, 3);
  for (size_t D : {8u, 16u, 128u}) {
    for (size_t group : {8u, 16u, 32u, 128u}) {
      if (group > D) continue;
      const size_t rows = 32, n = rows * D, ng = D / group;
      std::vector<float> x(n);
      std::vector<uint16_t> h(n);
      for (auto& v : x) v = nd(rng);
      ConvertFromF32(DType::kF16, x.data(), h.data(), n);
      ConvertToF32(DType::kF16, h.data(), x.data(), n);
      std::vector<float> mn(D), mx(D);
      quant::ColumnMinMax(x.data(), rows, D, mn.data(), mx.data());
      // row-group min/max
      std::vector<float> rmn(rows * ng), rmx(rows * ng), rmn2(rows * ng), rmx2(rows * ng);
      quant::RowGroupMinMax(x.data(), rows, D, group, rmn.data(), rmx.data());
      quant::RowGroupMinMaxFast(x.data(), rows, D, group, rmn2.data(), rmx2.data());
      EXPECT_EQ(rmn, rmn2);
      EXPECT_EQ(rmx, rmx2);
      for (int bits : {2, 4, 8}) {
        const int L = (1 << bits) - 1;
        std::vector<float> lo(D), st(D), inv(D);
        std::vector<uint16_t> loh(D), sth(D);
        ASSERT_EQ(quant::GroupRanges(mn.data(), mx.data(), D, L, loh.data(), sth.data(), lo.data(), st.data(), inv.data()), D);
        std::vector<uint8_t> c1(n), c2(n);
        quant::QuantizeColumns(x.data(), rows, D, lo.data(), inv.data(), L, c1.data());
        quant::QuantizeColumnsFast(x.data(), rows, D, lo.data(), inv.data(), L, c2.data());
        ASSERT_EQ(c1, c2) << "D " << D << " bits " << bits;
        std::vector<float> deq(n), scratch(n);
        std::vector<uint16_t> ref(n), fast(n + 16);
        quant::DequantizeColumns(c1.data(), rows, D, lo.data(), st.data(), deq.data());
        ConvertFromF32(DType::kF16, deq.data(), ref.data(), n);
        quant::DequantizeColumnsF16(c1.data(), rows, D, lo.data(), st.data(), scratch.data(), fast.data());
        for (size_t i = 0; i < n; ++i) ASSERT_LE(std::abs(int(ref[i]) - int(fast[i])), 1) << i;

        std::vector<float> glo(rows * ng), gst(rows * ng), ginv(rows * ng);
        std::vector<uint16_t> gloh(rows * ng), gsth(rows * ng);
        quant::GroupRanges(rmn.data(), rmx.data(), rows * ng, L, gloh.data(), gsth.data(), glo.data(), gst.data(),
                           ginv.data());
        quant::QuantizeRowGroups(x.data(), rows, D, group, glo.data(), ginv.data(), L, c1.data());
        quant::QuantizeRowGroupsFast(x.data(), rows, D, group, glo.data(), ginv.data(), L, c2.data());
        ASSERT_EQ(c1, c2);
        quant::DequantizeRowGroups(c1.data(), rows, D, group, glo.data(), gst.data(), deq.data());
        ConvertFromF32(DType::kF16, deq.data(), ref.data(), n);
        quant::DequantizeRowGroupsF16(c1.data(), rows, D, group, glo.data(), gst.data(), scratch.data(), fast.data());
        for (size_t i = 0; i < n; ++i) ASSERT_LE(std::abs(int(ref[i]) - int(fast[i])), 1) << i;
      }
    }
  }
}

TEST_P(QuantKernelTiers, BlockKernelsEqualTheirReference) {
  // The stage's block kernels (fused fp16 loops where this build has AVX-512, else the float
  // path) against the composition of the plain kernels: same bytes, decode within one ulp.
  testing::ReportSimdPath("quant block kernels", quant::HaveAvx512Kernels(), "AVX-512/F16C fused", "portable loops");
  std::mt19937 rng(21);
  std::normal_distribution<float> nd(0, 2);
  quant::BlockScratch s1, s2;
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (size_t D : {16u, 24u, 128u}) {
      for (size_t group : {0u, 8u, 16u, 32u, 128u}) {
        if (group > D) continue;
        for (size_t rows : {1u, 8u, 13u, 32u, 64u}) {
          const size_t n = rows * D, es = DTypeSize(dt);
          std::vector<float> x(n);
          for (auto& v : x) v = nd(rng) + (rng() % 4 == 0 ? 5.0f : 0.0f);
          std::vector<uint8_t> src(n * es);
          ConvertFromF32(dt, x.data(), src.data(), n);
          for (int bits = 1; bits <= 8; ++bits) {
            const size_t bytes = quant::BlockBytes(rows, D, group, bits), m = quant::BlockMetaCount(rows, D, group);
            std::vector<uint8_t> fast(bytes, 0xAA), ref(bytes, 0x55);
            ASSERT_EQ(quant::EncodeBlock(src.data(), dt, rows, D, group, bits, fast.data(), s1), m);
            ASSERT_EQ(quant::EncodeBlockReference(src.data(), dt, rows, D, group, bits, ref.data(), s2), m);
            ASSERT_EQ(fast, ref) << DTypeName(dt) << " D " << D << " group " << group << " rows " << rows << " bits " << bits;
            // The same rows read where they lie (a paged cache's: reversed, a row apart), and the
            // next rows asked for: the same bytes.
            {
              std::vector<uint8_t> spread(2 * n * es);
              std::vector<const uint8_t*> row_at(rows);
              for (size_t r = 0; r < rows; ++r) {
                row_at[r] = spread.data() + (2 * (rows - 1 - r) + 1) * D * es;
                std::memcpy(spread.data() + (2 * (rows - 1 - r) + 1) * D * es, src.data() + r * D * es, D * es);
              }
              const quant::NextRows next{row_at.data(), rows, D * es};
              std::vector<uint8_t> in_place(bytes, 0x33);
              ASSERT_EQ(quant::EncodeBlockFromRows(row_at.data(), dt, rows, D, group, bits, in_place.data(), s1, &next), m);
              ASSERT_EQ(in_place, ref) << "rows in place: " << DTypeName(dt) << " D " << D << " group " << group
                                       << " rows " << rows << " bits " << bits;
              // Decoded into those rows where they lie: what the contiguous decode writes, and
              // nothing between the rows.
              std::vector<uint8_t> contiguous(n * es);
              quant::DecodeBlock(fast.data(), rows, D, group, bits, dt, contiguous.data(), s2);
              std::fill(spread.begin(), spread.end(), uint8_t{0xEE});
              std::vector<uint8_t*> row_out(rows);
              for (size_t r = 0; r < rows; ++r) row_out[r] = const_cast<uint8_t*>(row_at[r]);
              quant::DecodeBlockToRows(fast.data(), rows, D, group, bits, dt, row_out.data(), s1);
              quant::StreamFence();
              for (size_t r = 0; r < rows; ++r) {
                ASSERT_EQ(std::memcmp(row_out[r], contiguous.data() + r * D * es, D * es), 0)
                    << "decoded row " << r << ": " << DTypeName(dt) << " D " << D << " group " << group << " bits " << bits;
                const uint8_t* gap = row_out[r] - D * es;
                ASSERT_TRUE(std::all_of(gap, gap + D * es, [](uint8_t b) { return b == 0xEE; })) << "wrote between rows";
              }
            }
            // Decode into an aligned and a misaligned buffer (streaming stores only on the first).
            for (size_t shift : {0u, 1u}) {
              std::vector<uint8_t> out_fast((n + 32) * es + 64), out_ref(n * es);
              uint8_t* base = out_fast.data() + (64 - reinterpret_cast<uintptr_t>(out_fast.data()) % 64) % 64 + shift * es;
              quant::DecodeBlock(fast.data(), rows, D, group, bits, dt, base, s1);
              quant::DecodeBlockReference(ref.data(), rows, D, group, bits, dt, out_ref.data(), s2);
              std::vector<float> a(n), b(n);
              ConvertToF32(dt, base, a.data(), n);
              ConvertToF32(dt, out_ref.data(), b.data(), n);
              for (size_t i = 0; i < n; ++i) {
                const float ulp = std::max(std::fabs(b[i]) * (dt == DType::kBF16 ? 1.0f / 128 : 1.0f / 1024), 1e-7f);
                ASSERT_LE(std::fabs(a[i] - b[i]), ulp) << DTypeName(dt) << " D " << D << " group " << group
                                                       << " rows " << rows << " bits " << bits << " i " << i;
              }
            }
          }
        }
      }
    }
  }
}

TEST(QuantKernels, GroupRangesEqualsScalarGroupRange) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100, 100);
  const size_t m = 333;
  std::vector<float> mn(m), mx(m), lo(m), st(m), inv(m);
  std::vector<uint16_t> loh(m), sth(m);
  for (size_t i = 0; i < m; ++i) {
    float a = u(rng), b = u(rng);
    if (i % 7 == 0) b = a;  // empty range
    if (i % 11 == 0) a = 0, b = 1e-6f;  // subnormal territory
    mn[i] = std::min(a, b), mx[i] = std::max(a, b);
  }
  for (int L : {1, 3, 15, 255}) {
    ASSERT_EQ(quant::GroupRanges(mn.data(), mx.data(), m, L, loh.data(), sth.data(), lo.data(), st.data(), inv.data()), m);
    for (size_t i = 0; i < m; ++i) {
      uint16_t lh, sh;
      float l, s;
      ASSERT_TRUE(quant::GroupRange(mn[i], mx[i], L, &lh, &sh, &l, &s));
      EXPECT_EQ(lh, loh[i]);
      EXPECT_EQ(sh, sth[i]);
      EXPECT_LE(lo[i], mn[i]);
      EXPECT_GE(lo[i] + L * st[i], mx[i] - 1e-5f * std::fabs(mx[i]) - 1e-6f);
    }
  }
  mx[5] = 1e6f;  // beyond fp16
  EXPECT_EQ(quant::GroupRanges(mn.data(), mx.data(), m, 15, loh.data(), sth.data(), lo.data(), st.data(), inv.data()), 5u);
}

// Every value decodes to within half a step of its group's range. With f32 in and out nothing
// else rounds, so the bound is tight.
// A NaN past a group's first row leaves the range finite; it must code as the group's low end,
// on every path (the scalar one once converted NaN to int: undefined, found by the frame fuzzer).
TEST(QuantStage, NanValuesCodeAsTheLowEnd) {
  KvBlock in = SynthesizeKv(KvShape{1, 1, 64, 16}, {.seed = 4, .dtype = DType::kF32}).value();
  in.Set(0, KvPart::kKey, 0, 5, 3, NAN);
  in.Set(0, KvPart::kValue, 0, 9, 7, NAN);
  for (const char* spec : {"quant(kbits=4,vbits=4)", "quant(kbits=3,vbits=3,kaxis=token,vaxis=channel,group=8)"}) {
    KvBlock out;
    ASSERT_TRUE(DecodeKv(EncodeKv(in, spec).value(), &out).ok()) << spec;
    EXPECT_TRUE(std::isfinite(out.Get(0, KvPart::kKey, 0, 5, 3))) << spec;
    EXPECT_TRUE(std::isfinite(out.Get(0, KvPart::kValue, 0, 9, 7))) << spec;
  }
}

TEST(QuantStage, ErrorWithinHalfStepOfEachGroup) {
  KvShape shape{2, 2, 100, 16};
  KvBlock in = SynthesizeKv(shape, {.seed = 2, .dtype = DType::kF32}).value();
  for (int bits = 1; bits <= 8; ++bits) {
    for (const char* kaxis : {"channel", "token"}) {
      for (int group : {1, 8, 32, 1000}) {
        const std::string spec = "quant(kbits=" + std::to_string(bits) + ",vbits=" + std::to_string(bits) +
                                 ",kaxis=" + kaxis + ",vaxis=" + kaxis + ",group=" + std::to_string(group) + ")";
        auto frame = EncodeKv(in, spec);
        ASSERT_TRUE(frame.ok()) << frame.status().ToString();
        KvBlock out;
        ASSERT_TRUE(DecodeKv(frame.value(), &out).ok());
        const bool channel = std::string(kaxis) == "channel";
        const uint32_t g = channel ? std::min<uint32_t>(group, shape.n_token) : std::min<uint32_t>(group, shape.head_dim);
        const int L = (1 << bits) - 1;
        for (uint32_t l = 0; l < shape.n_layer; ++l)
          for (int part = 0; part < 2; ++part)
            for (uint32_t h = 0; h < shape.n_head_kv; ++h)
              for (uint32_t t = 0; t < shape.n_token; ++t)
                for (uint32_t d = 0; d < shape.head_dim; ++d) {
                  // Recompute the group's range from the input.
                  float mn = INFINITY, mx = -INFINITY;
                  const uint32_t t0 = channel ? t / g * g : t, t1 = channel ? std::min(shape.n_token, t0 + g) : t + 1;
                  const uint32_t d0 = channel ? d : d / g * g, d1 = channel ? d + 1 : std::min(shape.head_dim, d0 + g);
                  for (uint32_t tt = t0; tt < t1; ++tt)
                    for (uint32_t dd = d0; dd < d1; ++dd) {
                      mn = std::min(mn, in.Get(l, KvPart(part), h, tt, dd));
                      mx = std::max(mx, in.Get(l, KvPart(part), h, tt, dd));
                    }
                  uint16_t lh, sh;
                  float lo, step;
                  ASSERT_TRUE(quant::GroupRange(mn, mx, L, &lh, &sh, &lo, &step));
                  const float err = std::fabs(in.Get(l, KvPart(part), h, t, d) - out.Get(l, KvPart(part), h, t, d));
                  ASSERT_LE(err, 0.5f * step * (1 + 1e-5f) + 1e-6f) << spec << " t " << t << " d " << d;
                }
      }
    }
  }
}

TEST(QuantStage, ResidualTokensStayFp16Exact) {
  KvShape shape{1, 2, 50, 8};
  KvBlock in = SynthesizeKv(shape, {.seed = 4, .dtype = DType::kF16}).value();
  KvBlock out;
  auto frame = EncodeKv(in, "quant(kbits=2,vbits=2,residual=20)").value();
  ASSERT_TRUE(DecodeKv(frame, &out).ok());
  for (int part = 0; part < 2; ++part)
    for (uint32_t t = 30; t < 50; ++t)
      for (uint32_t d = 0; d < 8; ++d) EXPECT_EQ(in.Get(0, KvPart(part), 1, t, d), out.Get(0, KvPart(part), 1, t, d));
  // Residual larger than the block: everything is kept.
  frame = EncodeKv(in, "quant(kbits=2,vbits=2,residual=1000)").value();
  ASSERT_TRUE(DecodeKv(frame, &out).ok());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), in.bytes()), 0);
}

TEST(QuantStage, GroupLargerThanAxisIsClampedAndRecorded) {
  KvShape shape{1, 1, 10, 8};
  KvBlock in = SynthesizeKv(shape, {.seed = 4}).value();
  auto big = EncodeKv(in, "quant(group=4096)").value();
  auto exact = EncodeKv(in, "quant(group=10)").value();
  auto view = ParseFrame(big).value();
  uint32_t kg, vg;
  std::memcpy(&kg, view.payload.data() + 8, 4);
  std::memcpy(&vg, view.payload.data() + 12, 4);
  EXPECT_EQ(kg, 10u);  // K groups span tokens: clamped to n_token
  EXPECT_EQ(vg, 8u);   // V groups span channels: clamped to head_dim
  EXPECT_EQ(view.payload.size(), ParseFrame(exact).value().payload.size());
}

TEST(QuantStage, BoostedLayersGetMoreBits) {
  KvBlock in = SynthesizeKv(KvShape{4, 2, 64, 16}, {.seed = 13, .dtype = DType::kF32}).value();
  KvBlock out;
  ByteBuffer f = EncodeKv(in, "quant(kbits=2,vbits=2,boost_layers=2,boost_bits=3)").value();
  ASSERT_TRUE(DecodeKv(f, &out).ok());
  auto layer_err = [&](uint32_t l) {
    double e = 0;
    for (uint32_t h = 0; h < 2; ++h)
      for (uint32_t t = 0; t < 64; ++t)
        for (uint32_t d = 0; d < 16; ++d) e += std::fabs(in.Get(l, KvPart::kKey, h, t, d) - out.Get(l, KvPart::kKey, h, t, d));
    return e;
  };
  EXPECT_LT(layer_err(0) * 4, layer_err(2));
  EXPECT_LT(layer_err(1) * 4, layer_err(3));
  // Sizes: two layers at 5 bits, two at 2, against all at 2 and all at 5.
  const size_t lo = EncodeKv(in, "quant(kbits=2,vbits=2)").value().size();
  const size_t hi = EncodeKv(in, "quant(kbits=5,vbits=5)").value().size();
  EXPECT_GT(f.size(), lo);
  EXPECT_LT(f.size(), hi);
  // Per-layer contexts keep one width each, so the entropy coder composes.
  KvBlock coded;
  ASSERT_TRUE(DecodeKv(EncodeKv(in, "quant(kbits=2,vbits=2,boost_layers=2,boost_bits=3)|rans").value(), &coded).ok());
  EXPECT_EQ(std::memcmp(coded.data(), out.data(), out.bytes()), 0);
}

TEST(QuantStage, ThreadCountDoesNotChangeTheBytes) {
  KvBlock in = SynthesizeKv(KvShape{3, 4, 77, 16}, {.seed = 8}).value();
  ThreadPool pool(3);
  auto a = EncodeKv(in, "quant(kbits=3,vbits=5,residual=9)", {}).value();
  auto b = EncodeKv(in, "quant(kbits=3,vbits=5,residual=9)", {.pool = &pool}).value();
  EXPECT_EQ(a, b);
  KvBlock o1, o2;
  ASSERT_TRUE(DecodeKv(a, &o1, {}).ok());
  ASSERT_TRUE(DecodeKv(a, &o2, {.pool = &pool}).ok());
  EXPECT_EQ(std::memcmp(o1.data(), o2.data(), o1.bytes()), 0);
}

TEST(QuantStage, RejectsValuesBeyondFp16Metadata) {
  KvBlock in = KvBlock::Create(KvShape{1, 1, 4, 8}, DType::kF32).value();
  in.Set(0, KvPart::kKey, 0, 1, 1, 1e9f);
  auto r = EncodeKv(in, "quant");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer 0 K head 0"), std::string::npos) << r.status().message();
}

TEST(QuantStage, MalformedPayloadIsRejected) {
  // A frame whose quant payload header disagrees with its spec: re-checksummed, so only the
  // stage's own verification can catch it.
  KvBlock in = SynthesizeKv(KvShape{1, 1, 16, 8}, {}).value();
  ByteBuffer f = EncodeKv(in, "quant(kbits=4,vbits=4)").value();
  const size_t payload = kFrameFixedHeader + ParseFrame(f).value().header.spec.size();
  f = testing::Rechecksummed(f, [&](ByteBuffer& b) { b[payload + 1] = 3; });  // kbits in the payload header
  KvBlock out;
  Status st = DecodeKv(f, &out);
  EXPECT_EQ(st.code(), StatusCode::kCorrupt);
  EXPECT_NE(st.message().find("quant payload header"), std::string::npos) << st.message();
}

INSTANTIATE_TEST_SUITE_P(Tiers, QuantPackTiers, testing::AllTiers(), testing::TierParamName);
INSTANTIATE_TEST_SUITE_P(Tiers, QuantKernelTiers, testing::AllTiers(), testing::TierParamName);

}  // namespace
}  // namespace kvserve
