// The Bayesian search: acquisition preferences on constructed cases, resume after an
// interruption, and that it finds a frontier faster than random search on a synthetic space.
#include <gtest/gtest.h>

#include <cmath>

#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

// 1-D space: x in [0,1]; ratio grows with x; quality falls with x, crossing 0.97 at x = 0.8.
std::vector<BoCandidate> LineSpace(int n) {
  std::vector<BoCandidate> c;
  for (int i = 0; i < n; ++i) {
    const double x = double(i) / (n - 1);
    c.push_back({"c" + std::to_string(i), {x}, 1 + 9 * x, 2 + 2 * x, 4 + 4 * (1 - x)});
  }
  return c;
}
double LineQuality(const BoCandidate& c) { return 1.0 - 0.0375 * c.features[0] * c.features[0]; }

BoObservation Observe(const std::vector<BoCandidate>& c, uint32_t i) {
  BoObservation o;
  o.candidate = i;
  o.quality = LineQuality(c[i]);
  o.quality_se = 0.001;
  return o;
}

TEST(BayesianSearch, AcquisitionPrefersAnUnexploredHighRatioRegion) {
  // Two clusters in a 2-D feature space, equally feasible by construction; the low-ratio one at
  // feature 0 is densely observed, the high-ratio one at feature 1 not at all.
  std::vector<BoCandidate> c;
  for (int i = 0; i < 20; ++i) c.push_back({"a" + std::to_string(i), {0.0, i / 19.0 * 0.2}, 3.0 + 0.01 * i, 5, 5});
  for (int i = 0; i < 20; ++i) c.push_back({"b" + std::to_string(i), {1.0, i / 19.0 * 0.2}, 6.0 + 0.01 * i, 5, 5});
  std::vector<BoObservation> obs;
  for (uint32_t i = 0; i < 20; i += 2) obs.push_back({i, 0.99, 0.002, 0, 0, 0});
  for (SearchMode mode : {SearchMode::kConstrained, SearchMode::kEhvi}) {
    BoOptions o;
    o.mode = mode;
    o.budget = 30;
    auto v = AcquisitionValues(c, obs, o, 10);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    double best_a = -INFINITY, best_b = -INFINITY;
    for (uint32_t i = 0; i < 20; ++i) best_a = std::max(best_a, v.value()[i]);
    for (uint32_t i = 20; i < 40; ++i) best_b = std::max(best_b, v.value()[i]);
    EXPECT_GT(best_b, best_a) << SearchModeName(mode);
    EXPECT_TRUE(std::isinf(v.value()[0]));  // observed
  }
}

TEST(BayesianSearch, ResumeAfterInterruptionGivesTheUninterruptedResult) {
  const auto c = LineSpace(60);
  for (SearchMode mode : {SearchMode::kConstrained, SearchMode::kEhvi, SearchMode::kRandom}) {
    BoOptions o;
    o.mode = mode;
    o.budget = 12;
    o.seed = 7;
    std::vector<BoObservation> full;
    ASSERT_TRUE(RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> { return Observe(c, i); }, &full).ok());
    ASSERT_EQ(full.size(), 12u);

    std::vector<BoObservation> part;
    int calls = 0;
    Status st = RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> {
      if (++calls == 7) return Status::IoError("simulated interruption");
      return Observe(c, i);
    }, &part);
    ASSERT_FALSE(st.ok());
    ASSERT_EQ(part.size(), 6u);
    int resumed_calls = 0;
    ASSERT_TRUE(RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> { ++resumed_calls; return Observe(c, i); }, &part).ok());
    EXPECT_EQ(resumed_calls, 6);  // logged evaluations are not repeated
    ASSERT_EQ(part.size(), full.size());
    for (size_t i = 0; i < full.size(); ++i) EXPECT_EQ(part[i].candidate, full[i].candidate) << SearchModeName(mode) << " step " << i;
  }
}

TEST(BayesianSearch, ALogFromAnotherRunIsRefused) {
  const auto c = LineSpace(60);
  BoOptions o;
  o.budget = 8;
  std::vector<BoObservation> log = {Observe(c, 59)};  // not the first cold-start point
  Status st = RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> { return Observe(c, i); }, &log);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("log"), std::string::npos) << st.ToString();
}

TEST(BayesianSearch, OneEvaluationAnswersAQualityGroup) {
  // Pairs of candidates that differ only in lossless coding: same quality, other ratio and speed.
  std::vector<BoCandidate> c;
  for (int i = 0; i < 20; ++i) {
    c.push_back({"raw" + std::to_string(i), {i / 19.0}, 2.0 + i * 0.2, 6, 9, i});
    c.push_back({"coded" + std::to_string(i), {i / 19.0}, 2.5 + i * 0.25, 1, 2, i});
  }
  BoOptions o;
  o.budget = 100;  // more than there are groups: it stops after 20 evaluations
  std::vector<BoObservation> log;
  int calls = 0;
  ASSERT_TRUE(RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> {
    ++calls;
    BoObservation b;
    b.quality = 1.0 - 0.002 * c[i].features[0];
    return b;
  }, &log).ok());
  EXPECT_EQ(calls, 20);
  const auto known = KnownQualities(c, log);
  ASSERT_EQ(known.size(), 40u);
  for (const auto& [i, q] : known) EXPECT_DOUBLE_EQ(q, 1.0 - 0.002 * c[i].features[0]);
}

TEST(BayesianSearch, BeatsRandomSearchOnASyntheticFrontier) {
  const auto c = LineSpace(200);
  std::vector<BoObservation> all;
  for (uint32_t i = 0; i < c.size(); ++i) all.push_back(Observe(c, i));
  const double grid_hv = ObservedHypervolume(c, all, 0.97);
  auto run = [&](SearchMode mode, uint64_t seed) {
    BoOptions o;
    o.mode = mode;
    o.budget = 12;
    o.seed = seed;
    std::vector<BoObservation> log;
    EXPECT_TRUE(RunBayesianSearch(c, o, [&](uint32_t i) -> Result<BoObservation> { return Observe(c, i); }, &log).ok());
    return ObservedHypervolume(c, log, 0.97) / grid_hv;
  };
  double bo = 0, random = 0;
  for (uint64_t s = 1; s <= 4; ++s) bo += run(SearchMode::kEhvi, s) / 4, random += run(SearchMode::kRandom, s) / 4;
  EXPECT_GT(bo, 0.9);
  EXPECT_GT(bo, random);
}

}  // namespace
}  // namespace kvserve
