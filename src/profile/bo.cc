// The Bayesian search loop: cold start, then a GP on quality and one of two acquisitions —
// KVServe's constrained ratio x P(feasible), or exact EHVI in 3-D. Candidates that differ only in
// lossless stages form one quality group: one evaluation answers all of them.
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "kv/rng.h"
#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

double NormalCdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

// The GP models y = -log(1 - q): quantisation error, and so 1 - q, shrinks geometrically with
// bits, and the feasible band near 1 is spread out instead of squeezed against the failures.
constexpr double kGapFloor = 0.002;  // q within 0.002 of 1 is indistinguishable from 1
double ToGp(double q) { return -std::log(std::max(1.0 - q, kGapFloor)); }

struct Groups {
  std::vector<uint32_t> of;                   // candidate -> dense group id
  std::vector<std::vector<uint32_t>> members;  // group -> candidates, ascending
};

Groups MakeGroups(const std::vector<BoCandidate>& cands) {
  Groups g;
  std::map<int64_t, uint32_t> ids;
  g.of.resize(cands.size());
  for (uint32_t i = 0; i < cands.size(); ++i) {
    const int64_t key = cands[i].quality_group >= 0 ? cands[i].quality_group : -1 - int64_t(i);
    auto [it, fresh] = ids.emplace(key, uint32_t(g.members.size()));
    if (fresh) g.members.emplace_back();
    g.of[i] = it->second;
    g.members[it->second].push_back(i);
  }
  return g;
}

// GP inputs per group: the space's (lossy) features plus log(ratio) scaled to [0,1], the ratio
// being the group's smallest (its members differ only in lossless coding). The ratio is known for
// every candidate before any model run and is the best single predictor of quality.
std::vector<std::vector<double>> GroupInputs(const std::vector<BoCandidate>& cands, const Groups& g) {
  std::vector<double> lr(g.members.size());
  double lo = INFINITY, hi = -INFINITY;
  for (size_t k = 0; k < g.members.size(); ++k) {
    double r = INFINITY;
    for (uint32_t i : g.members[k]) r = std::min(r, cands[i].ratio);
    lr[k] = std::log(std::max(r, 1e-9));
    lo = std::min(lo, lr[k]), hi = std::max(hi, lr[k]);
  }
  std::vector<std::vector<double>> x;
  for (size_t k = 0; k < g.members.size(); ++k) {
    std::vector<double> row = cands[g.members[k][0]].features;
    row.push_back(hi > lo ? (lr[k] - lo) / (hi - lo) : 0);
    x.push_back(std::move(row));
  }
  return x;
}

struct SearchState {
  const std::vector<BoCandidate>& cands;
  const Groups& groups;
  const std::vector<std::vector<double>>& x;
  const BoOptions& opts;
  uint32_t budget, n_init;
};

