// CLI: `bench e2e --mode pd` — the whole PD path (prefill node, controller, per-layer streaming
// over TCP through a shaped link, decode node) across bandwidths and policies, with Poisson or
// burst arrivals. Points the machine's link cannot carry are given by the simulator, labelled.
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "cli.h"
#include "control/simulator.h"
#include "kvserve/calibration.h"
#include "kvserve/file.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "kvserve/stats.h"
#include "kvserve/testbed.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

struct E2eFlags {
  std::string mode = "pd", kv_shape = "llama3-8b", gpu = "h100", arrival = "poisson", workload;
  std::string profile = SourceDir() + "/bench/profiles/default.json";
  std::string table = SourceDir() + "/docs/results/table_babyllama105.json";
  std::string svg, json_out;
  std::vector<double> bandwidths = {1, 2, 5, 10};
  std::vector<std::string> statics = {"uniform8", "kivi2", "cachegen", "mixhq4"};
  uint32_t requests = 24, prompt_tokens = 2048, max_new = 16, repeats = 3;
  double load = 0.9, slo_ms = 2000, floor = 0.97, prefill_tps = 0, decode_tps = 0;  // 0: from --kv-shape and --gpu
  int threads = 2;
  uint64_t seed = 1;
  bool quick = false, as_json = false;
  bool bandwidths_given = false, repeats_given = false;  // --quick keeps them
  bool allow_uncalibrated = false;
  double calibration_tolerance = 0.10;
  double inject_send_delay_ns = 0;  // test seam: per byte sent
  // Where the nodes run: "process" (each its own process, pinned) or "inproc"; the link: the
  // kernel's (netns), the in-process token bucket (shaper), or auto (netns where allowed).
  std::string nodes, link = "auto", cpus = "auto";
  // Resolved from them at the start of a run.
  std::string link_used, link_note, kvserve_exe;
  int cpu_prefill = -1, cpu_decode = -1, cpu_router = -1;
  // --mode pool
  double reuse = 0.8;
  uint32_t suffix_tokens = 64, chunk_tokens = kDefaultChunkTokens;
  std::string backend = "embedded", pool_address;
  uint64_t pool_capacity_mib = 8192;
};

struct Policy {
  std::string name;  // "none", "adaptive", "static:NAME"
  std::string spec;  // fixed strategy ("" for adaptive)
  double quality = 1, ratio = 1, encode_gbps = 0, decode_gbps = 0;
};

struct Point {
  double gbps = 0;
  std::string policy;
  bool measured = true;
  double mean_ms = 0, p50_ms = 0, p99_ms = 0, ttft_p99_ms = 0, slo_attainment = 0, goodput = 0, quality = 1;
  double wire_bytes = 0, compute_share = 0, capacity_rps = 0;
  bool valid = true;  // its policy's lone request on this link took what its parts predict
  // Over repeats: the half-widths of the 95% intervals of mean, P50, P99 JCT and P99 TTFT (each
  // figure above is the mean of the repeats' figures), and none's mean over this one's.
  uint32_t repeats = 1;
  double mean_ci = 0, p50_ci = 0, p99_ci = 0, ttft_p99_ci = 0;
  MeanCi vs_none;
  std::vector<double> repeat_means;
  uint32_t floor_violations = 0, errors = 0;
  std::map<std::string, uint32_t> choices;
  // --mode pool
  double hit_rate = 0, hit_ttft_mean_ms = 0, hit_ttft_p99_ms = 0, ttft_mean_ms = 0;
};

// The answered requests of a point, in order; failed ones are counted in p->errors and said on stderr.
std::vector<ServeResponse> Answers(std::vector<Result<ServeResponse>>& answers, Point* p) {
  std::vector<ServeResponse> out;
  for (auto& r : answers) {
    if (!r.ok()) {
      p->errors++;
      std::fprintf(stderr, "bench e2e: %s\n", r.status().ToString().c_str());
      continue;
    }
    out.push_back(std::move(r).value());
  }
  return out;
}

// This run's namespaces: kb<pid>-a and kb<pid>-b (short enough for the veth names).
std::string NetnsPrefix() { return "kb" + std::to_string(::getpid() % 100000); }

// One measured link: a decode node and a prefill node of the synthetic model over TCP shaped to
// `gbps` in process; the prefill node runs the profile's controller, or `strategy` without one.
struct Testbed {
  Testbed(double gbps, double send_delay_s_per_byte)
      : shaper(gbps), transport(MakeTcpTransport({.shaper = &shaper, .send_delay_s_per_byte = send_delay_s_per_byte})) {}
  ~Testbed() {
    if (decode) decode->Stop();
  }
  static Result<std::unique_ptr<Testbed>> Start(const E2eFlags& f, const SyntheticModel& sm, double gbps,
                                                const Profile* profile, const std::string& strategy) {
    auto t = std::make_unique<Testbed>(gbps, f.inject_send_delay_ns * 1e-9);
    DecodeNodeOptions d;
    d.synthetic = &sm;
    d.request_timeout_s = 600;
    t->decode = std::make_unique<DecodeNode>(t->transport.get(), d);
    KV_RETURN_IF_ERROR(t->decode->Start("127.0.0.1:0"));
    PrefillNodeOptions o;
    o.synthetic = &sm;
    o.decode_peers = {"127.0.0.1:" + std::to_string(t->decode->port())};
    o.profile = profile;
    o.strategy = strategy;
    o.assume_gbps = gbps;  // what a probe of the link would say before the first transfer
    o.request_timeout_s = 600;
    o.pool = Pool(f.threads);
    KV_ASSIGN_OR_RETURN(t->prefill, PrefillNode::Create(t->transport.get(), o));
    return t;
  }
  // The testbed of a policy: the profile's controller for adaptive, else its fixed strategy.
  static Result<std::unique_ptr<Testbed>> For(const E2eFlags& f, const SyntheticModel& sm, double gbps, const Profile& profile,
                                              const Policy& pol) {
    return Start(f, sm, gbps, pol.spec.empty() ? &profile : nullptr, pol.spec.empty() ? "none" : pol.spec);
  }
  LinkShaper shaper;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<DecodeNode> decode;
  std::unique_ptr<PrefillNode> prefill;
};

// ---- The process testbed's Ctrl-C: a thread waits for SIGINT/SIGTERM, stops the live testbed
// (its processes and namespaces) and exits 130. Started before any other thread, so every thread
// after it has those signals blocked.
std::mutex g_live_mu;
ProcessTestbed* g_live = nullptr;

void StopTestbedOnSignal() {
  static std::once_flag once;
  std::call_once(once, [] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([set] {
      int sig = 0;
      sigwait(&set, &sig);
      std::lock_guard<std::mutex> lock(g_live_mu);
      if (g_live != nullptr) g_live->Stop();
      // A testbed still starting is not live yet: its children die with this process
      // (PR_SET_PDEATHSIG); its namespaces are removed here.
      NetnsLink::Remove(SourceDir() + "/scripts/netns-link.sh", NetnsPrefix());
      std::fprintf(stderr, "bench e2e: stopped by signal %d; its node processes and namespaces are gone\n", sig);
      std::_Exit(130);
    }).detach();
  });
}

// The client of the process testbed: a request as JSON to the router's /generate, from inside
// the namespace the router is in; the answer read back (ServeResponseFromJson).
ServeFn RouterClient(const std::string& address, const std::string& netns, double timeout_s) {
  return [=](const ServeRequest& r) -> Result<ServeResponse> {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<ScopedNetns> ns, ScopedNetns::Enter(netns));
    httplib::Client cli("http://" + address);
    cli.set_connection_timeout(std::chrono::seconds(5));
    cli.set_read_timeout(std::chrono::duration<double>(timeout_s));
    const json body = {{"id", r.id}, {"tokens", r.prompt}, {"max_new_tokens", r.max_new_tokens}, {"slo_ms", r.slo_ms},
                       {"floor", r.floor}};
    auto res = cli.Post("/generate", body.dump(), "application/json");
    if (!res) return Status::Unavailable("router " + address + ": " + httplib::to_string(res.error()));
    if (res->status != 200) {
      return Status::Unavailable("router " + address + " answered " + std::to_string(res->status) + ": " + res->body.substr(0, 300));
    }
    return ServeResponseFromJson(res->body);
  };
}

