// The end-to-end benchmark's harness: a run's nodes, measured and modelled points, their
// repeats, the lone-request calibration and the capacity searches (kvserve/e2e_bench.h).
#include "kvserve/e2e_bench.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "control/simulator.h"
#include "kvserve/codec.h"
#include "kvserve/pool.h"

namespace kvserve {

// ---- The nodes of a run ----------------------------------------------------------------------------

// Both nodes in this process over the setup's transport, paced to the link rate by the
// in-process token bucket.
struct E2eBed::InProcess {
  explicit InProcess(double gbps) : shaper(gbps) {}
  ~InProcess() {
    prefill.reset();
    if (decode) decode->Stop();
  }
  LinkShaper shaper;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<DecodeNode> decode;
  std::unique_ptr<PrefillNode> prefill;
};

// A pool node in this process, its pool (a fresh embedded one, or a Redis server's, cleared)
// behind the in-process token bucket.
struct E2eBed::InProcessPool {
  explicit InProcessPool(double gbps) : shaper(gbps) {}
  LinkShaper shaper;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<PoolNode> node;
};

Result<std::unique_ptr<E2eBed>> E2eBed::Start(const E2eSetup& s, double gbps, const E2ePolicy& policy,
                                              std::vector<uint32_t> prompts) {
  if (s.model == nullptr) return Status::InvalidArgument("e2e setup: no model");
  if (s.mode != "pd" && s.mode != "pool") return Status::InvalidArgument("e2e mode '" + s.mode + "': pd | pool");
  const bool adaptive = policy.spec.empty();
  if (adaptive && s.profile == nullptr) return Status::InvalidArgument("policy " + policy.name + " needs a profile");
  const std::string strategy = adaptive ? "none" : policy.spec;
  // The pool node's policy: adaptive, recompute, or the strategy it stores and fetches.
  const std::string pool_policy = adaptive ? "adaptive" : policy.spec;
  std::sort(prompts.begin(), prompts.end());
  prompts.erase(std::unique(prompts.begin(), prompts.end()), prompts.end());
  std::unique_ptr<E2eBed> bed(new E2eBed());
  bed->setup_ = &s;
  if (s.mode == "pool" && s.nodes == "inproc") {
    auto t = std::make_unique<InProcessPool>(gbps);
    if (s.pool_backend == "embedded") {
      t->pool = MakeEmbeddedPool({.capacity_bytes = s.pool_capacity_mib << 20});
    } else if (s.pool_backend == "redis" || s.pool_backend == "redis-cluster") {
      if (s.pool_address.empty()) {
        return Status::InvalidArgument("pool backend " + s.pool_backend + " in process needs the address of a running server");
      }
      RedisPoolOptions ro;
      ro.address = s.pool_address;
      ro.cluster = s.pool_backend == "redis-cluster";
      ro.timeout_s = 30;
      KV_ASSIGN_OR_RETURN(t->pool, MakeRedisPool(ro));
      KV_RETURN_IF_ERROR(t->pool->Clear());  // each run starts from an empty pool
    } else {
      return Status::InvalidArgument("pool backend '" + s.pool_backend + "': embedded | redis | redis-cluster");
    }
    PoolNodeOptions o;
    o.synthetic = s.model;
    o.pool = t->pool.get();
    o.pool_link = &t->shaper;
    o.chunk_tokens = s.chunk_tokens;
    o.policy = pool_policy;
    o.profile = s.profile;
    o.assume_gbps = gbps;
    o.threads = s.pool;
    KV_ASSIGN_OR_RETURN(t->node, PoolNode::Create(o));
    for (uint32_t n : prompts) KV_RETURN_IF_ERROR(t->node->Prepare(n));
    PoolNode* node = t->node.get();
    bed->serve_ = [node](const ServeRequest& r) { return node->Serve(r); };
    bed->inproc_pool_ = std::move(t);
    return bed;
  }
  if (s.nodes == "inproc") {
    auto t = std::make_unique<InProcess>(gbps);
    KV_ASSIGN_OR_RETURN(t->transport, MakeTransport(s.transport, {.shaper = &t->shaper, .send_delay_s_per_byte = s.send_delay_ns * 1e-9}));
    DecodeNodeOptions d;
    d.synthetic = s.model;
    d.request_timeout_s = 600;
    t->decode = std::make_unique<DecodeNode>(t->transport.get(), d);
    // The decode node's request buffers allocated up front for the longest prompt, as the node
    // processes' are (ProcessTestbed), one per buffer it keeps.
    for (uint32_t i = 0; !prompts.empty() && i < d.kept_buffers; ++i) KV_RETURN_IF_ERROR(t->decode->Prepare(prompts.back()));
    KV_RETURN_IF_ERROR(t->decode->Start("127.0.0.1:0"));
    PrefillNodeOptions o;
    o.synthetic = s.model;
    o.decode_peers = {"127.0.0.1:" + std::to_string(t->decode->port())};
    o.profile = adaptive ? s.profile : nullptr;
    o.strategy = strategy;
    o.assume_gbps = gbps;  // what a probe of the link would say before the first transfer
    o.request_timeout_s = 600;
    o.pool = s.pool;
    KV_ASSIGN_OR_RETURN(t->prefill, PrefillNode::Create(t->transport.get(), o));
    for (uint32_t n : prompts) KV_RETURN_IF_ERROR(t->prefill->Prepare(n));
    PrefillNode* node = t->prefill.get();
    bed->serve_ = [node](const ServeRequest& r) { return node->Serve(r); };
    bed->inproc_ = std::move(t);
    return bed;
  }
  if (s.nodes != "process") return Status::InvalidArgument("e2e nodes '" + s.nodes + "': inproc | process");
  if (!s.router_client) return Status::InvalidArgument("e2e setup: node processes need a router client");
  ProcessTestbedOptions o;
  o.mode = s.mode;
  o.pool_backend = s.pool_backend;
  o.redis_server = s.redis_server;
  o.pool_policy = pool_policy;
  o.chunk_tokens = s.chunk_tokens;
  o.pool_capacity_mib = s.pool_capacity_mib;
  o.kvserve = s.kvserve_exe;
  o.kv_shape = s.model->name;
  o.gpu = s.model->gpu;
  o.prepare_tokens = prompts;
  if (adaptive) o.profile = s.profile_path;
  o.strategy = strategy;
  o.gbps = gbps;
  o.link = s.link;
  o.netns_script = s.netns_script;
  o.netns_prefix = s.netns_prefix;
  o.transport = s.transport;
  o.threads = s.threads;
  o.cpu_prefill = s.cpu_prefill, o.cpu_decode = s.cpu_decode, o.cpu_router = s.cpu_router;
  o.send_delay_ns = s.send_delay_ns;
  KV_ASSIGN_OR_RETURN(bed->procs_, ProcessTestbed::Start(o));
  bed->serve_ = s.router_client(bed->procs_->router_address(), bed->procs_->client_netns());
  if (s.on_live) s.on_live(bed->procs_.get());
  return bed;
}

E2eBed::~E2eBed() {
  if (procs_ && setup_->on_live) setup_->on_live(nullptr);
  procs_.reset();
  inproc_.reset();
  inproc_pool_.reset();
}

ServeRequest E2eRequest(const E2eSetup& s, uint64_t id, uint32_t n_token) {
  ServeRequest r;
  r.id = id;
  r.prompt.assign(n_token, 1);
  r.max_new_tokens = s.max_new;
  r.slo_ms = s.slo_ms;
  r.floor = s.floor;
  return r;
}

std::vector<double> PoissonArrivals(double rate, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1);
  std::vector<double> out;
  double t = 0;
  for (size_t i = 0; i < n; ++i) {
    out.push_back(t);
    if (rate > 0) t += gap(rng);
  }
  return out;
}