// Acquisition value of every group (-inf for evaluated ones); *pick = the candidate to evaluate.
Result<std::vector<double>> Acquire(const SearchState& s, const std::vector<BoObservation>& obs, uint32_t step,
                                    const GaussianProcess::FitOptions& fo, GaussianProcess::Hyper* hyper,
                                    bool* have_hyper, uint32_t* pick) {
  const BoOptions& opts = s.opts;
  const uint32_t n_groups = uint32_t(s.groups.members.size());
  std::vector<char> done(n_groups, 0);
  std::vector<std::vector<double>> gx;
  std::vector<double> gy, gv;
  const double lowest = opts.floor - opts.censor;
  for (const BoObservation& o : obs) {
    const uint32_t g = s.groups.of[o.candidate];
    done[g] = 1;
    gx.push_back(s.x[g]);
    const double q = std::max(o.quality, lowest);
    gy.push_back(ToGp(q));
    const double dydq = 1.0 / std::max(1.0 - q, kGapFloor);
    gv.push_back(o.quality_se * o.quality_se * dydq * dydq);
  }
  GaussianProcess gp;
  KV_RETURN_IF_ERROR(gp.Fit(gx, gy, gv, fo, *have_hyper ? hyper : nullptr));
  *hyper = gp.hyper();
  *have_hyper = true;

  std::vector<Objectives> known;
  for (const auto& [i, q] : KnownQualities(s.cands, obs)) known.push_back(CandidateObjectives(s.cands[i], q));
  std::vector<Objectives> front;
  for (uint32_t i : ParetoFront(known)) front.push_back(known[i]);
  double qsd_obs = 0, qmean = 0;
  for (double v : gy) qmean += v;
  qmean /= double(gy.size());
  for (double v : gy) qsd_obs += (v - qmean) * (v - qmean);
  qsd_obs = std::sqrt(qsd_obs / double(gy.size())) + 1e-6;
  const double decay = s.budget > s.n_init
                           ? std::max(0.0, 1.0 - double(step - std::min(step, s.n_init)) / double(s.budget - s.n_init))
                           : 0.0;
  const double beta = opts.explore * decay;
  const Objectives ref = ReferencePoint(opts.floor);

  std::vector<double> values(n_groups, -INFINITY);
  double best = -INFINITY, best_fallback = -INFINITY, best_sd = -1;
  uint32_t best_group = n_groups, fallback = n_groups;
  std::vector<std::pair<double, double>> boxes;
  for (uint32_t g = 0; g < n_groups; ++g) {
    if (done[g]) continue;
    double mu_y, var_y;
    gp.Predict(s.x[g], &mu_y, &var_y);
    const double sd_y = std::sqrt(var_y);
    const double y_floor = ToGp(opts.floor);
    const double pf = sd_y > 0 ? NormalCdf((mu_y - y_floor) / sd_y) : (mu_y >= y_floor ? 1.0 : 0.0);
    const double sd = std::exp(-mu_y) * sd_y;  // of Q, to first order (tie-break only)
    double ratio = 0;
    boxes.clear();
    for (uint32_t i : s.groups.members[g]) {
      ratio = std::max(ratio, s.cands[i].ratio);
      boxes.push_back({s.cands[i].ratio, s.cands[i].speed()});
    }
    double a = ratio * (pf + beta * sd_y / qsd_obs);
    if (opts.mode == SearchMode::kEhvi) {
      if (ratio * pf > best_fallback) best_fallback = ratio * pf, fallback = g;
      // Exact in the GP's space: P(Q >= t) = P(Y >= ToGp(t)); Q cannot exceed 1 - kGapFloor.
      auto survival = [&](double t) {
        return sd_y > 0 ? 1 - NormalCdf((ToGp(t) - mu_y) / sd_y) : (mu_y >= ToGp(t) ? 1.0 : 0.0);
      };
      a = ExpectedHypervolumeImprovement(front, ref, boxes, survival, 1 - kGapFloor);
    }
    values[g] = a;
    if (a > best || (a == best && sd > best_sd)) best = a, best_sd = sd, best_group = g;
  }
  // EHVI vanishes when no candidate can improve the set; fall back to the feasible ratio.
  if (opts.mode == SearchMode::kEhvi && !(best > 0) && fallback < n_groups) best_group = fallback;
  *pick = best_group < n_groups ? s.groups.members[best_group][0] : uint32_t(s.cands.size());
  return values;
}

// Cold-start order. constrained (KVServe): quantiles of the ratio range. ehvi: the group of
// median ratio (seed 1) or a random one; where more cold-start points are asked for, a maximin
// design over the GP inputs (each next group as far as possible from those chosen), so they
// cover templates and bit widths evenly. By default ehvi takes one: from the second evaluation on
// EHVI spends the budget better than a spread does (docs/PROFILER.md).
std::vector<uint32_t> ColdStartOrder(const std::vector<BoCandidate>& cands, const Groups& g,
                                     const std::vector<std::vector<double>>& x, SearchMode mode, uint32_t n_init,
                                     uint64_t seed) {
  const uint32_t n = uint32_t(cands.size());
  std::vector<uint32_t> by_ratio(n);
  std::iota(by_ratio.begin(), by_ratio.end(), 0);
  std::stable_sort(by_ratio.begin(), by_ratio.end(), [&](uint32_t a, uint32_t b) { return cands[a].ratio < cands[b].ratio; });
  std::vector<uint32_t> order;
  if (mode == SearchMode::kEhvi) {
    const size_t ng = g.members.size();
    std::vector<double> mind(ng, INFINITY);
    // The first point: seed 1 takes the median ratio, other seeds a random candidate.
    Rng rng(seed ^ 0xC01D57A27ull);
    uint32_t next = g.of[seed == 1 ? by_ratio[n / 2] : uint32_t(rng.Uniform() * n)];
    for (uint32_t k = 0; k < n_init && k < ng; ++k) {
      order.push_back(g.members[next][0]);
      double far = -1;
      uint32_t far_g = next;
      for (uint32_t j = 0; j < ng; ++j) {
        double d = 0;
        for (size_t f = 0; f < x[j].size(); ++f) d += (x[j][f] - x[next][f]) * (x[j][f] - x[next][f]);
        mind[j] = std::min(mind[j], d);
        if (mind[j] > far) far = mind[j], far_g = j;
      }
      next = far_g;
    }
  } else {
    for (uint32_t k = 0; k < n_init; ++k) order.push_back(by_ratio[std::min<size_t>(n - 1, size_t((k + 0.5) / n_init * n))]);
  }
  order.insert(order.end(), by_ratio.begin(), by_ratio.end());  // fallbacks when groups repeat
  return order;
}

