// The simulator: input files with errors that name the line, queueing, zero floor violations,
// and recovery after an injected drift.
#include <gtest/gtest.h>

#include "kvserve/controller.h"
#include "control/simulator.h"
#include "kvserve/profile.h"
#include "test_paths.h"

namespace kvserve {
namespace {

TEST(Trace, ParsesAndErrorsNameTheLine) {
  auto t = ParseTrace("# comment\ntime_s,gbps\n0,10\n5,2.5\n\n9,1\n", "t.csv");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t.value().size(), 3u);
  EXPECT_DOUBLE_EQ(TraceBandwidthGbps(t.value(), 4.9), 10);
  EXPECT_DOUBLE_EQ(TraceBandwidthGbps(t.value(), 5), 2.5);
  EXPECT_DOUBLE_EQ(TraceBandwidthGbps(t.value(), 100), 1);
  struct Case { const char* csv; const char* expect; } cases[] = {
      {"time_s,gbps\n0,10\n5,-1\n", "t.csv:3: gbps '-1'"},
      {"0,10\n5\n", "t.csv:2: want 2 fields"},
      {"0,10\n5,1\n3,1\n", "t.csv:3: time 3 goes back"},
      {"0,ten\n", "t.csv:1: gbps 'ten'"},
      {"time_s,gbps\n", "no rows"},
  };
  for (const Case& c : cases) {
    auto r = ParseTrace(c.csv, "t.csv");
    ASSERT_FALSE(r.ok()) << c.csv;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().ToString();
  }
}

TEST(Workload, ParsesAndErrorsNameTheLine) {
  auto w = ParseWorkload("arrival_s,prompt_tokens,label,slo_ms,floor\n0.5,2048,chat,600,0.97\n1.0,512,retrieval,300,0.99\n", "w.csv");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_EQ(w.value().size(), 2u);
  EXPECT_EQ(w.value()[1].label, "retrieval");
  struct Case { const char* csv; const char* expect; } cases[] = {
      {"h\n0.5,2048,chat,600\n", "w.csv:2: want 5 fields"},
      {"0.5,20.5,chat,600,0.97\n", "w.csv:1: prompt_tokens '20.5'"},
      {"0.5,20,ch at,600,0.97\n", "w.csv:1: label 'ch at'"},
      {"0.5,20,chat,0,0.97\n", "w.csv:1: slo_ms '0'"},
      {"0.5,20,chat,100,2\n", "w.csv:1: floor '2'"},
      {"1,20,chat,100,0.9\n0.5,20,chat,100,0.9\n", "w.csv:2: arrival_s 0.5 goes back"},
  };
  for (const Case& c : cases) {
    auto r = ParseWorkload(c.csv, "w.csv");
    ASSERT_FALSE(r.ok()) << c.csv;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos) << r.status().ToString();
  }
}

TEST(Drift, Parses) {
  auto d = ParseDrift({"codec:1.5@20", "link:2@30"});
  ASSERT_TRUE(d.ok());
  EXPECT_DOUBLE_EQ(d.value().codec_slowdown, 1.5);
  EXPECT_DOUBLE_EQ(d.value().at(), 20);
  EXPECT_FALSE(ParseDrift({"cpu:2@1"}).ok());
  EXPECT_FALSE(ParseDrift({"codec:1.5"}).ok());
}

TEST(ProfileForController, MalformedEntryIsNamed) {
  auto p = ProfileFromJson(R"({"version":1,"model_sha256":"x","pareto":[{"spec":"quant","quality":0.99,"ratio":0,"encode_gbps":1,"decode_gbps":1}]})", "p.json");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("p.json: pareto[0]"), std::string::npos) << p.status().ToString();
}

std::vector<StrategyCost> Strategies() {
  return {{"quant(kbits=8,vbits=8)", "q8", 0.999, 1.9, 3e9, 6e9},
          {"quant(kbits=4,vbits=4)", "q4", 0.985, 3.2, 2.5e9, 5e9},
          {"quant(kbits=3,vbits=3)", "q3", 0.975, 4.2, 2.5e9, 5e9},
          {"quant(kbits=2,vbits=2)|rans", "q2r", 0.962, 7.0, 0.8e9, 1.2e9}};
}

std::vector<WorkloadRequest> Workload(int n, double rate) {
  std::vector<WorkloadRequest> w;
  for (int i = 0; i < n; ++i)
    w.push_back({i / rate, uint32_t(1024 + (i * 7919) % 3072), i % 5 == 0 ? "retrieval" : "chat", 800, i % 3 ? 0.97 : 0.96});
  return w;
}

