// CLI: `bench e2e` — the whole PD path (router, prefill node with its controller, per-layer
// streaming over a shaped link, decode node; as processes by default) or the KV pool
// (--mode pool), across bandwidths and policies, with Poisson or burst arrivals. Flags, the
// signal handling, the router client and the output live here; the harness is library code
// (kvserve/e2e_bench.h, kvserve/testbed.h). Points the machine's link cannot carry are given by
// the simulator, labelled.
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "control/simulator.h"
#include "kvserve/calibration.h"
#include "kvserve/e2e_bench.h"
#include "kvserve/file.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "kvserve/stats.h"
#include "kvserve/testbed.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;
using Policy = E2ePolicy;
using Point = E2ePoint;

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
  std::string transport = "tcp";    // prefill to decode
  // Where the nodes run: "process" (each its own process, pinned) or "inproc"; the link: the
  // kernel's (netns), the in-process token bucket (shaper), or auto (netns where allowed).
  std::string nodes, link = "auto", cpus = "auto";
  // Measured capacity at this bandwidth (0: none): requests per run, search steps.
  double capacity_gbps = 0;
  uint32_t capacity_requests = 24;
  int capacity_steps = 4;
  // Resolved from them at the start of a run.
  std::string link_used, link_note, kvserve_exe;
  int cpu_prefill = -1, cpu_decode = -1, cpu_router = -1;
  // --mode pool
  double reuse = 0.8;
  uint32_t suffix_tokens = 64, chunk_tokens = kDefaultChunkTokens;
  std::string backend = "embedded", pool_address;
  uint64_t pool_capacity_mib = 8192;
};

// This run's namespaces: kb<pid>-a and kb<pid>-b (short enough for the veth names).
std::string NetnsPrefix() { return "kb" + std::to_string(::getpid() % 100000); }
std::string NetnsScript() { return SourceDir() + "/scripts/netns-link.sh"; }

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
      NetnsLink::Remove(NetnsScript(), NetnsPrefix());
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

// What every run of this benchmark shares, from the flags (resolved) and what they loaded.
E2eSetup SetupOf(const E2eFlags& f, const SyntheticModel& sm, const Profile& profile) {
  E2eSetup s;
  s.model = &sm;
  s.profile = &profile;
  s.profile_path = f.profile;
  s.max_new = f.max_new;
  s.slo_ms = f.slo_ms;
  s.floor = f.floor;
  s.threads = f.threads;
  s.pool = Pool(f.threads);
  s.nodes = f.nodes;
  s.link = f.link_used;
  s.kvserve_exe = f.kvserve_exe;
  s.netns_script = NetnsScript();
  s.netns_prefix = NetnsPrefix();
  s.cpu_prefill = f.cpu_prefill, s.cpu_decode = f.cpu_decode, s.cpu_router = f.cpu_router;
  s.send_delay_ns = f.inject_send_delay_ns;
  s.transport = f.transport;
  s.mode = f.mode;
  s.pool_backend = f.backend;
  s.pool_address = f.pool_address;
  s.chunk_tokens = f.chunk_tokens;
  s.suffix_tokens = f.suffix_tokens;
  s.pool_capacity_mib = f.pool_capacity_mib;
  s.wire_payload_share = f.link_used == "netns" ? kKernelLinkPayloadShare : 1.0;
  s.router_client = [](const std::string& address, const std::string& netns) { return RouterClient(address, netns, 600); };
  s.on_live = [](ProcessTestbed* t) {
    std::lock_guard<std::mutex> lock(g_live_mu);
    g_live = t;
  };
  return s;
}

void SayError(const Status& st) { std::fprintf(stderr, "bench e2e: %s\n", st.ToString().c_str()); }

json CiJson(const MeanCi& m) { return {{"mean", m.mean}, {"ci95", m.half_width}, {"n", m.n}}; }

json CalibrationJson(const LoneRequestCheck& c) {
  json stages = json::object();
  for (const StageCheck& s : c.stages) stages[s.stage] = {{"measured_ms", s.measured_s * 1e3}, {"predicted_ms", s.predicted_s * 1e3}};
  json j = {{"gbps", c.gbps}, {"policy", c.policy}, {"strategy", c.strategy}, {"measured_ms", c.measured_s * 1e3},
            {"predicted_ms", c.predicted_s * 1e3}, {"ratio", c.predicted_s > 0 ? c.measured_s / c.predicted_s : 0.0},
            {"stages", stages}, {"valid", c.valid},
            {"transfer_parts", {{"encode_ms", c.encode_s * 1e3}, {"send_ms", c.send_s * 1e3}, {"decode_ms", c.decode_s * 1e3},
                                {"wire_at_rate_ms", c.wire_at_rate_s * 1e3}}}};
  if (!c.valid) j["fault"] = c.fault;
  return j;
}

