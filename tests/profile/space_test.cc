// The search space: read from the registry, restricted by a space file, errors name the field.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "kvserve/codec.h"
#include "kvserve/profile.h"

namespace kvserve {
namespace {

TEST(SearchSpace, DefaultSpaceExpandsToValidDistinctStrategies) {
  const SearchSpace s = SearchSpace::Default();
  EXPECT_GT(s.candidates().size(), 100u);
  EXPECT_LT(s.candidates().size(), 400u);
  std::set<std::string> specs;
  for (const SpaceCandidate& c : s.candidates()) {
    EXPECT_TRUE(specs.insert(c.spec).second) << c.spec;
    auto canon = CanonicalStrategy(c.spec);
    ASSERT_TRUE(canon.ok()) << c.spec;
    EXPECT_EQ(canon.value(), c.spec);
    ASSERT_EQ(c.features.size(), s.feature_names().size());
    for (double f : c.features) {
      EXPECT_GE(f, 0.0);
      EXPECT_LE(f, 1.0);
    }
  }
}

TEST(SearchSpace, AllTakesTheRegistryRangeAndOneOfAndOptionalExpand) {
  auto s = SearchSpace::Parse(R"({"version":1,"templates":[{"stages":[
      {"stage":"quant","params":{"kbits":"all","vaxis":"all","group":64}},
      {"one_of":[{"stage":"rans"},{"stage":"zstd","params":{"level":[1,3]}}],"optional":true}]}]})");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s.value().candidates().size(), 8u * 2 * (1 + 2 + 1));  // kbits 1..8 from the registry
  // Features describe the lossy stages only: kbits scaled, vaxis one-hot; the coders (lossless
  // in the registry) are not GP inputs, and group does not vary.
  const auto& names = s.value().feature_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "quant.kbits"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "quant.vaxis=token"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "rans"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "zstd.level"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "quant.group"), names.end());
  // Strategies that differ only in lossless coding share a quality group: 8 x 2 groups of 4.
  std::map<uint32_t, int> group_size;
  for (const SpaceCandidate& c : s.value().candidates()) group_size[c.quality_group]++;
  EXPECT_EQ(group_size.size(), 16u);
  for (const auto& [g, n] : group_size) EXPECT_EQ(n, 4) << g;
  // kbits uses the registry's step scale 2^-bits: 1 bit -> 1, 2 bits -> ~0.5, 8 bits -> 0.
  const size_t k = std::find(names.begin(), names.end(), "quant.kbits") - names.begin();
  for (const SpaceCandidate& c : s.value().candidates()) {
    if (c.spec.find("kbits=1,") != std::string::npos) EXPECT_DOUBLE_EQ(c.features[k], 1.0);
    if (c.spec.find("kbits=8,") != std::string::npos) EXPECT_DOUBLE_EQ(c.features[k], 0.0);
    if (c.spec.find("kbits=2,") != std::string::npos) EXPECT_NEAR(c.features[k], (0.25 - 1.0 / 256) / (0.5 - 1.0 / 256), 1e-12);
  }
}

TEST(SearchSpace, ErrorsNameTheField) {
  struct Case {
    const char* json;
    const char* expect;
  } cases[] = {
      {"{", "not valid JSON"},
      {R"({"version":2,"templates":[]})", "version"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"nope"}]}]})", "templates[0].stages[0]: unknown stage 'nope'"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"quant","params":{"bits":[2]}}]}]})", "has no parameter 'bits'"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"quant","params":{"kbits":[9]}}]}]})", "kbits"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"quant","params":{"group":"all"}}]}]})", "list the values"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"rans"},{"stage":"quant"}]}]})", "templates[0]"},
      {R"({"version":1,"templates":[{"stages":[{"stage":"quant","params":{"kbits":{}}}]}]})", "kbits"},
  };
  for (const Case& c : cases) {
    auto s = SearchSpace::Parse(c.json, "space.json");
    ASSERT_FALSE(s.ok()) << c.json;
    EXPECT_NE(s.status().message().find(c.expect), std::string::npos) << s.status().ToString();
    EXPECT_EQ(s.status().message().rfind("space.json", 0), 0u) << s.status().ToString();
  }
}

}  // namespace
}  // namespace kvserve
