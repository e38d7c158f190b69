// The profile file: a versioned JSON record of one profiling run (model, space, every candidate's
// cheap objectives, the evaluation log) and the Pareto strategies the online controller reads.
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include <cmath>

#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "profile/json_text.h"
#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

using json = nlohmann::json;

Status FieldError(std::string_view origin, const std::string& field, const std::string& what) {
  return Status::InvalidArgument(std::string(origin) + ": " + field + ": " + what);
}

// Typed field access without exceptions.
template <typename T>
Status Get(std::string_view origin, const json& obj, const std::string& where, const char* key, T* out,
           bool required = true) {
  if (!obj.is_object() || !obj.contains(key)) {
    if (!required) return Status::Ok();
    return FieldError(origin, where + key, "missing");
  }
  const json& v = obj[key];
  if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return FieldError(origin, where + key, "want a string; got " + v.dump());
    *out = v.get<std::string>();
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v.is_number()) return FieldError(origin, where + key, "want a number; got " + v.dump());
    *out = v.get<double>();
    if (!std::isfinite(*out)) return FieldError(origin, where + key, "want a finite number; got " + v.dump());
  } else {
    if (!v.is_number_integer() || v.get<int64_t>() < 0) return FieldError(origin, where + key, "want a non-negative integer; got " + v.dump());
    *out = T(v.get<uint64_t>());
  }
  return Status::Ok();
}

// Relative accuracy can exceed 1 by noise (compressed KV scoring slightly better than exact);
// far above is a broken file, not a measurement.
constexpr double kMaxQuality = 1.05;

// The spec must parse: a profile naming an unknown stage would be recommended to the controller.
Status CheckSpec(std::string_view origin, const std::string& field, const std::string& spec) {
  Result<std::string> c = CanonicalStrategy(spec);
  if (!c.ok()) return FieldError(origin, field, "'" + spec + "' is not a strategy: " + c.status().message());
  return Status::Ok();
}

Status CheckQuality(std::string_view origin, const std::string& field, double quality) {
  if (!(quality >= 0 && quality <= kMaxQuality))
    return FieldError(origin, field, "want a relative accuracy in [0, " + std::to_string(kMaxQuality) + "]; got " +
                                         std::to_string(quality));
  return Status::Ok();
}

// quality: [0, kMaxQuality]; ratio >= 1 (1 = no compression); speeds > 0. Names the bad field.
Status CheckObjectives(std::string_view origin, const std::string& w, double quality, double ratio, double enc, double dec) {
  KV_RETURN_IF_ERROR(CheckQuality(origin, w + "quality", quality));
  if (!(ratio >= 1.0)) return FieldError(origin, w + "ratio", "want a compression ratio >= 1; got " + std::to_string(ratio));
  if (!(enc > 0)) return FieldError(origin, w + "encode_gbps", "want a speed > 0; got " + std::to_string(enc));
  if (!(dec > 0)) return FieldError(origin, w + "decode_gbps", "want a speed > 0; got " + std::to_string(dec));
  return Status::Ok();
}

int64_t GroupKey(const Profile& p, uint32_t i) {
  const int64_t g = p.candidates[i].quality_group;
  return g >= 0 ? g : -1 - int64_t(i);
}

}  // namespace

const char* QualityBucket(double q) {
  if (q < 0.96) return "[0,0.96)";
  if (q < 0.99) return "[0.96,0.99)";
  return "[0.99,1]";
}

std::string MachineDescription() {
  std::string cpu = "unknown cpu";
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto p = line.find(':');
      if (p != std::string::npos) cpu = line.substr(p + 2);
      break;
    }
  }
  return cpu + ", " + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + " cores";
}

void ComputeProfileFrontier(Profile* p) {
  p->reference = ReferencePoint(p->floor);
  std::vector<Objectives> pts;
  std::vector<uint32_t> src;
  // Quality of every candidate the log determines (evaluated, or same quality group).
  std::map<int64_t, const BoObservation*> group_obs;
  for (const BoObservation& o : p->log)
    if (o.candidate < p->candidates.size()) group_obs[GroupKey(*p, o.candidate)] = &o;
  std::vector<const BoObservation*> obs_of(p->candidates.size(), nullptr);
  for (uint32_t i = 0; i < p->candidates.size(); ++i) {
    auto it = group_obs.find(GroupKey(*p, i));
    if (it == group_obs.end()) continue;
    const BoObservation& o = *it->second;
    obs_of[i] = &o;
    // Below the floor is infeasible; ratio <= 1 is no compression, which every controller has.
    if (o.quality < p->floor || p->candidates[i].ratio <= p->reference.ratio) continue;
    pts.push_back(CandidateObjectives(p->candidates[i], o.quality));
    src.push_back(i);
  }
  p->hypervolume = Hypervolume3D(pts, p->reference);
  p->pareto.clear();
  for (uint32_t k : ParetoFront(pts)) {
    const BoObservation& o = *obs_of[src[k]];
    const BoCandidate& c = p->candidates[src[k]];
    p->pareto.push_back({c.spec, o.quality, o.quality_se, o.kl, c.ratio, c.encode_gbps, c.decode_gbps, QualityBucket(o.quality)});
  }
  std::sort(p->pareto.begin(), p->pareto.end(), [](const ProfileEntry& a, const ProfileEntry& b) {
    if (a.bucket != b.bucket) return a.quality > b.quality;
    return a.ratio > b.ratio;
  });
}

