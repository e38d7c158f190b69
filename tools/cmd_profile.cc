// CLI: `profile run|grid|show|compare|space` — the Bayesian profiling engine.
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvserve/eval.h"
#include "kvserve/profile.h"
#include "model_flags.h"
#include "table.h"
#include "profile/search.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

struct RunFlags {
  ModelFlags model;
  EvalFlags eval;
  std::string space_path, out, mode = "ehvi";
  uint32_t budget = 40, n_init = 0, speed_tokens = 128;
  int speed_runs = 3;
  uint32_t speed_rounds = 5;
  uint32_t speed_threads = 1;
  double floor = 0.97;
  uint64_t search_seed = 1;
  bool as_json = false;
};

Result<SearchSpace> LoadSpace(const std::string& path) {
  if (path.empty()) return SearchSpace::Default();
  return SearchSpace::Load(path);
}

std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

void PrintProfile(const Profile& p) {
  std::printf("profile of %s (sha256 %.16s…), %s search, %zu of %zu candidates evaluated, floor %.3f\n",
              p.model.c_str(), p.model_sha256.c_str(), p.mode.c_str(), p.log.size(), p.candidates.size(), p.floor);
  std::printf("machine: %s; speeds with %u codec thread%s\nhypervolume %.4g (reference: quality %.3f, ratio 1, speed 0)\n\n",
              p.machine.c_str(), p.speed_threads, p.speed_threads == 1 ? "" : "s", p.hypervolume, p.floor);
  std::printf("%-12s %7s %7s %8s %7s %8s %8s  %s\n", "bucket", "quality", "±se", "kl", "ratio", "enc GB/s", "dec GB/s",
              "strategy");
  for (const ProfileEntry& e : p.pareto)
    std::printf("%-12s %7.4f %7.4f %8.5f %7.2f %8.2f %8.2f  %s\n", e.bucket.c_str(), e.quality, e.quality_se, e.kl,
                e.ratio, e.encode_gbps, e.decode_gbps, e.spec.c_str());
  if (p.pareto.empty()) std::printf("(no strategy met the floor)\n");
}

Status DoRun(const RunFlags& f, bool grid) {
  KV_ASSIGN_OR_RETURN(SearchMode mode, ParseSearchMode(f.mode));
  if (!(f.floor > 0 && f.floor <= 1.5)) return Status::InvalidArgument("--floor: " + std::to_string(f.floor) + " is not in (0, 1.5]");
  KV_ASSIGN_OR_RETURN(SearchSpace space, LoadSpace(f.space_path));
  KV_ASSIGN_OR_RETURN(LlamaModel m, f.model.Load());
  KV_ASSIGN_OR_RETURN(auto ev, MakeEvaluator(m, f.eval));
  ProfileRunOptions o;
  o.grid = grid;
  o.bo.mode = mode;
  o.bo.budget = f.budget;
  o.bo.floor = f.floor;
  o.bo.seed = f.search_seed;
  o.bo.n_init = f.n_init;
  o.speed_tokens = f.speed_tokens;
  o.speed_runs = f.speed_runs;
  o.speed_rounds = f.speed_rounds;
  o.speed_threads = f.speed_threads;
  o.out = f.out;
  o.codec_env = Codec();
  std::fprintf(stderr, "%s: %zu candidates, %s\n", grid ? "grid" : "profile", space.candidates().size(),
               grid ? "evaluating every one" : ("budget " + std::to_string(std::min<size_t>(f.budget, space.candidates().size())) + " evaluations, " + f.mode).c_str());
  std::unique_ptr<Progress> bar;
  const char* phase = "";
  const double t0 = NowSeconds();
  auto res = RunProfile(*ev, space, o, [&](const ProfileProgress& pp) {
    if (phase != pp.phase) {
      if (bar) bar->Done();
      phase = pp.phase;
      bar = std::make_unique<Progress>(std::string(pp.phase == std::string("measure") ? "ratio+speed" : "evaluations"), pp.total);
    }
    bar->Update(pp.done, pp.phase == std::string("evaluate") ? "best hypervolume " + Fmt("%.4g", pp.hypervolume) : "");
    // Off a terminal, a line per tenth of the work so logs show progress too.
    if (!StderrIsTerminal() && pp.total >= 10 && pp.done % (pp.total / 10) == 0)
      std::fprintf(stderr, "%s %llu/%llu (%.0fs)%s\n", pp.phase, (unsigned long long)pp.done, (unsigned long long)pp.total,
                   NowSeconds() - t0, pp.phase == std::string("evaluate") ? (" hv " + Fmt("%.4g", pp.hypervolume)).c_str() : "");
  });
  if (bar) bar->Done();
  KV_RETURN_IF_ERROR(res.status());
  const Profile& p = res.value();
  if (f.as_json) {
    std::printf("%s", ProfileToJson(p).c_str());
  } else {
    PrintProfile(p);
    if (!f.out.empty()) std::printf("\nwritten to %s (%.0f s)\n", f.out.c_str(), NowSeconds() - t0);
  }
  return Status::Ok();
}

