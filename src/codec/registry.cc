// The stage registry: the one list of stages, their typed parameter descriptions and factories.
// Adding a stage = one file defining a StageRegistration + one line here.
#include "codec/stage.h"

namespace kvserve {

const std::vector<StageRegistration>& StageRegistry() {
  static const std::vector<StageRegistration> kRegistry = {
      PruneStageRegistration(),
      RotateStageRegistration(),
      DeltaStageRegistration(),
      LowRankStageRegistration(),
      CastStageRegistration(),
      FpSplitStageRegistration(),
      QuantStageRegistration(),
      Fp8StageRegistration(),
      MixHqStageRegistration(),
      ZstdStageRegistration(),
      RansStageRegistration(),
  };
  return kRegistry;
}

const std::vector<StageInfo>& RegisteredStages() {
  static const std::vector<StageInfo> kInfos = [] {
    std::vector<StageInfo> v;
    for (const auto& r : StageRegistry()) v.push_back(r.info);
    return v;
  }();
  return kInfos;
}

const StageInfo* FindStageInfo(std::string_view name) {
  for (const auto& info : RegisteredStages()) {
    if (info.name == name) return &info;
  }
  return nullptr;
}

Result<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec, const CodecEnv& env) {
  for (const auto& r : StageRegistry()) {
    if (r.info.name == spec.name) return r.factory(spec, env);
  }
  return Status::NotFound("unknown stage '" + spec.name + "'");
}

const char* DataKindName(DataKind kind) {
  switch (kind) {
    case DataKind::kTensor: return "tensor";
    case DataKind::kBytes: return "bytes";
    case DataKind::kSymbols: return "symbols";
  }
  return "?";
}

bool KindAccepts(DataKind input, DataKind produced) {
  return input == produced || (input == DataKind::kBytes && produced == DataKind::kSymbols);
}

const ParamSpec* StageInfo::FindParam(std::string_view key) const {
  for (const auto& p : params) {
    if (p.name == key) return &p;
  }
  return nullptr;
}

std::string ParamSpec::RangeText() const {
  auto num = [](double v, bool integral) {
    if (integral) return std::to_string(static_cast<long long>(v));
    std::string s = std::to_string(v);
    while (s.size() > 1 && s.back() == '0') s.pop_back();
    if (s.back() == '.') s += '0';
    return s;
  };
  switch (type) {
    case Type::kInt: return num(min, true) + ".." + num(max, true);
    case Type::kFloat: return num(min, false) + ".." + num(max, false);
    case Type::kList: return "auto|i.j.k";
    case Type::kEnum: {
      std::string s;
      for (const auto& c : choices) s += (s.empty() ? "" : "|") + c;
      return s;
    }
  }
  return "";
}

}  // namespace kvserve
