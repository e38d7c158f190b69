// Strategy spec parsing and canonical printing. The registry's ParamSpecs are the only source of
// which keys and values a stage accepts.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "codec/stage.h"
#include "kvserve/codec.h"

namespace kvserve {
namespace {

class Lexer {
 public:
  explicit Lexer(std::string_view s) : s_(s) {}
  void SkipSpace() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool AtEnd() { SkipSpace(); return i_ >= s_.size(); }
  bool Consume(char c) {
    SkipSpace();
    if (i_ < s_.size() && s_[i_] == c) { ++i_; return true; }
    return false;
  }
  char Peek() { SkipSpace(); return i_ < s_.size() ? s_[i_] : '\0'; }
  // Identifiers and values: letters, digits, '_', '-', '.', '+'.
  std::string_view Word() {
    SkipSpace();
    size_t b = i_;
    while (i_ < s_.size()) {
      char c = s_[i_];
      if (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == '+') ++i_;
      else break;
    }
    return s_.substr(b, i_ - b);
  }
  size_t pos() const { return i_ + 1; }  // 1-based, as a person counts

 private:
  std::string_view s_;
  size_t i_ = 0;
};

Status SpecError(size_t pos, const std::string& what) {
  return Status::InvalidArgument("strategy position " + std::to_string(pos) + ": " + what);
}

std::string FormatFloat(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// Checks `value` against `p` and returns its canonical text.
Result<std::string> CanonicalValue(const StageInfo& stage, const ParamSpec& p, std::string_view value, size_t pos) {
  auto out_of_range = [&]() {
    return SpecError(pos, "stage '" + stage.name + "' parameter " + p.name + "=" + std::string(value) +
                              " out of range (expected " + p.RangeText() + ")");
  };
  switch (p.type) {
    case ParamSpec::Type::kInt: {
      long long v = 0;
      const char* b = value.data();
      const char* e = value.data() + value.size();
      if (!value.empty() && *b == '+') ++b;
      auto r = std::from_chars(b, e, v);
      if (value.empty() || r.ec != std::errc() || r.ptr != e) {
        return SpecError(pos, "stage '" + stage.name + "' parameter " + p.name + "='" + std::string(value) +
                                  "' is not an integer (expected " + p.RangeText() + ")");
      }
      if (v < p.min || v > p.max) return out_of_range();
      return std::to_string(v);
    }
    case ParamSpec::Type::kFloat: {
      std::string tmp(value);
      char* end = nullptr;
      double v = std::strtod(tmp.c_str(), &end);
      if (tmp.empty() || end != tmp.c_str() + tmp.size() || !std::isfinite(v)) {
        return SpecError(pos, "stage '" + stage.name + "' parameter " + p.name + "='" + tmp +
                                  "' is not a number (expected " + p.RangeText() + ")");
      }
      if (v < p.min || v > p.max) return out_of_range();
      return FormatFloat(v);
    }
    case ParamSpec::Type::kList: {
      // "auto", or non-negative integers joined by '.'; a set is kept in ascending order
      // without repeats so that every set has one canonical text.
      if (value == "auto") return std::string("auto");
      std::vector<long long> v;
      size_t i = 0;
      while (i <= value.size()) {
        const size_t j = value.find('.', i);
        const std::string_view item = value.substr(i, j == std::string_view::npos ? std::string_view::npos : j - i);
        long long x = 0;
        auto r = std::from_chars(item.data(), item.data() + item.size(), x);
        if (item.empty() || r.ec != std::errc() || r.ptr != item.data() + item.size() || x < p.min || x > p.max) {
          return SpecError(pos, "stage '" + stage.name + "' parameter " + p.name + "='" + std::string(value) +
                                    "' is not 'auto' or a list of integers " + std::to_string((long long)p.min) +
                                    ".." + std::to_string((long long)p.max) + " joined by '.'");
        }
        v.push_back(x);
        if (j == std::string_view::npos) break;
        i = j + 1;
      }
      if (!p.sequence) {
        std::sort(v.begin(), v.end());
        v.erase(std::unique(v.begin(), v.end()), v.end());
      }
      std::string out;
      for (size_t k = 0; k < v.size(); ++k) out += (k ? "." : "") + std::to_string(v[k]);
      return out;
    }
    case ParamSpec::Type::kEnum:
      for (const auto& c : p.choices) {
        if (c == value) return c;
      }
      return SpecError(pos, "stage '" + stage.name + "' parameter " + p.name + "='" + std::string(value) +
                                "' is not one of " + p.RangeText());
  }
  return Status::Internal("unhandled parameter type");
}

Result<StageSpec> ParseStage(Lexer& lx) {
  const size_t name_pos = lx.pos();
  const std::string name(lx.Word());
  if (name.empty()) {
    char c = lx.Peek();
    return SpecError(name_pos, c ? std::string("expected a stage name, found '") + c + "'"
                                 : std::string("expected a stage name, found the end of the spec"));
  }
  const StageInfo* info = FindStageInfo(name);
  if (info == nullptr) {
    std::string known;
    for (const auto& s : RegisteredStages()) known += (known.empty() ? "" : ", ") + s.name;
    return SpecError(name_pos, "unknown stage '" + name + "' (known: none, " + known + ")");
  }
  std::vector<std::pair<std::string, std::string>> given;
  if (lx.Consume('(')) {
    if (!lx.Consume(')')) {
      while (true) {
        const size_t key_pos = lx.pos();
        const std::string key(lx.Word());
        if (key.empty()) return SpecError(key_pos, "expected a parameter name in stage '" + name + "'");
        const ParamSpec* p = info->FindParam(key);
        if (p == nullptr) {
          std::string known;
          for (const auto& q : info->params) known += (known.empty() ? "" : ", ") + q.name;
          return SpecError(key_pos, "stage '" + name + "' has no parameter '" + key + "' (known: " +
                                        (known.empty() ? "none" : known) + ")");
        }
        for (const auto& kv : given) {
          if (kv.first == key) return SpecError(key_pos, "stage '" + name + "' parameter '" + key + "' given twice");
        }
        if (!lx.Consume('=')) return SpecError(lx.pos(), "expected '=' after parameter '" + key + "'");
        const size_t value_pos = lx.pos();
        const std::string_view value = lx.Word();
        KV_ASSIGN_OR_RETURN(std::string canon, CanonicalValue(*info, *p, value, value_pos));
        given.emplace_back(key, std::move(canon));
        if (lx.Consume(')')) break;
        if (!lx.Consume(',')) {
          char c = lx.Peek();
          return SpecError(lx.pos(), std::string("expected ',' or ')' in stage '") + name + "', found " +
                                         (c ? std::string("'") + c + "'" : std::string("the end of the spec")));
        }
      }
    }
  }
  StageSpec st;
  st.name = name;
  for (const auto& p : info->params) {
    std::string v = p.default_value;
    for (const auto& kv : given) {
      if (kv.first == p.name) v = kv.second;
    }
    st.params.emplace_back(p.name, v);
  }
  return st;
}

}  // namespace

void StageSpec::Set(std::string_view key, std::string value) {
  for (auto& [k, v] : params) {
    if (k == key) v = std::move(value);
  }
}

const std::string& StageSpec::Get(std::string_view key) const {
  for (const auto& kv : params) {
    if (kv.first == key) return kv.second;
  }
  static const std::string kEmpty;
  return kEmpty;
}
int64_t StageSpec::GetInt(std::string_view key) const { return std::strtoll(Get(key).c_str(), nullptr, 10); }
double StageSpec::GetFloat(std::string_view key) const { return std::strtod(Get(key).c_str(), nullptr); }

std::string StageSpec::Canonical() const {
  if (params.empty()) return name;
  std::string s = name + "(";
  for (size_t i = 0; i < params.size(); ++i) {
    if (i) s += ',';
    s += params[i].first;
    s += '=';
    s += params[i].second;
  }
  return s + ")";
}

std::string StrategySpec::Canonical() const {
  if (stages.empty()) return "none";
  std::string s;
  for (size_t i = 0; i < stages.size(); ++i) {
    if (i) s += '|';
    s += stages[i].Canonical();
  }
  return s;
}

namespace {
// The grammar is printable ASCII. Anything else is named whole — a UTF-8 character as itself
// with its code point, other bytes in hex — so an error never prints half a character.
Status CheckCharacters(std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if ((c >= 0x20 && c < 0x7f) || c == '\t' || c == '\n' || c == '\r') continue;
    size_t len = c >= 0xf0 && c < 0xf5 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
    uint32_t cp = len == 4 ? c & 0x07 : len == 3 ? c & 0x0f : c & 0x1f;
    for (size_t k = 1; k < len; ++k) {
      const unsigned char n = i + k < text.size() ? static_cast<unsigned char>(text[i + k]) : 0;
      if ((n & 0xc0) != 0x80) { len = 0; break; }
      cp = (cp << 6) | (n & 0x3f);
    }
    if (c >= 0x80 && len > 1) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "U+%04X", cp);
      return SpecError(i + 1, "character '" + std::string(text.substr(i, len)) + "' (" + hex +
                                  ") is not part of the strategy grammar (ASCII stage names, parameters and '|')");
    }
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", c);
    return SpecError(i + 1, std::string("byte ") + hex + " is not a printable character of the strategy grammar");
  }
  return Status::Ok();
}
}  // namespace

