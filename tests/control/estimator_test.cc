// The bandwidth estimator on synthetic traces: convergence, a step change, an outlier, idling.
#include <gtest/gtest.h>

#include "kvserve/controller.h"

namespace kvserve {
namespace {

TEST(BandwidthEstimator, ConvergesAndFollowsAStepChange) {
  BandwidthEstimator e;
  EXPECT_FALSE(e.has_estimate());
  EXPECT_TRUE(e.NeedsProbe(0));
  double t = 0;
  for (int i = 0; i < 20; ++i, t += 0.1) e.AddSample(1e9 * (i % 2 ? 1.05 : 0.95), 1.0, t);  // ~1 GB/s, noisy
  EXPECT_NEAR(e.estimate(), 1e9, 0.06e9);
  const double before = e.Confidence(t);
  EXPECT_GT(before, 0.5);
  // The link drops to 0.2 GB/s: the first sample is held back, the second confirms the step.
  e.AddThroughput(0.2e9, t += 0.1);
  EXPECT_NEAR(e.estimate(), 1e9, 0.06e9);
  EXPECT_LT(e.Confidence(t), before);
  e.AddThroughput(0.21e9, t += 0.1);
  EXPECT_NEAR(e.estimate(), 0.205e9, 0.01e9);
  for (int i = 0; i < 5; ++i) e.AddThroughput(0.2e9, t += 0.1);
  EXPECT_NEAR(e.estimate(), 0.2e9, 0.01e9);
  // And up again, 10x.
  e.AddThroughput(2e9, t += 0.1);
  e.AddThroughput(2e9, t += 0.1);
  EXPECT_NEAR(e.estimate(), 2e9, 0.05e9);
}

TEST(BandwidthEstimator, IgnoresALoneOutlier) {
  BandwidthEstimator e;
  for (int i = 0; i < 10; ++i) e.AddThroughput(1e9, i * 0.1);
  e.AddThroughput(0.05e9, 1.0);  // one stalled transfer
  e.AddThroughput(1e9, 1.1);
  EXPECT_NEAR(e.estimate(), 1e9, 1e6);
}

TEST(BandwidthEstimator, IdleTimeLowersConfidenceAndAsksForAProbe) {
  BandwidthEstimator e;
  for (int i = 0; i < 10; ++i) e.AddThroughput(1e9, i * 0.1);
  EXPECT_FALSE(e.NeedsProbe(1.0));
  EXPECT_GT(e.Confidence(1.0), 2 * e.Confidence(4.0));
  EXPECT_TRUE(e.NeedsProbe(4.0));
  // After a long idle period the first sample restarts the estimate (the old level is stale).
  e.AddThroughput(0.3e9, 30.0);
  EXPECT_NEAR(e.estimate(), 0.3e9, 1);
  // Junk samples are ignored.
  e.AddSample(0, 1, 30.1);
  e.AddSample(1e9, 0, 30.1);
  EXPECT_NEAR(e.estimate(), 0.3e9, 1);
}

}  // namespace
}  // namespace kvserve
