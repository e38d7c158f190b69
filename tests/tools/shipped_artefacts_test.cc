// Every shipped artefact — search spaces, profiles and grids, traces, workloads, result tables,
// controller results, fuzz seeds — loads with the current build and agrees with the current
// registry and spaces. A stale file fails here with the command that regenerates it.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "control/simulator.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/profile.h"
#include "test_paths.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// How each artefact is made; printed with every failure.
std::string Regenerate(const std::string& rel) {
  static const std::vector<std::pair<std::string, std::string>> kCommands = {
      {"docs/results/grid.json",
       "build/kvserve profile grid -m babyllama105 --space bench/spaces/grid.json --threads 2 --speed-runs 3 -o docs/results/grid.json"},
      {"docs/results/profile_compare.json",
       "build/kvserve profile compare --grid docs/results/grid.json --seeds 10 --json --svg docs/results/profile_hv.svg > docs/results/profile_compare.json"},
      {"bench/profiles/default.json", "rm bench/profiles/default.json; build/kvserve profile run -m babyllama105 --threads 2 -o bench/profiles/default.json"},
      {"docs/results/control/", "bash scripts/control_results.sh"},
      {"docs/results/table_", "build/kvserve eval -m MODEL --table --markdown docs/results/table_MODEL.md --svg docs/results/table_MODEL.svg --json > docs/results/table_MODEL.json"},
      {"docs/results/codec_bench.json", "build/kvserve codec bench --runs 7 --json > docs/results/codec_bench.json"},
      {"fuzz/seeds/frame/", "bash scripts/gen_fuzz_seeds.sh"},
      {"bench/traces/", "python3 scripts/gen_control_inputs.py"},
      {"bench/workloads/", "python3 scripts/gen_control_inputs.py"},
      {"docs/results/e2e_pd_qwen32b", "build/kvserve bench e2e --kv-shape qwen2.5-32b --prompt-tokens 4096 --bandwidths 2,5,10 "
                                      "--requests 6 --repeats 2 --load 0.9 --json --svg docs/results/e2e_pd_qwen32b.svg > "
                                      "docs/results/e2e_pd_qwen32b.json; then python3 scripts/e2e_report.py (its .md)"},
      {"docs/results/e2e_pd", "build/kvserve bench e2e --kv-shape llama3-8b --prompt-tokens 4096 --bandwidths 1,2,5,10 "
                              "--requests 10 --repeats 3 --load 0.9 --json --svg docs/results/e2e_pd.svg > "
                              "docs/results/e2e_pd.json; then python3 scripts/e2e_report.py (docs/results/e2e_pd.md)"},
      {"docs/results/e2e_capacity", "build/kvserve bench e2e --kv-shape llama3-8b --prompt-tokens 1024 --bandwidths 5 --requests 2 "
                                    "--repeats 2 --load 0.9 --static kivi2,uniform8 --capacity-gbps 5 --capacity-requests 12 "
                                    "--capacity-steps 3 --json > docs/results/e2e_capacity.json; then python3 "
                                    "scripts/e2e_report.py (its .md)"},
      {"docs/results/e2e_repeatability", "build/kvserve bench e2e --kv-shape llama3-8b --prompt-tokens 4096 --bandwidths 2,5 "
                                         "--requests 24 --load 0.9 --json > docs/results/e2e_repeatability_runN.json, twice; "
                                         "docs/results/e2e_repeatability.md by hand from both"},
      {"docs/results/transport_ucx", "build/kvserve bench link --compare tcp,ucx --message-mib 4,16,64 --repeats 5 --mib 512 --json > "
                                     "docs/results/transport_ucx.json (docs/results/transport_ucx.md from it)"},
      {"docs/results/e2e_pd_ucx_shaper", "build/kvserve bench e2e --mode pd --transport ucx --link shaper --bandwidths 10,25 "
                                         "--prompt-tokens 4096 --requests 8 --repeats 2 --json > docs/results/e2e_pd_ucx_shaper.json"},
      {"docs/results/e2e_pd_tcp_shaper", "build/kvserve bench e2e --mode pd --transport tcp --link shaper --bandwidths 10,25 "
                                         "--prompt-tokens 4096 --requests 8 --repeats 2 --json > docs/results/e2e_pd_tcp_shaper.json"},
      {"docs/results/http_front", "python3 scripts/http_front_bench.py --cli build/kvserve --baseline-cli OLD/build/kvserve "
                                  "--seconds 10 --repeats 40 --json docs/results/http_front.json (docs/results/http_front.md by hand)"},
      {"docs/results/e2e_pool_redis", "build/kvserve bench e2e --mode pool --backend redis --bandwidths 5,10 --requests 12 "
                                      "--prompt-tokens 4096 --static kivi2,uniform8 --json --svg docs/results/e2e_pool_redis.svg > "
                                      "docs/results/e2e_pool_redis.json; then python3 scripts/e2e_pool_report.py (its .md)"},
      {"docs/results/e2e_pool", "build/kvserve bench e2e --mode pool --bandwidths 5,10,15 --requests 12 --prompt-tokens 4096 "
                                "--json --svg docs/results/e2e_pool.svg > docs/results/e2e_pool.json; then python3 "
                                "scripts/e2e_pool_report.py (docs/results/e2e_pool.md)"},
  };
  for (const auto& [prefix, cmd] : kCommands)
    if (rel.rfind(prefix, 0) == 0) return "stale " + rel + "; regenerate with: " + cmd;
  return "stale " + rel;
}

