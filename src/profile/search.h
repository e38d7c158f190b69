// Internal: the profiler's search machinery — Pareto/hypervolume, expected hypervolume
// improvement, the Gaussian process, acquisition and the search loop, and the comparison of
// searches on an exhaustive grid. The public API (kvserve/profile.h) is the space, the run and
// the profile file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kvserve/profile.h"

namespace kvserve {

// ---- Pareto and hypervolume ---------------------------------------------------------------------
// Every objective is maximised. The hypervolume is that of the region dominated by the points and
// dominating the reference point; points not strictly better than it in every objective add 0.
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

}  // namespace kvserve
