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

}  // namespace
}  // namespace kvserve
