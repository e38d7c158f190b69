// Calibration of the serving testbed (kvserve/calibration.h): the pipelined transfer time and
// the lone-request check against hand-computed values.
#include <gtest/gtest.h>

#include "kvserve/calibration.h"

namespace kvserve {
namespace {

TEST(Calibration, PipelinedSecondsIsTheSlowestStagePlusOneFrameOfTheOthers) {
  // 4 frames of 10 ms encode, 30 ms wire, 5 ms decode: 4 x 30 + 10 + 5 = 135 ms.
  EXPECT_NEAR(PipelinedSeconds(0.040, 0.120, 0.020, 4), 0.135, 1e-12);
  // One frame: the stages one after another.
  EXPECT_NEAR(PipelinedSeconds(0.010, 0.030, 0.005, 1), 0.045, 1e-12);
  // Codec-bound: 8 frames of 20 ms encode behind 1 ms of wire and 2 of decode.
  EXPECT_NEAR(PipelinedSeconds(0.160, 0.008, 0.016, 8), 0.163, 1e-12);
  EXPECT_EQ(PipelinedSeconds(1, 1, 1, 0), 0);
}

ServeResponse Lone(double transfer_extra_s) {
  // llama3-8b, 1000 prompt tokens, `none`: 128,000 KiB on the wire at 1 Gbit/s = 1.048576 s.
  ServeResponse r;
  r.strategy = "none";
  r.wire_bytes = 1000ull * 131072;
  StageTimings& t = r.timings;
  t.prefill_s = 0.040;  // 1000 / 25,000
  t.encode_s = 0.032, t.decode_s = 0.064;
  t.transfer_s = PipelinedSeconds(t.encode_s, 1.048576, t.decode_s, 32) + transfer_extra_s;
  t.generate_s = 0.075;  // 15 / 200
  t.total_s = t.prefill_s + t.transfer_s + t.generate_s + 0.001;
  return r;
}

TEST(Calibration, ALoneRequestWithinToleranceIsValidAndAnOverheadIsNamed) {
  const SyntheticModel m;  // llama3-8b on an H100: 25,000 and 200 tokens/s
  const LoneRequestCheck ok = CheckLoneRequest(Lone(0), m, 1.0, 1000, 16);
  // 0.040 + (1.048576 + (0.032 + 0.064) / 32) + 0.075 = 1.166576 s.
  EXPECT_NEAR(ok.predicted_s, 1.166576, 1e-9);
  EXPECT_TRUE(ok.valid);
  EXPECT_TRUE(ok.fault.empty());
  ASSERT_EQ(ok.stages.size(), 5u);
  EXPECT_EQ(ok.stages[2].stage, "transfer");
  EXPECT_NEAR(ok.stages[2].predicted_s, 1.051576, 1e-9);
  // 200 ms more on the wire than the link rate explains: 17% over, past 10% and 50 ms.
  const LoneRequestCheck off = CheckLoneRequest(Lone(0.200), m, 1.0, 1000, 16);
  EXPECT_FALSE(off.valid);
  EXPECT_EQ(off.fault, "transfer");
  // The same within a looser tolerance; and 40 ms over is within the 50 ms floor.
  EXPECT_TRUE(CheckLoneRequest(Lone(0.200), m, 1.0, 1000, 16, {.relative = 0.25}).valid);
  EXPECT_TRUE(CheckLoneRequest(Lone(0.040), m, 1.0, 1000, 16, {.relative = 0.01}).valid);
}

// A pool hit: 4096 prefix tokens in 16 chunks of 256 fetched (none: 512 MiB at 5 Gbit/s =
// 0.858993 s of wire, 0.160 s of decode), 64 suffix tokens computed.
ServeResponse PoolHit(double fetch_extra_s) {
  ServeResponse r;
  r.strategy = "none";
  r.cached_tokens = 4096;
  r.wire_bytes = 4096ull * 131072;
  StageTimings& t = r.timings;
  t.queue_s = 0.002;
  t.decode_s = 0.160;
  t.fetch_s = PipelinedSeconds(0, 0.8589934592, t.decode_s, 16) + fetch_extra_s;
  t.prefill_s = 64 / 25000.0;
  t.first_token_s = t.queue_s + t.fetch_s + t.prefill_s + 0.003;
  t.generate_s = 0.075;
  t.total_s = t.first_token_s + t.generate_s;
  return r;
}

TEST(Calibration, ALonePoolHitIsItsChunksPipelinedPlusTheSuffix) {
  const SyntheticModel m;
  const LoneRequestCheck ok = CheckLonePoolRequest(PoolHit(0), m, 5.0, 4160, 256);
  // 0.8589934592 + 0.160 / 16 + 64 / 25000 = 0.8715534592 s (decode hides behind the wire).
  EXPECT_NEAR(ok.predicted_s, 0.8715534592, 1e-9);
  EXPECT_TRUE(ok.valid) << ok.measured_s;
  ASSERT_EQ(ok.stages.size(), 4u);
  EXPECT_EQ(ok.stages[1].stage, "fetch");
  EXPECT_NEAR(ok.stages[3].measured_s, 0.003, 1e-9);  // other: what no stage accounts for
  const LoneRequestCheck slow = CheckLonePoolRequest(PoolHit(0.300), m, 5.0, 4160, 256);
  EXPECT_FALSE(slow.valid);
  EXPECT_EQ(slow.fault, "fetch");
  // A recompute: nothing fetched, the whole prompt's prefill predicted.
  ServeResponse re;
  re.timings.prefill_s = re.timings.first_token_s = 4160 / 25000.0;
  const LoneRequestCheck rc = CheckLonePoolRequest(re, m, 5.0, 4160, 256);
  EXPECT_NEAR(rc.predicted_s, 0.1664, 1e-12);
  EXPECT_TRUE(rc.valid);
}

}  // namespace
}  // namespace kvserve