// The nodes of one measured run, as the flags say: in this process or as processes (each pinned
// to its core, the link the kernel's or the prefill node's token bucket), behind one serve
// function. `prompts`: the lengths whose synthetic KV is made before the clock starts.
struct Bed {
  std::unique_ptr<Testbed> inproc;
  std::unique_ptr<ProcessTestbed> procs;
  ServeFn serve;
  ~Bed() {
    std::lock_guard<std::mutex> lock(g_live_mu);  // a signal now finds it stopped or still live, never half-freed
    if (g_live == procs.get()) g_live = nullptr;
    procs.reset();
  }
  static Result<std::unique_ptr<Bed>> Start(const E2eFlags& f, const SyntheticModel& sm, double gbps, const Profile* profile,
                                            const std::string& strategy, std::vector<uint32_t> prompts) {
    std::sort(prompts.begin(), prompts.end());
    prompts.erase(std::unique(prompts.begin(), prompts.end()), prompts.end());
    auto bed = std::make_unique<Bed>();
    if (f.nodes == "inproc") {
      KV_ASSIGN_OR_RETURN(bed->inproc, Testbed::Start(f, sm, gbps, profile, strategy));
      for (uint32_t n : prompts) KV_RETURN_IF_ERROR(bed->inproc->prefill->Prepare(n));
      PrefillNode* node = bed->inproc->prefill.get();
      bed->serve = [node](const ServeRequest& r) { return node->Serve(r); };
      return bed;
    }
    ProcessTestbedOptions o;
    o.kvserve = f.kvserve_exe;
    o.kv_shape = f.kv_shape;
    o.gpu = f.gpu;
    o.prepare_tokens = prompts;
    if (profile != nullptr) o.profile = f.profile;
    o.strategy = strategy;
    o.gbps = gbps;
    o.link = f.link_used;
    o.netns_script = SourceDir() + "/scripts/netns-link.sh";
    o.netns_prefix = NetnsPrefix();
    o.threads = f.threads;
    o.cpu_prefill = f.cpu_prefill, o.cpu_decode = f.cpu_decode, o.cpu_router = f.cpu_router;
    o.send_delay_ns = f.inject_send_delay_ns;
    KV_ASSIGN_OR_RETURN(std::unique_ptr<ProcessTestbed> t, ProcessTestbed::Start(o));
    bed->serve = RouterClient(t->router_address(), t->client_netns(), 600);
    std::lock_guard<std::mutex> lock(g_live_mu);
    bed->procs = std::move(t);
    g_live = bed->procs.get();
    return bed;
  }
  // The bed of a policy: the profile's controller for adaptive, else its fixed strategy.
  static Result<std::unique_ptr<Bed>> For(const E2eFlags& f, const SyntheticModel& sm, double gbps, const Profile& profile,
                                          const Policy& pol, const std::vector<uint32_t>& prompts) {
    return Start(f, sm, gbps, pol.spec.empty() ? &profile : nullptr, pol.spec.empty() ? "none" : pol.spec, prompts);
  }
};

// The driver's request `id`: a prompt of n_token tokens and the flags' generation, SLO and floor.
ServeRequest DriverRequest(const E2eFlags& f, uint64_t id, uint32_t n_token) {
  ServeRequest r;
  r.id = id;
  r.prompt.assign(n_token, 1);
  r.max_new_tokens = f.max_new;
  r.slo_ms = f.slo_ms;
  r.floor = f.floor;
  return r;
}

// Measured: every request through the real nodes, on a link shaped to `gbps` in process.
Result<Point> RunMeasured(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile, const Policy& pol, double gbps,
                          const std::vector<uint32_t>& prompts, const std::vector<double>& arrivals) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Bed> bed, Bed::For(f, sm, gbps, profile, pol, prompts));
  std::map<std::string, double> quality_of;
  for (const ProfileEntry& e : profile.pareto) quality_of[e.spec] = e.quality;
  std::vector<ServeRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i) requests.push_back(DriverRequest(f, i + 1, prompts[i]));
  // JCT from each scheduled arrival to the answer, at the client.
  std::vector<Result<ServeResponse>> answers = DriveArrivals(bed->serve, requests, arrivals);
  Point p;
  p.gbps = gbps;
  p.policy = pol.name;
  std::vector<double> jct, ttft;
  double compute = 0, total = 0, q = 0;
  uint32_t ok_slo = 0;
  for (const ServeResponse& resp : Answers(answers, &p)) {
    const ServeResponse* r = &resp;
    const StageTimings& t = r->timings;
    jct.push_back(t.total_s * 1e3);
    const double first = (t.total_s - t.generate_s) * 1e3;  // KV ready at the decode node
    ttft.push_back(first);
    ok_slo += first <= f.slo_ms;
    compute += t.prefill_s + t.generate_s;
    total += t.total_s;
    p.wire_bytes += double(r->wire_bytes);
    const double rq = r->strategy == "none" ? 1.0 : pol.spec.empty() ? quality_of[r->strategy] : pol.quality;
    q += rq;
    p.floor_violations += rq < f.floor;
    p.choices[r->strategy == "none" ? "none" : ShortSpec(r->strategy)]++;
  }
  bed.reset();
  if (jct.empty()) return Status::Unavailable("every request of " + pol.name + " at " + json(gbps).dump() + " Gbit/s failed");
  double sum = 0;
  for (double v : jct) sum += v;
  p.mean_ms = sum / jct.size();
  p.p50_ms = Percentile(jct, 0.5);
  p.p99_ms = Percentile(jct, 0.99);
  p.ttft_p99_ms = Percentile(ttft, 0.99);
  p.slo_attainment = double(ok_slo) / prompts.size();
  const double span = arrivals.back() + p.mean_ms / 1e3;
  p.goodput = ok_slo / std::max(1e-9, span);
  p.quality = q / jct.size();
  p.compute_share = compute / std::max(1e-12, total);
  return p;
}

// One point from its repeats: each figure the mean of the repeats' (counts summed), with the 95%
// intervals of the JCT and TTFT figures.
Point Aggregate(const std::vector<Point>& reps) {
  Point a = reps.front();
  a.repeats = uint32_t(reps.size());
  std::vector<double> mean, p50, p99, ttft;
  a.slo_attainment = a.goodput = a.quality = a.wire_bytes = a.compute_share = 0;
  a.floor_violations = a.errors = 0;
  a.choices.clear();
  for (const Point& r : reps) {
    mean.push_back(r.mean_ms), p50.push_back(r.p50_ms), p99.push_back(r.p99_ms), ttft.push_back(r.ttft_p99_ms);
    a.slo_attainment += r.slo_attainment / reps.size();
    a.goodput += r.goodput / reps.size();
    a.quality += r.quality / reps.size();
    a.wire_bytes += r.wire_bytes / reps.size();
    a.compute_share += r.compute_share / reps.size();
    a.floor_violations += r.floor_violations;
    a.errors += r.errors;
    for (const auto& [k, v] : r.choices) a.choices[k] += v;
  }
  const MeanCi m = MeanCi95(mean), q50 = MeanCi95(p50), q99 = MeanCi95(p99), t99 = MeanCi95(ttft);
  a.mean_ms = m.mean, a.mean_ci = m.half_width;
  a.p50_ms = q50.mean, a.p50_ci = q50.half_width;
  a.p99_ms = q99.mean, a.p99_ci = q99.half_width;
  a.ttft_p99_ms = t99.mean, a.ttft_p99_ci = t99.half_width;
  a.repeat_means = mean;
  return a;
}

