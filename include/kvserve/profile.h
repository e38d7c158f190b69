// The Bayesian profiling engine: the search space (read from the codec registry, restricted by a
// space file), Pareto/hypervolume, the Gaussian-process optimiser and the profile file it writes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

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

// ---- Pareto and hypervolume ---------------------------------------------------------------------
// Every objective is maximised. The hypervolume is that of the region dominated by the points and
// dominating the reference point; points not strictly better than it in every objective add 0.
struct Objectives {
  double quality = 0, ratio = 0, speed = 0;
};
// Indices of the non-dominated points (duplicates: the first is kept).
std::vector<uint32_t> ParetoFront(const std::vector<Objectives>& points);
double Hypervolume3D(const std::vector<Objectives>& points, const Objectives& ref);
// Exact expected hypervolume improvement of a new point whose ratio and speed are known and whose
// quality is N(mean, sd^2), over the set `front` (sd = 0: the plain improvement).
double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref, double ratio,
                                      double speed, double quality_mean, double quality_sd);
// The same for several new points that share one uncertain quality given by its survival
// function P(Q >= t), which is 0 above `quality_max`; integrated numerically (Simpson).
double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref,
                                      const std::vector<std::pair<double, double>>& boxes,
                                      const std::function<double(double)>& survival, double quality_max);
// The same for several new points that share one uncertain quality: (ratio, speed) each.
double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref,
                                      const std::vector<std::pair<double, double>>& boxes, double quality_mean,
                                      double quality_sd);

// ---- Gaussian process -----------------------------------------------------------------------------
// Matérn-5/2 kernel with one length scale per input (ARD), a signal variance and a learned noise
// variance on top of each observation's known variance. Targets are standardised internally.
class GaussianProcess {
 public:
  struct Hyper {
    std::vector<double> log_length;  // per input dimension
    double log_signal_var = 0;       // of the standardised target
    double log_noise_var = -9;       // learned extra noise, standardised units
  };
  struct FitOptions {
    int restarts = 3;      // random restarts besides the starting point
    int max_evals = 120;   // per local optimisation
    uint64_t seed = 1;
    bool optimise = true;  // false: use `start` as is
  };

  // x: n rows of d inputs; obs_var: known noise variance per observation (may be empty).
  Status Fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y,
             const std::vector<double>& obs_var, const FitOptions& opts, const Hyper* start = nullptr);
  void Predict(const std::vector<double>& x, double* mean, double* var) const;
  double log_marginal_likelihood() const { return lml_; }
  const Hyper& hyper() const { return hyper_; }
  size_t size() const { return n_; }

 private:
  struct Impl;
  Hyper hyper_;
  double lml_ = 0;
  size_t n_ = 0, d_ = 0;
  double y_mean_ = 0, y_scale_ = 1;
  std::vector<double> x_;      // n*d
  std::vector<double> alpha_;  // K^-1 y (standardised)
  std::vector<double> chol_;   // lower Cholesky factor, n*n column-major
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
};

struct BoOptions {
  SearchMode mode = SearchMode::kEhvi;
  uint32_t budget = 40;
  double floor = 0.97;
  uint64_t seed = 1;
  // Cold-start evaluations; 0 = the mode's default: 2 for ehvi (a maximin pair over the GP
  // inputs), 5 for constrained (KVServe: spread over the ratio range).
  uint32_t n_init = 0;
  // Observations below floor - censor are fitted as floor - censor: the GP need not model how
  // bad an infeasible strategy is, only that it is infeasible.
  double censor = 0.1;
  double explore = 0.5;  // constrained mode: initial weight of the sigma bonus, decays to 0
};

// The reference point of every hypervolume kvserve reports: quality at the floor, ratio 1 (no
// compression), speed 0.
Objectives ReferencePoint(double floor);
Objectives CandidateObjectives(const BoCandidate& c, double quality);
// Every candidate whose quality the log determines (evaluated ones and their quality groups), with
// that quality; in candidate order.
std::vector<std::pair<uint32_t, double>> KnownQualities(const std::vector<BoCandidate>& cands,
                                                        const std::vector<BoObservation>& log);
// Hypervolume of the known candidates (feasible ones count; quality as observed).
double ObservedHypervolume(const std::vector<BoCandidate>& cands, const std::vector<BoObservation>& log, double floor);

// The acquisition value of every candidate after `obs` (-inf for observed ones), as the search
// would compute it at `step`; the search proposes the largest.
Result<std::vector<double>> AcquisitionValues(const std::vector<BoCandidate>& cands, const std::vector<BoObservation>& obs,
                                              const BoOptions& opts, uint32_t step);

using QualityOracle = std::function<Result<BoObservation>(uint32_t candidate)>;
using StepFn = std::function<Status(const std::vector<BoObservation>& log)>;

// Runs until `log` holds opts.budget observations. Entries already in `log` (an interrupted
// run) are replayed: the optimiser must propose the same candidates again, which it does for the
// same space, options and seed; a mismatch is an error. `on_step` runs after each new entry.
Status RunBayesianSearch(const std::vector<BoCandidate>& cands, const BoOptions& opts, const QualityOracle& oracle,
                         std::vector<BoObservation>* log, const StepFn& on_step = nullptr);

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

// ---- Profiling runs (drive the codec and the evaluator) ------------------------------------------
class Evaluator;

struct ProfileRunOptions {
  BoOptions bo;
  bool grid = false;           // evaluate every candidate, in order (bo.mode/budget ignored)
  uint32_t speed_tokens = 128;  // llama3-8b synthetic block of this many tokens for codec speed
  int speed_runs = 3;           // median of this many encode/decode runs
  uint32_t ratio_contexts = 4;  // prompt KVs of the evaluation set encoded for the ratio
  std::string out;              // written after every evaluation; an existing run there resumes
};

struct ProfileProgress {
  const char* phase = "";  // "measure" (cheap objectives) or "evaluate"
  uint64_t done = 0, total = 0;
  double hypervolume = 0;
};
using ProfileProgressFn = std::function<void(const ProfileProgress&)>;

// ---- Search against an exhaustive grid ---------------------------------------------------------
// Every query of the searches is answered from the grid profile's log (a lookup stands in for an
// evaluation; the search domain is the grid's candidates).
struct CompareOptions {
  std::vector<double> budget_fracs = {0.01, 0.02, 0.05, 0.10};
  uint32_t seeds = 5;
  std::vector<SearchMode> methods = {SearchMode::kEhvi, SearchMode::kConstrained, SearchMode::kRandom};
  uint32_t n_init = 0;  // 0: each mode's default
};
struct CompareResult {
  std::string method;
  uint32_t budget = 0;
  double budget_frac = 0;
  double hv_fraction_mean = 0, hv_fraction_min = 0;
  double frontier_recall_mean = 0;
};
struct CompareReport {
  uint32_t grid_evals = 0;
  double grid_hypervolume = 0;
  uint32_t grid_frontier = 0;  // feasible non-dominated grid points
  std::vector<CompareResult> results;
  // Mean hypervolume fraction after each evaluation, per method (for the plot), up to the
  // largest budget.
  std::vector<std::pair<std::string, std::vector<double>>> curves;
};
using CompareProgressFn = std::function<void(uint64_t done, uint64_t total)>;
Result<CompareReport> CompareOnGrid(const Profile& grid, const CompareOptions& opts,
                                    const CompareProgressFn& progress = nullptr);

Result<Profile> RunProfile(Evaluator& ev, const SearchSpace& space, const ProfileRunOptions& opts,
                           const ProfileProgressFn& progress = nullptr);

}  // namespace kvserve
