// The end-to-end benchmark's harness (kvserve/e2e_bench.h): the capacity search, repeats and
// paired ratios against hand-computed values, a point's figures from hand-made answers, and
// measured and modelled points, calibration and capacity on small in-process runs.
#include "kvserve/e2e_bench.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace kvserve {
namespace {

TEST(E2eBench, SearchCapacityFindsTheThresholdWithinItsResolution) {
  int calls = 0;
  auto below = [&](double limit) {
    return [&calls, limit](double rate) -> Result<bool> {
      ++calls;
      return rate <= limit;
    };
  };
  // [0.1, 100] with 20 steps: the log-width 6.9 halves 20 times, to 7e-6 of a factor.
  auto r = SearchCapacity(below(3.7), 0.1, 100, 20);
  ASSERT_TRUE(r.ok());
  EXPECT_LE(r.value(), 3.7);
  EXPECT_NEAR(r.value(), 3.7, 3.7 * 1e-4);
  EXPECT_EQ(calls, 22);  // the two ends, then the steps
  calls = 0;
  EXPECT_EQ(SearchCapacity(below(0.05), 0.1, 100, 20).value(), 0.0);  // fails at lo: no capacity
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(SearchCapacity(below(1e9), 0.1, 100, 20).value(), 100.0);  // holds at hi: at least hi
  // Zero steps: the bracket only, the lower end.
  EXPECT_EQ(SearchCapacity(below(3.7), 0.1, 100, 0).value(), 0.1);
  EXPECT_FALSE(SearchCapacity(below(1), 0, 100, 5).ok());
  EXPECT_FALSE(SearchCapacity(below(1), 5, 1, 5).ok());
  EXPECT_FALSE(SearchCapacity(below(1), 1, 5, -1).ok());
  // An experiment that fails stops the search with its reason.
  auto broken = SearchCapacity([](double) -> Result<bool> { return Status::Unavailable("node gone"); }, 1, 10, 3);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("node gone"), std::string::npos);
}

E2ePoint Rep(double mean, double p50, double p99, double ttft) {
  E2ePoint p;
  p.gbps = 5, p.policy = "none";
  p.mean_ms = mean, p.p50_ms = p50, p.p99_ms = p99, p.ttft_p99_ms = ttft;
  p.slo_attainment = 0.5, p.quality = 1, p.errors = 1;
  p.choices = {{"none", 4}};
  return p;
}

TEST(E2eBench, AggregateRepeatsGivesMeansAndStudentTIntervals) {
  // Means 100, 110, 120: sd 10, t(0.975, 2) = 4.303 (stats.h's table): 4.303 * 10 / sqrt(3) = 24.8434.
  const E2ePoint a = AggregateRepeats({Rep(100, 90, 150, 80), Rep(110, 100, 160, 90), Rep(120, 110, 170, 100)});
  EXPECT_EQ(a.repeats, 3u);
  EXPECT_DOUBLE_EQ(a.mean_ms, 110);
  EXPECT_NEAR(a.mean_ci, 24.8434, 1e-3);
  EXPECT_DOUBLE_EQ(a.p50_ms, 100);
  EXPECT_NEAR(a.p99_ci, 24.8434, 1e-3);
  EXPECT_DOUBLE_EQ(a.ttft_p99_ms, 90);
  EXPECT_DOUBLE_EQ(a.slo_attainment, 0.5);
  EXPECT_EQ(a.errors, 3u);  // counts add up
  EXPECT_EQ(a.choices.at("none"), 12u);
  EXPECT_EQ(a.repeat_means, (std::vector<double>{100, 110, 120}));
  // One repeat: no interval.
  const E2ePoint one = AggregateRepeats({Rep(100, 90, 150, 80)});
  EXPECT_EQ(one.mean_ci, 0);
  EXPECT_EQ(AggregateRepeats({}).repeats, 1u);
}

TEST(E2eBench, PairedRatioPairsByRepeat) {
  E2ePoint num, den;
  num.repeat_means = {200, 330, 240};
  den.repeat_means = {100, 110, 120};  // ratios 2, 3, 2: mean 7/3, sd 0.57735
  const MeanCi r = PairedRatio(num, den);
  EXPECT_EQ(r.n, 3u);
  EXPECT_NEAR(r.mean, 7.0 / 3, 1e-12);
  EXPECT_NEAR(r.half_width, 4.303 * 0.577350 / std::sqrt(3.0), 1e-4);
  den.repeat_means = {100, 0};  // a zero is skipped, the shorter list decides
  EXPECT_EQ(PairedRatio(num, den).n, 1u);
}