void AddRunFlags(CLI::App* c, RunFlags* f, bool grid) {
  f->model.Add(c);
  f->eval.Add(c);
  c->add_option("--space", f->space_path, "space file (JSON; default: the built-in space, see `profile space`)");
  if (!grid) {
    c->add_option("--mode", f->mode, "acquisition: constrained | ehvi | random")->capture_default_str();
    c->add_option("--budget", f->budget, "quality evaluations")->capture_default_str()->check(InRange(1, 100000));
    c->add_option("--init", f->n_init, "cold-start evaluations (0: 1 for ehvi, 5 for constrained)")->capture_default_str();
    c->add_option("--search-seed", f->search_seed, "seed of the search")->capture_default_str();
  }
  c->add_option("--floor", f->floor, "quality floor (relative accuracy) for feasibility")->capture_default_str()->check(InRange(1e-9, 1.05));
  c->add_option("--speed-tokens", f->speed_tokens, "tokens of the llama3-8b block the codec speed is measured on")
      ->capture_default_str()->check(InRange(1, 65536));
  c->add_option("--speed-runs", f->speed_runs, "runs per speed measurement (median)")->capture_default_str()->check(InRange(1, 1000));
  c->add_option("--speed-rounds", f->speed_rounds,
                "rounds of speed measurements, every candidate once per round (each keeps its rounds' median: slow machine noise falls on all alike)")
      ->capture_default_str()
      ->check(InRange(1, 100));
  c->add_option("--speed-threads", f->speed_threads,
                "codec threads the speeds are measured with: the nodes' --threads, which the controller's latency model assumes")
      ->capture_default_str()->check(InRange(1, 256));
  c->add_option("-o,--output", f->out, "profile file; written after every evaluation, resumed if it exists")
      ->required(grid)->check(OutputPath());
  c->add_flag("--json", f->as_json, "print the profile as JSON");
}

// ---- SVG plots ---------------------------------------------------------------------------------
struct Series {
  std::string name, color;
  std::vector<std::pair<double, double>> xy;
  bool line = true;
  double radius = 2.5;
};

std::string Esc(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return o;
}

