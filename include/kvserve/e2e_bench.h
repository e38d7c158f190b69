// The end-to-end benchmark's harness (`kvserve bench e2e`): the nodes of one run (in process or
// as processes), a measured point driven at its arrival times, its repeats with intervals and
// paired ratios, the lone-request calibration, the simulator's modelled points, and the capacity
// search, measured and modelled. The CLI resolves flags and prints; this measures.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvserve/calibration.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "kvserve/stats.h"
#include "kvserve/testbed.h"
#include "kvserve/thread_pool.h"

namespace kvserve {

// A policy the benchmark compares: none, adaptive (the profile's controller), or a fixed
// strategy with the quality, ratio and codec speeds its strategy table measured.
struct E2ePolicy {
  std::string name;  // "none", "adaptive", "static:NAME", "recompute" (pool)
  std::string spec;  // fixed strategy ("" for adaptive)
  double quality = 1, ratio = 1, encode_gbps = 0, decode_gbps = 0;
};

// One (bandwidth, policy) point: its figures (over repeats, the mean of the repeats' figures).
struct E2ePoint {
  double gbps = 0;
  std::string policy;
  bool measured = true;
  double mean_ms = 0, p50_ms = 0, p99_ms = 0, ttft_p99_ms = 0, slo_attainment = 0, goodput = 0, quality = 1;
  double wire_bytes = 0, compute_share = 0, capacity_rps = 0;
  bool valid = true;  // its policy's lone request on this link took what its parts predict
  // Over repeats: the half-widths of the 95% intervals of mean, P50, P99 JCT and P99 TTFT, and
  // none's mean over this one's (paired by repeat).
  uint32_t repeats = 1;
  double mean_ci = 0, p50_ci = 0, p99_ci = 0, ttft_p99_ci = 0;
  MeanCi vs_none;
  std::vector<double> repeat_means;
  uint32_t floor_violations = 0, errors = 0;
  std::map<std::string, uint32_t> choices;
  // Pool mode (TTFT is its figure): over repeats, the means' 95% half-widths and each repeat's
  // mean TTFT, for paired ratios.
  double hit_rate = 0, hit_ttft_mean_ms = 0, hit_ttft_p99_ms = 0, ttft_mean_ms = 0;
  double ttft_mean_ci = 0, hit_ttft_mean_ci = 0;
  std::vector<double> repeat_ttft_means;
};

// What every run of one benchmark shares.
struct E2eSetup {
  // pd: a prefill node ships each request's KV to a decode node. pool: a pool node fetches a
  // request's stored prefix KV from the pool (or recomputes it) and computes the rest.
  std::string mode = "pd";
  const SyntheticModel* model = nullptr;
  const Profile* profile = nullptr;  // adaptive's controller
  std::string profile_path;          // the same, for node processes
  uint32_t max_new = 16;
  double slo_ms = 2000, floor = 0.97;
  int threads = 2;              // codec threads per node
  ThreadPool* pool = nullptr;   // in-process nodes' codec workers (`threads` of them; null: one)
  // Where the nodes run: "inproc" (both nodes in this process, the link the in-process token
  // bucket) or "process" (kvserve/testbed.h's ProcessTestbed with `link` "netns" or "shaper").
  std::string nodes = "inproc", link = "shaper";
  std::string kvserve_exe, netns_script, netns_prefix;
  int cpu_prefill = -1, cpu_decode = -1, cpu_router = -1;
  double send_delay_ns = 0;  // test seam: the sender's extra time per byte
  std::string transport = "tcp";  // prefill to decode: tcp | ucx (pd mode)
  // The share of the link's rate that carries payload, for the calibration's prediction: 1 for
  // the token bucket (it counts payload); the kernel's link (tbf) counts each segment's TCP/IP
  // and Ethernet headers, 1448 payload bytes of 1514 on the wire (kKernelLinkPayloadShare).
  double wire_payload_share = 1;
  // Node processes: the driver's client of the router (HTTP, which the library does not speak).
  std::function<ServeFn(const std::string& address, const std::string& netns)> router_client;
  // Told of a process testbed when it is live and when it has stopped (null), so a signal can
  // stop it. Called on the thread that runs the benchmark.
  std::function<void(ProcessTestbed*)> on_live;
  // Pool mode. Backend: embedded (a fresh pool in the pool node), redis (in process: the server
  // at pool_address, cleared per run; as processes: a redis-server of the testbed's own) or
  // redis-cluster (in process only). A prompt is a shared prefix plus suffix_tokens of its own.
  std::string pool_backend = "embedded", pool_address, redis_server = "redis-server";
  uint32_t chunk_tokens = 256, suffix_tokens = 64;
  uint64_t pool_capacity_mib = 8192;
};

// The nodes of one measured run of `policy` on a link of `gbps`: fresh, with the synthetic KV of
// `prompts`' lengths made before the clock starts, behind one serve function.
class E2eBed {
 public:
  static Result<std::unique_ptr<E2eBed>> Start(const E2eSetup& s, double gbps, const E2ePolicy& policy,
                                               std::vector<uint32_t> prompts);
  ~E2eBed();
  const ServeFn& serve() const { return serve_; }