std::string SpeedThreadsMismatch(const Profile& p, int node_threads) {
  if (node_threads == int(p.speed_threads)) return "";
  return "profile speeds were measured with " + std::to_string(p.speed_threads) + " codec thread(s), this node runs " +
         std::to_string(node_threads) + ": the controller's latency predictions assume " +
         std::to_string(p.speed_threads) + " (the bandit corrects what it observes; re-profile with --speed-threads " +
         std::to_string(node_threads) + " to start right)";
}

std::string ProfileToJson(const Profile& p) {
  json j;
  j["version"] = p.version;
  j["model"] = p.model;
  j["model_sha256"] = p.model_sha256;
  j["eval_seed"] = p.eval_seed;
  j["machine"] = p.machine;
  j["speed_threads"] = p.speed_threads;
  j["mode"] = p.mode;
  j["budget"] = p.budget;
  j["seed"] = p.seed;
  j["floor"] = p.floor;
  j["reference_point"] = {{"quality", p.reference.quality}, {"ratio", p.reference.ratio}, {"speed_gbps", p.reference.speed}};
  j["hypervolume"] = p.hypervolume;
  json space = json::parse(p.space_json.empty() ? "null" : p.space_json, nullptr, false);
  j["space"] = space.is_discarded() ? json(nullptr) : space;
  j["pareto"] = json::array();
  for (const ProfileEntry& e : p.pareto)
    j["pareto"].push_back({{"spec", e.spec}, {"quality", e.quality}, {"quality_se", e.quality_se}, {"kl", e.kl},
                           {"ratio", e.ratio}, {"encode_gbps", e.encode_gbps}, {"decode_gbps", e.decode_gbps},
                           {"bucket", e.bucket}});
  j["candidates"] = json::array();
  for (const BoCandidate& c : p.candidates)
    j["candidates"].push_back({{"spec", c.spec}, {"ratio", c.ratio}, {"encode_gbps", c.encode_gbps},
                               {"decode_gbps", c.decode_gbps}, {"quality_group", c.quality_group}});
  j["log"] = json::array();
  uint32_t shared = 0;
  for (const BoObservation& o : p.log) {
    json e = {{"candidate", o.candidate}, {"spec", o.candidate < p.candidates.size() ? p.candidates[o.candidate].spec : ""},
              {"quality", o.quality}, {"quality_se", o.quality_se}, {"kl", o.kl},
              {"acquisition", o.acquisition}, {"seconds", o.seconds}};
    if (o.shared_from >= 0) e["shared_from"] = o.shared_from, ++shared;
    j["log"].push_back(std::move(e));
  }
  if (p.mode == "grid") {
    j["grid_note"] = "one evaluation per quality group (strategies differing only in lossless stages decode to the "
                     "same KV): " + std::to_string(p.log.size() - shared) + " of " + std::to_string(p.log.size()) +
                     " log entries were evaluated; an entry with shared_from copies that entry's result";
  }
  return j.dump(1) + "\n";
}

