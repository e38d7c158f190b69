// The CLI against hostile input (the sweep recorded in docs/results/hostile_input.md): every case
// ends in one clear line and a non-zero exit, or in a correct result — never a crash, a hang, a
// partial output or a nonsense value reported as a result. Every command runs under a timeout.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "test_paths.h"
#include "tools/cli_test_util.h"

namespace {

namespace fs = std::filesystem;
using kvserve::testing::CliRun;

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvserve_bad_input_" + std::to_string(::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string P(const std::string& f) const { return dir_ + "/" + f; }
  static CliRun Run(const std::string& args, const std::string& prefix = "") {
    return kvserve::testing::Cli(args, prefix, 60);
  }
  // A failure as the CLI reports one: exit 1 (2 for a bad flag), one line naming the problem.
  static void ExpectOneLineError(const CliRun& r, const std::string& want, int code = 1) {
    EXPECT_EQ(r.code, code) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << "want '" << want << "' in: " << r.out;
  }
  void WriteText(const std::string& f, const std::string& text) const { std::ofstream(P(f), std::ios::binary) << text; }
  bool NoTempFiles() const {
    for (const auto& e : fs::directory_iterator(dir_))
      if (e.path().filename().string().find(".tmp.") != std::string::npos) return false;
    return true;
  }
  std::string dir_;
};

const std::string kModels = kvserve::ModelsDir();

TEST_F(BadInput, ModelFilesOfTheWrongSizeOrWithImpossibleHeaders) {
  std::ifstream in(kModels + "/stories260K.bin", std::ios::binary);
  std::string bin((std::istreambuf_iterator<char>(in)), {});
  WriteText("short.bin", bin.substr(0, bin.size() / 2));
  ExpectOneLineError(Run("model info -m " + P("short.bin") + " --tokenizer " + kModels + "/tok512.bin"), "bytes");
  WriteText("long.bin", bin + std::string(4096, '\0'));
  ExpectOneLineError(Run("model info -m " + P("long.bin") + " --tokenizer " + kModels + "/tok512.bin"), "bytes");
  std::string huge = bin.substr(0, 28);
  const int32_t dim = 1 << 30;
  std::memcpy(huge.data(), &dim, 4);
  WriteText("huge.bin", huge);
  ExpectOneLineError(Run("model info -m " + P("huge.bin") + " --tokenizer " + kModels + "/tok512.bin"), "dim");
  ExpectOneLineError(Run("model info -m /dev/zero"), "not a regular file");
}

TEST_F(BadInput, SizesAndThreadCountsOutsideTheirRange) {
  ExpectOneLineError(Run("kv synth --tokens 4000000000 -o " + P("x.kvf")), "--tokens", 2);
  ExpectOneLineError(Run("kv synth --tokens 0 -o " + P("x.kvf")), "--tokens", 2);
  ExpectOneLineError(Run("codec bench --tokens 0"), "--tokens", 2);
  ExpectOneLineError(Run("codec bench --runs 0"), "--runs", 2);
  ExpectOneLineError(Run("codec bench --threads 0"), "--threads", 2);
  ExpectOneLineError(Run("codec bench --threads 10000"), "--threads", 2);
  ExpectOneLineError(Run("eval --contexts 4000000000 -s none"), "--contexts", 2);
  ExpectOneLineError(Run("eval --threads -5 -s none"), "--threads", 2);
  ExpectOneLineError(Run("generate -t nan -p hi"), "--temperature", 2);
  ExpectOneLineError(Run("generate --top-p 2 -p hi"), "--top-p", 2);
  ExpectOneLineError(Run("control decide --slo-ms -5"), "--slo-ms", 2);
  ExpectOneLineError(Run("control decide --floor nan"), "--floor", 2);
  ExpectOneLineError(Run("control decide --kv-bytes-per-token -1"), "--kv-bytes-per-token", 2);
  ExpectOneLineError(Run("control simulate --prefill-tps -1"), "--prefill-tps", 2);
  ExpectOneLineError(Run("control simulate --codec-threads 0"), "--codec-threads", 2);
  // Within the flag's range but beyond the shape limit: refused before anything is allocated.
  ExpectOneLineError(Run("kv synth --tokens 16000000 -o " + P("x.kvf")), "above the limit");
  EXPECT_FALSE(fs::exists(P("x.kvf")));
}

