// Profile file round trip and the errors a reader must give.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "kvserve/profile.h"

namespace kvserve {
namespace {

Profile Sample() {
  Profile p;
  p.model = "babyllama105";
  p.model_sha256 = std::string(64, 'a');
  p.eval_seed = 3;
  p.machine = "test machine";
  p.space_json = R"({"templates":[],"version":1})";
  p.mode = "ehvi";
  p.budget = 3;
  p.seed = 5;
  p.floor = 0.97;
  p.candidates = {{"quant(kbits=4)", {}, 3.2, 5.0, 9.0}, {"quant(kbits=2)", {}, 5.3, 5.5, 9.5}, {"cast", {}, 1.0, 10, 10}};
  p.log = {{0, 0.999, 0.001, 0.001, 0.0, 1.2}, {1, 0.975, 0.003, 0.02, 0.5, 1.1}, {2, 1.0, 0, 0, 0.2, 0.9}};
  ComputeProfileFrontier(&p);
  return p;
}

TEST(ProfileFile, RoundTrips) {
  const Profile p = Sample();
  ASSERT_EQ(p.pareto.size(), 2u);  // "cast" (ratio 1) is left to the controller's built-in `none`
  auto back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const Profile& q = back.value();
  EXPECT_EQ(q.model_sha256, p.model_sha256);
  EXPECT_EQ(q.space_json, p.space_json);
  EXPECT_EQ(q.mode, p.mode);
  EXPECT_EQ(q.seed, p.seed);
  ASSERT_EQ(q.pareto.size(), p.pareto.size());
  for (size_t i = 0; i < p.pareto.size(); ++i) {
    EXPECT_EQ(q.pareto[i].spec, p.pareto[i].spec);
    EXPECT_DOUBLE_EQ(q.pareto[i].quality, p.pareto[i].quality);
    EXPECT_DOUBLE_EQ(q.pareto[i].ratio, p.pareto[i].ratio);
    EXPECT_EQ(q.pareto[i].bucket, p.pareto[i].bucket);
  }
  ASSERT_EQ(q.log.size(), 3u);
  EXPECT_EQ(q.log[1].candidate, 1u);
  EXPECT_DOUBLE_EQ(q.log[1].quality, 0.975);
  ASSERT_EQ(q.candidates.size(), 3u);
  EXPECT_DOUBLE_EQ(q.candidates[1].decode_gbps, 9.5);
  EXPECT_EQ(ProfileToJson(q), ProfileToJson(p));
}

TEST(ProfileFile, RecordsTheCodecThreadsOfItsSpeeds) {
  Profile p = Sample();
  p.speed_threads = 2;
  nlohmann::json j = nlohmann::json::parse(ProfileToJson(p));
  EXPECT_EQ(j["speed_threads"], 2);
  EXPECT_EQ(ProfileFromJson(j.dump()).value().speed_threads, 2u);
  j.erase("speed_threads");  // files written before the field: speeds of one thread
  EXPECT_EQ(ProfileFromJson(j.dump()).value().speed_threads, 1u);
  EXPECT_EQ(SpeedThreadsMismatch(p, 2), "");
  const std::string note = SpeedThreadsMismatch(p, 1);
  EXPECT_NE(note.find("measured with 2 codec thread(s), this node runs 1"), std::string::npos) << note;
  EXPECT_NE(note.find("--speed-threads 1"), std::string::npos) << note;
  j["speed_threads"] = 0;
  auto bad = ProfileFromJson(j.dump(), "p.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("speed_threads"), std::string::npos) << bad.status().ToString();
}

TEST(ProfileFile, BucketsFollowTheProfileLibrary) {
  EXPECT_STREQ(QualityBucket(0.5), "[0,0.96)");
  EXPECT_STREQ(QualityBucket(0.96), "[0.96,0.99)");
  EXPECT_STREQ(QualityBucket(0.9899), "[0.96,0.99)");
  EXPECT_STREQ(QualityBucket(0.99), "[0.99,1]");
  EXPECT_STREQ(QualityBucket(1.01), "[0.99,1]");
}

TEST(ProfileFile, RefusesAnotherModelAndAnUnknownVersion) {
  const std::string text = ProfileToJson(Sample());
  auto other = ProfileFromJson(text, "p.json", std::string(64, 'b'));
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("model_sha256"), std::string::npos) << other.status().ToString();
  nlohmann::json j = nlohmann::json::parse(text);
  j["version"] = 2;
  auto bad = ProfileFromJson(j.dump(), "p.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("version 2"), std::string::npos) << bad.status().ToString();
  EXPECT_FALSE(ProfileFromJson("{", "p.json").ok());
  EXPECT_FALSE(ProfileFromJson(R"({"version":1,"model_sha256":"x","pareto":[{"spec":"q"}]})", "p.json").ok());
  auto wrong_type = ProfileFromJson(R"({"version":1,"model_sha256":"x","pareto":[{"spec":"q","quality":"high","ratio":2,"encode_gbps":1,"decode_gbps":1}]})", "p.json");
  ASSERT_FALSE(wrong_type.ok());
  EXPECT_NE(wrong_type.status().message().find("pareto[0].quality"), std::string::npos) << wrong_type.status().ToString();
}

}  // namespace
}  // namespace kvserve