// One panel at (ox, oy) of size w x h.
std::string Panel(double ox, double oy, double w, double h, const std::string& title, const std::string& xl,
                  const std::string& yl, const std::vector<Series>& series, bool legend) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const Series& s : series)
    for (auto [x, y] : s.xy) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
  if (!(x1 > x0)) x1 = x0 + 1;
  if (!(y1 > y0)) y1 = y0 + 1;
  const double px = (x1 - x0) * 0.04, py = (y1 - y0) * 0.06;
  x0 -= px, x1 += px, y0 -= py, y1 += py;
  const double L = ox + 60, R = ox + w - 10, T = oy + 30, B = oy + h - 40;
  auto X = [&](double x) { return L + (x - x0) / (x1 - x0) * (R - L); };
  auto Y = [&](double y) { return B - (y - y0) / (y1 - y0) * (B - T); };
  std::ostringstream o;
  o << "<text x='" << (L + R) / 2 << "' y='" << oy + 18 << "' text-anchor='middle' font-weight='bold'>" << Esc(title) << "</text>\n";
  o << "<rect x='" << L << "' y='" << T << "' width='" << R - L << "' height='" << B - T << "' fill='none' stroke='#999'/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double xv = x0 + (x1 - x0) * i / 4, yv = y0 + (y1 - y0) * i / 4;
    o << "<text x='" << X(xv) << "' y='" << B + 14 << "' text-anchor='middle' font-size='10'>" << Fmt("%.3g", xv) << "</text>\n";
    o << "<text x='" << L - 4 << "' y='" << Y(yv) + 3 << "' text-anchor='end' font-size='10'>" << Fmt("%.3g", yv) << "</text>\n";
  }
  o << "<text x='" << (L + R) / 2 << "' y='" << B + 30 << "' text-anchor='middle' font-size='11'>" << Esc(xl) << "</text>\n";
  o << "<text transform='translate(" << ox + 14 << "," << (T + B) / 2 << ") rotate(-90)' text-anchor='middle' font-size='11'>"
    << Esc(yl) << "</text>\n";
  int li = 0;
  for (const Series& s : series) {
    if (s.line && s.xy.size() > 1) {
      o << "<polyline fill='none' stroke='" << s.color << "' stroke-width='1.8' points='";
      for (auto [x, y] : s.xy) o << X(x) << "," << Y(y) << " ";
      o << "'/>\n";
    } else {
      for (auto [x, y] : s.xy)
        o << "<circle cx='" << X(x) << "' cy='" << Y(y) << "' r='" << s.radius << "' fill='" << s.color << "'/>\n";
    }
    if (legend) {
      o << "<rect x='" << R - 150 << "' y='" << B - 18 - 16 * li << "' width='10' height='10' fill='" << s.color << "'/>";
      o << "<text x='" << R - 135 << "' y='" << B - 9 - 16 * li << "' font-size='11'>" << Esc(s.name) << "</text>\n";
      ++li;
    }
  }
  return o.str();
}

std::string Svg(double w, double h, const std::string& body) {
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n" << body << "</svg>\n";
  return o.str();
}

std::string FrontierSvg(const Profile& p) {
  std::vector<Series> q_r(2), r_s(2), q_s(2);
  std::vector<int> on(p.candidates.size(), 0);
  for (const ProfileEntry& e : p.pareto)
    for (size_t i = 0; i < p.candidates.size(); ++i)
      if (p.candidates[i].spec == e.spec) on[i] = 1;
  for (int k = 0; k < 2; ++k) {
    const std::string name = k ? "Pareto frontier" : "feasible, dominated";
    const std::string col = k ? "#d62728" : "#bbbbbb";
    q_r[k] = {name, col, {}, false, k ? 3.5 : 2.0};
    r_s[k] = q_r[k], q_s[k] = q_r[k];
  }
  for (const BoObservation& o : p.log) {
    if (o.quality < p.floor) continue;
    const BoCandidate& c = p.candidates[o.candidate];
    const int k = on[o.candidate];
    q_r[k].xy.push_back({c.ratio, o.quality});
    r_s[k].xy.push_back({c.ratio, c.speed()});
    q_s[k].xy.push_back({c.speed(), o.quality});
  }
  std::string body = Panel(0, 0, 420, 340, "quality vs ratio", "compression ratio", "relative accuracy", q_r, true);
  body += Panel(420, 0, 420, 340, "speed vs ratio", "compression ratio", "codec speed (GB/s, harmonic mean)", r_s, false);
  body += Panel(840, 0, 420, 340, "quality vs speed", "codec speed (GB/s)", "relative accuracy", q_s, false);
  body += "<text x='10' y='336' font-size='10' fill='#555'>" + Esc(p.model + ", " + std::to_string(p.log.size()) +
                                                                  " evaluations, feasible = quality >= " + Fmt("%.2f", p.floor)) + "</text>\n";
  return Svg(1260, 345, body);
}

