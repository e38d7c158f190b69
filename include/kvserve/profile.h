// The Bayesian profiling engine: the search space (read from the codec registry, restricted by a
// space file), Pareto/hypervolume, the Gaussian-process optimiser and the profile file it writes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/codec.h"
#include "kvserve/status.h"

namespace kvserve {

// ---- Search space -------------------------------------------------------------------------------
// A space file (JSON) lists templates; a template is a list of stage slots, a slot one stage
// (or `one_of` several, or `optional`), each parameter a list of values, one value, or "all"
// (every choice of an enum / every integer of a small range, as the registry declares them).
// Parameters not named keep the registry default. Every expanded strategy is type-checked.
struct SpaceCandidate {
  std::string spec;              // canonical strategy
  std::vector<double> features;  // GP encoding of its lossy stages: numbers scaled to [0,1], enums one-hot
  // Candidates that differ only in lossless stages (registry: StageInfo::lossless) decode to the
  // same KV, so they have the same quality: one evaluation answers the whole group.
  uint32_t quality_group = 0;
};

class SearchSpace {
 public:
  // `origin` names the file in errors.
  static Result<SearchSpace> Parse(std::string_view json_text, std::string_view origin = "space");
  static Result<SearchSpace> Load(const std::string& path);
  static SearchSpace Default();  // the built-in space of `kvserve profile run`

  const std::string& json() const { return json_; }  // as given (normalised JSON)
  const std::vector<SpaceCandidate>& candidates() const { return candidates_; }
  const std::vector<std::string>& feature_names() const { return feature_names_; }

 private:
  std::string json_;
  std::vector<SpaceCandidate> candidates_;
  std::vector<std::string> feature_names_;
};

// The three objectives of a strategy, each maximised: quality (relative accuracy), compression
// ratio, codec speed (GB/s).
struct Objectives {
  double quality = 0, ratio = 0, speed = 0;
};

// ---- Bayesian optimisation ----------------------------------------------------------------------
enum class SearchMode : uint8_t { kConstrained, kEhvi, kRandom };
const char* SearchModeName(SearchMode m);
Result<SearchMode> ParseSearchMode(std::string_view s);

// A candidate as the optimiser sees it: GP inputs and the cheap objectives, measured up front.
struct BoCandidate {
  std::string spec;
  std::vector<double> features;
  double ratio = 0;
  double encode_gbps = 0, decode_gbps = 0;
  int64_t quality_group = -1;  // same group = same quality; -1: a group of its own
  double speed() const;  // harmonic mean of encode and decode GB/s
};

// One quality evaluation, as logged.
struct BoObservation {
  uint32_t candidate = 0;
  double quality = 0, quality_se = 0, kl = 0;
  double acquisition = 0;  // value that chose it (0 for cold-start and random picks)
  double seconds = 0;      // evaluation time
  // Grid logs: the log entry whose evaluation this one shares (same quality group, so the same
  // decoded KV); -1 when this entry was evaluated itself.
  int64_t shared_from = -1;
};

struct BoOptions {
  SearchMode mode = SearchMode::kEhvi;
  uint32_t budget = 40;
  double floor = 0.97;
  uint64_t seed = 1;
  // Cold-start evaluations; 0 = the mode's default: 1 for ehvi (one group, then EHVI; more are
  // spread maximin over the GP inputs), 5 for constrained (KVServe: spread over the ratio range).
  uint32_t n_init = 0;
  // Observations below floor - censor are fitted as floor - censor: the GP need not model how
  // bad an infeasible strategy is, only that it is infeasible.
  double censor = 0.1;
  double explore = 0.5;  // constrained mode: initial weight of the sigma bonus, decays to 0
};

// ---- Profile file -----------------------------------------------------------------------------
inline constexpr int kProfileVersion = 1;

// Quality buckets of the profile library: [0, 0.96), [0.96, 0.99), [0.99, 1].
const char* QualityBucket(double quality);

struct ProfileEntry {
  std::string spec;
  double quality = 0, quality_se = 0, kl = 0;
  double ratio = 0, encode_gbps = 0, decode_gbps = 0;
  std::string bucket;
};

struct Profile {
  int version = kProfileVersion;
  std::string model, model_sha256;
  uint64_t eval_seed = 1;
  std::string machine;
  // Codec threads the speeds were measured with: the nodes' --threads (default 1) should match,
  // or the controller's latency model is off by their scaling.
  uint32_t speed_threads = 1;
  std::string space_json;  // the space, as a JSON text
  std::string mode;
  uint32_t budget = 0;
  uint64_t seed = 1;
  double floor = 0.97;
  Objectives reference;
  std::vector<BoCandidate> candidates;  // every candidate with its cheap objectives (for resume)
  std::vector<BoObservation> log;
  std::vector<ProfileEntry> pareto;  // feasible, non-dominated, by quality bucket then ratio
  double hypervolume = 0;
};

// Fills pareto and hypervolume from candidates and log.
void ComputeProfileFrontier(Profile* p);
std::string ProfileToJson(const Profile& p);
// `expect_sha256` (optional): the model the caller serves; another model's profile is refused.
Result<Profile> ProfileFromJson(std::string_view json, std::string_view origin = "profile",
                                std::string_view expect_sha256 = "");
Result<Profile> LoadProfile(const std::string& path, std::string_view expect_sha256 = "");
Status SaveProfile(const std::string& path, const Profile& p);
// One line naming the CPU and core count, for profile files and results.
std::string MachineDescription();
// Empty when the profile's speeds were measured with `node_threads` codec threads; else one
// line saying that the controller's latency predictions assume the profile's count.
std::string SpeedThreadsMismatch(const Profile& p, int node_threads);

// ---- Profiling runs (drive the codec and the evaluator) ------------------------------------------
class Evaluator;

struct ProfileRunOptions {
  BoOptions bo;
  bool grid = false;           // evaluate every candidate, in order (bo.mode/budget ignored)
  uint32_t speed_tokens = 128;  // llama3-8b synthetic block of this many tokens for codec speed
  int speed_runs = 3;           // median of this many encode/decode runs
  uint32_t speed_rounds = 5;    // rounds over every candidate; each keeps its rounds' median
  uint32_t speed_threads = 1;   // codec threads of the speed measurement (the nodes' --threads)
  uint32_t ratio_contexts = 4;  // prompt KVs of the evaluation set encoded for the ratio
  std::string out;              // written after every evaluation; an existing run there resumes
  CodecEnv codec_env;           // for the candidates' pipelines (lowrank bases)
};

struct ProfileProgress {
  const char* phase = "";  // "measure" (cheap objectives) or "evaluate"
  uint64_t done = 0, total = 0;
  double hypervolume = 0;
};
using ProfileProgressFn = std::function<void(const ProfileProgress&)>;

Result<Profile> RunProfile(Evaluator& ev, const SearchSpace& space, const ProfileRunOptions& opts,
                           const ProfileProgressFn& progress = nullptr);

}  // namespace kvserve
