// lowrank stage and its calibrated bases: full rank is lossless, error falls with rank, and a
// missing, mismatched or damaged basis is a clear error.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

class LowRank : public ::testing::Test {
 protected:
  void SetUp() override {
    // One folder per test process: CTest runs these tests in parallel.
    dir_ = ::testing::TempDir() + "/kvserve_lowrank_test_" + std::to_string(::getpid());
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    store_ = std::make_unique<CalibrationStore>(dir_);
    env_.calibration = store_.get();
    // Calibration and test tokens from one synthetic "model" (a seed fixes its per-head means).
    KvBlock all = SynthesizeKv(KvShape{2, 2, 390, 16}, {.seed = 50, .dtype = DType::kF32}).value();
    calib_ = all.SliceTokens(0, 300).value();
    test_ = all.SliceTokens(300, 90).value();
    test_.set_token_offset(0);
    basis_ = FitLowRankBasis({&calib_}).value();
    ASSERT_TRUE(SaveLowRankBasis(basis_, dir_).ok());
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string Spec(uint32_t rank) { return "lowrank(rank=" + std::to_string(rank) + ",basis=" + std::to_string(basis_.id) + ")"; }
  Result<ByteBuffer> Enc(const KvBlock& b, const std::string& spec) { return EncodeKv(b, spec, {}, env_); }
  Status Dec(const ByteBuffer& f, KvBlock* out) { return DecodeKv(f, out, {}, env_); }
  std::string dir_;
  std::unique_ptr<CalibrationStore> store_;
  CodecEnv env_;
  KvBlock calib_, test_;
  LowRankBasis basis_;
};

TEST_F(LowRank, FullRankIsLosslessAndErrorFallsWithRank) {
  KvBlock out;
  ASSERT_TRUE(Dec(Enc(test_, Spec(16)).value(), &out).ok());
  EXPECT_EQ(out.shape(), test_.shape());
  EXPECT_LT(CompareKv(test_, out).value().k.max_abs, 1e-3);
  double last = 1e9;
  for (uint32_t r : {2u, 4u, 8u, 12u}) {
    ASSERT_TRUE(Dec(Enc(test_, Spec(r)).value(), &out).ok());
    const double err = CompareKv(test_, out).value().v.mean_abs;
    EXPECT_LT(err, last) << r;
    last = err;
  }
}

TEST_F(LowRank, BasisIsOrthonormal) {
  const uint32_t D = 16;
  for (uint64_t sl = 0; sl < basis_.n_slab(); ++sl)
    for (uint32_t a = 0; a < D; ++a)
      for (uint32_t b = 0; b < D; ++b) {
        double dot = 0;
        for (uint32_t d = 0; d < D; ++d) dot += double(basis_.basis[(sl * D + d) * D + a]) * basis_.basis[(sl * D + d) * D + b];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-4);
      }
}

TEST_F(LowRank, ComposesWithQuantisers) {
  KvBlock out;
  const std::string spec = Spec(8) + "|quant(kbits=4,vbits=4)|rans";
  ASSERT_TRUE(Dec(Enc(test_, spec).value(), &out).ok()) << spec;
  EXPECT_EQ(out.shape(), test_.shape());
  EXPECT_GT(CompareKv(test_, out).value().k.snr_db, 8);
  const std::string pruned = "prune(keep=0.5)|" + Spec(8) + "|quant";
  ASSERT_TRUE(Dec(Enc(test_, pruned).value(), &out).ok()) << pruned;
  EXPECT_EQ(out.shape().head_dim, 16u);
  EXPECT_LT(out.shape().n_token, 90u);
}

TEST_F(LowRank, TiledLoopsEqualThePlainProjectionAndReconstruction) {
  // Ranks on and off the 16-wide tiles, 90 tokens (a partial tile of 4 at the end).
  const uint32_t D = 16;
  for (uint32_t rank : {16u, 12u, 3u}) {
    const ByteBuffer f = Enc(test_, Spec(rank)).value();
    const uint8_t* coeffs = ParseFrame(f).value().payload.data() + 1;  // raw f32 after the dtype byte
    KvBlock out;
    ASSERT_TRUE(Dec(f, &out).ok());
    for (uint32_t l = 0; l < 2; ++l)
      for (KvPart part : {KvPart::kKey, KvPart::kValue})
        for (uint32_t h = 0; h < 2; ++h) {
          const uint64_t sl = (uint64_t(l) * 2 + (part == KvPart::kValue)) * 2 + h;
          const float* mean = &basis_.mean[sl * D];
          const float* B = &basis_.basis[sl * D * D];
          for (uint32_t t = 0; t < 90; ++t) {
            std::vector<double> c(rank);
            for (uint32_t j = 0; j < rank; ++j) {
              for (uint32_t d = 0; d < D; ++d) c[j] += double(test_.Get(l, part, h, t, d) - mean[d]) * B[d * D + j];
              float got;
              std::memcpy(&got, coeffs + ((sl * 90 + t) * rank + j) * 4, 4);
              ASSERT_NEAR(got, c[j], 1e-4 * (1 + std::fabs(c[j]))) << "rank " << rank << " slab " << sl << " token " << t;
            }
            for (uint32_t d = 0; d < D; ++d) {
              double x = mean[d];
              for (uint32_t j = 0; j < rank; ++j) {
                float cj;
                std::memcpy(&cj, coeffs + ((sl * 90 + t) * rank + j) * 4, 4);
                x += double(cj) * B[d * D + j];
              }
              ASSERT_NEAR(out.Get(l, part, h, t, d), x, 1e-4 * (1 + std::fabs(x))) << "rank " << rank << " token " << t;
            }
          }
        }
  }
}

TEST_F(LowRank, MissingMismatchedOrDamagedBasisIsAClearError) {
  auto r = Enc(test_, "lowrank(rank=4,basis=12345)");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("lowrank basis 12345 is not in"), std::string::npos) << r.status().message();
  r = Enc(test_, "lowrank(rank=4)");
  EXPECT_NE(r.status().message().find("needs basis=<id>"), std::string::npos) << r.status().message();
  KvBlock other = SynthesizeKv(KvShape{3, 2, 10, 16}, {}).value();
  r = Enc(other, Spec(4));
  EXPECT_NE(r.status().message().find("is for 2 layers"), std::string::npos) << r.status().message();
  // Without calibration data the spec parses but cannot run, and says why.
  r = EncodeKv(test_, Spec(4));
  EXPECT_NE(r.status().message().find("needs calibration data"), std::string::npos) << r.status().message();
  r = Enc(other, Spec(4));
  EXPECT_NE(r.status().message().find("is for 2 layers"), std::string::npos) << r.status().message();
  // A frame encoded with a basis that later changed on disk is refused at decode.
  ByteBuffer f = Enc(test_, Spec(4)).value();
  {
    std::fstream file(dir_ + "/lowrank-" + std::to_string(basis_.id) + ".bin", std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x42');
  }
  CalibrationStore fresh(dir_);  // a new store: the first one keeps the basis it loaded
  KvBlock out;
  Status st = DecodeKv(f, &out, {}, CodecEnv{&fresh});
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.ToString();
  EXPECT_NE(st.message().find("does not match its id"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace kvserve
