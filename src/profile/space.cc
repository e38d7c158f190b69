// The profiler's search space: stage kinds, parameters and their ranges come from the codec
// registry; a space file only restricts them (which stages, in which order, which values).
#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "profile/json_text.h"
#include "kvserve/profile.h"

namespace kvserve {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxCandidates = 200000;
constexpr int kMaxAllValues = 64;  // "all" on an integer range wider than this is refused

// The space of `kvserve profile run` when no --space is given: uniform quantisation over bits,
// axes and coders, token selection, head-wise mixed precision, rotation, FP8 (the format engines
// already trust) and the lossless float coder; ~200 strategies.
constexpr const char* kDefaultSpace = R"({
  "version": 1,
  "templates": [
    {"name": "quant", "stages": [
      {"stage": "quant", "params": {"kbits": [2, 3, 4, 6, 8], "vbits": [2, 3, 4, 6, 8],
                                    "kaxis": "channel", "vaxis": "all", "group": 64}},
      {"one_of": [{"stage": "rans"}, {"stage": "zstd"}], "optional": true}]},
    {"name": "prune", "stages": [
      {"stage": "prune", "params": {"sink": 4, "recent": 32, "keep": [0.25, 0.5, 0.75], "score": "attn"}},
      {"stage": "quant", "params": {"kbits": [2, 3, 4], "vbits": [2, 3, 4], "vaxis": "channel", "group": 64}},
      {"stage": "rans"}]},
    {"name": "mixhq", "stages": [
      {"stage": "mixhq", "params": {"lo_frac": [0.5, 0.8, 1.0], "kcoarse": [3, 6], "vcoarse": [2, 4]}},
      {"stage": "rans"}]},
    {"name": "rotate", "stages": [
      {"stage": "rotate"},
      {"stage": "quant", "params": {"kbits": [2, 3, 4], "vbits": [2, 3, 4]}},
      {"stage": "rans"}]},
    {"name": "fp8", "stages": [
      {"stage": "fp8", "params": {"format": "all"}},
      {"one_of": [{"stage": "rans"}, {"stage": "zstd"}], "optional": true}]},
    {"name": "lossless", "stages": [
      {"stage": "fpsplit"},
      {"one_of": [{"stage": "rans"}, {"stage": "zstd"}]}]}
  ]
})";

Status SpaceError(std::string_view origin, const std::string& where, const std::string& what) {
  return Status::InvalidArgument(std::string(origin) + ": " + where + ": " + what);
}

std::string ValueText(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  if (v.is_number()) {
    std::string s = Json(v.get<double>()).dump();
    return s;
  }
  return v.dump();
}

// The values a slot parameter takes, as text the strategy parser accepts.
Result<std::vector<std::string>> ParamValues(std::string_view origin, const std::string& where, const StageInfo& st,
                                             const std::string& key, const Json& v) {
  const ParamSpec* p = st.FindParam(key);
  if (!p) {
    std::string known;
    for (const ParamSpec& q : st.params) known += (known.empty() ? "" : ", ") + q.name;
    return SpaceError(origin, where, "stage '" + st.name + "' has no parameter '" + key + "' (it has " + known + ")");
  }
  std::vector<std::string> out;
  if (v.is_string() && v.get<std::string>() == "all") {
    if (p->type == ParamSpec::Type::kEnum) return p->choices;
    if (p->type == ParamSpec::Type::kInt && p->max - p->min < kMaxAllValues) {
      for (int64_t i = int64_t(p->min); i <= int64_t(p->max); ++i) out.push_back(std::to_string(i));
      return out;
    }
    return SpaceError(origin, where + "." + key,
                      "\"all\" needs an enum or an integer range of at most " + std::to_string(kMaxAllValues) +
                          " values; '" + key + "' is " + p->RangeText() + ": list the values");
  }
  if (v.is_array()) {
    if (v.empty()) return SpaceError(origin, where + "." + key, "empty list of values");
    for (const Json& e : v) {
      if (!e.is_string() && !e.is_number()) return SpaceError(origin, where + "." + key, "value " + e.dump() + " is not a number or a string");
      out.push_back(ValueText(e));
    }
    return out;
  }
  if (v.is_string() || v.is_number()) return std::vector<std::string>{ValueText(v)};
  return SpaceError(origin, where + "." + key, "want a value, a list of values or \"all\"; got " + v.dump());
}