std::vector<std::string> Files(const std::string& rel_dir, const std::string& ext) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(SourceDir() + "/" + rel_dir))
    if (e.path().extension() == ext) out.push_back(rel_dir + "/" + e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

json ReadJson(const std::string& rel) {
  ByteBuffer b = ReadFile(SourceDir() + "/" + rel).value();
  return json::parse(std::string(b.begin(), b.end()));
}

// The spec as the current parser writes it, or the parse error.
std::string Canonical(const std::string& spec) {
  Result<std::string> c = CanonicalStrategy(spec);
  return c.ok() ? c.value() : "(does not parse: " + c.status().message() + ")";
}

// Checks a profile against the space it records: same candidates, in order, same quality groups,
// and every spec in canonical form.
void CheckProfile(const std::string& rel) {
  SCOPED_TRACE(Regenerate(rel));
  Result<Profile> p = LoadProfile(SourceDir() + "/" + rel);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_FALSE(p->space_json.empty()) << "profile records no space";
  Result<SearchSpace> space = SearchSpace::Parse(p->space_json, rel + ": space");
  ASSERT_TRUE(space.ok()) << space.status().ToString();
  const auto& want = space->candidates();
  ASSERT_EQ(p->candidates.size(), want.size()) << "the space now expands to another number of strategies";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(p->candidates[i].spec, want[i].spec) << "candidate " << i;
    ASSERT_EQ(p->candidates[i].quality_group, int64_t(want[i].quality_group)) << "candidate " << i;
  }
  for (const ProfileEntry& e : p->pareto) EXPECT_EQ(e.spec, Canonical(e.spec)) << "pareto entry";
  // The frontier it records is the one its log gives with today's code.
  Profile again = p.value();
  ComputeProfileFrontier(&again);
  EXPECT_NEAR(again.hypervolume, p->hypervolume, 1e-9 * std::max(1.0, p->hypervolume));
  ASSERT_EQ(again.pareto.size(), p->pareto.size());
  if (p->mode == "grid") {
    ASSERT_EQ(p->log.size(), p->candidates.size()) << "a grid evaluates every candidate";
    for (size_t i = 0; i < p->log.size(); ++i) ASSERT_EQ(p->log[i].candidate, i) << "grid log out of order";
  }
}

TEST(ShippedArtefacts, SpacesExpandWithTheCurrentRegistry) {
  for (const std::string& rel : Files("bench/spaces", ".json")) {
    Result<SearchSpace> s = SearchSpace::Load(SourceDir() + "/" + rel);
    EXPECT_TRUE(s.ok()) << rel << ": " << s.status().ToString();
  }
}

TEST(ShippedArtefacts, ProfilesAndGridMatchTheirSpaces) {
  for (const std::string& rel : Files("bench/profiles", ".json")) CheckProfile(rel);
  CheckProfile("docs/results/grid.json");
}

TEST(ShippedArtefacts, GridComparisonWasMadeFromTheShippedGrid) {
  const std::string rel = "docs/results/profile_compare.json";
  SCOPED_TRACE(Regenerate(rel));
  const json c = ReadJson(rel);
  Profile grid = LoadProfile(SourceDir() + "/docs/results/grid.json").value();
  EXPECT_EQ(c["grid_evals"].get<size_t>(), grid.log.size());
  EXPECT_NEAR(c["grid_hypervolume"].get<double>(), grid.hypervolume, 1e-9);
  EXPECT_EQ(c["grid_frontier"].get<size_t>(), grid.pareto.size());
}