Result<StrategySpec> ParseStrategy(std::string_view text) {
  KV_RETURN_IF_ERROR(CheckCharacters(text));
  Lexer lx(text);
  StrategySpec spec;
  if (lx.AtEnd()) return SpecError(1, "empty strategy (use 'none' for no compression)");
  {
    Lexer probe(text);
    if (probe.Word() == "none" && probe.AtEnd()) return spec;
  }
  DataKind kind = DataKind::kTensor;
  std::string producer = "the input KV";
  size_t index = 0;
  std::string selector;  // the token-selecting stage seen so far, if any
  while (true) {
    const size_t stage_pos = lx.pos();
    {
      Lexer probe = lx;
      if (probe.Word() == "none") return SpecError(stage_pos, "'none' must stand alone, not inside a chain");
    }
    KV_ASSIGN_OR_RETURN(StageSpec st, ParseStage(lx));
    const StageInfo* info = FindStageInfo(st.name);
    ++index;
    if (!KindAccepts(info->input, kind)) {
      return SpecError(stage_pos, "stage " + std::to_string(index) + " '" + st.name + "' consumes " +
                                      DataKindName(info->input) + ", but " + producer + " produces " +
                                      DataKindName(kind));
    }
    if (info->selects_tokens) {
      // Token scores describe the block's own tokens, and a second selection of the kept ones is
      // one selection with other parameters: one per strategy keeps frames simple to check.
      if (!selector.empty()) {
        return SpecError(stage_pos, "stage " + std::to_string(index) + " '" + st.name + "' selects tokens again after " +
                                        selector + "; a strategy has at most one token-selection stage");
      }
      selector = "stage " + std::to_string(index) + " '" + st.name + "'";
    }
    kind = info->output;
    producer = "stage " + std::to_string(index) + " '" + st.name + "'";
    spec.stages.push_back(std::move(st));
    if (lx.AtEnd()) break;
    if (!lx.Consume('|')) {
      return SpecError(lx.pos(), std::string("expected '|' between stages, found '") + lx.Peek() + "'");
    }
  }
  return spec;
}

Result<std::string> CanonicalStrategy(std::string_view text) {
  KV_ASSIGN_OR_RETURN(StrategySpec s, ParseStrategy(text));
  return s.Canonical();
}

}  // namespace kvserve