std::vector<uint32_t> PoolDocuments(uint32_t n, double reuse, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> doc_of;
  uint32_t n_docs = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const bool again = n_docs > 0 && std::uniform_real_distribution<double>(0, 1)(rng) < reuse;
    doc_of.push_back(again ? uint32_t(rng() % n_docs) : n_docs++);
  }
  return doc_of;
}

std::vector<int> PoolPrompt(uint64_t doc, uint64_t own, uint32_t prefix_tokens, uint32_t suffix_tokens) {
  const uint32_t n = prefix_tokens + suffix_tokens;
  std::vector<int> p(n);
  for (uint32_t j = 0; j < n; ++j) {
    const uint64_t salt = j < prefix_tokens ? doc : 1000003ull + own;
    p[j] = int(1 + (salt * 7919 + uint64_t(j) * 104729) % 30000);
  }
  return p;
}

std::map<std::string, double> PoolQualityOf(const E2eSetup& s, const E2ePolicy& policy) {
  std::map<std::string, double> quality_of = {{"none", 1.0}};
  if (s.profile != nullptr)
    for (const ProfileEntry& e : s.profile->pareto) quality_of[e.spec] = e.quality;
  if (!policy.spec.empty() && policy.spec != "recompute") quality_of[policy.spec] = policy.quality;
  return quality_of;
}

