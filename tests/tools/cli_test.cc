// The CLI as a person uses it: help, the kv/codec round trip, and one clear line per error.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kvserve/frame.h"
#include "tools/cli_test_util.h"

namespace {

using kvserve::testing::Cli;
using kvserve::testing::CliRun;

int Lines(const std::string& s) { return int(std::count(s.begin(), s.end(), '\n')); }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One folder per test process: CTest runs these tests in parallel.
    dir_ = ::testing::TempDir() + "/kvserve_cli_test_" + std::to_string(::getpid());
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string P(const std::string& f) { return dir_ + "/" + f; }
  std::string dir_;
};

TEST_F(CliTest, HelpForEveryCommand) {
  for (const char* c : {"--help", "info --help", "kv synth --help", "kv capture --help", "codec encode --help",
                        "codec decode --help", "codec compare --help", "codec bench --help", "generate --help",
                        "eval --help", "model info --help", "model heads --help", "calib lowrank --help"}) {
    CliRun r = Cli(c);
    EXPECT_EQ(r.code, 0) << c << "\n" << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << c;
  }
  CliRun info = Cli("info");
  EXPECT_EQ(info.code, 0);
  EXPECT_NE(info.out.find("quant"), std::string::npos);
  EXPECT_NE(info.out.find("kbits      1..8"), std::string::npos);
}

TEST_F(CliTest, SynthEncodeDecodeCompare) {
  ASSERT_EQ(Cli("kv synth --shape stories260k --tokens 100 --seed 3 -o " + P("a.kvf")).code, 0);
  CliRun e = Cli("codec encode -s 'quant(kbits=4,vbits=4)|zstd' -i " + P("a.kvf") + " -o " + P("b.kvf"));
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_NE(e.out.find("x), encode"), std::string::npos);
  ASSERT_EQ(Cli("codec decode -i " + P("b.kvf") + " -o " + P("c.kvf")).code, 0);
  CliRun c = Cli("codec compare " + P("a.kvf") + " " + P("c.kvf") + " --json");
  ASSERT_EQ(c.code, 0) << c.out;
  auto j = nlohmann::json::parse(c.out);
  EXPECT_GT(j["k"]["snr_db"].get<double>(), 15);
  EXPECT_LT(j["k"]["snr_db"].get<double>(), 200);
  EXPECT_GT(j["v"]["cosine"].get<double>(), 0.95);
  // Comparing a file with itself is exact.
  j = nlohmann::json::parse(Cli("codec compare " + P("a.kvf") + " " + P("a.kvf") + " --json").out);
  EXPECT_EQ(j["k"]["max_abs"].get<double>(), 0);
}

