// Registry-driven tests: every registered stage, with its default parameters, round-trips, stays
// within an error bound and refuses malformed input without crashing. A new stage is covered by
// registering it; only a stage that needs calibration data names it below.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>

#include "codec/frame_test_util.h"
#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/synth.h"

namespace kvserve {
namespace {

class StageConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    in_ = SynthesizeKv(KvShape{2, 2, 96, 16}, {.seed = 21}).value();
    dir_ = ::testing::TempDir() + "/kvserve_stage_conformance_" + std::to_string(::getpid());
    store_ = std::make_unique<CalibrationStore>(dir_);
    env_.calibration = store_.get();
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // The stage with its defaults, plus what a stage needs from outside: a fitted basis.
  std::string StageText(const StageInfo& info) {
    if (info.name != "lowrank") return info.name;
    LowRankBasis b = FitLowRankBasis({&in_}).value();
    EXPECT_TRUE(SaveLowRankBasis(b, dir_).ok());
    return "lowrank(basis=" + std::to_string(b.id) + ")";
  }
  // The shortest strategy that runs the stage: a stage taking bytes or symbols gets a producer
  // in front (8-bit quant: its codes are symbols), and `prefix` is that producer alone, so the
  // stage's own effect can be told apart from the producer's.
  void Strategy(const StageInfo& info, std::string* spec, std::string* prefix) {
    *prefix = "";
    if (info.input != DataKind::kTensor) *prefix = "quant(kbits=8,vbits=8)";
    *spec = (prefix->empty() ? "" : *prefix + "|") + StageText(info);
  }

  KvBlock in_;
  std::string dir_;
  std::unique_ptr<CalibrationStore> store_;
  CodecEnv env_;
};

const StageInfo& Info(const std::string& name) { return *FindStageInfo(name); }

// The reference block the decoded one should match: the input's kept tokens.
KvBlock KeptTokens(const KvBlock& in, const KvBlock& out) {
  if (out.positions().empty()) return in;
  KvBlock kept = KvBlock::Create(out.shape(), in.dtype()).value();
  const size_t row = size_t(in.shape().head_dim) * DTypeSize(in.dtype());
  for (uint64_t s = 0; s < in.shape().n_slab(); ++s)
    for (uint32_t j = 0; j < out.shape().n_token; ++j)
      std::memcpy(kept.slab_at(s) + j * row, in.slab_at(s) + (out.positions()[j] - in.token_offset()) * row, row);
  kept.set_positions(out.positions());
  return kept;
}

TEST_P(StageConformance, RoundTripsToTheInputShape) {
  const StageInfo& info = Info(GetParam());
  std::string spec, prefix;
  Strategy(info, &spec, &prefix);
  Result<Pipeline> p = Pipeline::Create(spec, env_);
  ASSERT_TRUE(p.ok()) << spec << ": " << p.status().ToString();
  EXPECT_EQ(Pipeline::Create(p->spec(), env_)->spec(), p->spec()) << "canonical spec must round-trip";
  ByteBuffer frame;
  Status st = p->Encode(in_, &frame);
  ASSERT_TRUE(st.ok()) << spec << ": " << st.ToString();
  KvBlock out;
  st = p->Decode(frame, &out);
  ASSERT_TRUE(st.ok()) << spec << ": " << st.ToString();
  EXPECT_EQ(out.dtype(), in_.dtype());
  EXPECT_EQ(out.shape().n_layer, in_.shape().n_layer);
  EXPECT_EQ(out.shape().n_head_kv, in_.shape().n_head_kv);
  EXPECT_EQ(out.shape().head_dim, in_.shape().head_dim) << "decoding restores every stage but token selection";
  EXPECT_LE(out.shape().n_token, in_.shape().n_token);
  EXPECT_GT(out.shape().n_token, 0u);
  // The same frame decodes the same way through DecodeKv, which reads the spec from the frame.
  KvBlock again;
  ASSERT_TRUE(DecodeKv(frame, &again, {}, env_).ok());
  ASSERT_EQ(again.bytes(), out.bytes());
  EXPECT_EQ(std::memcmp(again.data(), out.data(), out.bytes()), 0);
}

// Every storage type a KV block can have (FP8 included) goes in and comes back in that type.
TEST_P(StageConformance, TakesEveryStorageType) {
  const StageInfo& info = Info(GetParam());
  std::string spec, prefix;
  Strategy(info, &spec, &prefix);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16, DType::kE4M3, DType::kE5M2}) {
    SCOPED_TRACE(DTypeName(dt));
    const KvBlock in = in_.ConvertTo(dt).value();
    Result<ByteBuffer> frame = EncodeKv(in, spec, {}, env_);
    ASSERT_TRUE(frame.ok()) << spec << ": " << frame.status().ToString();
    KvBlock out;
    ASSERT_TRUE(DecodeKv(frame.value(), &out, {}, env_).ok()) << spec;
    EXPECT_EQ(out.dtype(), dt);
    EXPECT_EQ(out.shape().head_dim, in.shape().head_dim);
    const KvCompareResult c = CompareKv(KeptTokens(in, out), out).value();
    EXPECT_GT(std::min(c.k.cosine, c.v.cosine), 0.85) << spec;
  }
}