TEST(E2eBench, PoissonArrivalsAreSortedSeededAndAtTheirRate) {
  const auto a = PoissonArrivals(10, 4000, 7);
  ASSERT_EQ(a.size(), 4000u);
  EXPECT_EQ(a[0], 0);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_NEAR(a.back() / 3999, 0.1, 0.01);
  EXPECT_EQ(a, PoissonArrivals(10, 4000, 7));
  EXPECT_NE(a, PoissonArrivals(10, 4000, 8));
  const auto burst = PoissonArrivals(0, 5, 1);
  EXPECT_EQ(burst, std::vector<double>(5, 0.0));
}

ServeResponse Answer(double total_s, double generate_s, const std::string& strategy, uint64_t wire) {
  ServeResponse r;
  r.strategy = strategy;
  r.wire_bytes = wire;
  r.timings.total_s = total_s;
  r.timings.generate_s = generate_s;
  r.timings.prefill_s = 0.01;
  return r;
}

TEST(E2eBench, SummarisePdComputesTheFiguresFromTheAnswers) {
  Profile profile;
  profile.pareto.push_back({});
  profile.pareto[0].spec = "quant(kbits=2,vbits=2)";
  profile.pareto[0].quality = 0.9;
  E2eSetup s;
  s.profile = &profile;
  s.slo_ms = 250, s.floor = 0.95;
  std::vector<Result<ServeResponse>> answers = {Answer(0.3, 0.1, "none", 1000), Answer(0.5, 0.1, "quant(kbits=2,vbits=2)", 200),
                                                Status::Unavailable("lost"), Answer(0.4, 0.1, "none", 1000)};
  int errors_heard = 0;
  const E2ePoint p = SummarisePd(answers, s, {"adaptive", ""}, 5, 1.0, [&](const Status&) { ++errors_heard; });
  EXPECT_EQ(p.errors, 1u);
  EXPECT_EQ(errors_heard, 1);
  EXPECT_NEAR(p.mean_ms, 400, 1e-9);
  EXPECT_NEAR(p.p50_ms, 400, 1e-9);
  EXPECT_NEAR(p.p99_ms, 400 + 0.98 * 100, 1e-9);      // linear interpolation over 300, 400, 500
  EXPECT_NEAR(p.ttft_p99_ms, 300 + 0.98 * 100, 1e-9);  // TTFT = JCT - generation: 200, 300, 400
  EXPECT_NEAR(p.slo_attainment, 1.0 / 4, 1e-12);       // 200 ms only; a failed request misses
  EXPECT_NEAR(p.quality, (1 + 0.9 + 1) / 3, 1e-12);
  EXPECT_EQ(p.floor_violations, 1u);
  EXPECT_EQ(p.wire_bytes, 2200);
  EXPECT_EQ(p.choices.at("none"), 2u);
  EXPECT_NEAR(p.goodput, 1 / (1.0 + 0.4), 1e-12);
  EXPECT_NEAR(p.compute_share, (3 * 0.11) / 1.2, 1e-12);
  // A static policy's quality is its own.
  EXPECT_NEAR(SummarisePd(answers, s, {"static:x", "quant(kbits=2,vbits=2)", 0.8}, 5, 1.0, {}).quality, (1 + 0.8 + 1) / 3, 1e-12);
}

TEST(E2eBench, SummarisePoolCountsHitsAndTheirTtft) {
  E2eSetup s;
  s.slo_ms = 100, s.floor = 0.9;
  auto answer = [](double first_s, uint32_t cached, const std::string& action, const std::string& strategy) {
    ServeResponse r;
    r.timings.first_token_s = first_s;
    r.timings.total_s = first_s + 0.1;
    r.cached_tokens = cached;
    r.pool_action = action;
    r.strategy = strategy;
    return Result<ServeResponse>(r);
  };
  const std::vector<Result<ServeResponse>> answers = {answer(0.2, 0, "miss", "none"), answer(0.05, 512, "fetch", "none"),
                                                      answer(0.07, 512, "fetch", "quant(kbits=4,vbits=4)")};
  const E2ePoint p = SummarisePool(answers, s, {"adaptive", ""}, 5, 1, {{"none", 1.0}, {"quant(kbits=4,vbits=4)", 0.95}}, {});
  EXPECT_NEAR(p.hit_rate, 2.0 / 3, 1e-12);
  EXPECT_NEAR(p.hit_ttft_mean_ms, 60, 1e-9);
  EXPECT_NEAR(p.ttft_mean_ms, (200 + 50 + 70) / 3.0, 1e-9);
  EXPECT_NEAR(p.slo_attainment, 2.0 / 3, 1e-12);
  EXPECT_NEAR(p.quality, (1 + 1 + 0.95) / 3, 1e-12);
  EXPECT_EQ(p.choices.at("miss"), 1u);
  EXPECT_EQ(p.choices.at("fetch:none"), 1u);
}

