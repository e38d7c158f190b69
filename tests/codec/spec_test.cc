// Strategy spec grammar: canonical form, errors that name the position, stage type-checking.
#include <gtest/gtest.h>

#include <random>

#include "kvserve/codec.h"

namespace kvserve {
namespace {

TEST(Spec, CanonicalFillsDefaultsInRegistryOrder) {
  EXPECT_EQ(CanonicalStrategy("quant(vbits=2, kbits=3) | zstd").value(),
            "quant(kbits=3,vbits=2,kaxis=channel,vaxis=token,group=32,residual=0,boost_layers=0,boost_bits=1)|zstd(level=3)");
  EXPECT_EQ(CanonicalStrategy("  none ").value(), "none");
  EXPECT_EQ(CanonicalStrategy("cast()").value(), "cast(dtype=f16)");
  EXPECT_EQ(CanonicalStrategy("quant(kbits=+4)").value(),
            "quant(kbits=4,vbits=4,kaxis=channel,vaxis=token,group=32,residual=0,boost_layers=0,boost_bits=1)");
}

TEST(Spec, IssueExampleParses) {
  auto c = CanonicalStrategy("quant(kbits=2,kaxis=channel,vbits=2,vaxis=token,group=32,residual=64)|zstd(level=3)");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c.value(), "quant(kbits=2,vbits=2,kaxis=channel,vaxis=token,group=32,residual=64,boost_layers=0,boost_bits=1)|zstd(level=3)");
}

void ExpectError(const std::string& spec, const std::string& fragment) {
  auto r = ParseStrategy(spec);
  ASSERT_FALSE(r.ok()) << spec;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(fragment), std::string::npos)
      << "spec: " << spec << "\nmessage: " << r.status().message() << "\nwanted: " << fragment;
}

TEST(Spec, ErrorsNamePositionKeyAndValue) {
  ExpectError("quant(kbit=2)", "position 7: stage 'quant' has no parameter 'kbit'");
  ExpectError("quant(kbits=9)", "kbits=9 out of range (expected 1..8)");
  ExpectError("quant(kbits=two)", "kbits='two' is not an integer");
  ExpectError("quant(kaxis=row)", "kaxis='row' is not one of channel|token");
  ExpectError("quantize(kbits=2)", "position 1: unknown stage 'quantize'");
  ExpectError("quant(kbits=2", "expected ',' or ')'");
  ExpectError("quant(kbits=2,kbits=3)", "given twice");
  ExpectError("quant(kbits 2)", "expected '='");
  ExpectError("quant zstd", "expected '|' between stages");
  ExpectError("", "empty strategy");
  ExpectError("quant|", "expected a stage name, found the end");
  ExpectError("none|zstd", "'none' must stand alone");
  ExpectError("zstd(level=0)", "level=0 out of range (expected 1..19)");
}

// Errors quote characters whole: a non-ASCII character is named as itself with its code point
// (it used to print its first byte alone, half a UTF-8 character), other bytes in hex.
TEST(Spec, NonAsciiIsNamedWholeNeverHalfACharacter) {
  ExpectError("quant|zstd\xc3\xa9", "position 11: character '\xc3\xa9' (U+00E9)");
  ExpectError("qu\xc3\xa4nt", "position 3: character '\xc3\xa4' (U+00E4)");
  ExpectError("quant(kbits=\xe2\x82\xac)", "character '\xe2\x82\xac' (U+20AC)");
  ExpectError("quant\xf0\x9f\x98\x80", "(U+1F600)");
  ExpectError("quant\xc3", "byte 0xc3 is not a printable character");  // cut in half
  ExpectError(std::string("quant\0", 6), "byte 0x00");
  ExpectError("quant\x7f", "byte 0x7f");
}

TEST(Spec, RejectsIllTypedOrders) {
  ExpectError("zstd", "stage 1 'zstd' consumes bytes, but the input KV produces tensor");
  ExpectError("quant|quant", "stage 2 'quant' consumes tensor, but stage 1 'quant' produces symbols");
  ExpectError("cast|quant", "stage 2 'quant' consumes tensor");
  ExpectError("quant|zstd|cast", "stage 3 'cast' consumes tensor");
  EXPECT_TRUE(ParseStrategy("quant|zstd|zstd").ok());  // type-checks, even if pointless
}

// Random specs built from the registry: canonical(canonical(s)) == canonical(s), and parsing the
// canonical form with shuffled keys and extra spaces gives it back.
TEST(Spec, RandomSpecsCanonicalIsAFixedPoint) {
  std::mt19937 rng(11);
  const auto& stages = RegisteredStages();
  for (int iter = 0; iter < 500; ++iter) {
    std::string spec;
    DataKind kind = DataKind::kTensor;
    int n = 1 + rng() % 3;
    bool selected = false;  // at most one token-selection stage
    for (int k = 0; k < n; ++k) {
      std::vector<const StageInfo*> fit;
      for (const auto& s : stages)
        if (KindAccepts(s.input, kind) && !(selected && s.selects_tokens)) fit.push_back(&s);
      if (fit.empty()) break;
      const StageInfo* st = fit[rng() % fit.size()];
      std::vector<std::string> kvs;
      for (const auto& p : st->params) {
        if (rng() % 2) continue;
        std::string v;
        if (p.type == ParamSpec::Type::kEnum) v = p.choices[rng() % p.choices.size()];
        else if (p.type == ParamSpec::Type::kList) v = rng() % 2 ? "auto" : "7.3.3.1";
        else if (p.type == ParamSpec::Type::kInt)
          v = std::to_string(int64_t(p.min) + int64_t(rng() % uint64_t(std::min(1000.0, p.max - p.min) + 1)));
        else v = std::to_string(p.min + (p.max - p.min) * (rng() % 1000) / 1000.0);
        kvs.push_back(p.name + " = " + v);
      }
      std::shuffle(kvs.begin(), kvs.end(), rng);
      if (k) spec += " | ";
      spec += st->name;
      if (!kvs.empty() || rng() % 2) {
        spec += "( ";
        for (size_t i = 0; i < kvs.size(); ++i) spec += (i ? " , " : "") + kvs[i];
        spec += " )";
      }
      kind = st->output;
      selected = selected || st->selects_tokens;
    }
    auto c1 = CanonicalStrategy(spec);
    ASSERT_TRUE(c1.ok()) << spec << ": " << c1.status().ToString();
    auto c2 = CanonicalStrategy(c1.value());
    ASSERT_TRUE(c2.ok());
    EXPECT_EQ(c1.value(), c2.value());
  }
}

TEST(Registry, DescribesEveryParameter) {
  for (const auto& s : RegisteredStages()) {
    EXPECT_FALSE(s.summary.empty()) << s.name;
    for (const auto& p : s.params) {
      EXPECT_FALSE(p.help.empty()) << s.name << "." << p.name;
      // The default itself must validate.
      auto r = ParseStrategy(s.input == DataKind::kTensor ? s.name + "(" + p.name + "=" + p.default_value + ")"
                                                          : "quant|" + s.name + "(" + p.name + "=" + p.default_value + ")");
      EXPECT_TRUE(r.ok()) << r.status().ToString();
    }
  }
}

}  // namespace
}  // namespace kvserve