// One way to fill a slot: a stage text ("quant(kbits=2,...)") or "" for an absent optional slot.
Result<std::vector<std::string>> ExpandStage(std::string_view origin, const std::string& where, const Json& e) {
  if (!e.is_object() || !e.contains("stage") || !e["stage"].is_string())
    return SpaceError(origin, where, "want {\"stage\": NAME, \"params\": {...}}; got " + e.dump());
  const std::string name = e["stage"].get<std::string>();
  const StageInfo* st = FindStageInfo(name);
  if (!st) return SpaceError(origin, where, "unknown stage '" + name + "' (kvserve info lists them)");
  std::vector<std::string> texts = {""};
  if (e.contains("params")) {
    if (!e["params"].is_object()) return SpaceError(origin, where + ".params", "want an object");
    for (auto it = e["params"].begin(); it != e["params"].end(); ++it) {
      KV_ASSIGN_OR_RETURN(auto values, ParamValues(origin, where + ".params", *st, it.key(), it.value()));
      std::vector<std::string> next;
      for (const std::string& t : texts)
        for (const std::string& v : values) next.push_back(t + (t.empty() ? "" : ",") + it.key() + "=" + v);
      texts = std::move(next);
    }
  }
  for (std::string& t : texts) t = name + (t.empty() ? "" : "(" + t + ")");
  return texts;
}

Result<std::vector<std::string>> ExpandSlot(std::string_view origin, const std::string& where, const Json& slot) {
  std::vector<std::string> out;
  if (slot.is_object() && slot.contains("one_of")) {
    if (!slot["one_of"].is_array() || slot["one_of"].empty()) return SpaceError(origin, where + ".one_of", "want a non-empty list");
    for (size_t i = 0; i < slot["one_of"].size(); ++i) {
      KV_ASSIGN_OR_RETURN(auto t, ExpandStage(origin, where + ".one_of[" + std::to_string(i) + "]", slot["one_of"][i]));
      out.insert(out.end(), t.begin(), t.end());
    }
  } else {
    KV_ASSIGN_OR_RETURN(out, ExpandStage(origin, where, slot));
  }
  if (slot.is_object() && slot.contains("optional")) {
    if (!slot["optional"].is_boolean()) return SpaceError(origin, where + ".optional", "want true or false");
    if (slot["optional"].get<bool>()) out.push_back("");
  }
  return out;
}

struct Expanded {
  std::string spec;
  uint32_t template_index;
  StrategySpec parsed;
};

bool IsNumber(const std::string& s, double* v) {
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return !s.empty() && end && *end == '\0';
}

// The registry's scale for the GP (ParamSpec::Scale), before min-max scaling over the space.
double Scaled(ParamSpec::Scale scale, double x) {
  switch (scale) {
    case ParamSpec::Scale::kLinear: return x;
    case ParamSpec::Scale::kLog: return std::log(std::max(x, 1e-9));
    case ParamSpec::Scale::kLog1p: return std::log1p(std::max(x, 0.0));
    case ParamSpec::Scale::kInverse: return 1.0 / std::max(x, 1e-9);
    case ParamSpec::Scale::kStep: return std::exp2(-x);
  }
  return x;
}

}  // namespace