// Per-repeat ratios of two points' mean JCTs (num / den), paired by repeat: their mean and 95%
// interval.
MeanCi RatioOfMeans(const Point& num, const Point& den) {
  std::vector<double> r;
  for (size_t i = 0; i < std::min(num.repeat_means.size(), den.repeat_means.size()); ++i)
    if (den.repeat_means[i] > 0) r.push_back(num.repeat_means[i] / den.repeat_means[i]);
  return MeanCi95(r);
}

json CiJson(const MeanCi& m) { return {{"mean", m.mean}, {"ci95", m.half_width}, {"n", m.n}}; }

// Calibration: each policy's request alone on a measured link, against what its parts predict
// (kvserve/calibration.h). Points of a policy whose lone request is off are marked invalid.
Result<LoneRequestCheck> Calibrate(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile, const Policy& pol,
                                   double gbps, uint32_t prompt_tokens) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Bed> bed, Bed::For(f, sm, gbps, profile, pol, {prompt_tokens}));
  // Measured at the client, as the points are: with node processes, HTTP and the router count.
  std::vector<Result<ServeResponse>> answer = DriveArrivals(bed->serve, {DriverRequest(f, 1, prompt_tokens)}, {0.0});
  KV_RETURN_IF_ERROR(answer[0].status());
  const ServeResponse& out = answer[0].value();
  LoneRequestCheck c = CheckLoneRequest(out, sm, gbps, prompt_tokens, f.max_new, {.relative = f.calibration_tolerance});
  c.policy = pol.name;
  return c;
}

json CalibrationJson(const LoneRequestCheck& c) {
  json stages = json::object();
  for (const StageCheck& s : c.stages) stages[s.stage] = {{"measured_ms", s.measured_s * 1e3}, {"predicted_ms", s.predicted_s * 1e3}};
  json j = {{"gbps", c.gbps}, {"policy", c.policy}, {"strategy", c.strategy}, {"measured_ms", c.measured_s * 1e3},
            {"predicted_ms", c.predicted_s * 1e3}, {"ratio", c.predicted_s > 0 ? c.measured_s / c.predicted_s : 0.0},
            {"stages", stages}, {"valid", c.valid}};
  if (!c.valid) j["fault"] = c.fault;
  return j;
}

// Modelled: the simulator's prediction from the measured stage speeds, for links above what
// this machine carries.
// The simulator's replay of `pol` on a steady link, from the stage speeds measured on this
// machine (the profile's, or the strategy table's); latencies are arrival to KV decoded.
// The strategies the simulator gives `pol`: the profile's for adaptive, its own for a static one.
std::vector<StrategyCost> PolicyCosts(const Profile& profile, const Policy& pol) {
  if (pol.name == "adaptive") return StrategiesFromProfile(profile);
  if (pol.name == "none") return {};
  return {{pol.spec, pol.name, pol.quality, pol.ratio, pol.encode_gbps * 1e9, pol.decode_gbps * 1e9}};
}

Result<PolicyReport> SimulatePolicy(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile, const Policy& pol,
                                    double gbps, const std::vector<uint32_t>& prompts, const std::vector<double>& arrivals) {
  const std::vector<StrategyCost> costs = PolicyCosts(profile, pol);
  const std::string policy = pol.name == "adaptive" || pol.name == "none" ? pol.name : "static:" + pol.spec;
  std::vector<WorkloadRequest> w;
  for (size_t i = 0; i < prompts.size(); ++i) w.push_back({arrivals[i], prompts[i], "", f.slo_ms, f.floor});
  SimOptions o;
  o.kv_bytes_per_token = double(sm.kv_bytes_per_token());
  o.prefill_tokens_per_second = sm.prefill_tokens_per_second;
  o.codec_threads = f.threads;
  o.controller.pipelined = true;
  o.controller.n_layer = sm.n_layer;
  return Simulate(costs, {{0, gbps}}, w, policy, o);
}

// Capacity: the highest Poisson rate (requests/s) at which P99 TTFT stays within the SLO, by
// bisection on a log scale over 200 simulated requests (modelled, as the label says).
Result<double> ModelledCapacity(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile, const Policy& pol,
                                double gbps, uint32_t prompt_tokens) {
  const std::vector<uint32_t> prompts(200, prompt_tokens);
  auto meets = [&](double rate) -> Result<bool> {
    std::mt19937_64 rng(f.seed + 17);
    std::exponential_distribution<double> gap(rate);
    std::vector<double> arrivals;
    double t = 0;
    for (size_t i = 0; i < prompts.size(); ++i) arrivals.push_back(t), t += gap(rng);
    KV_ASSIGN_OR_RETURN(PolicyReport rep, SimulatePolicy(f, sm, profile, pol, gbps, prompts, arrivals));
    return rep.p99_ms <= f.slo_ms;
  };
  double lo = 1e-3, hi = 1e4;
  KV_ASSIGN_OR_RETURN(bool any, meets(lo));
  if (!any) return 0.0;
  for (int i = 0; i < 30; ++i) {
    const double mid = std::sqrt(lo * hi);
    KV_ASSIGN_OR_RETURN(bool ok, meets(mid));
    (ok ? lo : hi) = mid;
  }
  return lo;
}

Result<Point> RunModelled(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile, const Policy& pol, double gbps,
                          const std::vector<uint32_t>& prompts, const std::vector<double>& arrivals) {
  KV_ASSIGN_OR_RETURN(PolicyReport rep, SimulatePolicy(f, sm, profile, pol, gbps, prompts, arrivals));
  const std::vector<StrategyCost> costs = PolicyCosts(profile, pol);
  Point p;
  p.gbps = gbps;
  p.policy = pol.name;
  p.measured = false;
  const double gen_ms = (f.max_new - 1) / sm.decode_tokens_per_second * 1e3;
  std::vector<double> jct;
  for (double v : rep.latencies_ms) jct.push_back(v + gen_ms);
  double sum = 0;
  for (double v : jct) sum += v;
  p.mean_ms = sum / jct.size();
  p.p50_ms = Percentile(jct, 0.5);
  p.p99_ms = Percentile(jct, 0.99);
  p.ttft_p99_ms = rep.p99_ms;
  uint32_t ok = 0;
  for (double v : rep.latencies_ms) ok += v <= f.slo_ms;
  p.slo_attainment = double(ok) / jct.size();
  p.goodput = ok / std::max(1e-9, arrivals.back() + p.mean_ms / 1e3);
  std::map<std::string, double> quality_of = {{"none", 1.0}};
  for (const StrategyCost& c : costs) quality_of[c.name] = c.quality;
  double q = 0;
  for (const auto& [name, count] : rep.choices) {
    p.choices[name] = count;
    q += quality_of.count(name) ? quality_of[name] * count : count;
  }
  p.quality = q / jct.size();
  p.floor_violations = rep.floor_violations;
  return p;
}