TEST(ShippedArtefacts, TracesAndWorkloadsLoad) {
  for (const std::string& rel : Files("bench/traces", ".csv")) {
    auto t = LoadTrace(SourceDir() + "/" + rel);
    EXPECT_TRUE(t.ok()) << Regenerate(rel) << ": " << t.status().ToString();
  }
  for (const std::string& rel : Files("bench/workloads", ".csv")) {
    auto w = LoadWorkload(SourceDir() + "/" + rel);
    EXPECT_TRUE(w.ok()) << Regenerate(rel) << ": " << w.status().ToString();
  }
}

TEST(ShippedArtefacts, ControllerResultsUseTheShippedProfile) {
  Profile p = LoadProfile(SourceDir() + "/bench/profiles/default.json").value();
  std::set<std::string> known = {"none"};
  for (const ProfileEntry& e : p.pareto) known.insert(Canonical(e.spec));
  for (const std::string& rel : Files("docs/results/control", ".json")) {
    SCOPED_TRACE(Regenerate(rel));
    const json r = ReadJson(rel);
    for (const json& pol : r["policies"]) {
      const std::string name = pol["policy"];
      if (name.rfind("static:", 0) == 0) {
        const std::string spec = name.substr(7);
        EXPECT_EQ(spec, Canonical(spec));
        EXPECT_TRUE(known.count(spec)) << "static policy " << spec << " is not in the shipped profile";
      }
      for (const auto& [choice, count] : pol["choices"].items())
        EXPECT_TRUE(known.count(Canonical(choice))) << "choice " << choice << " is not in the shipped profile";
    }
  }
}

TEST(ShippedArtefacts, ResultTablesNameCanonicalStrategies) {
  std::vector<std::string> tables = Files("docs/results", ".json");
  for (const std::string& rel : tables) {
    if (rel.find("/table_") == std::string::npos) continue;
    SCOPED_TRACE(Regenerate(rel));
    const json t = ReadJson(rel);
    ASSERT_TRUE(t.contains("rows"));
    for (const json& row : t["rows"]) EXPECT_EQ(row["spec"].get<std::string>(), Canonical(row["spec"]));
  }
  const std::string rel = "docs/results/codec_bench.json";
  SCOPED_TRACE(Regenerate(rel));
  const json b = ReadJson(rel);
  for (const json& s : b["strategies"]) EXPECT_EQ(s["spec"].get<std::string>(), Canonical(s["spec"]));
}

// The end-to-end result has the fields the current bench writes, its policies are ones the
// current bench runs, and points above its measured link ceiling are labelled modelled.
// The end-to-end results (every shipped PD run: shapes, capacity, repeatability) have the fields the current
// bench writes — the testbed they ran on, the calibration, intervals and paired ratios — their
// policies are ones the current bench runs, and points above the measured link ceiling are
// labelled modelled.
TEST(ShippedArtefacts, EndToEndResultsHaveTheCurrentFormat) {
  std::vector<std::string> results;
  for (const std::string& rel : Files("docs/results", ".json"))
    if (rel.rfind("docs/results/e2e_pd", 0) == 0 || rel.rfind("docs/results/e2e_capacity", 0) == 0 ||
        rel.rfind("docs/results/e2e_repeatability", 0) == 0) {
      results.push_back(rel);
    }
  ASSERT_GE(results.size(), 2u);
  for (const std::string& rel : results) {
    SCOPED_TRACE(Regenerate(rel));
    const json r = ReadJson(rel);
    for (const char* k : {"mode", "kv_shape", "link_ceiling_gbps", "link_ceiling_readings_gbps", "points", "pipelining",
                          "compute_model", "nodes", "link", "calibration", "ratios", "repeats"})
      ASSERT_TRUE(r.contains(k)) << k;
    EXPECT_TRUE(r["calibration"].contains("checks") && r["calibration"].contains("wire_payload_share"));
    const double ceiling = r["link_ceiling_gbps"];
    for (const json& p : r["points"]) {
      for (const char* k : {"gbps", "policy", "measured", "mean_ms", "p50_ms", "p99_ms", "ttft_p99_ms", "slo_attainment",
                            "wire_bytes", "quality", "capacity_rps_modelled", "valid", "ci95", "vs_none", "repeat_mean_ms"})
        ASSERT_TRUE(p.contains(k)) << k << " in " << p.dump();
      EXPECT_EQ(p["measured"].get<bool>(), p["gbps"].get<double>() <= 0.9 * ceiling) << p.dump();
      const std::string policy = p["policy"];
      EXPECT_TRUE(policy == "none" || policy == "adaptive" || policy.rfind("static:", 0) == 0) << policy;
    }
    for (const char* k : {"sum_ms", "max_ms", "observed_ms"}) EXPECT_TRUE(r["pipelining"].contains(k)) << k;
    if (r.contains("capacity_measured")) {
      for (const json& c : r["capacity_measured"])
        for (const char* k : {"policy", "gbps", "rps", "per_repeat_rps", "runs", "modelled_rps", "at_upper_end"})
          EXPECT_TRUE(c.contains(k)) << k;
    }
  }
}