TEST(E2eBench, PoolWorkloadIsSeededAndSharesPrefixesByDocument) {
  const std::vector<uint32_t> docs = PoolDocuments(50, 0.8, 7);
  EXPECT_EQ(docs, PoolDocuments(50, 0.8, 7));
  EXPECT_EQ(docs[0], 0u);
  uint32_t seen = 0;  // a request names a document seen before, or the next new one
  for (uint32_t d : docs) {
    EXPECT_LE(d, seen);
    if (d == seen) ++seen;
  }
  EXPECT_LT(seen, 30u);  // reuse 0.8: most requests reuse
  EXPECT_EQ(PoolDocuments(10, 0, 1), (std::vector<uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  const std::vector<int> a = PoolPrompt(3, 1, 512, 16), b = PoolPrompt(3, 2, 512, 16), c = PoolPrompt(4, 1, 512, 16);
  ASSERT_EQ(a.size(), 528u);
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 512, b.begin()));   // same document: same prefix
  EXPECT_FALSE(std::equal(a.begin() + 512, a.end(), b.begin() + 512));  // own suffixes
  EXPECT_FALSE(std::equal(a.begin(), a.begin() + 512, c.begin()));  // another document
  for (int t : a) EXPECT_TRUE(t >= 1 && t <= 30000);
}

TEST(E2eBench, PoolFiguresAggregateOverRepeatsAndPairByRepeat) {
  std::vector<E2ePoint> reps(3);
  const double ttft[] = {100, 110, 120}, hit[] = {50, 60, 70};
  for (int i = 0; i < 3; ++i) reps[i].ttft_mean_ms = ttft[i], reps[i].hit_ttft_mean_ms = hit[i], reps[i].hit_rate = 0.5 + 0.1 * i;
  const E2ePoint a = AggregateRepeats(reps);
  EXPECT_DOUBLE_EQ(a.ttft_mean_ms, 110);
  EXPECT_NEAR(a.ttft_mean_ci, 24.8434, 1e-3);  // as the JCT interval above
  EXPECT_DOUBLE_EQ(a.hit_ttft_mean_ms, 60);
  EXPECT_NEAR(a.hit_rate, 0.6, 1e-12);
  EXPECT_EQ(a.repeat_ttft_means, (std::vector<double>{100, 110, 120}));
  E2ePoint num;
  num.repeat_ttft_means = {200, 330, 240};
  const MeanCi r = PairedTtftRatio(num, a);
  EXPECT_NEAR(r.mean, (2 + 3 + 2) / 3.0, 1e-12);
  EXPECT_EQ(r.n, 3u);
}

// Small in-process runs of the real nodes (llama3-8b's stand-in, 64-token prompts).
struct InProcess : ::testing::Test {
  void SetUp() override {
    auto sm = SyntheticModelByName("llama3-8b", "h100");
    ASSERT_TRUE(sm.ok());
    model = sm.value();
    s.model = &model;
    s.max_new = 2;
    s.threads = 1;
    s.slo_ms = 60000;
  }
  SyntheticModel model;
  E2eSetup s;
};

TEST_F(InProcess, MeasuredAndModelledPointsOfTheSamePolicyAgreeInKind) {
  const E2ePolicy none{"none", "none"};
  const std::vector<uint32_t> prompts = {64, 64, 64};
  const std::vector<double> arrivals = {0, 0.01, 0.02};
  auto m = RunMeasuredPoint(s, none, 2, prompts, arrivals);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->measured);
  EXPECT_EQ(m->errors, 0u);
  EXPECT_GE(m->wire_bytes, 3.0 * 64 * 131072);
  EXPECT_EQ(m->choices.at("none"), 3u);
  EXPECT_GT(m->mean_ms, 1e3 * 64 * 131072 * 8 / 2e9);  // at least its bytes at 2 Gbit/s
  auto mod = RunModelledPoint(s, none, 2, prompts, arrivals);
  ASSERT_TRUE(mod.ok()) << mod.status().ToString();
  EXPECT_FALSE(mod->measured);
  EXPECT_GT(mod->mean_ms, 0);
  EXPECT_FALSE(RunMeasuredPoint(s, none, 2, prompts, {0}).ok());  // arrivals must match
  // Adaptive without a profile is refused by name.
  auto adaptive = RunMeasuredPoint(s, {"adaptive", ""}, 2, prompts, arrivals);
  ASSERT_FALSE(adaptive.ok());
  EXPECT_NE(adaptive.status().message().find("adaptive"), std::string::npos);
  s.nodes = "elsewhere";
  EXPECT_FALSE(RunMeasuredPoint(s, none, 2, prompts, arrivals).ok());
}