// `what` names the plotted figure (each point's mean_ms); hollow points are modelled.
std::string PlotSvg(const std::vector<Point>& points, const std::vector<Policy>& policies, double ceiling,
                    const std::string& what = "mean JCT") {
  const double W = 720, H = 420, L = 70, R = 170, T = 30, B = 50;
  double lo = 1e30, hi = 0, gmin = 1e30, gmax = 0;
  for (const Point& p : points) lo = std::min(lo, p.mean_ms), hi = std::max(hi, p.mean_ms), gmin = std::min(gmin, p.gbps), gmax = std::max(gmax, p.gbps);
  lo = std::pow(10, std::floor(std::log10(std::max(1e-3, lo))));
  hi = std::pow(10, std::ceil(std::log10(std::max(lo * 10, hi))));
  if (gmax <= gmin) gmax = gmin * 10;
  auto x = [&](double g) { return L + (std::log(g) - std::log(gmin)) / (std::log(gmax) - std::log(gmin)) * (W - L - R); };
  auto y = [&](double v) { return H - B - (std::log(v) - std::log(lo)) / (std::log(hi) - std::log(lo)) * (H - T - B); };
  const char* colours[] = {"#000000", "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"};
  char b[512];
  std::string s = "<svg xmlns='http://www.w3.org/2000/svg' width='720' height='420' font-family='sans-serif' font-size='12'>\n";
  s += "<rect width='100%' height='100%' fill='white'/>\n";
  std::snprintf(b, sizeof b, "<text x='%g' y='18'>%s vs link bandwidth (hollow: modelled, above the %.1f Gbit/s link ceiling)</text>\n", L,
                what.c_str(), ceiling);
  s += b;
  for (double v = lo; v <= hi * 1.001; v *= 10) {
    std::snprintf(b, sizeof b, "<line x1='%g' x2='%g' y1='%g' y2='%g' stroke='#ddd'/><text x='%g' y='%g' text-anchor='end'>%g ms</text>\n",
                  L, W - R, y(v), y(v), L - 6, y(v) + 4, v);
    s += b;
  }
  std::vector<double> gs;
  for (const Point& p : points) if (std::find(gs.begin(), gs.end(), p.gbps) == gs.end()) gs.push_back(p.gbps);
  for (double g : gs) {
    std::snprintf(b, sizeof b, "<text x='%g' y='%g' text-anchor='middle'>%g</text>\n", x(g), H - B + 18, g);
    s += b;
  }
  std::snprintf(b, sizeof b, "<text x='%g' y='%g' text-anchor='middle'>Gbit/s</text>\n", (L + W - R) / 2, H - 12);
  s += b;
  for (size_t k = 0; k < policies.size(); ++k) {
    const char* c = colours[k % 8];
    std::string path;
    for (const Point& p : points) {
      if (p.policy != policies[k].name) continue;
      std::snprintf(b, sizeof b, "%s%g,%g", path.empty() ? "" : " ", x(p.gbps), y(p.mean_ms));
      path += b;
      std::snprintf(b, sizeof b, "<circle cx='%g' cy='%g' r='4' fill='%s' stroke='%s'/>\n", x(p.gbps), y(p.mean_ms),
                    p.measured ? c : "white", c);
      s += b;
    }
    std::snprintf(b, sizeof b, "<polyline points='%s' fill='none' stroke='%s'/>\n<text x='%g' y='%g' fill='%s'>%s</text>\n",
                  path.c_str(), c, W - R + 10, T + 20 + 18.0 * k, c, policies[k].name.c_str());
    s += b;
  }
  return s + "</svg>\n";
}

// Policies: none, adaptive, and the static methods of the strategy table (with the quality,
// ratio and speeds that table measured on a real model and this machine).
Result<std::vector<Policy>> LoadPolicies(const E2eFlags& f) {
  std::vector<Policy> policies = {{"none", "none"}, {"adaptive", ""}};
  KV_ASSIGN_OR_RETURN(ByteBuffer text, ReadFile(f.table));
  const json t = json::parse(text.begin(), text.end(), nullptr, false);
  if (t.is_discarded() || !t.contains("rows")) return Status::Corrupt("strategy table '" + f.table + "' is not a table JSON");
  for (const std::string& name : f.statics) {
    bool found = false;
    for (const json& row : t["rows"]) {
      if (row.value("name", "") != name) continue;
      policies.push_back({"static:" + name, row["spec"], row["relative_accuracy"], row["ratio"], row["encode_gbps"],
                          row["decode_gbps"]});
      found = true;
    }
    if (!found) return Status::InvalidArgument("static policy '" + name + "' is not a row of " + f.table);
  }
  return policies;
}

// The fields of a point both modes report.
json PointJson(const Point& p) {
  return {{"gbps", p.gbps}, {"policy", p.policy}, {"measured", p.measured}, {"mean_ms", p.mean_ms},
          {"p50_ms", p.p50_ms}, {"p99_ms", p.p99_ms}, {"ttft_p99_ms", p.ttft_p99_ms},
          {"slo_attainment", p.slo_attainment}, {"goodput_rps", p.goodput}, {"wire_bytes", p.wire_bytes},
          {"quality", p.quality}, {"floor_violations", p.floor_violations}, {"errors", p.errors},
          {"compute_share", p.compute_share}, {"choices", p.choices}, {"valid", p.valid}, {"repeats", p.repeats},
          {"ci95", {{"mean_ms", p.mean_ci}, {"p50_ms", p.p50_ci}, {"p99_ms", p.p99_ci}, {"ttft_p99_ms", p.ttft_p99_ci}}},
          {"repeat_mean_ms", p.repeat_means}};
}

Status WriteText(const std::string& path, const std::string& text) {
  return WriteFileAtomic(path, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

std::string CoreName(int cpu) { return cpu < 0 ? "unpinned" : std::to_string(cpu); }

// The fields every e2e result starts with: what ran, the compute model, the link ceiling, the load.
json RunHeader(const E2eFlags& f, const SyntheticModel& sm, double ceiling, const char* mode, const char* note) {
  return {{"mode", mode},
          {"kv_shape", sm.name},
          {"kv_bytes_per_token", sm.kv_bytes_per_token()},
          {"compute_model", {{"prefill_tokens_per_second", sm.prefill_tokens_per_second},
                             {"decode_tokens_per_second", sm.decode_tokens_per_second},
                             {"gpu", sm.gpu},
                             {"tensor_parallel", sm.tensor_parallel},
                             {"derived", f.prefill_tps == 0 && f.decode_tps == 0},
                             {"note", note}}},
          {"link_ceiling_gbps", ceiling},
          {"requests", f.requests},
          {"max_new_tokens", f.max_new},
          {"load", f.load},
          {"arrival", f.arrival},
          {"slo_ms", f.slo_ms},
          {"floor", f.floor},
          {"codec_threads", f.threads},
          {"nodes", f.nodes},
          {"link", f.link_used},
          {"link_note", f.link_note},
          {"codec", {{"runs_on", "host CPU"},
                     {"threads_per_node", f.threads},
                     {"cores_on_machine", std::thread::hardware_concurrency()},
                     {"cores", f.nodes == "process" ? json{{"prefill", CoreName(f.cpu_prefill)}, {"decode", CoreName(f.cpu_decode)},
                                                           {"router", CoreName(f.cpu_router)}}
                                                     : json("shared")},
                     {"nodes", f.nodes == "process"
                                   ? "separate processes (router, prefill, decode), each pinned to its core; the driver in the bench process"
                                   : "one process: prefill and decode nodes share these cores"}}}};
}

// What the link kind carries on this machine, read three times: one reading on a noisy machine
// decided measured or modelled by chance. The lowest is the ceiling; all are reported. Loopback
// TCP for the token bucket; for the kernel's link, the same veth between two namespaces with no
// rate set.
Result<std::vector<double>> LinkCeilingReadings(const E2eFlags& f) {
  const std::unique_ptr<Transport> probe = MakeTcpTransport();
  std::unique_ptr<NetnsLink> veth;
  LinkEnds ends;
  if (f.link_used == "netns") {
    KV_ASSIGN_OR_RETURN(veth, NetnsLink::Up(SourceDir() + "/scripts/netns-link.sh", NetnsPrefix(), 0));
    ends = {veth->receiver(), NetnsLink::kReceiverIp, veth->sender()};
  }
  std::vector<double> readings;
  for (int i = 0; i < 3; ++i) {
    KV_ASSIGN_OR_RETURN(LinkMeasurement link, MeasureLink(probe.get(), "", 128, ends));
    readings.push_back(link.gbps);
  }
  return readings;
}

// Resolves --nodes, --link and --cpus for this machine: the process testbed by default (pd), the
// kernel's link where this process may make namespaces, and one core per node where there are
// cores enough. Says on stderr what it fell back from.
Status ResolveTestbed(E2eFlags* f) {
  if (f->nodes.empty()) f->nodes = f->mode == "pd" ? "process" : "inproc";
  if (f->nodes == "process" && f->mode != "pd") return Status::InvalidArgument("--nodes process is for --mode pd; pool mode runs in process");
  if (f->nodes == "process" && (f->prefill_tps > 0 || f->decode_tps > 0)) {
    return Status::InvalidArgument("--prefill-tps/--decode-tps set the in-process nodes' compute; node processes take it from "
                                   "--kv-shape and --gpu (or use --nodes inproc)");
  }
  if (f->nodes == "inproc") {
    if (f->link == "netns") return Status::InvalidArgument("--link netns needs --nodes process (the namespaces hold processes)");
    f->link_used = "shaper";
    f->link_note = "in-process token bucket on loopback TCP";
    return Status::Ok();
  }
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return Status::IoError("cannot find this executable (/proc/self/exe) to start the node processes");
  f->kvserve_exe.assign(exe, size_t(n));
  const int cores = int(std::thread::hardware_concurrency());
  if (f->cpus == "auto") {
    // Prefill and decode each get a core; the router and the driver one of their own if any is left.
    if (cores >= 2) f->cpu_prefill = 0, f->cpu_decode = 1;
    if (cores >= 3) f->cpu_router = 2;
  } else if (f->cpus != "none") {
    int* slot[] = {&f->cpu_prefill, &f->cpu_decode, &f->cpu_router};
    size_t k = 0, at = 0;
    const std::string& list = f->cpus;
    while (at <= list.size()) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, comma - at);
      char* end = nullptr;
      const long v = std::strtol(item.c_str(), &end, 10);
      if (k >= 3 || item.empty() || *end != 0 || v < 0 || v >= cores) {
        return Status::InvalidArgument("--cpus '" + list + "': PREFILL,DECODE[,ROUTER] cores below " + std::to_string(cores) +
                                       ", or auto, or none");
      }
      *slot[k++] = int(v);
      at = comma + 1;
    }
    if (k < 2) return Status::InvalidArgument("--cpus '" + list + "': give the prefill and the decode node's cores");
  }
  f->link_used = f->link == "auto" ? "netns" : f->link;
  if (f->link_used == "netns") {
    // A probe: the namespaces this run would make, made and removed once.
    auto probe = NetnsLink::Up(SourceDir() + "/scripts/netns-link.sh", NetnsPrefix(), 0);
    if (!probe.ok()) {
      if (f->link == "netns" || probe.status().code() != StatusCode::kUnavailable) return probe.status();
      f->link_used = "shaper";
      f->link_note = "in the prefill process: a token bucket on loopback TCP (the kernel's link was not allowed: " +
                     probe.status().message() + ")";
      std::fprintf(stderr, "bench e2e: %s\n", f->link_note.c_str());
      return Status::Ok();
    }
  }
  f->link_note = f->link_used == "netns"
                     ? "veth between two network namespaces, shaped by the kernel (tc tbf); prefill and router in one, decode in the other"
                     : "in the prefill process: a token bucket on loopback TCP";
  return Status::Ok();
}

