// BO and random search replayed against an exhaustive grid: the fraction of the grid's
// hypervolume and of its feasible frontier each reaches at a budget, over several seeds.
#include <algorithm>
#include <cmath>
#include <set>

#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {

Result<CompareReport> CompareOnGrid(const Profile& grid, const CompareOptions& opts, const CompareProgressFn& progress) {
  const uint32_t n = uint32_t(grid.candidates.size());
  if (n == 0) return Status::InvalidArgument("grid: no candidates");
  std::vector<const BoObservation*> by_candidate(n, nullptr);
  for (const BoObservation& o : grid.log) by_candidate[o.candidate] = &o;
  for (uint32_t i = 0; i < n; ++i)
    if (!by_candidate[i])
      return Status::InvalidArgument("grid: candidate " + std::to_string(i) + " ('" + grid.candidates[i].spec +
                                     "') has no evaluation (is the grid run finished?)");
  KV_ASSIGN_OR_RETURN(SearchSpace space, SearchSpace::Parse(grid.space_json, "grid space"));
  if (space.candidates().size() != n) return Status::InvalidArgument("grid: its space no longer expands to its candidates");
  std::vector<BoCandidate> cands = grid.candidates;
  for (uint32_t i = 0; i < n; ++i) {
    if (space.candidates()[i].spec != cands[i].spec)
      return Status::InvalidArgument("grid: candidate " + std::to_string(i) + " differs from its space's expansion");
    cands[i].features = space.candidates()[i].features;
    cands[i].quality_group = space.candidates()[i].quality_group;
  }

  CompareReport rep;
  rep.grid_evals = n;
  rep.grid_hypervolume = ObservedHypervolume(cands, grid.log, grid.floor);
  std::vector<Objectives> pts;
  std::vector<uint32_t> idx;
  for (uint32_t i = 0; i < n; ++i) {
    if (by_candidate[i]->quality < grid.floor || cands[i].ratio <= 1) continue;
    pts.push_back(CandidateObjectives(cands[i], by_candidate[i]->quality));
    idx.push_back(i);
  }
  std::set<uint32_t> frontier;
  for (uint32_t k : ParetoFront(pts)) frontier.insert(idx[k]);
  rep.grid_frontier = uint32_t(frontier.size());
  if (!(rep.grid_hypervolume > 0)) return Status::InvalidArgument("grid: no feasible point above the reference");

  std::vector<uint32_t> budgets;
  for (double f : opts.budget_fracs) {
    if (!(f > 0 && f <= 1)) return Status::InvalidArgument("budget fraction " + std::to_string(f) + " is not in (0, 1]");
    budgets.push_back(std::max<uint32_t>(1, uint32_t(std::lround(f * n))));
  }
  const uint32_t max_budget = *std::max_element(budgets.begin(), budgets.end());
  auto oracle = [&](uint32_t i) -> Result<BoObservation> { return *by_candidate[i]; };

  // Runs one search and returns its hypervolume fraction and frontier recall after each step.
  auto run = [&](SearchMode mode, uint32_t budget, uint64_t seed, std::vector<double>* hv, std::vector<double>* recall) -> Status {
    BoOptions o;
    o.mode = mode;
    o.budget = budget;
    o.floor = grid.floor;
    o.seed = seed;
    o.n_init = opts.n_init;
    std::vector<BoObservation> log;
    KV_RETURN_IF_ERROR(RunBayesianSearch(cands, o, oracle, &log));
    hv->clear(), recall->clear();
    uint32_t found = 0;
    for (size_t k = 1; k <= log.size(); ++k) {
      found += frontier.count(log[k - 1].candidate);
      std::vector<BoObservation> prefix(log.begin(), log.begin() + k);
      hv->push_back(ObservedHypervolume(cands, prefix, grid.floor) / rep.grid_hypervolume);
      recall->push_back(frontier.empty() ? 0 : double(found) / frontier.size());
    }
    return Status::Ok();
  };

  const uint64_t total = uint64_t(opts.methods.size()) * opts.seeds;
  uint64_t done = 0;
  for (SearchMode mode : opts.methods) {
    // EHVI and random search do not depend on the budget (a longer run extends a shorter one),
    // so one run per seed serves every budget; the constrained mode's exploration bonus decays
    // over the budget, so it runs once per budget.
    const bool anytime = mode != SearchMode::kConstrained;
    std::vector<std::vector<double>> hv_at(budgets.size()), rec_at(budgets.size());
    std::vector<double> curve(max_budget, 0);
    for (uint32_t s = 1; s <= opts.seeds; ++s) {
      std::vector<double> hv, recall;
      if (anytime) {
        KV_RETURN_IF_ERROR(run(mode, max_budget, s, &hv, &recall));
        for (size_t b = 0; b < budgets.size(); ++b) {
          hv_at[b].push_back(hv[std::min<size_t>(budgets[b], hv.size()) - 1]);
          rec_at[b].push_back(recall[std::min<size_t>(budgets[b], recall.size()) - 1]);
        }
      } else {
        for (size_t b = 0; b < budgets.size(); ++b) {
          KV_RETURN_IF_ERROR(run(mode, budgets[b], s, &hv, &recall));
          hv_at[b].push_back(hv.back());
          rec_at[b].push_back(recall.back());
        }
      }
      for (size_t k = 0; k < max_budget && k < hv.size(); ++k) curve[k] += hv[k] / opts.seeds;
      if (progress) progress(++done, total);
    }
    for (size_t b = 0; b < budgets.size(); ++b) {
      CompareResult r;
      r.method = SearchModeName(mode);
      r.budget = budgets[b];
      r.budget_frac = opts.budget_fracs[b];
      for (double v : hv_at[b]) r.hv_fraction_mean += v / hv_at[b].size();
      r.hv_fraction_min = *std::min_element(hv_at[b].begin(), hv_at[b].end());
      for (double v : rec_at[b]) r.frontier_recall_mean += v / rec_at[b].size();
      rep.results.push_back(r);
    }
    rep.curves.push_back({SearchModeName(mode), curve});
  }
  return rep;
}

}  // namespace kvserve
