// The Bayesian search loop: cold start spread over the ratio range, then a GP on quality and one
// of two acquisitions — KVServe's constrained ratio x P(feasible), or exact EHVI in 3-D.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kv/rng.h"
#include "kvserve/profile.h"

namespace kvserve {
namespace {

double NormalCdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

// GP inputs: the space's features plus log(ratio), scaled to [0,1] over the candidates. The ratio
// is known for every candidate before any model run and is the best single predictor of quality.
std::vector<std::vector<double>> GpInputs(const std::vector<BoCandidate>& cands) {
  double lo = INFINITY, hi = -INFINITY;
  for (const BoCandidate& c : cands) {
    const double l = std::log(std::max(c.ratio, 1e-9));
    lo = std::min(lo, l), hi = std::max(hi, l);
  }
  std::vector<std::vector<double>> x;
  x.reserve(cands.size());
  for (const BoCandidate& c : cands) {
    std::vector<double> row = c.features;
    row.push_back(hi > lo ? (std::log(std::max(c.ratio, 1e-9)) - lo) / (hi - lo) : 0);
    x.push_back(std::move(row));
  }
  return x;
}


// Acquisition value of every candidate (-inf for those already observed) and the pick.
Result<std::vector<double>> Acquire(const std::vector<BoCandidate>& cands, const std::vector<std::vector<double>>& x,
                                    const std::vector<BoObservation>& obs, const BoOptions& opts, uint32_t step,
                                    uint32_t budget, uint32_t n_init, const GaussianProcess::FitOptions& fo,
                                    GaussianProcess::Hyper* hyper, bool* have_hyper, uint32_t* pick) {
  const uint32_t n = uint32_t(cands.size());
  std::vector<char> done(n, 0);
  std::vector<std::vector<double>> gx;
  std::vector<double> gy, gv;
  const double lowest = opts.floor - opts.censor;
  for (const BoObservation& o : obs) {
    done[o.candidate] = 1;
    gx.push_back(x[o.candidate]);
    gy.push_back(std::max(o.quality, lowest));
    gv.push_back(o.quality_se * o.quality_se);
  }
  GaussianProcess gp;
  KV_RETURN_IF_ERROR(gp.Fit(gx, gy, gv, fo, *have_hyper ? hyper : nullptr));
  *hyper = gp.hyper();
  *have_hyper = true;

  std::vector<Objectives> front_pts;
  for (const BoObservation& o : obs) front_pts.push_back(CandidateObjectives(cands[o.candidate], o.quality));
  std::vector<Objectives> front;
  for (uint32_t i : ParetoFront(front_pts)) front.push_back(front_pts[i]);
  double qsd_obs = 0, qmean = 0;
  for (double v : gy) qmean += v;
  qmean /= double(gy.size());
  for (double v : gy) qsd_obs += (v - qmean) * (v - qmean);
  qsd_obs = std::sqrt(qsd_obs / double(gy.size())) + 1e-6;
  const double decay = budget > n_init ? std::max(0.0, 1.0 - double(step - std::min(step, n_init)) / double(budget - n_init)) : 0.0;
  const double beta = opts.explore * decay;
  const Objectives ref = ReferencePoint(opts.floor);

  std::vector<double> values(n, -INFINITY);
  double best = -INFINITY, best_fallback = -INFINITY, best_sd = -1;
  uint32_t fallback = n;
  *pick = n;
  for (uint32_t i = 0; i < n; ++i) {
    if (done[i]) continue;
    double mu, var;
    gp.Predict(x[i], &mu, &var);
    const double sd = std::sqrt(var);
    const double pf = sd > 0 ? NormalCdf((mu - opts.floor) / sd) : (mu >= opts.floor ? 1.0 : 0.0);
    double a = cands[i].ratio * (pf + beta * sd / qsd_obs);
    if (opts.mode == SearchMode::kEhvi) {
      a = ExpectedHypervolumeImprovement(front, ref, cands[i].ratio, cands[i].speed(), mu, sd);
      if (cands[i].ratio * pf > best_fallback) best_fallback = cands[i].ratio * pf, fallback = i;
    }
    values[i] = a;
    if (a > best || (a == best && sd > best_sd)) best = a, best_sd = sd, *pick = i;
  }
  // EHVI vanishes when no candidate can improve the set; fall back to the feasible ratio.
  if (opts.mode == SearchMode::kEhvi && !(best > 0) && fallback < n) *pick = fallback;
  return values;
}

}  // namespace

double BoCandidate::speed() const {
  if (encode_gbps <= 0 || decode_gbps <= 0) return 0;
  return 2.0 / (1.0 / encode_gbps + 1.0 / decode_gbps);
}

const char* SearchModeName(SearchMode m) {
  switch (m) {
    case SearchMode::kConstrained: return "constrained";
    case SearchMode::kEhvi: return "ehvi";
    case SearchMode::kRandom: return "random";
  }
  return "?";
}

Result<SearchMode> ParseSearchMode(std::string_view s) {
  if (s == "constrained") return SearchMode::kConstrained;
  if (s == "ehvi") return SearchMode::kEhvi;
  if (s == "random") return SearchMode::kRandom;
  return Status::InvalidArgument("mode: unknown '" + std::string(s) + "' (want constrained, ehvi or random)");
}

Objectives ReferencePoint(double floor) { return {floor, 1.0, 0.0}; }

Objectives CandidateObjectives(const BoCandidate& c, double quality) { return {quality, c.ratio, c.speed()}; }

double ObservedHypervolume(const std::vector<BoCandidate>& cands, const std::vector<BoObservation>& log, double floor) {
  std::vector<Objectives> pts;
  for (const BoObservation& o : log) pts.push_back(CandidateObjectives(cands[o.candidate], o.quality));
  return Hypervolume3D(pts, ReferencePoint(floor));
}

Status RunBayesianSearch(const std::vector<BoCandidate>& cands, const BoOptions& opts, const QualityOracle& oracle,
                         std::vector<BoObservation>* log, const StepFn& on_step) {
  const uint32_t n = uint32_t(cands.size());
  if (n == 0) return Status::InvalidArgument("search: the space has no candidates");
  if (opts.budget == 0) return Status::InvalidArgument("search: budget must be at least 1");
  if (!(opts.floor > 0 && opts.floor <= 1.5)) return Status::InvalidArgument("search: floor " + std::to_string(opts.floor) + " is out of range");
  const uint32_t budget = std::min(opts.budget, n);
  const uint32_t n_init = std::max<uint32_t>(1, std::min(opts.n_init, budget));
  const std::vector<std::vector<double>> x = GpInputs(cands);

  // Cold-start order: quantiles of the ratio range, so the first points bracket the frontier.
  std::vector<uint32_t> by_ratio(n);
  std::iota(by_ratio.begin(), by_ratio.end(), 0);
  std::stable_sort(by_ratio.begin(), by_ratio.end(), [&](uint32_t a, uint32_t b) { return cands[a].ratio < cands[b].ratio; });

  Rng rng(opts.seed);
  std::vector<char> done(n, 0);
  std::vector<BoObservation> obs;
  GaussianProcess::Hyper hyper;
  bool have_hyper = false;

  for (uint32_t step = 0; step < budget; ++step) {
    uint32_t pick = n;
    double acq = 0;
    if (opts.mode == SearchMode::kRandom) {
      uint32_t left = n - step, k = uint32_t(rng.Uniform() * left);
      for (uint32_t i = 0; i < n; ++i)
        if (!done[i] && k-- == 0) { pick = i; break; }
    } else if (step < n_init) {
      const uint32_t at = std::min(n - 1, uint32_t((step + 0.5) / n_init * n));
      for (uint32_t off = 0; off < n && pick == n; ++off) {
        if (at + off < n && !done[by_ratio[at + off]]) pick = by_ratio[at + off];
        else if (off <= at && !done[by_ratio[at - off]]) pick = by_ratio[at - off];
      }
    } else {
      GaussianProcess::FitOptions fo;
      fo.seed = opts.seed * 1000003 + step;
      // Full restarts while the data is small or every 5th step; otherwise refine the last fit.
      fo.restarts = (step < 30 || step % 5 == 0) ? 2 : 0;
      KV_ASSIGN_OR_RETURN(std::vector<double> values,
                          Acquire(cands, x, obs, opts, step, budget, n_init, fo, &hyper, &have_hyper, &pick));
      acq = pick < n ? values[pick] : 0;
    }
    if (pick >= n) return Status::Internal("search: no candidate left to propose");
    done[pick] = 1;
    if (step < log->size()) {
      if ((*log)[step].candidate != pick)
        return Status::InvalidArgument("search: the log's entry " + std::to_string(step) + " is candidate " +
                                       std::to_string((*log)[step].candidate) + " but this run proposes " +
                                       std::to_string(pick) + " (different space, mode, floor or seed?)");
      obs.push_back((*log)[step]);
      continue;
    }
    KV_ASSIGN_OR_RETURN(BoObservation o, oracle(pick));
    o.candidate = pick;
    o.acquisition = acq;
    obs.push_back(o);
    log->push_back(o);
    if (on_step) KV_RETURN_IF_ERROR(on_step(*log));
  }
  return Status::Ok();
}

}  // namespace kvserve

namespace kvserve {
Result<std::vector<double>> AcquisitionValues(const std::vector<BoCandidate>& cands,
                                              const std::vector<BoObservation>& obs, const BoOptions& opts,
                                              uint32_t step) {
  if (obs.empty()) return Status::InvalidArgument("acquisition: needs at least one observation");
  for (const BoObservation& o : obs)
    if (o.candidate >= cands.size()) return Status::InvalidArgument("acquisition: observation of unknown candidate " + std::to_string(o.candidate));
  GaussianProcess::Hyper hyper;
  bool have = false;
  uint32_t pick;
  GaussianProcess::FitOptions fo;
  fo.seed = opts.seed;
  const uint32_t budget = std::min<uint32_t>(opts.budget, cands.size());
  return Acquire(cands, GpInputs(cands), obs, opts, step, budget, std::min(opts.n_init, budget), fo, &hyper, &have, &pick);
}
}  // namespace kvserve