json CalibrationSection(const E2eFlags& f, const std::vector<LoneRequestCheck>& checks, double payload_share) {
  json cal = json::array();
  bool valid = true;
  for (const LoneRequestCheck& c : checks) cal.push_back(CalibrationJson(c)), valid = valid && c.valid;
  return {{"tolerance", {{"relative", f.calibration_tolerance}, {"absolute_ms", CalibrationTolerance{}.absolute_s * 1e3}}},
          {"wire_payload_share", payload_share},
          {"checks", cal},
          {"valid", valid}};
}

// Said after the figures are written, so a failed calibration still leaves them to look at.
Status CalibrationVerdict(const E2eFlags& f, const std::vector<LoneRequestCheck>& checks) {
  std::string which;
  size_t off = 0;
  for (const LoneRequestCheck& c : checks) {
    if (c.valid) continue;
    char b[160];
    std::snprintf(b, sizeof b, "%s%s at %g Gbit/s: %.0f ms against %.0f predicted (%s)", which.empty() ? "" : "; ", c.policy.c_str(),
                  c.gbps, c.measured_s * 1e3, c.predicted_s * 1e3, c.fault.c_str());
    which += b;
    ++off;
  }
  if (off == 0 || f.allow_uncalibrated) return Status::Ok();
  return Status::OutOfRange("calibration: " + std::to_string(off) + " lone request(s) off their prediction by more than " +
                            json(f.calibration_tolerance * 100).dump() + "% or 50 ms — " + which +
                            "; their points say \"valid\": false (--allow-uncalibrated exits 0)");
}

void PrintCalibration(const std::vector<LoneRequestCheck>& checks, const char* predicted) {
  std::printf("calibration (each policy alone; predicted = %s):\n", predicted);
  for (const LoneRequestCheck& c : checks) {
    std::printf("  %g Gbit/s %-18s %8.1f ms measured, %8.1f predicted (%.2fx)%s%s\n", c.gbps, c.policy.c_str(), c.measured_s * 1e3,
                c.predicted_s * 1e3, c.predicted_s > 0 ? c.measured_s / c.predicted_s : 0.0, c.valid ? "" : "  OFF: ",
                c.valid ? "" : c.fault.c_str());
    if (c.valid) continue;
    if (c.send_s > 0) {
      std::printf("    its transfer: encode %.1f ms, sends %.1f ms (its bytes at the rate %.1f), decode %.1f ms\n", c.encode_s * 1e3,
                  c.send_s * 1e3, c.wire_at_rate_s * 1e3, c.decode_s * 1e3);
    } else {  // a pool hit: its fetches are timed as a whole (the fetch stage above)
      std::printf("    its fetch: its bytes at the rate %.1f ms, decode %.1f ms\n", c.wire_at_rate_s * 1e3, c.decode_s * 1e3);
    }
  }
}

bool IsStatic(const Point& p) { return p.policy.rfind("static:", 0) == 0; }

// The points one bandwidth's ratios are made of (points[first...]): none, adaptive, and the
// rival with the lowest `figure`.
struct RatioPoints {
  const Point* none = nullptr;
  const Point* adaptive = nullptr;
  const Point* best = nullptr;
};