TEST_F(InProcess, CalibrationOfALoneRequestHoldsAndCatchesAnInjectedDelay) {
  // 512 tokens of KV at 1 Gbit/s: 537 ms of wire, well above the 50 ms floor of the tolerance.
  auto c = CalibratePolicy(s, {"none", "none"}, 1, 512, {.relative = 0.5});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->valid) << c->measured_s << " vs " << c->predicted_s;
  EXPECT_EQ(c->policy, "none");
  s.send_delay_ns = 20;  // 20 ns a byte: 1.3 s more for 64 MiB
  auto slow = CalibratePolicy(s, {"none", "none"}, 1, 512, {.relative = 0.5});
  ASSERT_TRUE(slow.ok()) << slow.status().ToString();
  EXPECT_FALSE(slow->valid);
}

// Pool mode in process: one document reused, so after the first request every one fetches its
// prefix; the lone-request check stores the prefix, then measures a hit.
TEST_F(InProcess, PoolRequestsFetchTheStoredPrefixAndALoneHitIsCalibrated) {
  s.mode = "pool";
  s.chunk_tokens = 64;
  s.suffix_tokens = 16;
  const E2ePolicy none{"none", "none"};
  std::vector<ServeRequest> requests;
  for (uint64_t i = 0; i < 3; ++i) {
    ServeRequest r = E2eRequest(s, i + 1, 0);
    r.prompt = PoolPrompt(0, i, 256, 16);
    requests.push_back(std::move(r));
  }
  auto p = RunMeasuredRequests(s, none, 2, requests, {0, 1.0, 2.0});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->errors, 0u);
  EXPECT_NEAR(p->hit_rate, 2.0 / 3, 1e-12);
  EXPECT_EQ(p->choices.at("miss"), 1u);
  EXPECT_EQ(p->choices.at("fetch:none"), 2u);
  // A hit moves its 256 prefix tokens of KV: 32 MiB at 2 Gbit/s, less the one burst of credit an
  // idle token bucket lends (1 MiB, LinkShaper's default): 130 ms at least.
  EXPECT_GT(p->hit_ttft_mean_ms, 1e3 * (256 * 131072 - (1 << 20)) * 8 / 2e9);
  auto c = CalibratePolicy(s, none, 2, 256, {.relative = 0.5});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->strategy, "none");
  EXPECT_GT(c->predicted_s, 0.134);
  EXPECT_TRUE(c->valid) << c->measured_s << " vs " << c->predicted_s;
  s.pool_backend = "memcached";
  EXPECT_FALSE(RunMeasuredRequests(s, none, 2, requests, {0, 1.0, 2.0}).ok());
  s.pool_backend = "redis";  // in process: needs a running server's address
  auto no_address = RunMeasuredRequests(s, none, 2, requests, {0, 1.0, 2.0});
  ASSERT_FALSE(no_address.ok());
  EXPECT_NE(no_address.status().message().find("address"), std::string::npos);
}

TEST_F(InProcess, MeasuredCapacityRunsOneSearchPerRepeat) {
  // 4 requests a run, a range whose low end a 64-token request meets (16 ms of wire a request).
  s.slo_ms = 500;
  std::vector<std::pair<double, bool>> seen;
  auto c = MeasureCapacity(s, {"none", "none"}, 5, 64, 4, 2, 2, 1000, 2, 3,
                           [&](double rate, bool meets) { seen.emplace_back(rate, meets); });
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->per_repeat.size(), 2u);
  EXPECT_EQ(c->rps.n, 2u);
  EXPECT_EQ(c->runs, seen.size());
  EXPECT_TRUE(seen.front().second) << "2 requests/s of 64 tokens must meet a 500 ms objective";
  for (double r : c->per_repeat) EXPECT_GE(r, 2);
  EXPECT_FALSE(MeasureCapacity(s, {"none", "none"}, 5, 64, 0, 2, 0.5, 10, 2, 3).ok());
}

}  // namespace
}  // namespace kvserve