// The synthetic stand-in of --kv-shape on --gpu, with the flags' compute rates where given.
Result<SyntheticModel> ModelOf(const E2eFlags& f) {
  KV_ASSIGN_OR_RETURN(SyntheticModel sm, SyntheticModelByName(f.kv_shape, f.gpu));
  if (f.prefill_tps > 0) sm.prefill_tokens_per_second = f.prefill_tps;
  if (f.decode_tps > 0) sm.decode_tokens_per_second = f.decode_tps;
  return sm;
}

Status RunPoolMode(const E2eFlags& f);

Status RunE2e(E2eFlags f) {
  StopTestbedOnSignal();  // before any thread starts
  KV_RETURN_IF_ERROR(ResolveTestbed(&f));
  if (f.mode == "pool") {
    if (f.quick) {
      if (!f.bandwidths_given) f.bandwidths = {2, 15};
      f.requests = std::min<uint32_t>(f.requests, 8), f.prompt_tokens = std::min<uint32_t>(f.prompt_tokens, 1024);
    }
    return RunPoolMode(f);
  }
  if (f.quick) {
    if (!f.bandwidths_given) f.bandwidths = {1, 10};
    if (!f.repeats_given) f.repeats = 1;
    f.requests = std::min<uint32_t>(f.requests, 6), f.prompt_tokens = std::min<uint32_t>(f.prompt_tokens, 1024);
  }
  KV_ASSIGN_OR_RETURN(SyntheticModel sm, ModelOf(f));
  KV_ASSIGN_OR_RETURN(Profile profile, LoadProfile(f.profile));
  KV_ASSIGN_OR_RETURN(std::vector<Policy> policies, LoadPolicies(f));
  // Prompts: fixed, or drawn from a workload file's lengths; arrivals at the rate that puts the
  // uncompressed link at the offered load.
  std::mt19937_64 rng(f.seed);
  std::vector<uint32_t> prompts;
  if (!f.workload.empty()) {
    KV_ASSIGN_OR_RETURN(std::vector<WorkloadRequest> w, LoadWorkload(f.workload));
    for (uint32_t i = 0; i < f.requests; ++i) prompts.push_back(w[i % w.size()].prompt_tokens);
  } else {
    prompts.assign(f.requests, f.prompt_tokens);
  }
  double mean_tokens = 0;
  for (uint32_t n : prompts) mean_tokens += n;
  mean_tokens /= prompts.size();
  // The link ceiling of this machine, measured now with the same transport.
  KV_ASSIGN_OR_RETURN(std::vector<double> readings, LinkCeilingReadings(f));
  const double ceiling = *std::min_element(readings.begin(), readings.end());
  std::vector<Point> points;
  json ratios = json::array();
  json pipelining;
  // The instrument first: every policy alone on every measured link.
  std::vector<LoneRequestCheck> checks;
  for (double gbps : f.bandwidths) {
    if (gbps > 0.9 * ceiling) continue;
    for (const Policy& pol : policies) {
      if (StderrIsTerminal() || !f.as_json) std::fprintf(stderr, "bench e2e: calibrating %s at %g Gbit/s...\n", pol.name.c_str(), gbps);
      KV_ASSIGN_OR_RETURN(LoneRequestCheck c, Calibrate(f, sm, profile, pol, gbps, prompts[0]));
      checks.push_back(std::move(c));
    }
  }
  auto calibrated = [&](double gbps, const std::string& policy) {
    for (const LoneRequestCheck& c : checks)
      if (c.gbps == gbps && c.policy == policy) return c.valid;
    return true;  // modelled points: the simulator's, checked against the measured ones above
  };
  for (double gbps : f.bandwidths) {
    const double rate = f.arrival == "burst" ? 0 : f.load * gbps * 1e9 / 8 / (mean_tokens * sm.kv_bytes_per_token());
    std::vector<double> arrivals;
    double t = 0;
    std::exponential_distribution<double> gap(rate > 0 ? rate : 1);
    for (size_t i = 0; i < prompts.size(); ++i) {
      arrivals.push_back(t);
      if (rate > 0) t += gap(rng);
    }
    const bool measured = gbps <= 0.9 * ceiling;
    // Repeats with fresh nodes, the policies in a rotating order, so a slow spell of the machine
    // falls on each policy in turn; the same arrivals for every repeat and policy (paired). The
    // simulator's modelled points are deterministic: run once.
    const uint32_t repeats = measured ? f.repeats : 1;
    std::map<std::string, std::vector<Point>> reps;
    for (uint32_t r = 0; r < repeats; ++r) {
      for (size_t k = 0; k < policies.size(); ++k) {
        const Policy& pol = policies[(k + r) % policies.size()];
        if (StderrIsTerminal() || !f.as_json) {
          std::fprintf(stderr, "bench e2e: %s at %g Gbit/s (%s, repeat %u of %u)...\n", pol.name.c_str(), gbps,
                       measured ? "measured" : "modelled", r + 1, repeats);
        }
        auto p = measured ? RunMeasured(f, sm, profile, pol, gbps, prompts, arrivals)
                          : RunModelled(f, sm, profile, pol, gbps, prompts, arrivals);
        KV_RETURN_IF_ERROR(p.status());
        reps[pol.name].push_back(std::move(p).value());
      }
    }
    const size_t first = points.size();
    for (const Policy& pol : policies) {
      Point p = Aggregate(reps[pol.name]);
      KV_ASSIGN_OR_RETURN(p.capacity_rps, ModelledCapacity(f, sm, profile, pol, gbps, uint32_t(std::lround(mean_tokens))));
      p.valid = calibrated(gbps, pol.name);
      points.push_back(std::move(p));
    }
    // Ratios at this bandwidth, paired by repeat: none over each policy, and the best static
    // (lowest mean JCT) over adaptive.
    const Point* none = nullptr;
    const Point* adaptive = nullptr;
    const Point* best = nullptr;
    for (size_t i = first; i < points.size(); ++i) {
      const Point& p = points[i];
      if (p.policy == "none") none = &p;
      if (p.policy == "adaptive") adaptive = &p;
      if (p.policy.rfind("static:", 0) == 0 && (best == nullptr || p.mean_ms < best->mean_ms)) best = &p;
    }
    for (size_t i = first; none && i < points.size(); ++i) points[i].vs_none = RatioOfMeans(*none, points[i]);
    if (none && adaptive) {
      json r = {{"gbps", gbps}, {"measured", measured}, {"none_over_adaptive", CiJson(RatioOfMeans(*none, *adaptive))}};
      if (best) r["best_static"] = best->policy, r["best_static_over_adaptive"] = CiJson(RatioOfMeans(*best, *adaptive));
      ratios.push_back(r);
    }
    if (measured && pipelining.is_null()) {
      // One request alone on this link with a compressing strategy: are the three stages overlapped?
      const std::string strategy = policies.size() > 2 ? policies[2].spec : "quant|rans";
      KV_ASSIGN_OR_RETURN(std::unique_ptr<Bed> bed, Bed::Start(f, sm, gbps, nullptr, strategy, {prompts[0]}));
      ServeRequest r = DriverRequest(f, 1, prompts[0]);
      r.max_new_tokens = 1;
      KV_ASSIGN_OR_RETURN(ServeResponse out, bed->serve(r));
      const StageTimings& st = out.timings;
      pipelining = {{"gbps", gbps}, {"strategy", strategy}, {"encode_ms", st.encode_s * 1e3}, {"wire_ms", st.wire_s * 1e3},
                    {"decode_ms", st.decode_s * 1e3}, {"sum_ms", (st.encode_s + st.wire_s + st.decode_s) * 1e3},
                    {"max_ms", std::max({st.encode_s, st.wire_s, st.decode_s}) * 1e3}, {"observed_ms", st.transfer_s * 1e3}};
    }
  }
  json out = RunHeader(f, sm, ceiling, "pd", "synthetic KV and modelled GPU compute; codec, transport and link are real");
  out["mean_prompt_tokens"] = mean_tokens;
  out["ttft_definition"] = "arrival at the prefill node to the KV decoded at the decode node";
  out["pipelining"] = pipelining;
  json pts = json::array();
  for (const Point& p : points) {
    json j = PointJson(p);
    j["capacity_rps_modelled"] = p.capacity_rps;
    j["vs_none"] = CiJson(p.vs_none);
    pts.push_back(std::move(j));
  }
  out["points"] = pts;
  out["ratios"] = ratios;
  out["repeats"] = f.repeats;
  out["link_ceiling_readings_gbps"] = readings;
  out["statistics"] = "each measured point: the mean of its repeats' figures (fresh nodes, policies in rotating order, the "
                      "same arrivals), ci95 = half-width of the 95% Student-t interval; percentiles by linear interpolation; "
                      "ratios paired by repeat";
  json cal = json::array();
  size_t off = 0;
  for (const LoneRequestCheck& c : checks) cal.push_back(CalibrationJson(c)), off += !c.valid;
  out["calibration"] = {{"tolerance", {{"relative", f.calibration_tolerance}, {"absolute_ms", CalibrationTolerance{}.absolute_s * 1e3}}},
                        {"checks", cal},
                        {"valid", off == 0}};
  // Said after the figures are written, so a failed calibration still leaves them to look at.
  auto verdict = [&]() -> Status {
    if (off == 0 || f.allow_uncalibrated) return Status::Ok();
    std::string which;
    for (const LoneRequestCheck& c : checks) {
      if (c.valid) continue;
      char b[160];
      std::snprintf(b, sizeof b, "%s%s at %g Gbit/s: %.0f ms against %.0f predicted (%s)", which.empty() ? "" : "; ",
                    c.policy.c_str(), c.gbps, c.measured_s * 1e3, c.predicted_s * 1e3, c.fault.c_str());
      which += b;
    }
    return Status::OutOfRange("calibration: " + std::to_string(off) + " lone request(s) off their prediction by more than " +
                              json(f.calibration_tolerance * 100).dump() + "% or 50 ms — " + which +
                              "; their points say \"valid\": false (--allow-uncalibrated exits 0)");
  };
  if (!f.svg.empty()) KV_RETURN_IF_ERROR(WriteText(f.svg, PlotSvg(points, policies, ceiling)));
  if (f.as_json) {
    std::printf("%s\n", out.dump(1).c_str());
    std::fflush(stdout);  // whole, before the verdict's line on stderr
    return verdict();
  }
  std::printf("calibration (each policy alone; predicted = prefill + frames pipelined at the link rate + generation):\n");
  for (const LoneRequestCheck& c : checks) {
    std::printf("  %g Gbit/s %-18s %8.1f ms measured, %8.1f predicted (%.2fx)%s%s\n", c.gbps, c.policy.c_str(), c.measured_s * 1e3,
                c.predicted_s * 1e3, c.predicted_s > 0 ? c.measured_s / c.predicted_s : 0.0, c.valid ? "" : "  OFF: ",
                c.valid ? "" : c.fault.c_str());
  }
  std::printf("PD end to end: %s KV (%.0f KiB/token), %u requests of %.0f prompt tokens, load %.2f, %s arrivals\n", sm.name.c_str(),
              sm.kv_bytes_per_token() / 1024.0, f.requests, mean_tokens, f.load, f.arrival.c_str());
  std::printf("link ceiling %.1f Gbit/s (lowest of %zu readings, %.1f to %.1f); %u repeats per measured point, mean ± 95%% CI\n",
              ceiling, readings.size(), ceiling, *std::max_element(readings.begin(), readings.end()), f.repeats);
  std::printf("%7s %-18s %17s %9s %9s %10s %6s %8s %7s %14s %s\n", "Gbit/s", "policy", "mean ms", "p50 ms", "p99 ms", "TTFT p99",
              "SLO", "quality", "kind", "vs none", "capacity rps (modelled)");
  for (const Point& p : points) {
    std::printf("%7g %-18s %9.1f ±%6.1f %9.1f %9.1f %10.1f %5.0f%% %8.4f %7s %6.2fx ±%5.2f %8.2f%s\n", p.gbps, p.policy.c_str(),
                p.mean_ms, p.mean_ci, p.p50_ms, p.p99_ms, p.ttft_p99_ms, 100 * p.slo_attainment, p.quality,
                p.measured ? "meas." : "model", p.vs_none.mean, p.vs_none.half_width, p.capacity_rps, p.valid ? "" : "  (invalid)");
  }
  if (!pipelining.is_null()) {
    std::printf("pipelining at %g Gbit/s (%s): encode %.1f + wire %.1f + decode %.1f = %.1f ms; slowest %.1f; observed %.1f ms\n",
                pipelining["gbps"].get<double>(), ShortSpec(pipelining["strategy"].get<std::string>()).c_str(),
                pipelining["encode_ms"].get<double>(), pipelining["wire_ms"].get<double>(), pipelining["decode_ms"].get<double>(),
                pipelining["sum_ms"].get<double>(), pipelining["max_ms"].get<double>(), pipelining["observed_ms"].get<double>());
  }
  std::fflush(stdout);
  return verdict();
}