 private:
  struct InProcess;
  E2eBed() = default;
  const E2eSetup* setup_ = nullptr;
  struct InProcessPool;
  std::unique_ptr<InProcess> inproc_;
  std::unique_ptr<InProcessPool> inproc_pool_;
  std::unique_ptr<ProcessTestbed> procs_;
  ServeFn serve_;
};

inline constexpr double kKernelLinkPayloadShare = 1448.0 / 1514.0;

// The driver's request `id`: a prompt of n_token tokens, the setup's generation, SLO and floor.
ServeRequest E2eRequest(const E2eSetup& s, uint64_t id, uint32_t n_token);

// Arrival times of n requests, Poisson at `rate` per second from `seed` (rate 0: all at once).
std::vector<double> PoissonArrivals(double rate, size_t n, uint64_t seed);

// Pool mode's workload: which document each of n requests reuses as its prefix, a new one or,
// with probability `reuse`, one seen before (uniformly), from `seed`.
std::vector<uint32_t> PoolDocuments(uint32_t n, double reuse, uint64_t seed);

// A pool request's prompt: `prefix_tokens` of document `doc` (the same ids for every request of
// that document) then `suffix_tokens` of its own (`own`: distinct per request).
std::vector<int> PoolPrompt(uint64_t doc, uint64_t own, uint32_t prefix_tokens, uint32_t suffix_tokens);

// The quality a pool answer had: 1 for none (and a miss), the profile's for its strategies, the
// policy's own for its strategy.
std::map<std::string, double> PoolQualityOf(const E2eSetup& s, const E2ePolicy& policy);

// The answers of a point as its figures: JCT from the driver, TTFT = JCT less generation (the
// KV decoded at the decode node), the SLO on TTFT. Failed requests count in `errors`; `on_error`
// hears each (may be null).
E2ePoint SummarisePd(const std::vector<Result<ServeResponse>>& answers, const E2eSetup& s, const E2ePolicy& policy,
                     double gbps, double last_arrival_s, const std::function<void(const Status&)>& on_error);

// The same for the pool: JCT and TTFT (arrival to the first token: prefix fetched or computed,
// suffix computed) from the driver, hit TTFT over requests that reused a stored prefix, the SLO
// on TTFT; `quality_of` maps a fetched strategy to its quality (a miss or recompute is exact).
E2ePoint SummarisePool(const std::vector<Result<ServeResponse>>& answers, const E2eSetup& s, const E2ePolicy& policy,
                       double gbps, double last_arrival_s, const std::map<std::string, double>& quality_of,
                       const std::function<void(const Status&)>& on_error);

// Measured: these requests through fresh nodes (E2eBed) at their arrival times, summarised for
// the setup's mode (SummarisePd or SummarisePool).
Result<E2ePoint> RunMeasuredRequests(const E2eSetup& s, const E2ePolicy& policy, double gbps,
                                     const std::vector<ServeRequest>& requests, const std::vector<double>& arrivals,
                                     const std::function<void(const Status&)>& on_error = {});

// Measured, PD: a request of each prompt length (E2eRequest) through fresh nodes at its arrival.
Result<E2ePoint> RunMeasuredPoint(const E2eSetup& s, const E2ePolicy& policy, double gbps, const std::vector<uint32_t>& prompts,
                                  const std::vector<double>& arrivals, const std::function<void(const Status&)>& on_error = {});

// One point from its repeats: each figure the mean of the repeats' (counts summed), with the 95%
// intervals of the JCT and TTFT figures.
E2ePoint AggregateRepeats(const std::vector<E2ePoint>& repeats);

// Per-repeat ratios of two points' mean JCTs (num / den), paired by repeat: mean and 95% interval.
MeanCi PairedRatio(const E2ePoint& num, const E2ePoint& den);
// The same for mean TTFT (pool mode's figure).
MeanCi PairedTtftRatio(const E2ePoint& num, const E2ePoint& den);

// The policy's request alone on fresh nodes, measured at the client, against what its parts
// predict (kvserve/calibration.h). Pool mode: a request stores the prefix of `prompt_tokens`
// first (a miss, not checked); then a lone request with that prefix and another suffix is the
// one checked (CheckLonePoolRequest): a hit, or the recompute its policy chose.
Result<LoneRequestCheck> CalibratePolicy(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens,
                                         const CalibrationTolerance& tolerance);

// ---- Modelled (the simulator, from the measured stage speeds) ------------------------------------

// The simulator's replay of `policy` on a steady link; latencies are arrival to KV decoded.
Result<E2ePoint> RunModelledPoint(const E2eSetup& s, const E2ePolicy& policy, double gbps, const std::vector<uint32_t>& prompts,
                                  const std::vector<double>& arrivals);

// ---- Capacity --------------------------------------------------------------------------------------

// The highest rate in [lo, hi] for which `meets` holds, by bisection on a log scale in `steps`
// steps, assuming it holds below some rate and not above: 0 when it fails at `lo`, `hi` when it
// holds there. Each call of `meets` is one experiment.
Result<double> SearchCapacity(const std::function<Result<bool>(double rate)>& meets, double lo, double hi, int steps);

// Modelled capacity: the highest Poisson rate at which the simulator keeps P99 TTFT within the
// SLO, over 200 requests of `prompt_tokens`.
Result<double> ModelledCapacity(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens, uint64_t seed);

struct MeasuredCapacity {
  std::string policy;
  double gbps = 0;
  MeanCi rps;                      // over repeats: each repeat's own search
  std::vector<double> per_repeat;  // requests/s
  uint32_t runs = 0;               // measured runs the searches took
  uint32_t at_upper_end = 0;       // searches whose upper end met the objective: capacity is at least that
};

// Measured capacity: per repeat, a search (SearchCapacity, `steps` steps between `lo` and `hi`
// requests/s) whose every step is a measured run of `requests` Poisson arrivals on fresh nodes;
// a rate meets the objective when every request is answered and P99 TTFT is within the SLO.
// Few requests a run measure what a burst of that many can take, above the steady state.
Result<MeasuredCapacity> MeasureCapacity(const E2eSetup& s, const E2ePolicy& policy, double gbps, uint32_t prompt_tokens,
                                         uint32_t requests, uint32_t repeats, double lo, double hi, int steps, uint64_t seed,
                                         const std::function<void(double rate, bool meets)>& progress = {});

}  // namespace kvserve
