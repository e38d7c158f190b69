// CLI: `control simulate|decide` — the online controller, replayed on bandwidth traces.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli.h"
#include "kvserve/controller.h"
#include "kvserve/profile.h"
#include "control/simulator.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

const std::string kSource = SourceDir();

struct ControlFlags {
  std::string profile = kSource + "/bench/profiles/default.json";
  bool pipelined = false, no_ma = false;
  uint32_t top_k = 3;
  uint64_t seed = 1;
  void Add(CLI::App* c) {
    c->add_option("--profile", profile, "profile file (default: the shipped default profile)")->capture_default_str();
    c->add_flag("--pipelined", pipelined, "predict (and simulate) layer-streamed transfers");
    c->add_option("--top-k", top_k, "bandit arms: the k best predicted strategies")->capture_default_str();
    c->add_option("--seed", seed, "bandit seed")->capture_default_str();
  }
  ControllerOptions Options() const {
    ControllerOptions o;
    o.pipelined = pipelined;
    o.top_k = top_k;
    o.seed = seed;
    return o;
  }
};

json ReportJson(const PolicyReport& r) {
  json j = {{"policy", r.policy}, {"mean_ms", r.mean_ms}, {"p50_ms", r.p50_ms}, {"p99_ms", r.p99_ms},
            {"slo_attainment", r.slo_attainment}, {"floor_violations", r.floor_violations}, {"requests", r.requests}};
  j["recovery_requests"] = r.recovery_requests >= 0 ? json(r.recovery_requests) : json(nullptr);
  json c = json::object();
  for (const auto& [name, n] : r.choices) c[name] = n;
  j["choices"] = c;
  return j;
}

}  // namespace