// ---- --mode pool: KV disaggregation --------------------------------------------------------------
// Requests whose prompts are a shared document (prefix) plus their own suffix, through a PoolNode
// per policy, with the pool behind a link shaped to each bandwidth. TTFT is what counts here.
Status RunPoolMode(const E2eFlags& f) {
  KV_ASSIGN_OR_RETURN(SyntheticModel sm, ModelOf(f));
  KV_ASSIGN_OR_RETURN(Profile profile, LoadProfile(f.profile));
  KV_ASSIGN_OR_RETURN(std::vector<Policy> policies, LoadPolicies(f));
  policies.insert(policies.begin() + 1, Policy{"recompute", "recompute"});
  std::unique_ptr<KvPool> pool;
  if (f.backend == "embedded") {
    pool = MakeEmbeddedPool({.capacity_bytes = f.pool_capacity_mib << 20});
  } else {
    if (f.pool_address.empty()) {
      return Status::InvalidArgument("--backend " + f.backend + " needs --pool-address HOST:PORT of a running server "
                                     "(e.g. redis-server --port 6390 --save '')");
    }
    RedisPoolOptions ro;
    ro.address = f.pool_address;
    ro.cluster = f.backend == "redis-cluster";
    ro.timeout_s = 30;
    KV_ASSIGN_OR_RETURN(pool, MakeRedisPool(ro));
  }
  const uint32_t prefix = f.prompt_tokens, n = prefix + f.suffix_tokens;
  // Which document each request reuses: a new one, or with probability `reuse` one seen before.
  std::mt19937_64 rng(f.seed);
  std::vector<uint32_t> doc_of;
  uint32_t n_docs = 0;
  for (uint32_t i = 0; i < f.requests; ++i) {
    const bool reuse = n_docs > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < f.reuse;
    doc_of.push_back(reuse ? uint32_t(rng() % n_docs) : n_docs++);
  }
  auto prompt_of = [&](uint32_t i) {
    std::vector<int> p(n);
    for (uint32_t j = 0; j < n; ++j) {
      const uint64_t salt = j < prefix ? doc_of[i] : 1000003ull + i;
      p[j] = int(1 + (salt * 7919 + uint64_t(j) * 104729) % 30000);
    }
    return p;
  };
  KV_ASSIGN_OR_RETURN(std::vector<double> readings, LinkCeilingReadings(f));
  const double ceiling = *std::min_element(readings.begin(), readings.end());
  const double prefix_bytes = double(prefix) * sm.kv_bytes_per_token();
  std::map<std::string, double> quality_of = {{"none", 1.0}};
  for (const ProfileEntry& e : profile.pareto) quality_of[e.spec] = e.quality;
  for (const Policy& p : policies) if (!p.spec.empty() && p.name != "recompute") quality_of[p.spec] = p.quality;
  std::vector<Point> points;
  for (double gbps : f.bandwidths) {
    // Poisson arrivals at the rate that loads the uncompressed pool link to `load` with hits.
    const double rate = f.arrival == "burst" ? 0 : f.load * gbps * 1e9 / 8 / prefix_bytes;
    std::mt19937_64 arng(f.seed + 1);
    std::exponential_distribution<double> gap(rate > 0 ? rate : 1);
    std::vector<double> arrivals;
    double t = 0;
    for (uint32_t i = 0; i < f.requests; ++i) arrivals.push_back(t), t += rate > 0 ? gap(arng) : 0;
    for (const Policy& pol : policies) {
      if (StderrIsTerminal() || !f.as_json) std::fprintf(stderr, "bench e2e --mode pool: %s at %g Gbit/s...\n", pol.name.c_str(), gbps);
      KV_RETURN_IF_ERROR(pool->Clear());
      LinkShaper shaper(gbps);
      PoolNodeOptions o;
      o.synthetic = &sm;
      o.pool = pool.get();
      o.pool_link = &shaper;
      o.chunk_tokens = f.chunk_tokens;
      o.policy = pol.name == "adaptive" ? "adaptive" : pol.spec;
      o.profile = &profile;
      o.assume_gbps = gbps;
      o.threads = Pool(f.threads);
      KV_ASSIGN_OR_RETURN(std::unique_ptr<PoolNode> node, PoolNode::Create(o));
      KV_RETURN_IF_ERROR(node->Prepare(n));
      std::vector<ServeRequest> requests;
      for (uint32_t i = 0; i < f.requests; ++i) {
        ServeRequest r = DriverRequest(f, i + 1, 0);
        r.prompt = prompt_of(i);
        requests.push_back(std::move(r));
      }
      PoolNode* served = node.get();
      std::vector<Result<ServeResponse>> answers =
          DriveArrivals([served](const ServeRequest& r) { return served->Serve(r); }, requests, arrivals);
      Point p;
      p.gbps = gbps;
      p.policy = pol.name;
      p.measured = true;
      std::vector<double> jct, ttft, hit_ttft;
      double q = 0, compute = 0, total = 0;
      uint32_t ok_slo = 0;
      for (const ServeResponse& resp : Answers(answers, &p)) {
        const ServeResponse* r = &resp;
        const StageTimings& st = r->timings;
        jct.push_back(st.total_s * 1e3);
        ttft.push_back(st.first_token_s * 1e3);
        if (r->cached_tokens > 0) hit_ttft.push_back(st.first_token_s * 1e3);
        ok_slo += st.first_token_s * 1e3 <= f.slo_ms;
        compute += st.prefill_s + st.generate_s;
        total += st.total_s;
        p.wire_bytes += double(r->wire_bytes);
        const double rq = r->cached_tokens > 0 ? quality_of.count(r->strategy) ? quality_of[r->strategy] : 0.0 : 1.0;
        q += rq;
        p.floor_violations += rq < f.floor;
        p.choices[r->pool_action == "fetch" ? (r->strategy == "none" ? "fetch:none" : "fetch:" + ShortSpec(r->strategy)) : r->pool_action]++;
      }
      if (jct.empty()) return Status::Unavailable("every request of " + pol.name + " failed");
      auto mean = [](const std::vector<double>& v) {
        double s = 0;
        for (double x : v) s += x;
        return v.empty() ? 0.0 : s / v.size();
      };
      p.mean_ms = mean(jct);
      p.p50_ms = Percentile(jct, 0.5);
      p.p99_ms = Percentile(jct, 0.99);
      p.ttft_mean_ms = mean(ttft);
      p.ttft_p99_ms = Percentile(ttft, 0.99);
      p.hit_ttft_mean_ms = mean(hit_ttft);
      p.hit_ttft_p99_ms = Percentile(hit_ttft, 0.99);
      p.hit_rate = double(hit_ttft.size()) / jct.size();
      p.slo_attainment = double(ok_slo) / f.requests;
      p.goodput = ok_slo / std::max(1e-9, arrivals.back() + p.mean_ms / 1e3);
      p.quality = q / jct.size();
      p.compute_share = compute / std::max(1e-12, total);
      points.push_back(std::move(p));
    }
  }
  json out = RunHeader(f, sm, ceiling, "pool", "synthetic KV and modelled GPU compute; codec, pool and link pacing are real");
  out["link_ceiling_readings_gbps"] = readings;
  out["backend"] = pool->name();
  out["pool_link"] = f.backend == "embedded" ? "in-process token bucket in front of the embedded pool"
                                             : "loopback TCP to the server, paced by an in-process token bucket";
  out["prefix_tokens"] = prefix;
  out["suffix_tokens"] = f.suffix_tokens;
  out["chunk_tokens"] = f.chunk_tokens;
  out["reuse"] = f.reuse;
  out["ttft_definition"] = "arrival at the node to the first token (prefix fetched or computed, suffix computed)";
  json pts = json::array();
  for (const Point& p : points) {
    json j = PointJson(p);
    j["machine_limited"] = f.backend != "embedded" && p.gbps > 0.9 * ceiling;
    j["ttft_mean_ms"] = p.ttft_mean_ms;
    j["hit_ttft_mean_ms"] = p.hit_ttft_mean_ms;
    j["hit_ttft_p99_ms"] = p.hit_ttft_p99_ms;
    j["hit_rate"] = p.hit_rate;
    pts.push_back(std::move(j));
  }
  out["points"] = pts;
  if (!f.svg.empty()) {
    std::vector<Point> plotted = points;
    for (Point& p : plotted) p.mean_ms = std::max(1e-3, p.ttft_mean_ms);
    KV_RETURN_IF_ERROR(WriteText(f.svg, PlotSvg(plotted, policies, f.backend == "embedded" ? 1e9 : ceiling, "mean TTFT")));
  }
  if (f.as_json) {
    std::printf("%s\n", out.dump(1).c_str());
    return Status::Ok();
  }
  std::printf("KV pool (%s): %s KV, %u requests, %u-token shared prefixes + %u, reuse %.2f, load %.2f; link ceiling %.1f Gbit/s\n",
              pool->name().c_str(), sm.name.c_str(), f.requests, prefix, f.suffix_tokens, f.reuse, f.load, ceiling);
  std::printf("%7s %-18s %6s %11s %11s %11s %6s %8s %9s %s\n", "Gbit/s", "policy", "hits", "TTFT ms", "hit TTFT", "TTFT p99",
              "SLO", "quality", "vs none", "choices");
  double none_ms = 0;
  for (const Point& p : points) {
    if (p.policy == "none") none_ms = p.hit_ttft_mean_ms;
    std::string ch;
    for (const auto& [k, v] : p.choices) ch += (ch.empty() ? "" : " ") + k + "=" + std::to_string(v);
    std::printf("%7g %-18s %5.0f%% %11.1f %11.1f %11.1f %5.0f%% %8.4f %8.2fx %s\n", p.gbps, p.policy.c_str(), 100 * p.hit_rate,
                p.ttft_mean_ms, p.hit_ttft_mean_ms, p.ttft_p99_ms, 100 * p.slo_attainment, p.quality,
                p.hit_ttft_mean_ms > 0 ? none_ms / p.hit_ttft_mean_ms : 0.0, ch.c_str());
  }
  return Status::Ok();
}

}  // namespace