Result<SearchSpace> SearchSpace::Parse(std::string_view text, std::string_view origin) {
  KV_ASSIGN_OR_RETURN(Json doc, ParseJsonText(text, origin));
  if (!doc.is_object()) return SpaceError(origin, "file", "want a JSON object");
  if (!doc.contains("version") || !doc["version"].is_number_integer() || doc["version"].get<int64_t>() != 1)
    return SpaceError(origin, "version", "want 1; got " + (doc.contains("version") ? doc["version"].dump() : "none"));
  if (!doc.contains("templates") || !doc["templates"].is_array() || doc["templates"].empty())
    return SpaceError(origin, "templates", "want a non-empty list");

  std::vector<Expanded> all;
  std::set<std::string> seen;
  const Json& templates = doc["templates"];
  for (size_t ti = 0; ti < templates.size(); ++ti) {
    const std::string where = "templates[" + std::to_string(ti) + "]";
    const Json& t = templates[ti];
    if (!t.is_object() || !t.contains("stages") || !t["stages"].is_array() || t["stages"].empty())
      return SpaceError(origin, where, "want {\"name\": ..., \"stages\": [slot, ...]}");
    std::vector<std::string> specs = {""};
    for (size_t si = 0; si < t["stages"].size(); ++si) {
      KV_ASSIGN_OR_RETURN(auto choices, ExpandSlot(origin, where + ".stages[" + std::to_string(si) + "]", t["stages"][si]));
      std::vector<std::string> next;
      for (const std::string& s : specs)
        for (const std::string& c : choices) next.push_back(c.empty() ? s : s.empty() ? c : s + "|" + c);
      specs = std::move(next);
      if (specs.size() > kMaxCandidates)
        return SpaceError(origin, where, "expands to more than " + std::to_string(kMaxCandidates) + " strategies");
    }
    for (const std::string& s : specs) {
      if (s.empty()) continue;
      auto parsed = ParseStrategy(s);
      if (!parsed.ok()) return SpaceError(origin, where, "'" + s + "': " + parsed.status().message());
      std::string canonical = parsed.value().Canonical();
      if (!seen.insert(canonical).second) continue;
      all.push_back({canonical, uint32_t(ti), std::move(parsed).value()});
    }
  }
  if (all.empty()) return SpaceError(origin, "templates", "expands to no strategy");
  if (all.size() > kMaxCandidates) return SpaceError(origin, "templates", "more than " + std::to_string(kMaxCandidates) + " strategies");

  // Features: template one-hot, stage presence, then per (stage, parameter) a scaled number or a
  // one-hot over the values that occur. Only what varies across the space becomes a feature.
  SearchSpace space;
  space.json_ = doc.dump();
  std::vector<std::string> stage_names;
  std::map<std::string, std::set<std::string>> values;  // "stage.key" -> values
  std::map<std::string, uint32_t> stage_count;
  // Lossless stages do not change quality, so they are not GP inputs (the GP models quality).
  auto lossless = [](const StageSpec& s) {
    const StageInfo* info = FindStageInfo(s.name);
    return info && info->lossless;
  };
  for (const Expanded& e : all) {
    for (const StageSpec& s : e.parsed.stages) {
      if (lossless(s)) continue;
      if (std::find(stage_names.begin(), stage_names.end(), s.name) == stage_names.end()) stage_names.push_back(s.name);
      stage_count[s.name]++;
      for (const auto& [k, v] : s.params) values[s.name + "." + k].insert(v);
    }
  }
  struct Feature {
    enum Kind { kTemplate, kPresence, kNumber, kOneHot } kind;
    std::string stage, key, value;
    uint32_t template_index = 0;
    double lo = 0, hi = 0;
    ParamSpec::Scale scale = ParamSpec::Scale::kLinear;
  };
  std::vector<Feature> feats;
  if (templates.size() > 1)
    for (uint32_t ti = 0; ti < templates.size(); ++ti) feats.push_back({Feature::kTemplate, "", "", "", ti});
  for (const std::string& name : stage_names)
    if (stage_count[name] < all.size()) feats.push_back({Feature::kPresence, name, "", ""});
  for (const std::string& name : stage_names) {
    const StageInfo* st = FindStageInfo(name);
    for (const ParamSpec& p : st->params) {
      const auto& vs = values[name + "." + p.name];
      if (vs.size() < 2) continue;
      const bool numeric = p.type == ParamSpec::Type::kInt || p.type == ParamSpec::Type::kFloat;
      if (numeric) {
        double lo = INFINITY, hi = -INFINITY, x;
        for (const std::string& v : vs)
          if (IsNumber(v, &x)) lo = std::min(lo, Scaled(p.scale, x)), hi = std::max(hi, Scaled(p.scale, x));
        feats.push_back({Feature::kNumber, name, p.name, "", 0, lo, hi, p.scale});
      } else {
        for (const std::string& v : vs) feats.push_back({Feature::kOneHot, name, p.name, v});
      }
    }
  }
  for (const Feature& f : feats) {
    switch (f.kind) {
      case Feature::kTemplate: space.feature_names_.push_back("template=" + std::to_string(f.template_index)); break;
      case Feature::kPresence: space.feature_names_.push_back(f.stage); break;
      case Feature::kNumber: space.feature_names_.push_back(f.stage + "." + f.key); break;
      case Feature::kOneHot: space.feature_names_.push_back(f.stage + "." + f.key + "=" + f.value); break;
    }
  }
  std::map<std::string, uint32_t> groups;
  for (const Expanded& e : all) {
    SpaceCandidate c;
    c.spec = e.spec;
    std::string lossy_key;
    for (const StageSpec& st : e.parsed.stages)
      if (!lossless(st)) lossy_key += (lossy_key.empty() ? "" : "|") + st.Canonical();
    c.quality_group = groups.emplace(lossy_key, uint32_t(groups.size())).first->second;
    for (const Feature& f : feats) {
      const StageSpec* s = nullptr;
      for (const StageSpec& st : e.parsed.stages)
        if (st.name == f.stage) s = &st;
      double x = 0;
      switch (f.kind) {
        case Feature::kTemplate: x = e.template_index == f.template_index; break;
        case Feature::kPresence: x = s != nullptr; break;
        case Feature::kNumber:
          if (s && IsNumber(s->Get(f.key), &x)) x = f.hi > f.lo ? (Scaled(f.scale, x) - f.lo) / (f.hi - f.lo) : 0;
          else x = 0;
          break;
        case Feature::kOneHot: x = s && s->Get(f.key) == f.value; break;
      }
      c.features.push_back(x);
    }
    space.candidates_.push_back(std::move(c));
  }
  return space;
}

Result<SearchSpace> SearchSpace::Load(const std::string& path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer bytes, ReadFile(path));
  return Parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path);
}

SearchSpace SearchSpace::Default() {
  auto s = Parse(kDefaultSpace, "default space");
  return std::move(s).value();  // the built-in space parses (tested)
}

}  // namespace kvserve
