// Pareto filtering, 3-D hypervolume and EHVI on hand-checked sets.
#include <gtest/gtest.h>

#include <cmath>

#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

const Objectives kOrigin{0, 0, 0};

TEST(Pareto, KeepsOnlyNonDominatedPoints) {
  std::vector<Objectives> p = {{1, 1, 1}, {2, 2, 2}, {3, 1, 1}, {2, 2, 2}, {1, 3, 0.5}, {0.5, 0.5, 3}};
  EXPECT_EQ(ParetoFront(p), (std::vector<uint32_t>{1, 2, 4, 5}));  // 0 dominated, 3 duplicates 1
  EXPECT_TRUE(ParetoFront({}).empty());
}

TEST(Hypervolume, HandCheckedSets) {
  EXPECT_DOUBLE_EQ(Hypervolume3D({{2, 3, 4}}, kOrigin), 24);
  // Two boxes in one plane overlapping in a unit square: 2 + 2 - 1.
  EXPECT_DOUBLE_EQ(Hypervolume3D({{2, 1, 1}, {1, 2, 1}}, kOrigin), 3);
  // Boxes 1x1x2 and 2x2x1 overlap in 1x1x1: 2 + 4 - 1.
  EXPECT_DOUBLE_EQ(Hypervolume3D({{1, 1, 2}, {2, 2, 1}}, kOrigin), 5);
  // A dominated point and a point below the reference add nothing.
  EXPECT_DOUBLE_EQ(Hypervolume3D({{1, 1, 2}, {2, 2, 1}, {0.5, 0.5, 0.5}, {-1, 9, 9}}, kOrigin), 5);
  // Reference shift: quality measured from 0.97.
  EXPECT_NEAR(Hypervolume3D({{0.99, 3, 2}}, {0.97, 1, 0}), 0.02 * 2 * 2, 1e-12);
  // Three mutually non-dominated points: inclusion-exclusion by hand.
  // a=(3,1,1) b=(1,3,1) c=(1,1,3): 3+3+3 - 3*(1) + 1 = 7.
  EXPECT_DOUBLE_EQ(Hypervolume3D({{3, 1, 1}, {1, 3, 1}, {1, 1, 3}}, kOrigin), 7);
}

TEST(Hypervolume, ExpectedImprovementWithoutUncertaintyIsThePlainImprovement) {
  std::vector<Objectives> front = {{3, 1, 1}, {1, 3, 1}, {1, 1, 3}};
  const double base = Hypervolume3D(front, kOrigin);
  for (Objectives n : {Objectives{2, 2, 2}, Objectives{0.5, 4, 4}, Objectives{1, 1, 1}, Objectives{4, 0.5, 2}}) {
    auto with = front;
    with.push_back(n);
    EXPECT_NEAR(ExpectedHypervolumeImprovement(front, kOrigin, n.ratio, n.speed, n.quality, 0),
                Hypervolume3D(with, kOrigin) - base, 1e-12);
  }
}

TEST(Hypervolume, ExpectedImprovementMatchesNumericalIntegration) {
  std::vector<Objectives> front = {{0.99, 4, 2}, {0.98, 6, 1}, {0.995, 2, 5}};
  const Objectives ref{0.97, 1, 0};
  const double base = Hypervolume3D(front, ref);
  const double mu = 0.985, sd = 0.01, ratio = 5, speed = 3;
  double numeric = 0;
  const int steps = 20000;
  for (int i = 0; i < steps; ++i) {  // midpoint rule over +-8 sd
    const double z = -8 + 16 * (i + 0.5) / steps, q = mu + sd * z;
    auto with = front;
    with.push_back({q, ratio, speed});
    numeric += (Hypervolume3D(with, ref) - base) * std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI) * (16.0 / steps);
  }
  EXPECT_NEAR(ExpectedHypervolumeImprovement(front, ref, ratio, speed, mu, sd), numeric, 1e-6 * (1 + numeric));
  EXPECT_GT(numeric, 0);
  // The survival-function form (numerical integration) agrees with the closed form.
  auto survival = [&](double t) { return 0.5 * std::erfc((t - mu) / (sd * std::sqrt(2.0))); };
  EXPECT_NEAR(ExpectedHypervolumeImprovement(front, ref, {{ratio, speed}}, survival, mu + 10 * sd), numeric,
              1e-4 * numeric);
}

TEST(Hypervolume, ExpectedImprovementOfAGroupSharingOneQuality) {
  // Two new points with the same quality: the improvement is that of adding both.
  std::vector<Objectives> front = {{0.99, 4, 2}};
  const Objectives ref{0.97, 1, 0};
  const double q = 0.985;
  auto with = front;
  with.push_back({q, 6, 1});
  with.push_back({q, 2, 5});
  EXPECT_NEAR(ExpectedHypervolumeImprovement(front, ref, {{6, 1}, {2, 5}}, q, 0),
              Hypervolume3D(with, ref) - Hypervolume3D(front, ref), 1e-12);
  // Nothing above quality_max: a survival of 1 everywhere is cut there.
  EXPECT_NEAR(ExpectedHypervolumeImprovement({}, ref, {{2, 1}}, [](double) { return 1.0; }, 0.98), 0.01 * 1 * 1, 1e-12);
}

}  // namespace
}  // namespace kvserve
