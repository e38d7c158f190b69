// The search space: read from the registry, restricted by a space file, errors name the field.
#include <gtest/gtest.h>

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
  // Features: presence of rans and zstd, kbits scaled, vaxis one-hot, zstd level scaled.
  const auto& names = s.value().feature_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "quant.kbits"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "quant.vaxis=token"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "rans"), names.end());
  EXPECT_EQ(std::find(names.begin(), names.end(), "quant.group"), names.end());  // does not vary
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
