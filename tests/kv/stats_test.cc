// Benchmark statistics (kvserve/stats.h) against hand-computed values.
#include <gtest/gtest.h>

#include <cmath>

#include "kvserve/stats.h"

namespace kvserve {
namespace {

TEST(Stats, PercentilesInterpolateBetweenOrderStatistics) {
  const std::vector<double> v = {15, 20, 35, 40, 50};  // unsorted input is sorted first
  EXPECT_EQ(Percentile({50, 15, 40, 20, 35}, 0.5), 35);
  EXPECT_EQ(Percentile(v, 0), 15);
  EXPECT_EQ(Percentile(v, 1), 50);
  EXPECT_DOUBLE_EQ(Percentile(v, 0.4), 29);    // at 1.6: 20 + 0.6 x 15
  EXPECT_DOUBLE_EQ(Percentile(v, 0.99), 49.6);  // at 3.96: 40 + 0.96 x 10
  EXPECT_EQ(Percentile({7}, 0.99), 7);
  EXPECT_EQ(Percentile({}, 0.5), 0);
}

TEST(Stats, MeanIntervalsUseStudentsT) {
  // 2, 4, 6: mean 4, sd 2, se 2/sqrt(3); t(2) = 4.303 -> half-width 4.9687.
  const MeanCi m = MeanCi95({2, 4, 6});
  EXPECT_EQ(m.n, 3u);
  EXPECT_DOUBLE_EQ(m.mean, 4);
  EXPECT_NEAR(m.half_width, 4.303 * 2 / std::sqrt(3.0), 1e-12);
  EXPECT_EQ(MeanCi95({5}).half_width, 0);
  EXPECT_EQ(MeanCi95({3, 3, 3, 3}).half_width, 0);
  EXPECT_NEAR(StudentT95(1), 12.706, 1e-9);
  EXPECT_NEAR(StudentT95(30), 2.042, 1e-9);
  EXPECT_NEAR(StudentT95(60), 2.000, 0.003);
  EXPECT_NEAR(StudentT95(1000), 1.962, 0.003);
}

}  // namespace
}  // namespace kvserve