RatioPoints FindRatioPoints(const std::vector<Point>& points, size_t first, const std::function<bool(const Point&)>& rival,
                            double Point::*figure) {
  RatioPoints r;
  for (size_t i = first; i < points.size(); ++i) {
    const Point& p = points[i];
    if (p.policy == "none") r.none = &p;
    if (p.policy == "adaptive") r.adaptive = &p;
    if (rival(p) && (r.best == nullptr || p.*figure < r.best->*figure)) r.best = &p;
  }
  return r;
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

// Which core each node process ran on.
json CoresJson(const E2eFlags& f) {
  if (f.nodes != "process") return "shared";
  if (f.mode == "pool") {
    json c = {{"pool_node", CoreName(f.cpu_prefill)}, {"router", CoreName(f.cpu_router)}};
    if (f.backend == "redis") c["redis_server"] = CoreName(f.cpu_decode);
    return c;
  }
  return {{"prefill", CoreName(f.cpu_prefill)}, {"decode", CoreName(f.cpu_decode)}, {"router", CoreName(f.cpu_router)}};
}

std::string NodesNote(const E2eFlags& f) {
  if (f.nodes != "process") {
    return f.mode == "pool" ? "one process: the pool node (and an embedded pool) shares these cores with the driver"
                            : "one process: prefill and decode nodes share these cores";
  }
  if (f.mode == "pool") {
    return f.backend == "redis" ? "separate processes (router, pool node, redis-server), each pinned to its core; the driver in the bench process"
                                : "separate processes (router, pool node with its embedded pool), each pinned to its core; the driver in the bench process";
  }
  return "separate processes (router, prefill, decode), each pinned to its core; the driver in the bench process";
}

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
          {"transport", f.transport},
          {"link_note", f.link_note},
          {"codec", {{"runs_on", "host CPU"},
                     {"threads_per_node", f.threads},
                     {"cores_on_machine", std::thread::hardware_concurrency()},
                     {"cores", CoresJson(f)},
                     {"nodes", NodesNote(f)}}}};
}

// What the link kind carries on this machine, read three times: one reading on a noisy machine
// decided measured or modelled by chance. The lowest is the ceiling; all are reported. Loopback
// TCP for the token bucket; for the kernel's link, the same veth between two namespaces with no
// rate set; UCX between this process and a receiver process on the decode node's core.
Result<std::vector<double>> LinkCeilingReadings(const E2eFlags& f) {
  KV_ASSIGN_OR_RETURN(const std::unique_ptr<Transport> probe, MakeTransport(f.transport));
  std::unique_ptr<NetnsLink> veth;
  LinkEnds ends;
  if (f.link_used == "netns") {
    KV_ASSIGN_OR_RETURN(veth, NetnsLink::Up(NetnsScript(), NetnsPrefix(), 0));
    ends = {veth->receiver(), NetnsLink::kReceiverIp, veth->sender()};
  }
  std::vector<double> readings;
  for (int i = 0; i < 3; ++i) {
    if (f.transport == "ucx" && !f.kvserve_exe.empty()) {
      // Between two processes, as the nodes run: UCX's shared memory between two workers of one
      // process is not what the nodes get.
      KV_ASSIGN_OR_RETURN(std::unique_ptr<ChildProcess> rx,
                          ChildProcess::Start({.name = "link receiver",
                                               .argv = {f.kvserve_exe, "bench", "link", "--listen", "127.0.0.1:0", "--transport", "ucx"},
                                               .cpu = f.cpu_decode}));
      KV_ASSIGN_OR_RETURN(LinkMeasurement link, MeasureLink(probe.get(), rx->address(), 128));
      readings.push_back(link.gbps);
      continue;
    }
    KV_ASSIGN_OR_RETURN(LinkMeasurement link, MeasureLink(probe.get(), "", 128, ends));
    readings.push_back(link.gbps);
  }
  return readings;
}

