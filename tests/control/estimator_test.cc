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

// A burst of short prompts (6 KB of KV in 150 us each, loopback) then long ones (64 MiB at
// 10 Gbit/s): the small transfers inform the latency and never the bandwidth, so the first long
// transfer already gives the link's rate.
TEST(BandwidthEstimator, SmallTransfersDoNotReadAsASlowLink) {
  BandwidthEstimator e;
  double t = 0;
  for (int i = 0; i < 50; ++i) e.AddSample(6144, 150e-6, t += 0.01);
  EXPECT_FALSE(e.has_estimate());  // 6 KB in 150 us is 0.33 Gbit/s: not a bandwidth sample
  EXPECT_NEAR(e.latency_seconds(), 150e-6, 1e-9);
  const double big = 64.0 * (1 << 20), rate = 10e9 / 8;
  e.AddSample(big, 150e-6 + big / rate, t += 0.1);
  ASSERT_TRUE(e.has_estimate());
  EXPECT_NEAR(e.estimate(), rate, 0.1 * rate);
  for (int i = 0; i < 5; ++i) e.AddSample(big, 150e-6 + big / rate, t += 0.1);
  EXPECT_NEAR(e.estimate(), rate, 0.01 * rate);
  // More small transfers leave the level where the large ones put it.
  for (int i = 0; i < 20; ++i) e.AddSample(6144, 150e-6, t += 0.01);
  EXPECT_NEAR(e.estimate(), rate, 0.01 * rate);
}

// Mid-size transfers on a link with 2 ms of latency: 512 KiB at 1 Gbit/s take 6.2 ms, which
// alone reads 0.67 Gbit/s; with the latency the small ones measured, the fit gives the rate.
TEST(BandwidthEstimator, LargerTransfersDiscountTheMeasuredLatency) {
  BandwidthEstimator e;
  double t = 0;
  for (int i = 0; i < 10; ++i) e.AddSample(1000, 2e-3, t += 0.01);
  const double bytes = 512 * 1024, rate = 1e9 / 8;
  for (int i = 0; i < 10; ++i) e.AddSample(bytes, 2e-3 + bytes / rate, t += 0.05);
  EXPECT_NEAR(e.estimate(), rate, 0.02 * rate);
  BandwidthEstimator naive({.min_bandwidth_bytes = 0});
  for (int i = 0; i < 10; ++i) naive.AddSample(bytes, 2e-3 + bytes / rate, i * 0.05);
  EXPECT_LT(naive.estimate(), 0.7 * rate);  // what counting latency as bandwidth reads
  // A latency above half a transfer's time is not taken from it: the sample stays positive.
  BandwidthEstimator slow;
  slow.AddSample(100, 1.0, 0);
  slow.AddSample(1 << 20, 0.01, 0.1);
  EXPECT_NEAR(slow.estimate(), double(1 << 20) / 0.005, 1);
}

}  // namespace
}  // namespace kvserve