TEST(ShippedArtefacts, FuzzSeedFramesAreCurrentFrames) {
  for (const std::string& rel : Files("fuzz/seeds/frame", ".kvf")) {
    SCOPED_TRACE(Regenerate(rel));
    ByteBuffer b = ReadFile(SourceDir() + "/" + rel).value();
    Result<FrameView> v = ParseFrame(b);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    // regression_* seeds are inputs that once crashed a parser: they need only be current frames.
    if (rel.find("/regression_") != std::string::npos) continue;
    EXPECT_EQ(v->header.spec, Canonical(v->header.spec));
    KvBlock out;
    Status st = DecodeKv(b, &out);
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
}

// The pool results (embedded and redis backends) have the fields the current bench writes: the
// testbed they ran on, the calibration, repeats with intervals and paired ratios of TTFT.
TEST(ShippedArtefacts, PoolEndToEndResultsHaveTheCurrentFormat) {
  for (const std::string rel : {"docs/results/e2e_pool.json", "docs/results/e2e_pool_redis.json"}) {
    SCOPED_TRACE(Regenerate(rel));
    const json r = ReadJson(rel);
    for (const char* k : {"mode", "backend", "kv_shape", "link_ceiling_gbps", "points", "compute_model", "reuse", "prefix_tokens",
                          "nodes", "link", "calibration", "ratios", "repeats"})
      ASSERT_TRUE(r.contains(k)) << k;
    EXPECT_EQ(r["mode"], "pool");
    EXPECT_TRUE(r["calibration"].contains("checks") && r["calibration"].contains("wire_payload_share"));
    std::set<std::string> policies;
    for (const json& p : r["points"]) {
      for (const char* k : {"gbps", "policy", "measured", "ttft_mean_ms", "ttft_p99_ms", "hit_ttft_mean_ms", "hit_rate",
                            "slo_attainment", "wire_bytes", "quality", "floor_violations", "choices", "valid", "ci95", "vs_none",
                            "repeat_ttft_mean_ms"})
        ASSERT_TRUE(p.contains(k)) << k << " in " << p.dump();
      EXPECT_TRUE(p["ci95"].contains("ttft_mean_ms")) << p.dump();
      policies.insert(p["policy"].get<std::string>());
      const std::string policy = p["policy"];
      EXPECT_TRUE(policy == "none" || policy == "adaptive" || policy == "recompute" || policy.rfind("static:", 0) == 0) << policy;
      if (policy == "recompute") {
        EXPECT_EQ(p["hit_rate"].get<double>(), 0.0);
      }
    }
    for (const char* k : {"none", "adaptive", "recompute"}) EXPECT_TRUE(policies.count(k)) << k;
  }
}

TEST(ShippedArtefacts, HttpFrontResultsHaveTheCurrentFormat) {
  const std::string rel = "docs/results/http_front.json";
  const json j = ReadJson(rel);
  ASSERT_TRUE(j.contains("runs") && j["runs"].size() >= 2) << Regenerate(rel);
  for (const json& r : j["runs"]) {
    for (const char* key : {"alone", "with_slow", "alone_again", "thousand", "wrk"}) {
      EXPECT_TRUE(r.contains(key)) << rel << " lacks '" << key << "': " << Regenerate(rel);
    }
    EXPECT_TRUE(r["wrk"].contains("requests_per_s") && r["thousand"].contains("answered_200")) << Regenerate(rel);
  }
}

TEST(ShippedArtefacts, TransportComparisonHasTheCurrentFormat) {
  const std::string rel = "docs/results/transport_ucx.json";
  const json j = ReadJson(rel);
  ASSERT_TRUE(j.contains("points") && j.contains("round_trip") && j.contains("memcpy_gbps")) << Regenerate(rel);
  for (const json& p : j["points"]) {
    EXPECT_TRUE(p.contains("transport") && p.contains("message_mib") && p.contains("median_gbps") && p["gbps"].is_array())
        << Regenerate(rel);
  }
  for (const char* rel2 : {"docs/results/e2e_pd_ucx_shaper.json", "docs/results/e2e_pd_tcp_shaper.json"}) {
    const json e = ReadJson(rel2);
    EXPECT_TRUE(e.contains("transport") && e.contains("calibration") && e.contains("points")) << Regenerate(rel2);
  }
}

}  // namespace
}  // namespace kvserve
