// A profiling run on the real (small) model, end to end: the profile file it writes, and an
// interrupted run resumed from its file equals an uninterrupted one.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "kvserve/eval.h"
#include "kvserve/profile.h"
#include "model/model_test_util.h"

namespace kvserve {
namespace {

constexpr const char* kSpace = R"({"version":1,"templates":[{"stages":[
  {"stage":"quant","params":{"kbits":[2,4],"vbits":[2,4],"vaxis":"channel","group":64}},
  {"stage":"rans","optional":true}]}]})";

class RunnerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvserve_runner_" + std::to_string(::getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    EvalOptions o;
    o.n_contexts = 8;
    ev_ = Evaluator::Create(testing::Stories(), o).value();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  ProfileRunOptions Options(const std::string& out, uint32_t budget) {
    ProfileRunOptions o;
    o.bo.budget = budget;
    o.bo.seed = 3;
    o.speed_tokens = 16;
    o.speed_runs = 1;
    o.speed_rounds = 1;
    o.out = out;
    return o;
  }
  std::string dir_;
  std::unique_ptr<Evaluator> ev_;
};

TEST_F(RunnerTest, WritesAProfileAndResumes) {
  const SearchSpace space = SearchSpace::Parse(kSpace).value();
  ASSERT_EQ(space.candidates().size(), 8u);  // 4 quality groups of 2
  const std::string a = dir_ + "/a.json", b = dir_ + "/b.json";
  auto full = RunProfile(*ev_, space, Options(a, 3));
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  auto loaded = LoadProfile(a, testing::Stories().sha256);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  EXPECT_EQ(loaded.value().log.size(), 3u);
  EXPECT_EQ(loaded.value().model_sha256, testing::Stories().sha256);
  EXPECT_FALSE(loaded.value().pareto.empty());
  for (const ProfileEntry& e : loaded.value().pareto) {
    EXPECT_GE(e.quality, 0.97);
    EXPECT_GT(e.ratio, 1.0);
  }
  EXPECT_FALSE(LoadProfile(a, std::string(64, '0')).ok());  // another model's profile

  // Interrupted after 2 evaluations (the file as it stood then: the measurements and the first
  // two log entries), then the same command again.
  Profile cut = loaded.value();
  cut.log.resize(2);
  ComputeProfileFrontier(&cut);
  ASSERT_TRUE(SaveProfile(b, cut).ok());
  auto resumed = RunProfile(*ev_, space, Options(b, 3));
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  ASSERT_EQ(resumed.value().log.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(resumed.value().log[i].candidate, full.value().log[i].candidate);
    EXPECT_DOUBLE_EQ(resumed.value().log[i].quality, full.value().log[i].quality);
  }
  // Same file, another seed: refused rather than mixed.
  ProfileRunOptions other = Options(b, 3);
  other.bo.seed = 4;
  auto refused = RunProfile(*ev_, space, other);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("seed"), std::string::npos) << refused.status().ToString();
  // Speeds measured with another codec thread count are not mixed either.
  ProfileRunOptions threads = Options(b, 3);
  threads.speed_threads = 2;
  refused = RunProfile(*ev_, space, threads);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("codec thread count"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(resumed.value().speed_threads, 1u);
}

// Codec speeds are measured in rounds, every candidate once per round (slow machine noise then
// falls on all candidates alike rather than on those measured during it), each keeping the median.
TEST_F(RunnerTest, MeasuresSpeedsInRoundsOverEveryCandidate) {
  const SearchSpace space = SearchSpace::Parse(kSpace).value();
  ProfileRunOptions o = Options("", 1);
  o.speed_rounds = 3;
  std::vector<uint64_t> done;
  uint64_t total = 0;
  auto p = RunProfile(*ev_, space, o, [&](const ProfileProgress& pr) {
    if (std::string(pr.phase) != "measure") return;
    done.push_back(pr.done);
    total = pr.total;
  });
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(total, 3 * space.candidates().size());
  ASSERT_EQ(done.size(), total);
  for (size_t i = 0; i < done.size(); ++i) EXPECT_EQ(done[i], i + 1);
  for (const BoCandidate& c : p.value().candidates) {
    EXPECT_GT(c.encode_gbps, 0) << c.spec;
    EXPECT_GT(c.decode_gbps, 0) << c.spec;
  }
}

}  // namespace
}  // namespace kvserve