TEST(Simulator, AdaptiveMeetsFloorsAndBeatsStaticAndNone) {
  const auto trace = ParseTrace("0,25\n60,2\n120,10\n").value();
  const auto w = Workload(180, 1.0);
  SimOptions o;
  auto run = [&](const std::string& policy) {
    auto r = Simulate(Strategies(), trace, w, policy, o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.value();
  };
  const PolicyReport adaptive = run("adaptive"), oracle = run("oracle"), none = run("none");
  EXPECT_EQ(adaptive.floor_violations, 0u);
  EXPECT_EQ(oracle.floor_violations, 0u);
  EXPECT_LT(adaptive.mean_ms, none.mean_ms);
  double best_static = 1e30;
  for (const StrategyCost& s : Strategies()) best_static = std::min(best_static, run("static:" + s.spec).mean_ms);
  EXPECT_LE(adaptive.mean_ms, best_static * 1.02);
  EXPECT_LE(adaptive.mean_ms, oracle.mean_ms * 1.10);
  EXPECT_EQ(adaptive.requests, 180u);
  EXPECT_FALSE(Simulate(Strategies(), trace, w, "static:quant(kbits=5)", o).ok());
  EXPECT_FALSE(Simulate(Strategies(), trace, w, "greedy", o).ok());
}

// The codec turns 3x slower at t = 60 s: the live speeds (adaptive, adaptive-bandit) and the
// residual moving average (adaptive-ma) each recover within 20 requests.
TEST(Simulator, EveryAdaptivePolicyRecoversAfterCodecDrift) {
  const auto trace = ParseTrace("0,2\n").value();
  const auto w = Workload(160, 1.0);
  SimOptions o;
  o.drift = ParseDrift({"codec:3@60"}).value();
  for (const char* policy : {"adaptive", "adaptive-bandit", "adaptive-ma"}) {
    auto r = Simulate(Strategies(), trace, w, policy, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_GE(r.value().recovery_requests, 0) << policy;
    EXPECT_LE(r.value().recovery_requests, 20) << policy;
    EXPECT_EQ(r.value().floor_violations, 0u) << policy;
  }
}

// Issue 32's simulator goals as a regression check of the decision rule, on the shipped profile
// and both shipped workloads over a reduced set of the shipped traces (the full grid, 3 workloads
// x 8 traces x 3 drifts, is the benchmark: scripts/control_results.sh): adaptive within 2% of the
// best static strategy and 5% of the per-request oracle, no floor violated. KVServe's rule
// (adaptive-ma) is not held to it; on long prompts it trails by 4-6%.
TEST(Simulator, AdaptiveMeetsTheGoalsOnTheShippedWorkloads) {
  const std::vector<StrategyCost> s = StrategiesFromProfile(LoadProfile(SourceDir() + "/bench/profiles/default.json").value());
  for (const char* workload : {"mixed", "long_prompt"}) {
    const auto w = LoadWorkload(SourceDir() + "/bench/workloads/" + workload + ".csv").value();
    for (const char* trace : {"steady_1gbps", "steady_10gbps", "step", "congestion"}) {
      const auto t = LoadTrace(SourceDir() + "/bench/traces/" + trace + ".csv").value();
      SCOPED_TRACE(std::string(workload) + " on " + trace);
      SimOptions o;
      auto run = [&](const std::string& policy) { return Simulate(s, t, w, policy, o).value(); };
      const PolicyReport adaptive = run("adaptive"), oracle = run("oracle");
      double best_static = run("none").mean_ms;
      for (const StrategyCost& x : s) best_static = std::min(best_static, run("static:" + x.spec).mean_ms);
      EXPECT_LE(adaptive.mean_ms, 1.02 * best_static);
      EXPECT_LE(adaptive.mean_ms, 1.05 * oracle.mean_ms);
      EXPECT_EQ(adaptive.floor_violations, 0u);
    }
  }
}

TEST(Simulator, ExplainsEveryDecision) {
  const auto trace = ParseTrace("0,5\n").value();
  SimOptions o;
  o.explain = true;
  auto r = Simulate(Strategies(), trace, Workload(10, 2.0), "adaptive", o);
  ASSERT_TRUE(r.ok());
  ASSERT_EQ(r.value().explanations.size(), 10u);
  EXPECT_NE(r.value().explanations[0].find("chose"), std::string::npos);
  EXPECT_NE(r.value().explanations[0].find("Gbps"), std::string::npos);
}

}  // namespace
}  // namespace kvserve
