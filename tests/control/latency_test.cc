// The latency model and break-even bandwidths on hand-computed cases.
#include <gtest/gtest.h>

#include "kvserve/controller.h"

namespace kvserve {
namespace {

// ratio 4, encode 2 GB/s, decode 4 GB/s: serial speed S = 1/(1/2 + 1/4) GB/s = 4/3 GB/s.
const StrategyCost kQ4{"quant", "q4", 0.99, 4.0, 2e9, 4e9};
const StrategyCost kNone{"none", "none", 1.0, 1.0, 0, 0};

TEST(LatencyModel, SequentialAndUncompressed) {
  const double v = 1e9, b = 1e9;  // 1 GB at 1 GB/s
  EXPECT_DOUBLE_EQ(LatencyModel::Uncompressed(v, b), 1.0);
  EXPECT_DOUBLE_EQ(LatencyModel::Sequential(kNone, v, b), 1.0);
  // 0.5 s encode + 0.25 s transfer + 0.25 s decode.
  EXPECT_DOUBLE_EQ(LatencyModel::Sequential(kQ4, v, b), 1.0);
  EXPECT_DOUBLE_EQ(LatencyModel::Sequential(kQ4, v, 0.5e9), 0.5 + 0.5 + 0.25);
}

TEST(LatencyModel, BreakEvenIsWhereSequentialEqualsUncompressed) {
  // B* = (1 - 1/4) * 4/3 GB/s = 1 GB/s: exactly the bandwidth where both take 1 s above.
  EXPECT_NEAR(LatencyModel::BreakEvenSequential(kQ4), 1e9, 1e-3);
  EXPECT_EQ(LatencyModel::BreakEvenSequential(kNone), 0);
  for (double b : {0.5e9, 0.9e9, 1.1e9, 2e9}) {
    const bool pays = LatencyModel::Sequential(kQ4, 1e9, b) < LatencyModel::Uncompressed(1e9, b);
    EXPECT_EQ(pays, b < LatencyModel::BreakEvenSequential(kQ4)) << b;
  }
}

TEST(LatencyModel, PipelinedOverlapsStagesPlusOneLayerFillAndDrain) {
  const double v = 1e9, b = 1e9;
  // steady max(0.5, 0.25, 0.25) = 0.5 s; fill/drain (1/32 GB)(1/2 + 1/4 s/GB) = 0.0234375 s.
  EXPECT_NEAR(LatencyModel::Pipelined(kQ4, v, b, 32), 0.5 + 0.0234375, 1e-12);
  // Link-bound: B = 0.1 GB/s: max(0.5, 2.5, 0.25) + fill.
  EXPECT_NEAR(LatencyModel::Pipelined(kQ4, v, 0.1e9, 32), 2.5 + 0.0234375, 1e-12);
  // B* pipelined: min(32 * 0.75 * 4/3, 1 / (1/2 + 0.75/32)) GB/s = min(32, 1.9104...) GB/s.
  const double expect = 1e9 / (0.5 + 0.75 / 32);
  EXPECT_NEAR(LatencyModel::BreakEvenPipelined(kQ4, 32), expect, 1);
  for (double bw : {1.5e9, 1.9e9, 1.92e9, 3e9}) {
    const bool pays = LatencyModel::Pipelined(kQ4, v, bw, 32) < LatencyModel::Uncompressed(v, bw);
    EXPECT_EQ(pays, bw < LatencyModel::BreakEvenPipelined(kQ4, 32)) << bw;
  }
  // A ratio close to 1 makes the link bound the binding one.
  StrategyCost weak = kQ4;
  weak.ratio = 1.01;
  EXPECT_NEAR(LatencyModel::BreakEvenPipelined(weak, 32), 32 * (1 - 1 / 1.01) * 4e9 / 3, 1);
}

}  // namespace
}  // namespace kvserve