// ---- Measured points -----------------------------------------------------------------------------

namespace {

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

std::string Gbps(double g) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", g);
  return b;
}

}  // namespace

namespace {

// What a mode reads from one answer: its TTFT, its quality, the choice it is counted under.
struct Reading {
  double ttft_ms = 0, quality = 1;
  std::string choice;
};

// The figures both modes report, over the answered requests (failed ones counted and heard).
E2ePoint Summarise(const std::vector<Result<ServeResponse>>& answers, const E2eSetup& s, const E2ePolicy& policy, double gbps,
                   double last_arrival_s, const std::function<void(const Status&)>& on_error,
                   const std::function<Reading(const ServeResponse&)>& read) {
  E2ePoint p;
  p.gbps = gbps;
  p.policy = policy.name;
  std::vector<double> jct, ttft;
  double compute = 0, total = 0, q = 0;
  uint32_t ok_slo = 0;
  for (const Result<ServeResponse>& a : answers) {
    if (!a.ok()) {
      p.errors++;
      if (on_error) on_error(a.status());
      continue;
    }
    const ServeResponse& r = a.value();
    const Reading got = read(r);
    jct.push_back(r.timings.total_s * 1e3);
    ttft.push_back(got.ttft_ms);
    ok_slo += got.ttft_ms <= s.slo_ms;
    compute += r.timings.prefill_s + r.timings.generate_s;
    total += r.timings.total_s;
    p.wire_bytes += double(r.wire_bytes);
    q += got.quality;
    p.floor_violations += got.quality < s.floor;
    p.choices[got.choice]++;
  }
  if (jct.empty()) return p;
  p.mean_ms = Mean(jct);
  p.p50_ms = Percentile(jct, 0.5);
  p.p99_ms = Percentile(jct, 0.99);
  p.ttft_mean_ms = Mean(ttft);
  p.ttft_p99_ms = Percentile(ttft, 0.99);
  p.slo_attainment = double(ok_slo) / double(answers.size());
  p.goodput = ok_slo / std::max(1e-9, last_arrival_s + p.mean_ms / 1e3);
  p.quality = q / double(jct.size());
  p.compute_share = compute / std::max(1e-12, total);
  return p;
}

}  // namespace

E2ePoint SummarisePd(const std::vector<Result<ServeResponse>>& answers, const E2eSetup& s, const E2ePolicy& policy,
                     double gbps, double last_arrival_s, const std::function<void(const Status&)>& on_error) {
  std::map<std::string, double> quality_of;
  if (s.profile != nullptr)
    for (const ProfileEntry& e : s.profile->pareto) quality_of[e.spec] = e.quality;
  return Summarise(answers, s, policy, gbps, last_arrival_s, on_error, [&](const ServeResponse& r) {
    Reading got;
    got.ttft_ms = (r.timings.total_s - r.timings.generate_s) * 1e3;  // KV ready at the decode node
    got.quality = r.strategy == "none" ? 1.0 : policy.spec.empty() ? quality_of[r.strategy] : policy.quality;
    got.choice = r.strategy == "none" ? "none" : ShortSpec(r.strategy);
    return got;
  });
}

E2ePoint SummarisePool(const std::vector<Result<ServeResponse>>& answers, const E2eSetup& s, const E2ePolicy& policy,
                       double gbps, double last_arrival_s, const std::map<std::string, double>& quality_of,
                       const std::function<void(const Status&)>& on_error) {
  E2ePoint p = Summarise(answers, s, policy, gbps, last_arrival_s, on_error, [&](const ServeResponse& r) {
    Reading got;
    got.ttft_ms = r.timings.first_token_s * 1e3;
    const auto known = quality_of.find(r.strategy);
    got.quality = r.cached_tokens > 0 ? (known != quality_of.end() ? known->second : 0.0) : 1.0;  // a miss is exact
    got.choice = r.pool_action == "fetch" ? (r.strategy == "none" ? "fetch:none" : "fetch:" + ShortSpec(r.strategy)) : r.pool_action;
    return got;
  });
  std::vector<double> hit_ttft;
  size_t answered = 0;
  for (const Result<ServeResponse>& a : answers) {
    answered += a.ok();
    if (a.ok() && a->cached_tokens > 0) hit_ttft.push_back(a->timings.first_token_s * 1e3);
  }
  p.hit_ttft_mean_ms = Mean(hit_ttft);
  p.hit_ttft_p99_ms = Percentile(hit_ttft, 0.99);
  p.hit_rate = answered ? double(hit_ttft.size()) / double(answered) : 0.0;
  return p;
}