TEST_P(StageConformance, StaysWithinItsErrorBound) {
  const StageInfo& info = Info(GetParam());
  std::string spec, prefix;
  Strategy(info, &spec, &prefix);
  KvBlock out;
  ASSERT_TRUE(DecodeKv(EncodeKv(in_, spec, {}, env_).value(), &out, {}, env_).ok()) << spec;
  if (info.lossless) {
    // A lossless stage adds no error to what its producer left.
    KvBlock base;
    ASSERT_TRUE(DecodeKv(EncodeKv(in_, prefix.empty() ? "none" : prefix).value(), &base).ok());
    ASSERT_EQ(base.bytes(), out.bytes()) << spec;
    EXPECT_EQ(std::memcmp(base.data(), out.data(), out.bytes()), 0) << spec << " is declared lossless";
    return;
  }
  // Default parameters are a usable operating point: at least 6 dB on the kept tokens (the
  // loosest default, lowrank keeping 4 of 16 dimensions, gives 8; 4-bit quant about 20). Each
  // stage's own test checks its exact bound.
  const KvCompareResult c = CompareKv(KeptTokens(in_, out), out).value();
  EXPECT_GE(std::min(c.k.snr_db, c.v.snr_db), 6.0) << spec;
  EXPECT_GT(std::min(c.k.cosine, c.v.cosine), 0.9) << spec;
}

TEST_P(StageConformance, RefusesMalformedInputWithoutCrashing) {
  const StageInfo& info = Info(GetParam());
  std::string spec, prefix;
  Strategy(info, &spec, &prefix);
  const ByteBuffer frame = EncodeKv(in_, spec, {}, env_).value();
  const FrameView v = ParseFrame(frame).value();
  const size_t payload_at = v.payload.data() - frame.data(), payload_len = v.payload.size();
  KvBlock out;
  // Truncated payloads, re-checksummed so that only the stage's own checks stand in the way.
  for (size_t drop : {size_t{1}, size_t{7}, payload_len / 2, payload_len}) {
    if (drop > payload_len) continue;
    Status st = DecodeKv(testing::Shortened(frame, drop), &out, {}, env_);
    EXPECT_FALSE(st.ok()) << spec << " decoded a payload " << drop << " bytes short";
    EXPECT_FALSE(st.message().empty());
  }
  // Flipped payload bytes behind a valid checksum: an error or some block, never a crash or a
  // block of the wrong shape.
  for (size_t at : {size_t{0}, size_t{1}, payload_len / 3, payload_len / 2, payload_len - 1}) {
    ByteBuffer bad = testing::Rechecksummed(frame, [&](ByteBuffer& b) { b[payload_at + at] ^= 0x5a; });
    Status st = DecodeKv(bad, &out, {}, env_);
    if (st.ok()) {
      EXPECT_EQ(out.shape().head_dim, in_.shape().head_dim) << spec;
    }
  }
  // The wire checksum catches what was not re-checksummed.
  ByteBuffer flipped = frame;
  flipped[payload_at + payload_len / 2] ^= 1;
  EXPECT_EQ(DecodeKv(flipped, &out, {}, env_).code(), StatusCode::kCorrupt) << spec;
}

std::vector<std::string> AllStages() {
  std::vector<std::string> names;
  for (const StageInfo& info : RegisteredStages()) names.push_back(info.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Registry, StageConformance, ::testing::ValuesIn(AllStages()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace kvserve
