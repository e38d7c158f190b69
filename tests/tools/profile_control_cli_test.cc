// The profile and control commands as a person uses them: help, JSON keys, one-line errors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <set>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tools/cli_test_util.h"

namespace {

using kvserve::testing::Cli;
using kvserve::testing::CliRun;

const std::string kSrc = KVSERVE_SOURCE_DIR;

std::string TempFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/kvserve_pc_" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ProfileControlCli, Help) {
  for (const char* c : {"profile run --help", "profile grid --help", "profile show --help", "profile compare --help",
                        "profile space --help", "control simulate --help", "control decide --help"}) {
    CliRun r = Cli(c);
    EXPECT_EQ(r.code, 0) << c << "\n" << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << c;
  }
}

TEST(ProfileControlCli, ShowsTheShippedProfileAndSpaces) {
  CliRun r = Cli("profile show " + kSrc + "/bench/profiles/default.json --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  for (const char* k : {"version", "model_sha256", "pareto", "reference_point", "space"}) EXPECT_TRUE(j.contains(k)) << k;
  ASSERT_FALSE(j["pareto"].empty());
  for (const char* k : {"spec", "quality", "ratio", "encode_gbps", "decode_gbps", "bucket"}) EXPECT_TRUE(j["pareto"][0].contains(k)) << k;
  CliRun s = Cli("profile space --space " + kSrc + "/bench/spaces/grid.json --json");
  ASSERT_EQ(s.code, 0);
  EXPECT_EQ(nlohmann::json::parse(s.out)["candidates"].size(), 1006u);
}

TEST(ProfileControlCli, SimulateAllPoliciesAsJson) {
  CliRun r = Cli("control simulate --trace " + kSrc + "/bench/traces/step.csv --policy all --drift codec:1.5@100 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_TRUE(j.contains("trace"));
  EXPECT_TRUE(j.contains("recovery_requests"));
  std::set<std::string> names;
  for (const auto& p : j["policies"]) {
    for (const char* k : {"policy", "mean_ms", "p50_ms", "p99_ms", "slo_attainment", "floor_violations"}) EXPECT_TRUE(p.contains(k)) << k;
    EXPECT_EQ(p["floor_violations"].get<int>(), 0) << p["policy"];
    names.insert(p["policy"].get<std::string>());
  }
  for (const char* p : {"adaptive", "adaptive-ma", "oracle", "none"}) EXPECT_TRUE(names.count(p)) << p;
  EXPECT_GT(names.size(), 10u);  // every static strategy of the profile too
}

TEST(ProfileControlCli, DecideExplains) {
  CliRun r = Cli("control decide --bandwidth-gbps 2 --tokens 4096 --label retrieval --explain");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("floor 0.990"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("chose "), std::string::npos) << r.out;
}

TEST(ProfileControlCli, BadInputIsOneLineNamingTheProblem) {
  const std::string trace = TempFile("trace.csv", "time_s,gbps\n0,10\n5,-3\n");
  CliRun r = Cli("control simulate --trace " + trace);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("trace.csv:3: gbps '-3'"), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;

  const std::string wl = TempFile("wl.csv", "0.5,100,chat,300,0.97\n0.7,100,chat,300\n");
  r = Cli("control simulate --trace " + kSrc + "/bench/traces/steady_10gbps.csv --workload " + wl);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("wl.csv:2: want 5 fields"), std::string::npos) << r.out;

  const std::string prof = TempFile("p.json", R"({"version":7,"model_sha256":"x","pareto":[]})");
  r = Cli("control simulate --trace " + kSrc + "/bench/traces/steady_10gbps.csv --profile " + prof);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("format version 7"), std::string::npos) << r.out;

  const std::string space = TempFile("s.json", R"({"version":1,"templates":[{"stages":[{"stage":"quant","params":{"kbits":[0]}}]}]})");
  r = Cli("profile space --space " + space);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("kbits"), std::string::npos) << r.out;

  r = Cli("profile compare --grid " + prof);
  EXPECT_EQ(r.code, 1);
  r = Cli("profile run --mode greedy -o /dev/null");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("greedy"), std::string::npos) << r.out;
}

}  // namespace