TEST_F(BadInput, DevicesFifosAndDirectoriesAsInput) {
  ExpectOneLineError(Run("codec decode -i /dev/zero -o " + P("z.kvf")), "a character device, not a regular file");
  ASSERT_EQ(::mkfifo(P("fifo").c_str(), 0600), 0);
  ExpectOneLineError(Run("codec decode -i " + P("fifo") + " -o " + P("z.kvf")), "a FIFO, not a regular file");
  ExpectOneLineError(Run("codec decode -i " + dir_ + " -o " + P("z.kvf")), "a directory, not a regular file");
  ExpectOneLineError(Run("generate -p hi --tokenizer /dev/zero -m " + kModels + "/stories260K.bin"), "not a regular file");
  EXPECT_FALSE(fs::exists(P("z.kvf")));
}

TEST_F(BadInput, OutputEqualToInputAndConcurrentWriters) {
  ASSERT_EQ(Run("kv synth --shape stories260k --tokens 64 -o " + P("a.kvf")).code, 0);
  CliRun r = Run("codec encode -s 'quant(kbits=4,vbits=4)|rans' -i " + P("a.kvf") + " -o " + P("a.kvf"));
  EXPECT_EQ(r.code, 0) << r.out;
  r = Run("codec decode -i " + P("a.kvf") + " -o " + P("b.kvf"));
  EXPECT_EQ(r.code, 0) << r.out;
  // Eight writers of one output: it ends as one of their whole files.
  ASSERT_EQ(Run("kv synth --shape llama3-8b --tokens 64 -o " + P("big.kvf")).code, 0);
  std::string cmd = "cd " + dir_ + " && for i in 1 2 3 4 5 6 7 8; do timeout 60 " + std::string(KVSERVE_CLI) +
                    " codec encode -s \"quant(kbits=$i,vbits=$i)\" -i big.kvf -o out.kvf > /dev/null 2>&1 & done; wait";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  r = Run("codec decode -i " + P("out.kvf") + " -o " + P("back.kvf"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(NoTempFiles());
  // /dev/null as output stays a device.
  r = Run("codec encode -s quant -i " + P("a.kvf") + " -o /dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  struct stat st;
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(BadInput, KilledWritersLeaveNoPartialOutput) {
  // SIGKILL cannot be caught: the output is written to an unnamed file that only gets a name
  // once complete. SIGTERM is caught and the temp file removed. Either way: no output, or a
  // whole one, and no temp files.
  // Killed at several moments of a ~4 s synth + write, so some land in the write itself.
  const std::pair<const char*, const char*> kills[] = {{"KILL", "0.5"}, {"KILL", "1.5"}, {"KILL", "2.5"},
                                                       {"KILL", "3.5"}, {"TERM", "2.5"}};
  for (const auto& [sig, after] : kills) {
    const std::string out = P(std::string("killed_") + sig + after + ".kvf");
    const std::string cmd = "timeout -s " + std::string(sig) + " " + after + " " + std::string(KVSERVE_CLI) +
                            " kv synth --shape llama3-8b --tokens 2048 -o " + out + " > /dev/null 2>&1";
    (void)std::system(cmd.c_str());
    if (fs::exists(out)) {
      CliRun r = Run("codec decode -i " + out + " -o /dev/null");
      EXPECT_EQ(r.code, 0) << sig << "@" << after << ": a partial output: " << r.out;
    }
    EXPECT_TRUE(NoTempFiles()) << sig << "@" << after;
  }
}

TEST_F(BadInput, UnwritableOrCorruptCacheOnlyCostsTime) {
  WriteText("not_a_dir", "x");
  CliRun r = Run("eval -m stories260K --contexts 2 -s none --json", "KVSERVE_CACHE=" + P("not_a_dir"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"relative_accuracy\""), std::string::npos) << r.out;
}

TEST_F(BadInput, MalformedProfilesNameTheField) {
  const std::string good = R"J({"version": 1, "model_sha256": "aa", "floor": 0.97, "pareto": [)J"
                           R"J({"spec": "quant(kbits=4)", "quality": 0.99, "ratio": 3.2, "encode_gbps": 5, "decode_gbps": 9}]})J";
  WriteText("good.json", good);
  CliRun r = Run("control decide --profile " + P("good.json") + " --bandwidth-gbps 1");
  EXPECT_EQ(r.code, 0) << r.out;
  auto bad = [&](const std::string& from, const std::string& to, const std::string& want) {
    std::string text = good;
    text.replace(text.find(from), from.size(), to);
    WriteText("bad.json", text);
    ExpectOneLineError(Run("control decide --profile " + P("bad.json") + " --bandwidth-gbps 1"), want);
  };
  bad("\"quality\": 0.99", "\"quality\": NaN", "not valid JSON (byte");
  bad("\"ratio\": 3.2", "\"ratio\": -3.2", "pareto[0].ratio: want a compression ratio >= 1");
  bad("\"quality\": 0.99", "\"quality\": \"high\"", "pareto[0].quality: want a number");
  bad("\"quality\": 0.99", "\"quality\": 50.0", "pareto[0].quality: want a relative accuracy in [0, 1.05");
  bad("\"spec\": \"quant(kbits=4)\"", "\"spec\": \"zzz\"", "pareto[0].spec: 'zzz' is not a strategy");
  bad("\"encode_gbps\": 5", "\"encode_gbps\": 0", "pareto[0].encode_gbps: want a speed > 0");
  bad("\"floor\": 0.97", "\"floor\": -5", "floor: want a quality floor in (0, 1.05");
  // Nested 200,000 deep: refused before anything recurses.
  WriteText("deep.json", "{\"space\": " + std::string(200000, '[') + std::string(200000, ']') + "}");
  ExpectOneLineError(Run("control decide --profile " + P("deep.json") + " --bandwidth-gbps 1"), "nested deeper than 64");
}

TEST_F(BadInput, MalformedTracesAndWorkloadsNameTheLine) {
  auto trace = [&](const std::string& text, const std::string& want) {
    WriteText("t.csv", "time_s,gbps\n" + text);
    ExpectOneLineError(Run("control simulate --trace " + P("t.csv") + " --policy none"), want);
  };
  trace("0,10\n5,0\n", "t.csv:3: gbps");
  trace("0,10\n5,-1\n", "gbps '-1' is not a number in (0, 1e6]");
  trace("0,10\n5,2\n3,4\n", "goes back");
  trace("0,inf\n", "gbps 'inf'");
  auto work = [&](const std::string& text, const std::string& want) {
    WriteText("w.csv", "arrival_s,prompt_tokens,label,slo_ms,floor\n" + text);
    ExpectOneLineError(Run("control simulate --trace " + kvserve::SourceDir() + "/bench/traces/steady_10gbps.csv --workload " +
                           P("w.csv") + " --policy none"),
                       want);
  };
  work("1e300,100,chat,500,0.97\n", "arrival_s '1e300' is not a number in [0, 1e7]");
  work("0,100,chat,-5,0.97\n", "slo_ms '-5'");
  work("0,0,chat,500,0.97\n", "prompt_tokens '0'");
  work("2,100,chat,500,0.97\n1,100,chat,500,0.97\n", "goes back");
}

TEST_F(BadInput, MemoryThatIsNotThereIsAOneLineError) {
  // Under a 1.5 GiB address-space limit a 768 MiB block plus its frame does not fit.
  CliRun r = Run("kv synth --shape llama3-8b --tokens 6144 -o " + P("oom.kvf"), "ulimit -v 1500000;");
  ExpectOneLineError(r, "out of memory");
  EXPECT_FALSE(fs::exists(P("oom.kvf")));
}

// Frames with token selection decode to a KV file like any other (it used to fail: "the block
// already had tokens selected"), that file re-encodes, and a second selection is refused.
TEST_F(BadInput, PrunedFramesDecodeAndReencode) {
  for (const std::string& args : {"kv synth --shape stories260k --tokens 64 -o " + P("a.kvf"),
                                   "codec encode -i " + P("a.kvf") + " -s 'prune(keep=0.5,recent=8)|quant' -o " + P("p.kvf"),
                                   "codec decode -i " + P("p.kvf") + " -o " + P("b.kvf"),
                                   "codec encode -i " + P("b.kvf") + " -s 'quant|zstd' -o " + P("c.kvf"),
                                   "codec decode -i " + P("c.kvf") + " -o " + P("d.kvf")}) {
    const CliRun r = Run(args);
    ASSERT_EQ(r.code, 0) << args << "\n" << r.out;
  }
  ExpectOneLineError(Run("codec encode -i " + P("a.kvf") + " -s 'prune|prune(keep=0.2)' -o " + P("e.kvf")),
                     "at most one token-selection stage");
  ExpectOneLineError(Run("codec encode -i " + P("b.kvf") + " -s 'prune(recent=2)|quant' -o " + P("e.kvf")),
                     "already selected");
  EXPECT_FALSE(fs::exists(P("e.kvf")));
}

TEST_F(BadInput, NonAsciiSpecTextIsQuotedWhole) {
  ASSERT_EQ(Run("kv synth --shape stories260k --tokens 16 -o " + P("a.kvf")).code, 0);
  CliRun r = Run("codec encode -i " + P("a.kvf") + " -s 'quant|zstd\xc3\xa9' -o " + P("x.kvf"));
  ExpectOneLineError(r, "character '\xc3\xa9' (U+00E9)");
  r = Run("codec encode -i " + P("a.kvf") + " -s 'qu\xc3\xa4nt' -o " + P("x.kvf"));
  ExpectOneLineError(r, "position 3: character '\xc3\xa4' (U+00E4)");
}

// Output folders are checked when the flags are read: a missing one fails at once, not after the
// minutes of measuring that `profile run` or `eval --table` spend before writing.
TEST_F(BadInput, OutputFoldersAreCheckedBeforeAnyWork) {
  const std::string missing = P("missing/dir/");
  ExpectOneLineError(Run("profile run --budget 20 -o " + missing + "p.json"), "does not exist", 2);
  ExpectOneLineError(Run("eval --table --markdown " + missing + "t.md"), "does not exist", 2);
  ExpectOneLineError(Run("eval --table --svg " + missing + "t.svg"), "does not exist", 2);
  ExpectOneLineError(Run("eval --table --svg " + dir_), "is a directory", 2);
  ExpectOneLineError(Run("kv synth --tokens 8 -o " + missing + "a.kvf"), "does not exist", 2);
  WriteText("plain", "x");
  ExpectOneLineError(Run("kv synth --tokens 8 -o " + P("plain/a.kvf")), "is not a directory", 2);
}

// GGUF models: --tokenizer was ignored, and a file without output.weight silently ran with the
// embedding as its classifier. Now the tokenizer replaces the embedded one (or its error is
// reported) and the tied classifier is said.
TEST_F(BadInput, GgufTokenizerIsUsedAndATiedClassifierIsSaid) {
  const std::string gguf = kModels + "/tinyllamas-stories-260k-f32.gguf";
  ExpectOneLineError(Run("model info -m " + gguf + " --tokenizer " + P("nope.bin")), "nope.bin");
  CliRun r = Run("generate -m " + gguf + " --tokenizer " + kModels + "/tok512.bin -n 8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: tokenizer"), std::string::npos) << r.out;
  ExpectOneLineError(Run("model info -m " + gguf + " --tokenizer " + kModels + "/tok105.bin"), "tok105.bin");
  std::ifstream in(gguf, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const std::string name("\r\0\0\0output.weight", 17);  // the tensor's name as GGUF v1 stores it
  const size_t at = bytes.find(name);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, name.size(), std::string("\r\0\0\0outpux.weight", 17));
  WriteText("tied.gguf", bytes);
  r = Run("model info -m " + P("tied.gguf"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: '" + P("tied.gguf") + "' has no output.weight tensor"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("shared classifier"), std::string::npos) << r.out;
}

// A deep queue used to make every arrival rescan every request still in flight: 200,000
// simultaneous requests took over a minute. The replay is now linear in the requests.
TEST_F(BadInput, SimulateStaysLinearUnderADeepBacklog) {
  std::ofstream w(P("burst.csv"));
  w << "arrival_s,prompt_tokens,label,slo_ms,floor\n";
  for (int i = 0; i < 200000; ++i) w << "0,1000,chat,1000,0.97\n";
  w.close();
  CliRun r = Run("control simulate --trace " + kvserve::SourceDir() + "/bench/traces/steady_5gbps.csv --workload " +
                 P("burst.csv") + " --policy adaptive --json");
  ASSERT_EQ(r.code, 0) << r.out.substr(0, 400);
  EXPECT_NE(r.out.find("\"requests\": 200000"), std::string::npos) << r.out.substr(0, 400);
}

// The README says calibration data lives in $KVSERVE_CACHE/calib unless KVSERVE_CALIB says
// otherwise; it used to stay in the source tree whatever KVSERVE_CACHE said.
TEST_F(BadInput, KvserveCacheMovesTheCalibrationFolder) {
  CliRun r = Run("calib lowrank -m stories260K --contexts 2", "KVSERVE_CACHE=" + P("cache"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("saved in " + P("cache") + "/calib"), std::string::npos) << r.out;
  bool found = false;
  for (const auto& e : fs::directory_iterator(P("cache") + "/calib"))
    found = found || e.path().filename().string().rfind("lowrank-", 0) == 0;
  EXPECT_TRUE(found);
  r = Run("calib lowrank -m stories260K --contexts 2", "KVSERVE_CACHE=" + P("cache") + " KVSERVE_CALIB=" + P("elsewhere"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("saved in " + P("elsewhere")), std::string::npos) << r.out;
}

TEST_F(BadInput, VersionIsNotAnError) {
  CliRun r = Run("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "kvserve 0.1.0\n");
}

}  // namespace