Result<E2ePoint> RunMeasuredRequests(const E2eSetup& s, const E2ePolicy& policy, double gbps,
                                     const std::vector<ServeRequest>& requests, const std::vector<double>& arrivals,
                                     const std::function<void(const Status&)>& on_error) {
  if (requests.empty() || arrivals.size() != requests.size()) {
    return Status::InvalidArgument("a point needs as many arrivals as requests (" + std::to_string(arrivals.size()) + " for " +
                                   std::to_string(requests.size()) + ")");
  }
  std::vector<uint32_t> lengths;
  for (const ServeRequest& r : requests) lengths.push_back(uint32_t(r.prompt.size()));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<E2eBed> bed, E2eBed::Start(s, gbps, policy, lengths));
  // JCT from each scheduled arrival to the answer, at the client.
  const std::vector<Result<ServeResponse>> answers = DriveArrivals(bed->serve(), requests, arrivals);
  bed.reset();
  E2ePoint p = s.mode == "pool" ? SummarisePool(answers, s, policy, gbps, arrivals.back(), PoolQualityOf(s, policy), on_error)
                                : SummarisePd(answers, s, policy, gbps, arrivals.back(), on_error);
  if (p.errors == answers.size()) return Status::Unavailable("every request of " + policy.name + " at " + Gbps(gbps) + " Gbit/s failed");
  return p;
}

Result<E2ePoint> RunMeasuredPoint(const E2eSetup& s, const E2ePolicy& policy, double gbps, const std::vector<uint32_t>& prompts,
                                  const std::vector<double>& arrivals, const std::function<void(const Status&)>& on_error) {
  std::vector<ServeRequest> requests;
  for (size_t i = 0; i < prompts.size(); ++i) requests.push_back(E2eRequest(s, i + 1, uint32_t(prompts[i])));
  return RunMeasuredRequests(s, policy, gbps, requests, arrivals, on_error);
}