void AddBenchE2eCommand(CLI::App& bench) {
  auto* c = bench.add_subcommand("e2e", "End-to-end PD serving across bandwidths and policies (JCT, TTFT, SLO, capacity)");
  auto f = std::make_shared<E2eFlags>();
  c->add_option("--mode", f->mode, "pd (prefill to decode node) | pool (prefix KV fetched from a pool)")
      ->capture_default_str()->check(CLI::IsMember({"pd", "pool"}));
  c->add_option("--reuse", f->reuse, "pool: probability that a request reuses a document seen before")->capture_default_str()->check(InRange(0, 1));
  c->add_option("--suffix-tokens", f->suffix_tokens, "pool: tokens after the shared prefix")->capture_default_str()->check(InRange(1, 1 << 16));
  c->add_option("--chunk-tokens", f->chunk_tokens, "pool: tokens per stored chunk")->capture_default_str()->check(InRange(1, 1 << 16));
  c->add_option("--backend", f->backend, "pool: embedded | redis | redis-cluster")->capture_default_str()
      ->check(CLI::IsMember({"embedded", "redis", "redis-cluster"}));
  c->add_option("--pool-address", f->pool_address, "pool: HOST:PORT of the Redis server (or a cluster node)");
  c->add_option("--pool-capacity-mib", f->pool_capacity_mib, "pool: embedded capacity (LRU beyond)")->capture_default_str()->check(InRange(1, 1 << 24));
  auto* bandwidths =
      c->add_option("--bandwidths", f->bandwidths, "link rates in Gbit/s")->delimiter(',')->capture_default_str()->check(InRange(1e-3, 1e4));
  c->add_option("--requests", f->requests, "requests per point")->capture_default_str()->check(InRange(1, 10000));
  auto* repeats = c->add_option("--repeats", f->repeats, "runs of each measured point (fresh nodes, policies rotating), for 95% intervals")
      ->capture_default_str()->check(InRange(1, 100));
  c->add_option("--prompt-tokens", f->prompt_tokens, "prompt length (without --workload); pool: the shared prefix")->capture_default_str()->check(InRange(1, 1 << 17));
  c->add_option("--workload", f->workload, "workload CSV whose prompt lengths are used in turn");
  c->add_option("--max-new", f->max_new, "generated tokens per request")->capture_default_str()->check(InRange(1, 1 << 16));
  c->add_option("--load", f->load, "offered load on the uncompressed link")->capture_default_str()->check(InRange(0.01, 10));
  c->add_option("--arrival", f->arrival, "poisson | burst")->capture_default_str()->check(CLI::IsMember({"poisson", "burst"}));
  c->add_option("--kv-shape", f->kv_shape, "synthetic KV shape: " + JoinNames(SyntheticShapeNames()))->capture_default_str()
      ->check(CLI::IsMember(SyntheticShapeNames()));
  c->add_option("--gpu", f->gpu, "GPU preset of the compute model: " + JoinNames(GpuPresetNames()) + " (docs/SERVING.md)")
      ->capture_default_str()->check(CLI::IsMember(GpuPresetNames()));
  c->add_option("--profile", f->profile, "profile for the adaptive policy")->capture_default_str();
  c->add_option("--table", f->table, "strategy table JSON with the static policies' specs and quality")->capture_default_str();
  c->add_option("--static", f->statics, "static policies (table row names)")->delimiter(',')->capture_default_str();
  c->add_option("--slo-ms", f->slo_ms, "TTFT objective per request")->capture_default_str()->check(InRange(1e-3, 1e9));
  c->add_option("--floor", f->floor, "quality floor")->capture_default_str()->check(InRange(0, 1.05));
  c->add_option("--prefill-tps", f->prefill_tps, "modelled prefill tokens/s (0: from --kv-shape and --gpu)")
      ->capture_default_str()->check(InRange(0, 1e9));
  c->add_option("--decode-tps", f->decode_tps, "modelled decode tokens/s per request (0: from --kv-shape and --gpu)")
      ->capture_default_str()->check(InRange(0, 1e9));
  c->add_option("--threads", f->threads, "codec threads")->capture_default_str()->check(InRange(1, 256));
  c->add_option("--seed", f->seed, "arrival seed")->capture_default_str();
  c->add_option("--svg", f->svg, "also write JCT vs bandwidth per policy (SVG)")->check(OutputPath());
  c->add_flag("--quick", f->quick,
              "6 requests of at most 1024 tokens (8 in pool mode), one repeat and two bandwidths unless --repeats and "
              "--bandwidths say (about a minute)");
  c->add_flag("--json", f->as_json, "machine-readable output");
  c->add_flag("--allow-uncalibrated", f->allow_uncalibrated,
              "exit 0 even when a policy's lone request is off its prediction (its points still say \"valid\": false)");
  c->add_option("--calibration-tolerance", f->calibration_tolerance,
                "how far (relative; 50 ms at least) a lone request may be from its prediction")
      ->capture_default_str()->check(InRange(0.001, 10));
  c->add_option("--nodes", f->nodes,
                "process: router, prefill and decode nodes as separate processes, each pinned to a core (pd default) | "
                "inproc: both nodes in this process (pool default)")
      ->check(CLI::IsMember({"process", "inproc"}));
  c->add_option("--link", f->link,
                "netns: a veth between two network namespaces shaped by the kernel (tc tbf; needs root) | shaper: a token "
                "bucket in the sending process | auto: netns where allowed")
      ->capture_default_str()->check(CLI::IsMember({"auto", "netns", "shaper"}));
  c->add_option("--cpus", f->cpus, "cores of the node processes: PREFILL,DECODE[,ROUTER] | auto (one each while cores last) | none")
      ->capture_default_str();
  c->add_option("--inject-send-delay-ns", f->inject_send_delay_ns,
                "test seam: extra sending time per byte, an overhead the calibration must catch (0: none)")
      ->capture_default_str()->check(InRange(0, 1e6));
  SetAction(c, [=]() {
    f->bandwidths_given = bandwidths->count() > 0;
    f->repeats_given = repeats->count() > 0;
    return RunE2e(*f);
  });
}

}  // namespace kvserve::cli