uint32_t DefaultInit(const BoOptions& o) {
  if (o.n_init > 0) return o.n_init;
  return o.mode == SearchMode::kEhvi ? 1 : 5;
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

std::vector<std::pair<uint32_t, double>> KnownQualities(const std::vector<BoCandidate>& cands,
                                                        const std::vector<BoObservation>& log) {
  const Groups g = MakeGroups(cands);
  std::vector<double> q(cands.size(), NAN);
  for (const BoObservation& o : log)
    if (o.candidate < cands.size())
      for (uint32_t i : g.members[g.of[o.candidate]]) q[i] = o.quality;
  std::vector<std::pair<uint32_t, double>> out;
  for (uint32_t i = 0; i < cands.size(); ++i)
    if (!std::isnan(q[i])) out.push_back({i, q[i]});
  return out;
}

double ObservedHypervolume(const std::vector<BoCandidate>& cands, const std::vector<BoObservation>& log, double floor) {
  std::vector<Objectives> pts;
  for (const auto& [i, q] : KnownQualities(cands, log)) pts.push_back(CandidateObjectives(cands[i], q));
  return Hypervolume3D(pts, ReferencePoint(floor));
}

Status RunBayesianSearch(const std::vector<BoCandidate>& cands, const BoOptions& opts, const QualityOracle& oracle,
                         std::vector<BoObservation>* log, const StepFn& on_step) {
  const uint32_t n = uint32_t(cands.size());
  if (n == 0) return Status::InvalidArgument("search: the space has no candidates");
  if (opts.budget == 0) return Status::InvalidArgument("search: budget must be at least 1");
  if (!(opts.floor > 0 && opts.floor <= 1.5)) return Status::InvalidArgument("search: floor " + std::to_string(opts.floor) + " is out of range");
  const Groups groups = MakeGroups(cands);
  const uint32_t n_groups = uint32_t(groups.members.size());
  const uint32_t budget = std::min(opts.budget, n_groups);
  const uint32_t n_init = std::max<uint32_t>(1, std::min(DefaultInit(opts), budget));
  const std::vector<std::vector<double>> x = GroupInputs(cands, groups);
  const SearchState state{cands, groups, x, opts, budget, n_init};
  const std::vector<uint32_t> cold = ColdStartOrder(cands, groups, x, opts.mode, n_init, opts.seed);

  Rng rng(opts.seed);
  std::vector<char> done(n_groups, 0);
  std::vector<BoObservation> obs;
  GaussianProcess::Hyper hyper;
  bool have_hyper = false;
  uint32_t left = n;  // candidates whose group is not evaluated

  for (uint32_t step = 0; step < budget; ++step) {
    uint32_t pick = n;
    double acq = 0;
    if (opts.mode == SearchMode::kRandom) {
      uint32_t k = uint32_t(rng.Uniform() * left);
      for (uint32_t i = 0; i < n; ++i)
        if (!done[groups.of[i]] && k-- == 0) { pick = i; break; }
    } else if (step < n_init) {
      size_t skip = step;  // the step-th cold-start point, or the next one whose group is new
      for (size_t k = skip; k < cold.size() && pick == n; ++k)
        if (!done[groups.of[cold[k]]]) pick = cold[k];
    } else {
      GaussianProcess::FitOptions fo;
      fo.seed = opts.seed * 1000003 + step;
      // Full restarts while the data is small or every 5th step; otherwise refine the last fit.
      fo.restarts = (step < 30 || step % 5 == 0) ? 2 : 0;
      KV_ASSIGN_OR_RETURN(std::vector<double> values, Acquire(state, obs, step, fo, &hyper, &have_hyper, &pick));
      acq = pick < n ? values[groups.of[pick]] : 0;
    }
    if (pick >= n) return Status::Internal("search: no candidate left to propose");
    done[groups.of[pick]] = 1;
    left -= uint32_t(groups.members[groups.of[pick]].size());
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

Result<std::vector<double>> AcquisitionValues(const std::vector<BoCandidate>& cands, const std::vector<BoObservation>& obs,
                                              const BoOptions& opts, uint32_t step) {
  if (obs.empty()) return Status::InvalidArgument("acquisition: needs at least one observation");
  for (const BoObservation& o : obs)
    if (o.candidate >= cands.size()) return Status::InvalidArgument("acquisition: observation of unknown candidate " + std::to_string(o.candidate));
  const Groups groups = MakeGroups(cands);
  const std::vector<std::vector<double>> x = GroupInputs(cands, groups);
  const uint32_t budget = std::min<uint32_t>(opts.budget, groups.members.size());
  const SearchState state{cands, groups, x, opts, budget, std::min(DefaultInit(opts), budget)};
  GaussianProcess::Hyper hyper;
  bool have = false;
  uint32_t pick;
  GaussianProcess::FitOptions fo;
  fo.seed = opts.seed;
  KV_ASSIGN_OR_RETURN(std::vector<double> per_group, Acquire(state, obs, step, fo, &hyper, &have, &pick));
  std::vector<double> out(cands.size());
  for (uint32_t i = 0; i < cands.size(); ++i) out[i] = per_group[groups.of[i]];
  return out;
}

}  // namespace kvserve