void AddControlCommands(CLI::App& app) {
  auto* ctl = app.add_subcommand("control", "Online controller: per-request strategy choice under bandwidth, SLO and floor");
  ctl->require_subcommand(1);
  {
    auto* f = new ControlFlags;
    auto* trace = new std::string;
    auto* workload = new std::string(kSource + "/bench/workloads/mixed.csv");
    auto* policy = new std::string("adaptive");
    auto* drifts = new std::vector<std::string>;
    auto* as_json = new bool(false);
    auto* explain = new bool(false);
    auto* sim = new SimOptions;
    auto* c = ctl->add_subcommand("simulate", "Replay a bandwidth trace over a request stream and compare policies");
    f->Add(c);
    c->add_option("--trace", *trace, "bandwidth trace: CSV of time_s,gbps (bench/traces/)")->required();
    c->add_option("--workload", *workload, "requests: CSV of arrival_s,prompt_tokens,label,slo_ms,floor")->capture_default_str();
    c->add_option("--policy", *policy, "adaptive | adaptive-bandit | adaptive-ma (KVServe's rule) | oracle | none | static:SPEC | all")->capture_default_str();
    c->add_option("--drift", *drifts, "injected mismatch, repeatable: codec:1.5@100 (codec 1.5x slower from t=100 s), link:2@100");
    c->add_option("--kv-bytes-per-token", sim->kv_bytes_per_token, "fp16 KV bytes per prompt token (llama3-8b: 131072)")
        ->capture_default_str()->check(InRange(1, 1e9));
    c->add_option("--prefill-tps", sim->prefill_tokens_per_second, "prefill tokens per second (model time)")->capture_default_str()->check(InRange(1e-3, 1e9));
    c->add_option("--codec-threads", sim->codec_threads, "codec speed multiplier per side")->capture_default_str()->check(InRange(1, 256));
    c->add_flag("--explain", *explain, "print the adaptive controller's explanation of every decision");
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(Profile p, LoadProfile(f->profile));
      if (p.pareto.empty()) return Status::InvalidArgument(f->profile + ": no Pareto strategies");
      KV_ASSIGN_OR_RETURN(auto tr, LoadTrace(*trace));
      KV_ASSIGN_OR_RETURN(auto wl, LoadWorkload(*workload));
      KV_ASSIGN_OR_RETURN(sim->drift, ParseDrift(*drifts));
      sim->controller = f->Options();
      sim->explain = *explain;
      const std::vector<StrategyCost> strategies = StrategiesFromProfile(p);
      std::vector<std::string> policies;
      if (*policy == "all") {
        policies = {"adaptive", "adaptive-bandit", "adaptive-ma", "oracle", "none"};
        for (const StrategyCost& s : strategies) policies.push_back("static:" + s.spec);
      } else {
        policies = {*policy};
      }
      std::vector<PolicyReport> reps;
      for (const std::string& pol : policies) {
        KV_ASSIGN_OR_RETURN(PolicyReport r, Simulate(strategies, tr, wl, pol, *sim));
        reps.push_back(std::move(r));
      }
      if (*explain)
        for (const PolicyReport& r : reps)
          for (const std::string& line : r.explanations) std::fprintf(*as_json ? stderr : stdout, "%s\n", line.c_str());
      if (*as_json) {
        json j;
        j["trace"] = *trace;
        j["workload"] = *workload;
        j["profile"] = f->profile;
        j["drift"] = *drifts;
        j["policies"] = json::array();
        json recovery = nullptr, recovery_ma = nullptr;
        for (const PolicyReport& r : reps) {
          j["policies"].push_back(ReportJson(r));
          if (r.policy == "adaptive" && r.recovery_requests >= 0) recovery = r.recovery_requests;
          if (r.policy == "adaptive-ma" && r.recovery_requests >= 0) recovery_ma = r.recovery_requests;
        }
        j["recovery_requests"] = recovery;
        j["recovery_requests_ma"] = recovery_ma;
        std::printf("%s\n", j.dump(1).c_str());
        return Status::Ok();
      }
      std::printf("trace %s, %zu requests, %zu profile strategies%s\n\n", trace->c_str(), wl.size(), strategies.size(),
                  sim->drift.any() ? ", with drift" : "");
      std::printf("%-64s %9s %9s %9s %6s %6s %8s\n", "policy", "mean ms", "p50 ms", "p99 ms", "SLO", "floor!", "recovery");
      for (const PolicyReport& r : reps) {
        std::string name = r.policy.rfind("static:", 0) == 0 ? "static:" + ShortSpec(r.policy.substr(7)) : r.policy;
        if (name.size() > 64) name = name.substr(0, 63) + "…";
        std::printf("%-64s %9.1f %9.1f %9.1f %5.1f%% %6u %8s\n", name.c_str(), r.mean_ms, r.p50_ms, r.p99_ms,
                    100 * r.slo_attainment, r.floor_violations,
                    r.recovery_requests >= 0 ? std::to_string(r.recovery_requests).c_str() : "-");
      }
      return Status::Ok();
    });
  }
  {
    auto* f = new ControlFlags;
    auto* r = new Request;
    auto* gbps = new double(10);
    auto* tokens = new uint32_t(4096);
    auto* slo_ms = new double(1000);
    auto* kv_per_token = new double(131072);
    auto* as_json = new bool(false);
    auto* explain = new bool(false);
    auto* c = ctl->add_subcommand("decide", "One decision for one request, with its explanation");
    f->Add(c);
    c->add_option("--bandwidth-gbps", *gbps, "link bandwidth estimate")->capture_default_str()->check(InRange(1e-6, 1e6));
    c->add_option("--tokens", *tokens, "prompt tokens")->capture_default_str()->check(InRange(1, 1e7));
    c->add_option("--label", r->label, "workload label (retrieval demands floor 0.99)")->capture_default_str();
    c->add_option("--slo-ms", *slo_ms, "latency budget of the transfer path")->capture_default_str()->check(InRange(1e-3, 1e9));
    c->add_option("--floor", r->floor, "quality floor (relative accuracy)")->capture_default_str()->check(InRange(1e-9, 1.05));
    c->add_option("--kv-bytes-per-token", *kv_per_token, "fp16 KV bytes per token")->capture_default_str()->check(InRange(1, 1e9));
    c->add_flag("--explain", *explain, "print the explanation line");
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() -> Status {
      if (!(*gbps > 0)) return Status::InvalidArgument("--bandwidth-gbps: must be > 0");
      KV_ASSIGN_OR_RETURN(Profile p, LoadProfile(f->profile));
      KV_ASSIGN_OR_RETURN(Controller ctl, Controller::FromProfile(p, f->Options()));
      r->prompt_tokens = *tokens;
      r->kv_bytes = double(*tokens) * *kv_per_token;
      r->slo_seconds = *slo_ms / 1e3;
      Decision d;
      ctl.Decide(*r, *gbps * 1e9 / 8, 1.0, QueueState{}, &d);
      const StrategyCost& s = ctl.strategies()[d.choice];
      if (*as_json) {
        json j = {{"spec", s.spec}, {"name", s.name}, {"predicted_ms", d.predicted_seconds * 1e3}, {"meets_slo", d.meets_slo},
                  {"floor", d.floor}, {"explanation", ctl.Explain(*r, d)}};
        j["candidates"] = json::array();
        for (const CandidateNote& n : d.notes)
          j["candidates"].push_back({{"name", ctl.strategies()[n.strategy].name}, {"status", DropReasonName(n.reason)},
                                     {"predicted_ms", n.reason == DropReason::kKept ? json(n.predicted_seconds * 1e3) : json(nullptr)}});
        std::printf("%s\n", j.dump(1).c_str());
      } else {
        std::printf("%s\n", *explain ? ctl.Explain(*r, d).c_str() : s.spec.c_str());
      }
      return Status::Ok();
    });
  }
}

}  // namespace kvserve::cli