// Resolves --nodes, --link and --cpus for this machine: the process testbed by default (pd), the
// kernel's link where this process may make namespaces, and one core per node where there are
// cores enough. Says on stderr what it fell back from.
Status ResolveTestbed(E2eFlags* f) {
  const bool pool = f->mode == "pool";
  if (f->nodes.empty()) f->nodes = pool && f->backend == "redis-cluster" ? "inproc" : "process";
  if (pool && f->nodes == "process") {
    if (f->backend == "redis-cluster") {
      return Status::InvalidArgument("--backend redis-cluster runs with --nodes inproc and --pool-address of a running cluster node");
    }
    if (!f->pool_address.empty()) {
      return Status::InvalidArgument("--pool-address is for --nodes inproc: node processes run a redis-server of their own");
    }
  }
  if (pool && f->nodes == "inproc" && f->backend != "embedded" && f->pool_address.empty()) {
    return Status::InvalidArgument("--backend " + f->backend + " with --nodes inproc needs --pool-address HOST:PORT of a running server "
                                   "(e.g. redis-server --port 6390 --save ''), or --nodes process to start one");
  }
  if (f->nodes == "process" && (f->prefill_tps > 0 || f->decode_tps > 0)) {
    return Status::InvalidArgument("--prefill-tps/--decode-tps set the in-process nodes' compute; node processes take it from "
                                   "--kv-shape and --gpu (or use --nodes inproc)");
  }
  if (f->nodes == "inproc") {
    if (f->link == "netns") return Status::InvalidArgument("--link netns needs --nodes process (the namespaces hold processes)");
    f->link_used = "shaper";
    f->link_note = pool ? "in-process token bucket in front of the pool" : "in-process token bucket on loopback TCP";
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
  if (pool && f->backend == "embedded") {
    if (f->link == "netns") {
      return Status::InvalidArgument("--link netns needs a pool across the link (--backend redis): an embedded pool lives in the pool node");
    }
    f->link_used = "shaper";
    f->link_note = "in the pool node: a token bucket paces its embedded pool's traffic";
    return Status::Ok();
  }
  if (f->transport == "ucx") {
    // UCX between processes of one machine goes through shared memory, not the veth: only the
    // token bucket in the prefill process can pace it.
    if (f->link == "netns") return Status::InvalidArgument("--transport ucx paces with --link shaper: shared memory bypasses a veth");
    if (pool) return Status::InvalidArgument("--transport ucx is for --mode pd (prefill to decode)");
    auto ucx = MakeTransport("ucx");
    if (!ucx.ok()) return ucx.status();
    f->link_used = "shaper";
    f->link_note = "in the prefill process: a token bucket on UCX (shared memory between the node processes)";
    return Status::Ok();
  }
  f->link_used = f->link == "auto" ? "netns" : f->link;
  if (f->link_used == "netns") {
    // A probe: the namespaces this run would make, made and removed once.
    auto probe = NetnsLink::Up(NetnsScript(), NetnsPrefix(), 0);
    if (!probe.ok()) {
      if (f->link == "netns" || probe.status().code() != StatusCode::kUnavailable) return probe.status();
      f->link_used = "shaper";
      f->link_note = std::string(pool ? "in the pool node" : "in the prefill process") +
                     ": a token bucket on loopback TCP (the kernel's link was not allowed: " + probe.status().message() + ")";
      std::fprintf(stderr, "bench e2e: %s\n", f->link_note.c_str());
      return Status::Ok();
    }
  }
  if (pool) {
    f->link_note = f->link_used == "netns"
                       ? "veth between two network namespaces, shaped by the kernel (tc tbf); pool node and router in one, redis-server in the other"
                       : "in the pool node: a token bucket paces its traffic to redis-server on loopback TCP";
    return Status::Ok();
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
      if (!f.repeats_given) f.repeats = 1;
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
  const E2eSetup setup = SetupOf(f, sm, profile);
  // Prompts: fixed, or drawn from a workload file's lengths; arrivals at the rate that puts the
  // uncompressed link at the offered load.
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
  if (f.capacity_gbps > 0) {
    if (std::find(f.bandwidths.begin(), f.bandwidths.end(), f.capacity_gbps) == f.bandwidths.end()) {
      return Status::InvalidArgument("--capacity-gbps " + json(f.capacity_gbps).dump() + " is not one of --bandwidths");
    }
    if (f.capacity_gbps > 0.9 * ceiling) {
      return Status::InvalidArgument("--capacity-gbps " + json(f.capacity_gbps).dump() + " is above 90% of this link's ceiling (" +
                                     json(ceiling).dump() + " Gbit/s): capacity is measured, not modelled");
    }
  }
  std::vector<Point> points;
  json ratios = json::array();
  json pipelining;
  // The instrument first: every policy alone on every measured link.
  std::vector<LoneRequestCheck> checks;
  for (double gbps : f.bandwidths) {
    if (gbps > 0.9 * ceiling) continue;
    for (const Policy& pol : policies) {
      if (StderrIsTerminal() || !f.as_json) std::fprintf(stderr, "bench e2e: calibrating %s at %g Gbit/s...\n", pol.name.c_str(), gbps);
      KV_ASSIGN_OR_RETURN(LoneRequestCheck c,
                          CalibratePolicy(setup, pol, gbps, prompts[0], {.relative = f.calibration_tolerance}));
      checks.push_back(std::move(c));
    }
  }
  auto calibrated = [&](double gbps, const std::string& policy) {
    for (const LoneRequestCheck& c : checks)
      if (c.gbps == gbps && c.policy == policy) return c.valid;
    return true;  // modelled points: the simulator's, checked against the measured ones above
  };
  for (size_t b = 0; b < f.bandwidths.size(); ++b) {
    const double gbps = f.bandwidths[b];
    const double rate = f.arrival == "burst" ? 0 : f.load * gbps * 1e9 / 8 / (mean_tokens * sm.kv_bytes_per_token());
    const std::vector<double> arrivals = PoissonArrivals(rate, prompts.size(), f.seed + b);
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
        auto p = measured ? RunMeasuredPoint(setup, pol, gbps, prompts, arrivals, SayError)
                          : RunModelledPoint(setup, pol, gbps, prompts, arrivals);
        KV_RETURN_IF_ERROR(p.status());
        reps[pol.name].push_back(std::move(p).value());
      }
    }
    const size_t first = points.size();
    for (const Policy& pol : policies) {
      Point p = AggregateRepeats(reps[pol.name]);
      KV_ASSIGN_OR_RETURN(p.capacity_rps, ModelledCapacity(setup, pol, gbps, uint32_t(std::lround(mean_tokens)), f.seed + 17));
      p.valid = calibrated(gbps, pol.name);
      points.push_back(std::move(p));
    }
    // Ratios at this bandwidth, paired by repeat: none over each policy, and the best static
    // (lowest mean JCT) over adaptive.
    const auto [none, adaptive, best] = FindRatioPoints(points, first, IsStatic, &Point::mean_ms);
    for (size_t i = first; none && i < points.size(); ++i) points[i].vs_none = PairedRatio(*none, points[i]);
    if (none && adaptive) {
      json r = {{"gbps", gbps}, {"measured", measured}, {"none_over_adaptive", CiJson(PairedRatio(*none, *adaptive))}};
      if (best) r["best_static"] = best->policy, r["best_static_over_adaptive"] = CiJson(PairedRatio(*best, *adaptive));
      ratios.push_back(r);
    }
    if (measured && pipelining.is_null()) {
      // One request alone on this link with a compressing strategy: are the three stages overlapped?
      const std::string strategy = policies.size() > 2 ? policies[2].spec : "quant|rans";
      KV_ASSIGN_OR_RETURN(std::unique_ptr<E2eBed> bed, E2eBed::Start(setup, gbps, {"pipelining", strategy}, {prompts[0]}));
      ServeRequest r = E2eRequest(setup, 1, prompts[0]);
      r.max_new_tokens = 1;
      KV_ASSIGN_OR_RETURN(ServeResponse out, bed->serve()(r));
      const StageTimings& st = out.timings;
      pipelining = {{"gbps", gbps}, {"strategy", strategy}, {"encode_ms", st.encode_s * 1e3}, {"wire_ms", st.wire_s * 1e3},
                    {"decode_ms", st.decode_s * 1e3}, {"sum_ms", (st.encode_s + st.wire_s + st.decode_s) * 1e3},
                    {"max_ms", std::max({st.encode_s, st.wire_s, st.decode_s}) * 1e3}, {"observed_ms", st.transfer_s * 1e3}};
    }
  }
  // Capacity measured: at --capacity-gbps, none, the best static there and adaptive, each a
  // search per repeat whose every step is a measured run (bracketed around the modelled figure).
  json capacity = json::array();
  if (f.capacity_gbps > 0) {
    const double gbps = f.capacity_gbps;
    const Point* best = nullptr;
    for (const Point& p : points)
      if (p.gbps == gbps && p.policy.rfind("static:", 0) == 0 && (best == nullptr || p.mean_ms < best->mean_ms)) best = &p;
    for (const Policy& pol : policies) {
      if (pol.name != "none" && pol.name != "adaptive" && (best == nullptr || pol.name != best->policy)) continue;
      const uint32_t tokens = uint32_t(std::lround(mean_tokens));
      double modelled = 0;  // the point's own modelled capacity (same prompts, same seed)
      for (const Point& p : points)
        if (p.gbps == gbps && p.policy == pol.name) modelled = p.capacity_rps;
      const double guide = modelled > 0 ? modelled : 0.1;
      auto progress = [&](double rate, bool meets) {
        if (StderrIsTerminal() || !f.as_json)
          std::fprintf(stderr, "bench e2e: capacity of %s at %g Gbit/s: %.3f requests/s %s\n", pol.name.c_str(), gbps, rate,
                       meets ? "meets the SLO" : "misses it");
      };
      KV_ASSIGN_OR_RETURN(MeasuredCapacity c, MeasureCapacity(setup, pol, gbps, tokens, f.capacity_requests, f.repeats, guide / 8,
                                                              guide * 8, f.capacity_steps, f.seed + 29, progress));
      capacity.push_back({{"policy", pol.name}, {"gbps", gbps}, {"rps", CiJson(c.rps)}, {"per_repeat_rps", c.per_repeat},
                          {"runs", c.runs}, {"requests_per_run", f.capacity_requests}, {"modelled_rps", modelled},
                          {"at_upper_end", c.at_upper_end},
                          {"search", {{"lo_rps", guide / 8}, {"hi_rps", guide * 8}, {"steps", f.capacity_steps}}}});
    }
  }
  json out = RunHeader(f, sm, ceiling, "pd", "synthetic KV and modelled GPU compute; codec, transport and link are real");
  out["mean_prompt_tokens"] = mean_tokens;
  if (f.capacity_gbps > 0) {
    out["capacity_measured"] = capacity;
    out["capacity_definition"] = "the highest Poisson rate whose measured run answers every request with P99 TTFT within "
                                 "the SLO, by bisection on a log scale between 1/8 and 8 times the modelled capacity; one "
                                 "search per repeat, each with its own arrivals; a run of N requests measures what a burst "
                                 "of N takes, so few requests a run read above the steady state the model gives";
  }
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
  out["calibration"] = CalibrationSection(f, checks, setup.wire_payload_share);
  auto verdict = [&] { return CalibrationVerdict(f, checks); };
  if (!f.svg.empty()) KV_RETURN_IF_ERROR(WriteText(f.svg, PlotSvg(points, policies, ceiling)));
  if (f.as_json) {
    std::printf("%s\n", out.dump(1).c_str());
    std::fflush(stdout);  // whole, before the verdict's line on stderr
    return verdict();
  }
  PrintCalibration(checks, "prefill + frames pipelined at the link rate + generation");
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
  for (const json& c : capacity) {
    std::printf("capacity at %g Gbit/s (measured) %-18s %7.3f ± %.3f requests/s over %d searches (%d runs; modelled %.3f)%s\n",
                c["gbps"].get<double>(), c["policy"].get<std::string>().c_str(), c["rps"]["mean"].get<double>(),
                c["rps"]["ci95"].get<double>(), c["rps"]["n"].get<int>(), c["runs"].get<int>(), c["modelled_rps"].get<double>(),
                c["at_upper_end"].get<int>() > 0 ? "  (a search met the SLO at its upper end: at least this)" : "");
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
// Requests whose prompts are a shared document (prefix) plus their own suffix, through a pool node
// per policy (a process with its own redis-server, or in this process), the pool behind a link
// shaped to each bandwidth. TTFT is what counts here.
Status RunPoolMode(const E2eFlags& f) {
  KV_ASSIGN_OR_RETURN(SyntheticModel sm, ModelOf(f));
  KV_ASSIGN_OR_RETURN(Profile profile, LoadProfile(f.profile));
  KV_ASSIGN_OR_RETURN(std::vector<Policy> policies, LoadPolicies(f));
  policies.insert(policies.begin() + 1, Policy{"recompute", "recompute"});
  const E2eSetup setup = SetupOf(f, sm, profile);
  const uint32_t prefix = f.prompt_tokens;
  const std::vector<uint32_t> doc_of = PoolDocuments(f.requests, f.reuse, f.seed);
  std::vector<ServeRequest> requests;
  for (uint32_t i = 0; i < f.requests; ++i) {
    ServeRequest r = E2eRequest(setup, i + 1, 0);
    r.prompt = PoolPrompt(doc_of[i], i, prefix, f.suffix_tokens);
    requests.push_back(std::move(r));
  }
  KV_ASSIGN_OR_RETURN(std::vector<double> readings, LinkCeilingReadings(f));
  const double ceiling = *std::min_element(readings.begin(), readings.end());
  // An embedded pool's link is a token bucket in the node: nothing on this machine limits it.
  auto machine_limited = [&](double gbps) { return f.backend != "embedded" && gbps > 0.9 * ceiling; };
  const double prefix_bytes = double(prefix) * sm.kv_bytes_per_token();
  // The instrument first: each policy's lone request with its prefix stored, on every link.
  std::vector<LoneRequestCheck> checks;
  for (double gbps : f.bandwidths) {
    if (machine_limited(gbps)) continue;
    for (const Policy& pol : policies) {
      if (StderrIsTerminal() || !f.as_json) std::fprintf(stderr, "bench e2e --mode pool: calibrating %s at %g Gbit/s...\n", pol.name.c_str(), gbps);
      KV_ASSIGN_OR_RETURN(LoneRequestCheck c, CalibratePolicy(setup, pol, gbps, prefix, {.relative = f.calibration_tolerance}));
      checks.push_back(std::move(c));
    }
  }
  auto calibrated = [&](double gbps, const std::string& policy) {
    for (const LoneRequestCheck& c : checks)
      if (c.gbps == gbps && c.policy == policy) return c.valid;
    return false;  // not checked: the machine limits this link
  };
  std::vector<Point> points;
  json ratios = json::array();
  for (double gbps : f.bandwidths) {
    // Poisson arrivals at the rate that loads the uncompressed pool link to `load` with hits.
    const double rate = f.arrival == "burst" ? 0 : f.load * gbps * 1e9 / 8 / prefix_bytes;
    const std::vector<double> arrivals = PoissonArrivals(rate, f.requests, f.seed + 1);
    std::map<std::string, std::vector<Point>> reps;
    for (uint32_t r = 0; r < f.repeats; ++r) {
      for (size_t k = 0; k < policies.size(); ++k) {
        const Policy& pol = policies[(k + r) % policies.size()];
        if (StderrIsTerminal() || !f.as_json) {
          std::fprintf(stderr, "bench e2e --mode pool: %s at %g Gbit/s (repeat %u of %u)...\n", pol.name.c_str(), gbps, r + 1, f.repeats);
        }
        KV_ASSIGN_OR_RETURN(Point p, RunMeasuredRequests(setup, pol, gbps, requests, arrivals, SayError));
        reps[pol.name].push_back(std::move(p));
      }
    }
    const size_t first = points.size();
    for (const Policy& pol : policies) {
      Point p = AggregateRepeats(reps[pol.name]);
      p.valid = calibrated(gbps, pol.name);
      points.push_back(std::move(p));
    }
    // Ratios of mean TTFT at this bandwidth, paired by repeat: none over each policy; the best
    // other policy (recompute or a static) over adaptive.
    const auto [none, adaptive, best] = FindRatioPoints(
        points, first, [](const Point& p) { return p.policy == "recompute" || IsStatic(p); }, &Point::ttft_mean_ms);
    for (size_t i = first; none && i < points.size(); ++i) points[i].vs_none = PairedTtftRatio(*none, points[i]);
    if (none && adaptive) {
      json r = {{"gbps", gbps}, {"none_over_adaptive", CiJson(PairedTtftRatio(*none, *adaptive))}};
      if (best) r["best_other"] = best->policy, r["best_other_over_adaptive"] = CiJson(PairedTtftRatio(*best, *adaptive));
      ratios.push_back(r);
    }
  }
  json out = RunHeader(f, sm, ceiling, "pool", "synthetic KV and modelled GPU compute; codec, pool and link pacing are real");
  out["link_ceiling_readings_gbps"] = readings;
  out["backend"] = f.backend;
  out["pool_link"] = f.link_note;
  out["prefix_tokens"] = prefix;
  out["suffix_tokens"] = f.suffix_tokens;
  out["chunk_tokens"] = f.chunk_tokens;
  out["reuse"] = f.reuse;
  out["repeats"] = f.repeats;
  out["ttft_definition"] = "scheduled arrival to the first token at the client (prefix fetched or computed, suffix computed)";
  out["statistics"] = "each point: the mean of its repeats' figures (fresh nodes and pool, policies in rotating order, the "
                      "same arrivals), ci95 = half-width of the 95% Student-t interval; ratios of mean TTFT paired by repeat";
  json pts = json::array();
  for (const Point& p : points) {
    json j = PointJson(p);
    j["machine_limited"] = machine_limited(p.gbps);
    j["ttft_mean_ms"] = p.ttft_mean_ms;
    j["hit_ttft_mean_ms"] = p.hit_ttft_mean_ms;
    j["hit_ttft_p99_ms"] = p.hit_ttft_p99_ms;
    j["hit_rate"] = p.hit_rate;
    j["ci95"]["ttft_mean_ms"] = p.ttft_mean_ci;
    j["ci95"]["hit_ttft_mean_ms"] = p.hit_ttft_mean_ci;
    j["repeat_ttft_mean_ms"] = p.repeat_ttft_means;
    j["vs_none"] = CiJson(p.vs_none);
    pts.push_back(std::move(j));
  }
  out["points"] = pts;
  out["ratios"] = ratios;
  out["calibration"] = CalibrationSection(f, checks, setup.wire_payload_share);
  if (!f.svg.empty()) {
    std::vector<Point> plotted = points;
    for (Point& p : plotted) p.mean_ms = std::max(1e-3, p.ttft_mean_ms);
    KV_RETURN_IF_ERROR(WriteText(f.svg, PlotSvg(plotted, policies, f.backend == "embedded" ? 1e9 : ceiling, "mean TTFT")));
  }
  if (f.as_json) {
    std::printf("%s\n", out.dump(1).c_str());
    std::fflush(stdout);
    return CalibrationVerdict(f, checks);
  }
  PrintCalibration(checks, "prefix chunks fetched at the link rate, decoded as measured, pipelined + prefill of the rest");
  std::printf("KV pool (%s, %s): %s KV, %u requests, %u-token shared prefixes + %u, reuse %.2f, load %.2f; link ceiling %.1f Gbit/s\n",
              f.backend.c_str(), f.nodes.c_str(), sm.name.c_str(), f.requests, prefix, f.suffix_tokens, f.reuse, f.load, ceiling);
  std::printf("%u repeats per point, mean ± 95%% CI\n", f.repeats);
  std::printf("%7s %-18s %6s %18s %11s %11s %6s %8s %14s %s\n", "Gbit/s", "policy", "hits", "TTFT ms", "hit TTFT", "TTFT p99",
              "SLO", "quality", "vs none", "choices");
  for (const Point& p : points) {
    std::string ch;
    for (const auto& [k, v] : p.choices) ch += (ch.empty() ? "" : " ") + k + "=" + std::to_string(v);
    std::printf("%7g %-18s %5.0f%% %9.1f ±%7.1f %11.1f %11.1f %5.0f%% %8.4f %6.2fx ±%5.2f %s%s\n", p.gbps, p.policy.c_str(),
                100 * p.hit_rate, p.ttft_mean_ms, p.ttft_mean_ci, p.hit_ttft_mean_ms, p.ttft_p99_ms, 100 * p.slo_attainment, p.quality,
                p.vs_none.mean, p.vs_none.half_width, ch.c_str(), p.valid ? "" : "  (invalid)");
  }
  std::fflush(stdout);
  return CalibrationVerdict(f, checks);
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
  c->add_option("--pool-address", f->pool_address,
                "pool, --nodes inproc: HOST:PORT of a running Redis server (or a cluster node); node processes start their own");
  c->add_option("--pool-capacity-mib", f->pool_capacity_mib, "pool: capacity (embedded; redis-server's maxmemory), LRU beyond")->capture_default_str()->check(InRange(1, 1 << 24));
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
                "process: router, prefill and decode nodes (pool: router, pool node, redis-server) as separate processes, each "
                "pinned to a core (default) | "
                "inproc: the nodes in this process (pool default with --backend redis-cluster)")
      ->check(CLI::IsMember({"process", "inproc"}));
  c->add_option("--link", f->link,
                "netns: a veth between two network namespaces shaped by the kernel (tc tbf; needs root) | shaper: a token "
                "bucket in the sending process | auto: netns where allowed")
      ->capture_default_str()->check(CLI::IsMember({"auto", "netns", "shaper"}));
  c->add_option("--cpus", f->cpus, "cores of the node processes: PREFILL,DECODE[,ROUTER] (pool: POOL_NODE,REDIS[,ROUTER]) | auto (one each while "
                "cores last) | none")
      ->capture_default_str();
  c->add_option("--capacity-gbps", f->capacity_gbps,
                "also measure capacity at this bandwidth (one of --bandwidths, measured): for none, the best static and "
                "adaptive, the highest Poisson rate whose run keeps P99 TTFT within the SLO, per repeat (0: off)")
      ->capture_default_str()->check(InRange(0, 1e4));
  c->add_option("--capacity-requests", f->capacity_requests, "requests per capacity run")->capture_default_str()->check(InRange(2, 10000));
  c->add_option("--capacity-steps", f->capacity_steps, "bisection steps per capacity search (after bracketing)")
      ->capture_default_str()->check(InRange(0, 30));
  c->add_option("--transport", f->transport, "prefill to decode: tcp | ucx (shared memory here; paced by --link shaper)")
      ->capture_default_str()->check(CLI::IsMember(TransportNames()));
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