std::string CurveSvg(const CompareReport& r, const std::string& title) {
  const char* colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"};
  std::vector<Series> s;
  for (size_t i = 0; i < r.curves.size(); ++i) {
    Series ser{r.curves[i].first, colors[i % 4], {}, true};
    for (size_t k = 0; k < r.curves[i].second.size(); ++k) ser.xy.push_back({double(k + 1), r.curves[i].second[k]});
    s.push_back(ser);
  }
  Series target{"95% of grid", "#999999", {}, true};
  if (!r.curves.empty()) target.xy = {{1, 0.95}, {double(r.curves[0].second.size()), 0.95}};
  s.push_back(target);
  return Svg(640, 420, Panel(0, 0, 640, 420, title, "evaluations", "hypervolume / grid hypervolume (mean over seeds)", s, true));
}

Result<std::vector<double>> ParseFracs(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end || !(v > 0 && v <= 1))
      return Status::InvalidArgument("--budget-frac: '" + item + "' is not a fraction in (0, 1]");
    out.push_back(v);
  }
  if (out.empty()) return Status::InvalidArgument("--budget-frac: empty");
  return out;
}

}  // namespace

void AddProfileCommands(CLI::App& app) {
  auto* prof = app.add_subcommand("profile", "Bayesian profiling: the Pareto frontier of quality, ratio and codec speed");
  prof->require_subcommand(1);
  {
    auto* f = new RunFlags;
    f->model.model = "babyllama105";
    auto* c = prof->add_subcommand("run", "Profile a model: Bayesian search over a strategy space, writes a profile file");
    AddRunFlags(c, f, false);
    SetAction(c, [f] { return DoRun(*f, false); });
  }
  {
    auto* f = new RunFlags;
    f->model.model = "babyllama105";
    auto* c = prof->add_subcommand("grid", "Evaluate every candidate of a space (the reference for `profile compare`)");
    AddRunFlags(c, f, true);
    SetAction(c, [f] { return DoRun(*f, true); });
  }
  {
    auto* path = new std::string;
    auto* svg = new std::string;
    auto* as_json = new bool(false);
    auto* c = prof->add_subcommand("show", "Print a profile file as a table");
    c->add_option("profile", *path, "profile file")->required();
    c->add_option("--svg", *svg, "also write 2-D projections of the frontier (SVG)")->check(OutputPath());
    c->add_flag("--json", *as_json, "print the pareto strategies as JSON");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(Profile p, LoadProfile(*path));
      if (*as_json) {
        json j = json::parse(ProfileToJson(p));
        j.erase("candidates");
        j.erase("log");
        std::printf("%s\n", j.dump(1).c_str());
      } else {
        PrintProfile(p);
      }
      if (!svg->empty()) {
        if (p.candidates.empty()) return Status::InvalidArgument(*path + ": has no candidates to plot");
        KV_RETURN_IF_ERROR(WriteTextAtomic(*svg, FrontierSvg(p)));
      }
      return Status::Ok();
    });
  }
  {
    auto* path = new std::string;
    auto* fracs = new std::string("0.01,0.02,0.05,0.1");
    auto* seeds = new uint32_t(5);
    auto* methods = new std::string("ehvi,constrained,random");
    auto* svg = new std::string;
    auto* as_json = new bool(false);
    auto* n_init = new uint32_t(0);
    auto* c = prof->add_subcommand("compare", "BO (ehvi, constrained) and random search against a cached grid");
    c->add_option("--grid", *path, "grid file written by `profile grid`")->required();
    c->add_option("--budget-frac", *fracs, "budgets as fractions of the grid, comma-separated")->capture_default_str();
    c->add_option("--seeds", *seeds, "seeds per method")->capture_default_str()->check(InRange(1, 1000));
    c->add_option("--methods", *methods, "comma-separated: ehvi, constrained, random")->capture_default_str();
    c->add_option("--init", *n_init, "cold-start evaluations of the BO methods (0: 1 for ehvi, 5 for constrained)")->capture_default_str();
    c->add_option("--svg", *svg, "also write hypervolume vs evaluations (SVG)")->check(OutputPath());
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(Profile grid, LoadProfile(*path));
      CompareOptions o;
      KV_ASSIGN_OR_RETURN(o.budget_fracs, ParseFracs(*fracs));
      if (*seeds == 0) return Status::InvalidArgument("--seeds: must be at least 1");
      o.seeds = *seeds;
      o.n_init = *n_init;
      o.methods.clear();
      std::stringstream ss(*methods);
      std::string item;
      while (std::getline(ss, item, ',')) {
        KV_ASSIGN_OR_RETURN(SearchMode m, ParseSearchMode(item));
        o.methods.push_back(m);
      }
      Progress bar("searches", uint64_t(o.methods.size()) * o.seeds);
      const double t0 = NowSeconds();
      auto rep = CompareOnGrid(grid, o, [&](uint64_t d, uint64_t) { bar.Update(d); });
      bar.Done();
      KV_RETURN_IF_ERROR(rep.status());
      const CompareReport& r = rep.value();
      if (*as_json) {
        json j;
        j["grid_evals"] = r.grid_evals;
        j["grid_hypervolume"] = r.grid_hypervolume;
        j["grid_frontier"] = r.grid_frontier;
        j["seeds"] = o.seeds;
        j["results"] = json::array();
        for (const CompareResult& x : r.results)
          j["results"].push_back({{"method", x.method}, {"budget", x.budget}, {"budget_frac", x.budget_frac},
                                  {"hv_fraction_mean", x.hv_fraction_mean}, {"hv_fraction_min", x.hv_fraction_min},
                                  {"frontier_recall_mean", x.frontier_recall_mean}});
        j["seconds"] = NowSeconds() - t0;
        std::printf("%s\n", j.dump(1).c_str());
      } else {
        std::printf("grid: %u evaluations, hypervolume %.4g, %u feasible frontier points; %u seeds per method\n\n",
                    r.grid_evals, r.grid_hypervolume, r.grid_frontier, o.seeds);
        std::printf("%-12s %7s %6s %10s %10s %10s\n", "method", "budget", "frac", "HV mean", "HV min", "recall");
        for (const CompareResult& x : r.results)
          std::printf("%-12s %7u %5.1f%% %10.3f %10.3f %10.3f\n", x.method.c_str(), x.budget, 100 * x.budget_frac,
                      x.hv_fraction_mean, x.hv_fraction_min, x.frontier_recall_mean);
        std::printf("\n(%.1f s)\n", NowSeconds() - t0);
      }
      if (!svg->empty())
        KV_RETURN_IF_ERROR(WriteTextAtomic(*svg, CurveSvg(r, grid.model + ": hypervolume reached vs evaluations (" +
                                                                 std::to_string(r.grid_evals) + "-point grid)")));
      return Status::Ok();
    });
  }
  {
    auto* path = new std::string;
    auto* as_json = new bool(false);
    auto* c = prof->add_subcommand("space", "Expand a space file (or the built-in space): candidates and GP features");
    c->add_option("--space", *path, "space file (default: the built-in space)");
    c->add_flag("--json", *as_json, "the space and its candidates as JSON");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(SearchSpace s, LoadSpace(*path));
      if (*as_json) {
        json j;
        j["space"] = json::parse(s.json());
        j["features"] = s.feature_names();
        j["candidates"] = json::array();
        for (const SpaceCandidate& c : s.candidates()) j["candidates"].push_back(c.spec);
        std::printf("%s\n", j.dump(1).c_str());
        return Status::Ok();
      }
      std::printf("%s\n\n%zu candidates; %zu GP features:", json::parse(s.json()).dump(2).c_str(), s.candidates().size(),
                  s.feature_names().size());
      for (const std::string& n : s.feature_names()) std::printf(" %s", n.c_str());
      std::printf("\n");
      return Status::Ok();
    });
  }
}

}  // namespace kvserve::cli