TEST_F(CliTest, ErrorsAreOneLineAndLeaveNoOutput) {
  ASSERT_EQ(Cli("kv synth --shape stories260k --tokens 20 -o " + P("a.kvf")).code, 0);
  CliRun bad_spec = Cli("codec encode -s 'quant(kbit=2)' -i " + P("a.kvf") + " -o " + P("o.kvf"));
  EXPECT_EQ(bad_spec.code, 1);
  EXPECT_EQ(Lines(bad_spec.out), 1) << bad_spec.out;
  EXPECT_NE(bad_spec.out.find("no parameter 'kbit'"), std::string::npos);
  CliRun missing = Cli("codec encode -s quant -i " + P("nope.kvf") + " -o " + P("o.kvf"));
  EXPECT_EQ(missing.code, 1);
  EXPECT_EQ(Lines(missing.out), 1) << missing.out;
  EXPECT_NE(missing.out.find("nope.kvf"), std::string::npos);
  // A corrupt frame.
  std::filesystem::copy_file(P("a.kvf"), P("bad.kvf"));
  {
    std::fstream f(P("bad.kvf"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  CliRun corrupt = Cli("codec decode -i " + P("bad.kvf") + " -o " + P("o.kvf"));
  EXPECT_EQ(corrupt.code, 1);
  EXPECT_EQ(Lines(corrupt.out), 1) << corrupt.out;
  EXPECT_NE(corrupt.out.find("checksum mismatch"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(P("o.kvf")));
  // Bad flags.
  CliRun flag = Cli("codec bench --tokens lots");
  EXPECT_EQ(flag.code, 2);
  EXPECT_EQ(Lines(flag.out), 1) << flag.out;
  CliRun shape = Cli("kv synth --shape gpt9 -o " + P("z.kvf"));
  EXPECT_EQ(shape.code, 1);
  EXPECT_NE(shape.out.find("unknown shape preset 'gpt9'"), std::string::npos);
}

// KVSERVE_SIMD caps the kernels' tier (the frames do not change); a bad name is one clear error.
TEST_F(CliTest, SimdCapFromTheEnvironment) {
  CliRun r = Cli("info", "KVSERVE_SIMD=baseline");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("simd: baseline kernels"), std::string::npos) << r.out;
  r = Cli("info", "KVSERVE_SIMD=sse9");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("KVSERVE_SIMD: simd tier 'sse9' unknown (baseline, avx2, avx512)"), std::string::npos) << r.out;
}

TEST_F(CliTest, BenchJsonHasTheDocumentedKeys) {
  CliRun r = Cli("codec bench --tokens 16 --runs 1 -s 'quant(kbits=2,vbits=2)' --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["memcpy_gbps"].get<double>(), 0);
  for (const char* k : {"encode_gbps", "decode_gbps", "ratio"}) EXPECT_GT(j["zstd"][k].get<double>(), 0) << k;
  ASSERT_EQ(j["strategies"].size(), 1u);
  for (const char* k : {"encode_gbps", "decode_gbps", "ratio", "snr_db_k", "snr_db_v"})
    EXPECT_GT(j["strategies"][0][k].get<double>(), 0) << k;
  for (const char* k : {"payload", "zstd_bytes", "rans_bytes", "zstd_decode_gbps", "rans_decode_gbps"})
    EXPECT_TRUE(j["entropy"].contains(k)) << k;
  // 16 tokens x 128 dims per slab: K = 512 B codes + 128 x 4 B ranges, V = 512 B codes + 16 x 4
  // groups x 4 B ranges, against 2 x 4096 B of fp16: 8192 / 1792 = 4.571.
  EXPECT_NEAR(j["strategies"][0]["ratio"].get<double>(), 8192.0 / 1792, 0.01);
}

TEST_F(CliTest, BenchThreadSweepReportsEachPointAndItsScaling) {
  CliRun r = Cli("codec bench --tokens 16 --runs 1 --threads 1,2 -s 'quant(kbits=2,vbits=2)' --json");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["threads"].get<int>(), 1);  // the top level is the first point
  ASSERT_EQ(j["sweep"].size(), 2u);
  EXPECT_EQ(j["sweep"][1]["threads"].get<int>(), 2);
  // The first point is its own baseline; the second's scaling is its speed over the first's.
  EXPECT_DOUBLE_EQ(j["sweep"][0]["strategies"][0]["encode_scaling"].get<double>(), 1.0);
  const auto& s0 = j["sweep"][0]["strategies"][0];
  const auto& s1 = j["sweep"][1]["strategies"][0];
  EXPECT_NEAR(s1["decode_scaling"].get<double>(),
              s1["decode_gbps"].get<double>() / s0["decode_gbps"].get<double>(), 1e-9);
  EXPECT_GT(j["sweep"][1]["entropy"]["rans_encode_scaling"].get<double>(), 0);
  EXPECT_EQ(j["sweep"][1]["entropy"]["rans_bytes"], j["entropy"]["rans_bytes"]);  // threads never change the frame
  // The serving path: per-layer frames of the same strategy, with their speed over the block's.
  const auto& layer = j["strategies"][0]["per_layer"];
  EXPECT_GT(layer["encode_gbps"].get<double>(), 0);
  EXPECT_NEAR(layer["decode_vs_block"].get<double>(),
              layer["decode_gbps"].get<double>() / j["strategies"][0]["decode_gbps"].get<double>(), 1e-9);
  EXPECT_GT(layer["frame_bytes"].get<uint64_t>(), 0u);
  CliRun whole = Cli("codec bench --tokens 16 --runs 1 --no-per-layer -s 'quant(kbits=2,vbits=2)' --json");
  ASSERT_EQ(whole.code, 0) << whole.out;
  EXPECT_FALSE(nlohmann::json::parse(whole.out)["strategies"][0].contains("per_layer"));
}

TEST_F(CliTest, ModelCommands) {
  setenv("KVSERVE_CACHE", P("cache").c_str(), 1);
  CliRun g = Cli("generate -m babyllama105 -n 40");
  ASSERT_EQ(g.code, 0) << g.out;
  EXPECT_NE(g.out.find("Once upon a time, there was"), std::string::npos) << g.out;
  CliRun ids = Cli("generate -m stories260K --tokens 1 -n 5 --ids");
  EXPECT_NE(ids.out.find("403 407 261 378 432"), std::string::npos) << ids.out;
  CliRun e = Cli("eval -m babyllama105 --contexts 2 -s none --json");
  ASSERT_EQ(e.code, 0) << e.out;
  auto j = nlohmann::json::parse(e.out);
  EXPECT_EQ(j["relative_accuracy"].get<double>(), 1.0);
  EXPECT_EQ(j["top1_agreement"].get<double>(), 1.0);
  EXPECT_EQ(j["kl"].get<double>(), 0.0);
  EXPECT_EQ(j["contexts"].get<int>(), 2);
  EXPECT_EQ(j["positions"].get<int>(), 2 * 63);
  for (const char* k : {"strategy", "relative_accuracy_se", "ppl_ratio", "greedy_match", "ratio", "seconds"})
    EXPECT_TRUE(j.contains(k)) << k;
  CliRun h = Cli("model heads -m babyllama105 --contexts 2 --json");
  ASSERT_EQ(h.code, 0) << h.out;
  EXPECT_EQ(nlohmann::json::parse(h.out)["heads"].size(), 20u);
  CliRun c = Cli("kv capture -m stories260K --prompt 'Once upon a time' -o " + P("p.kvf"));
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("5x4x5x8 f16"), std::string::npos) << c.out;
  // An engine's FP8 cache: codes with a scale per layer and K/V, kept in the file.
  CliRun c8 = Cli("kv capture -m stories260K --prompt 'Once upon a time' --dtype e4m3 --fp8-scale tensor -o " + P("p8.kvf"));
  ASSERT_EQ(c8.code, 0) << c8.out;
  EXPECT_NE(c8.out.find("e4m3 scaled per tensor"), std::string::npos) << c8.out;
  EXPECT_EQ(kvserve::ReadKvFile(P("p8.kvf")).value().fp8_scales().scale.size(), 10u);
  CliRun s8 = Cli("kv synth --shape stories260k --tokens 32 --dtype e5m2 --fp8-scale head -o " + P("s8.kvf"));
  ASSERT_EQ(s8.code, 0) << s8.out;
  EXPECT_EQ(kvserve::ReadKvFile(P("s8.kvf")).value().fp8_scales().scale.size(), 40u);
  CliRun bad8 = Cli("kv synth --dtype f16 --fp8-scale head -o " + P("x8.kvf"));
  EXPECT_EQ(bad8.code, 1);
  EXPECT_NE(bad8.out.find("need an FP8 dtype"), std::string::npos) << bad8.out;
  CliRun badg = Cli("kv synth --dtype e4m3 --fp8-scale channel -o " + P("x8.kvf"));
  EXPECT_NE(badg.out.find("'channel' is not none, tensor or head"), std::string::npos) << badg.out;
  CliRun bad = Cli("eval -m nosuch -s none");
  EXPECT_EQ(bad.code, 1);
  EXPECT_EQ(Lines(bad.out), 1) << bad.out;
  CliRun badspec = Cli("eval -m stories260K -s 'quant(kbits=0)'");
  EXPECT_EQ(badspec.code, 1);
  EXPECT_NE(badspec.out.find("kbits=0 out of range"), std::string::npos);
  unsetenv("KVSERVE_CACHE");
}

}  // namespace