E2ePoint AggregateRepeats(const std::vector<E2ePoint>& reps) {
  if (reps.empty()) return {};
  E2ePoint a = reps.front();
  a.repeats = uint32_t(reps.size());
  std::vector<double> mean, p50, p99, ttft, ttft_mean, hit_ttft;
  a.slo_attainment = a.goodput = a.quality = a.wire_bytes = a.compute_share = 0;
  a.hit_rate = a.hit_ttft_p99_ms = 0;
  a.floor_violations = a.errors = 0;
  a.choices.clear();
  const double n = double(reps.size());
  for (const E2ePoint& r : reps) {
    mean.push_back(r.mean_ms), p50.push_back(r.p50_ms), p99.push_back(r.p99_ms), ttft.push_back(r.ttft_p99_ms);
    a.slo_attainment += r.slo_attainment / n;
    a.goodput += r.goodput / n;
    a.quality += r.quality / n;
    a.wire_bytes += r.wire_bytes / n;
    a.compute_share += r.compute_share / n;
    a.hit_rate += r.hit_rate / n;
    a.hit_ttft_p99_ms += r.hit_ttft_p99_ms / n;
    ttft_mean.push_back(r.ttft_mean_ms), hit_ttft.push_back(r.hit_ttft_mean_ms);
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
  const MeanCi tm = MeanCi95(ttft_mean), hm = MeanCi95(hit_ttft);
  a.ttft_mean_ms = tm.mean, a.ttft_mean_ci = tm.half_width;
  a.hit_ttft_mean_ms = hm.mean, a.hit_ttft_mean_ci = hm.half_width;
  a.repeat_ttft_means = ttft_mean;
  return a;
}

namespace {
MeanCi PairedRatioOf(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> r;
  for (size_t i = 0; i < std::min(num.size(), den.size()); ++i)
    if (den[i] > 0) r.push_back(num[i] / den[i]);
  return MeanCi95(r);
}
}  // namespace

MeanCi PairedRatio(const E2ePoint& num, const E2ePoint& den) { return PairedRatioOf(num.repeat_means, den.repeat_means); }

MeanCi PairedTtftRatio(const E2ePoint& num, const E2ePoint& den) {
  return PairedRatioOf(num.repeat_ttft_means, den.repeat_ttft_means);
}

Result<LoneRequestCheck> CalibratePolicy(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens,
                                         const CalibrationTolerance& tolerance) {
  if (s.mode == "pool") {
    const uint32_t n = prompt_tokens + s.suffix_tokens;
    KV_ASSIGN_OR_RETURN(std::unique_ptr<E2eBed> bed, E2eBed::Start(s, gbps, policy, {n}));
    ServeRequest store = E2eRequest(s, 1, 0), lone = E2eRequest(s, 2, 0);
    store.prompt = PoolPrompt(0, 1, prompt_tokens, s.suffix_tokens);
    lone.prompt = PoolPrompt(0, 2, prompt_tokens, s.suffix_tokens);
    // The first stores the prefix before it answers; the second finds it there.
    KV_RETURN_IF_ERROR(DriveArrivals(bed->serve(), {store}, {0.0})[0].status());
    std::vector<Result<ServeResponse>> answer = DriveArrivals(bed->serve(), {lone}, {0.0});
    KV_RETURN_IF_ERROR(answer[0].status());
    LoneRequestCheck c = CheckLonePoolRequest(answer[0].value(), *s.model, gbps * s.wire_payload_share, n, s.chunk_tokens, tolerance);
    c.gbps = gbps;
    c.policy = policy.name;
    return c;
  }
  KV_ASSIGN_OR_RETURN(std::unique_ptr<E2eBed> bed, E2eBed::Start(s, gbps, policy, {prompt_tokens}));
  // Measured at the client, as the points are: with node processes, HTTP and the router count.
  std::vector<Result<ServeResponse>> answer = DriveArrivals(bed->serve(), {E2eRequest(s, 1, prompt_tokens)}, {0.0});
  KV_RETURN_IF_ERROR(answer[0].status());
  LoneRequestCheck c =
      CheckLoneRequest(answer[0].value(), *s.model, gbps * s.wire_payload_share, prompt_tokens, s.max_new, tolerance);
  c.gbps = gbps;  // the link as named; its payload rate is what the prediction used
  c.policy = policy.name;
  return c;
}

// ---- Modelled points ---------------------------------------------------------------------------------

namespace {

// The strategies the simulator gives a policy: the profile's for adaptive, its own for a static one.
std::vector<StrategyCost> PolicyCosts(const E2eSetup& s, const E2ePolicy& policy) {
  if (policy.name == "adaptive") return s.profile ? StrategiesFromProfile(*s.profile) : std::vector<StrategyCost>{};
  if (policy.name == "none") return {};
  return {{policy.spec, policy.name, policy.quality, policy.ratio, policy.encode_gbps * 1e9, policy.decode_gbps * 1e9}};
}

Result<PolicyReport> SimulatePolicy(const E2eSetup& s, const E2ePolicy& policy, double gbps, const std::vector<uint32_t>& prompts,
                                    const std::vector<double>& arrivals) {
  const std::vector<StrategyCost> costs = PolicyCosts(s, policy);
  const std::string name = policy.name == "adaptive" || policy.name == "none" ? policy.name : "static:" + policy.spec;
  std::vector<WorkloadRequest> w;
  for (size_t i = 0; i < prompts.size(); ++i) w.push_back({arrivals[i], prompts[i], "", s.slo_ms, s.floor});
  SimOptions o;
  o.kv_bytes_per_token = double(s.model->kv_bytes_per_token());
  o.prefill_tokens_per_second = s.model->prefill_tokens_per_second;
  o.codec_threads = s.threads;
  o.controller.pipelined = true;
  o.controller.n_layer = s.model->n_layer;
  return Simulate(costs, {{0, gbps}}, w, name, o);
}

}  // namespace

Result<E2ePoint> RunModelledPoint(const E2eSetup& s, const E2ePolicy& policy, double gbps, const std::vector<uint32_t>& prompts,
                                  const std::vector<double>& arrivals) {
  KV_ASSIGN_OR_RETURN(PolicyReport rep, SimulatePolicy(s, policy, gbps, prompts, arrivals));
  E2ePoint p;
  p.gbps = gbps;
  p.policy = policy.name;
  p.measured = false;
  const double gen_ms = (s.max_new - 1) / s.model->decode_tokens_per_second * 1e3;
  std::vector<double> jct;
  for (double v : rep.latencies_ms) jct.push_back(v + gen_ms);
  if (jct.empty()) return Status::Internal("the simulator returned no latencies");
  p.mean_ms = Mean(jct);
  p.p50_ms = Percentile(jct, 0.5);
  p.p99_ms = Percentile(jct, 0.99);
  p.ttft_p99_ms = rep.p99_ms;
  uint32_t ok = 0;
  for (double v : rep.latencies_ms) ok += v <= s.slo_ms;
  p.slo_attainment = double(ok) / double(jct.size());
  p.goodput = ok / std::max(1e-9, arrivals.back() + p.mean_ms / 1e3);
  std::map<std::string, double> quality_of = {{"none", 1.0}};
  for (const StrategyCost& c : PolicyCosts(s, policy)) quality_of[c.name] = c.quality;
  double q = 0;
  for (const auto& [name, count] : rep.choices) {
    p.choices[name] = count;
    q += quality_of.count(name) ? quality_of[name] * count : count;
  }
  p.quality = q / double(jct.size());
  p.floor_violations = rep.floor_violations;
  return p;
}

// ---- Capacity ----------------------------------------------------------------------------------------

Result<double> SearchCapacity(const std::function<Result<bool>(double rate)>& meets, double lo, double hi, int steps) {
  if (!(lo > 0 && hi > lo) || steps < 0) {
    return Status::InvalidArgument("capacity search needs 0 < lo < hi and steps >= 0 (lo " + std::to_string(lo) + ", hi " +
                                   std::to_string(hi) + ", steps " + std::to_string(steps) + ")");
  }
  KV_ASSIGN_OR_RETURN(bool at_lo, meets(lo));
  if (!at_lo) return 0.0;
  KV_ASSIGN_OR_RETURN(bool at_hi, meets(hi));
  if (at_hi) return hi;
  for (int i = 0; i < steps; ++i) {
    const double mid = std::sqrt(lo * hi);
    KV_ASSIGN_OR_RETURN(bool ok, meets(mid));
    (ok ? lo : hi) = mid;
  }
  return lo;
}

Result<double> ModelledCapacity(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens, uint64_t seed) {
  const std::vector<uint32_t> prompts(200, prompt_tokens);
  return SearchCapacity(
      [&](double rate) -> Result<bool> {
        KV_ASSIGN_OR_RETURN(PolicyReport rep, SimulatePolicy(s, policy, gbps, prompts, PoissonArrivals(rate, prompts.size(), seed)));
        return rep.p99_ms <= s.slo_ms;
      },
      1e-3, 1e4, 30);
}

Result<MeasuredCapacity> MeasureCapacity(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens,
                                         uint32_t requests, uint32_t repeats, double lo, double hi, int steps, uint64_t seed,
                                         const std::function<void(double rate, bool meets)>& progress) {
  if (requests == 0 || repeats == 0) return Status::InvalidArgument("capacity needs requests and repeats above 0");
  MeasuredCapacity out;
  out.policy = policy.name;
  out.gbps = gbps;
  const std::vector<uint32_t> prompts(requests, prompt_tokens);
  for (uint32_t r = 0; r < repeats; ++r) {
    // Each repeat its own arrivals (a new draw), the same for every rate's shape: scaled.
    const std::vector<double> unit = PoissonArrivals(1.0, requests, seed + 101 * r);
    KV_ASSIGN_OR_RETURN(double rps, SearchCapacity(
                                        [&](double rate) -> Result<bool> {
                                          std::vector<double> arrivals = unit;
                                          for (double& a : arrivals) a /= rate;
                                          out.runs++;
                                          auto p = RunMeasuredPoint(s, policy, gbps, prompts, arrivals);
                                          const bool ok = p.ok() && p->errors == 0 && p->ttft_p99_ms <= s.slo_ms;
                                          if (progress) progress(rate, ok);
                                          return ok;
                                        },
                                        lo, hi, steps));
    out.per_repeat.push_back(rps);
    out.at_upper_end += rps >= hi;
  }
  out.rps = MeanCi95(out.per_repeat);
  return out;
}

}  // namespace kvserve