Result<Profile> ProfileFromJson(std::string_view text, std::string_view origin, std::string_view expect_sha256) {
  KV_ASSIGN_OR_RETURN(json j, ParseJsonText(text, origin));
  if (!j.is_object()) return FieldError(origin, "file", "want a JSON object; got " + std::string(j.type_name()));
  Profile p;
  int64_t version = 0;
  KV_RETURN_IF_ERROR(Get(origin, j, "", "version", &version));
  if (version != kProfileVersion)
    return FieldError(origin, "version", "format version " + std::to_string(version) + " is not supported (this kvserve reads " +
                                             std::to_string(kProfileVersion) + ")");
  KV_RETURN_IF_ERROR(Get(origin, j, "", "model_sha256", &p.model_sha256));
  if (!expect_sha256.empty() && p.model_sha256 != expect_sha256)
    return FieldError(origin, "model_sha256", "profile is for model " + p.model_sha256.substr(0, 16) + "…, not " +
                                                  std::string(expect_sha256.substr(0, 16)) + "… (profile this model)");
  KV_RETURN_IF_ERROR(Get(origin, j, "", "model", &p.model, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "eval_seed", &p.eval_seed, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "machine", &p.machine, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "speed_threads", &p.speed_threads, false));  // absent: 1, as before
  if (p.speed_threads < 1 || p.speed_threads > 256)
    return FieldError(origin, "speed_threads", "want codec threads in [1, 256]; got " + std::to_string(p.speed_threads));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "mode", &p.mode, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "budget", &p.budget, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "seed", &p.seed, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "floor", &p.floor, false));
  KV_RETURN_IF_ERROR(Get(origin, j, "", "hypervolume", &p.hypervolume, false));
  if (!(p.floor > 0 && p.floor <= kMaxQuality))
    return FieldError(origin, "floor", "want a quality floor in (0, " + std::to_string(kMaxQuality) + "]; got " + std::to_string(p.floor));
  if (j.contains("space") && !j["space"].is_null()) p.space_json = j["space"].dump();
  p.reference = ReferencePoint(p.floor);
  if (!j.contains("pareto") || !j["pareto"].is_array()) return FieldError(origin, "pareto", "missing or not a list");
  for (size_t i = 0; i < j["pareto"].size(); ++i) {
    const json& e = j["pareto"][i];
    const std::string w = "pareto[" + std::to_string(i) + "].";
    ProfileEntry pe;
    KV_RETURN_IF_ERROR(Get(origin, e, w, "spec", &pe.spec));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "quality", &pe.quality));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "ratio", &pe.ratio));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "encode_gbps", &pe.encode_gbps));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "decode_gbps", &pe.decode_gbps));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "quality_se", &pe.quality_se, false));
    KV_RETURN_IF_ERROR(Get(origin, e, w, "kl", &pe.kl, false));
    KV_RETURN_IF_ERROR(CheckSpec(origin, w + "spec", pe.spec));
    KV_RETURN_IF_ERROR(CheckObjectives(origin, w, pe.quality, pe.ratio, pe.encode_gbps, pe.decode_gbps));
    if (!(pe.quality_se >= 0)) return FieldError(origin, w + "quality_se", "want >= 0; got " + std::to_string(pe.quality_se));
    pe.bucket = QualityBucket(pe.quality);
    p.pareto.push_back(std::move(pe));
  }
  if (j.contains("candidates") && j["candidates"].is_array()) {
    for (size_t i = 0; i < j["candidates"].size(); ++i) {
      const json& e = j["candidates"][i];
      const std::string w = "candidates[" + std::to_string(i) + "].";
      BoCandidate c;
      KV_RETURN_IF_ERROR(Get(origin, e, w, "spec", &c.spec));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "ratio", &c.ratio));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "encode_gbps", &c.encode_gbps));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "decode_gbps", &c.decode_gbps));
      KV_RETURN_IF_ERROR(CheckSpec(origin, w + "spec", c.spec));
      KV_RETURN_IF_ERROR(CheckObjectives(origin, w, 0, c.ratio, c.encode_gbps, c.decode_gbps));
      if (e.contains("quality_group") && e["quality_group"].is_number_integer()) c.quality_group = e["quality_group"].get<int64_t>();
      p.candidates.push_back(std::move(c));
    }
  }
  if (j.contains("log") && j["log"].is_array()) {
    for (size_t i = 0; i < j["log"].size(); ++i) {
      const json& e = j["log"][i];
      const std::string w = "log[" + std::to_string(i) + "].";
      BoObservation o;
      KV_RETURN_IF_ERROR(Get(origin, e, w, "candidate", &o.candidate));
      if (o.candidate >= p.candidates.size())
        return FieldError(origin, w + "candidate", std::to_string(o.candidate) + " is not one of the " +
                                                       std::to_string(p.candidates.size()) + " candidates");
      KV_RETURN_IF_ERROR(Get(origin, e, w, "quality", &o.quality));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "quality_se", &o.quality_se, false));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "kl", &o.kl, false));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "acquisition", &o.acquisition, false));
      KV_RETURN_IF_ERROR(Get(origin, e, w, "seconds", &o.seconds, false));
      KV_RETURN_IF_ERROR(CheckQuality(origin, w + "quality", o.quality));
      if (e.contains("shared_from")) {
        uint64_t from = 0;
        KV_RETURN_IF_ERROR(Get(origin, e, w, "shared_from", &from));
        if (from >= i) return FieldError(origin, w + "shared_from", "want an earlier log entry; got " + std::to_string(from));
        o.shared_from = int64_t(from);
      }
      p.log.push_back(o);
    }
  }
  return p;
}

Result<Profile> LoadProfile(const std::string& path, std::string_view expect_sha256) {
  KV_ASSIGN_OR_RETURN(ByteBuffer bytes, ReadFile(path));
  return ProfileFromJson(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path, expect_sha256);
}

Status SaveProfile(const std::string& path, const Profile& p) {
  const std::string text = ProfileToJson(p);
  return WriteFileAtomic(path, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

}  // namespace kvserve
