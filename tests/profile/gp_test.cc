// GaussianProcess against closed-form cases: two-point posterior, interpolation, a known optimum.
#include <gtest/gtest.h>

#include <cmath>

#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

double Matern52(double r) { return (1 + std::sqrt(5.0) * r + 5.0 / 3.0 * r * r) * std::exp(-std::sqrt(5.0) * r); }

GaussianProcess::FitOptions Fixed() {
  GaussianProcess::FitOptions o;
  o.optimise = false;
  return o;
}

TEST(GaussianProcess, TwoPointPosteriorMatchesClosedForm) {
  // y = [1, -1] standardises to itself (mean 0, sd 1); length 1, signal 1, no noise.
  GaussianProcess gp;
  GaussianProcess::Hyper h{{0.0}, 0.0, -18.0};
  ASSERT_TRUE(gp.Fit({{0.0}, {1.0}}, {1.0, -1.0}, {}, Fixed(), &h).ok());
  const double m1 = Matern52(1.0), k1 = Matern52(0.25), k2 = Matern52(0.75);
  double mean, var;
  gp.Predict({0.25}, &mean, &var);
  EXPECT_NEAR(mean, (k1 - k2) / (1 - m1), 1e-6);
  EXPECT_NEAR(var, 1 - (k1 * k1 - 2 * m1 * k1 * k2 + k2 * k2) / (1 - m1 * m1), 1e-6);
}

TEST(GaussianProcess, NoiselessInterpolatesWithZeroVarianceAtData) {
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (int i = 0; i < 7; ++i) {
    x.push_back({i / 6.0, std::fmod(i * 0.37, 1.0)});
    y.push_back(std::sin(5 * x.back()[0]) + x.back()[1]);
  }
  GaussianProcess gp;
  GaussianProcess::Hyper h{{std::log(0.3), std::log(0.5)}, 0.0, -18.0};
  ASSERT_TRUE(gp.Fit(x, y, {}, Fixed(), &h).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    double mean, var;
    gp.Predict(x[i], &mean, &var);
    EXPECT_NEAR(mean, y[i], 1e-4);
    EXPECT_LT(var, 1e-5);
  }
  // Far from every point the posterior returns to the prior: its variance is the signal's.
  double mean, var, sd2 = 0, m = 0;
  for (double v : y) m += v / y.size();
  for (double v : y) sd2 += (v - m) * (v - m) / y.size();
  gp.Predict({50.0, 50.0}, &mean, &var);
  EXPECT_NEAR(var, sd2, 1e-6 * sd2);
  EXPECT_NEAR(mean, m, 1e-6);
}

TEST(GaussianProcess, KnownObservationNoiseWidensThePosterior) {
  GaussianProcess quiet, noisy;
  GaussianProcess::Hyper h{{std::log(0.3)}, 0.0, -18.0};
  std::vector<std::vector<double>> x = {{0.0}, {0.5}, {1.0}};
  std::vector<double> y = {0.0, 1.0, 0.0};
  ASSERT_TRUE(quiet.Fit(x, y, {}, Fixed(), &h).ok());
  ASSERT_TRUE(noisy.Fit(x, y, {0.05, 0.05, 0.05}, Fixed(), &h).ok());
  double mq, vq, mn, vn;
  quiet.Predict({0.5}, &mq, &vq);
  noisy.Predict({0.5}, &mn, &vn);
  EXPECT_GT(vn, vq + 1e-4);
  EXPECT_LT(mn, mq);  // shrinks toward the mean
}

TEST(GaussianProcess, OptimisedFitFindsTheMaximumOfA1DFunction) {
  // f(x) = -(x - 0.63)^2 on [0, 1], 9 noiseless samples: the posterior mean's argmax is near 0.63.
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (int i = 0; i <= 8; ++i) {
    const double v = i / 8.0;
    x.push_back({v});
    y.push_back(-(v - 0.63) * (v - 0.63));
  }
  GaussianProcess gp;
  GaussianProcess::FitOptions o;
  o.restarts = 3;
  ASSERT_TRUE(gp.Fit(x, y, {}, o).ok());
  GaussianProcess start;
  GaussianProcess::Hyper h0{{std::log(0.5)}, 0.0, std::log(1e-3)};
  ASSERT_TRUE(start.Fit(x, y, {}, Fixed(), &h0).ok());
  EXPECT_GE(gp.log_marginal_likelihood(), start.log_marginal_likelihood());
  double best = -1e9, at = -1;
  for (int i = 0; i <= 1000; ++i) {
    double m;
    gp.Predict({i / 1000.0}, &m, nullptr);
    if (m > best) best = m, at = i / 1000.0;
  }
  EXPECT_NEAR(at, 0.63, 0.02);
}

TEST(GaussianProcess, RejectsBadInput) {
  GaussianProcess gp;
  EXPECT_FALSE(gp.Fit({}, {}, {}, {}).ok());
  EXPECT_FALSE(gp.Fit({{0.0}}, {1.0, 2.0}, {}, {}).ok());
  EXPECT_FALSE(gp.Fit({{0.0}, {1.0, 2.0}}, {1.0, 2.0}, {}, {}).ok());
  EXPECT_FALSE(gp.Fit({{NAN}}, {1.0}, {}, {}).ok());
}

}  // namespace
}  // namespace kvserve
