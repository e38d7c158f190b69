// The service-aware online controller: an interpretable latency model, a bandwidth estimator, the
// per-request decision (filters by quality floor, bandwidth threshold, cooldown and SLO), online
// correction (moving-average residual, cooldown, discounted Thompson-sampling bandit) and the
// trace-driven simulator that compares policies.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvserve/profile.h"
#include "kvserve/status.h"

namespace kvserve {

// ---- Latency model (docs/CONTROLLER.md) -----------------------------------------------------------
// Units: bytes, bytes per second, seconds. A strategy s has ratio r, encode and decode speeds
// Se, Sd (of the fp16 input); its serial codec speed is S = 1 / (1/Se + 1/Sd).
struct StrategyCost {
  std::string spec;  // "none" for no compression
  std::string name;  // short form for explanations (registry defaults left out)
  double quality = 1, ratio = 1;
  double encode_Bps = 0, decode_Bps = 0;  // 0 for none: no codec work
  bool none() const { return ratio <= 1.0 && encode_Bps == 0; }
};

struct LatencyModel {
  // T0 = V / B (model time is added by the caller; it is the same for every strategy).
  static double Uncompressed(double bytes, double bandwidth_Bps);
  // Sequential: V/Se + V/(r B) + V/Sd.
  static double Sequential(const StrategyCost& s, double bytes, double bandwidth_Bps);
  // Layer-streamed over n_layer chunks: max(V/Se, V/(r B), V/Sd) + one layer's encode + decode.
  static double Pipelined(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_layer);
  // Bandwidth below which compression pays: sequential B* = (1 - 1/r) S; pipelined
  // B* = min(L (1 - 1/r) S, 1 / (1/min(Se, Sd) + (1/Se + 1/Sd)/L)). 0 for none and r <= 1.
  static double BreakEvenSequential(const StrategyCost& s);
  static double BreakEvenPipelined(const StrategyCost& s, uint32_t n_layer);
};

// ---- Bandwidth estimator ----------------------------------------------------------------------------
struct BandwidthEstimatorOptions {
  double alpha = 0.3;           // EWMA weight of a new sample
  double outlier_factor = 3.0;  // a sample this far (ratio) from the estimate is suspect
  double step_agree = 0.35;     // two suspect samples within this relative distance: a step
  double idle_seconds = 2.0;    // older estimates lose confidence; ask for a probe after this
  double window_seconds = 30.0; // history for the planning estimate (harmonic mean)
  // A transfer's time is latency + bytes / B. Transfers smaller than this are mostly latency:
  // they inform the latency estimate and never the bandwidth (a burst of 6 KB transfers would
  // otherwise read a 10 Gbit/s link as 0.3). Larger ones count their time less that latency.
  double min_bandwidth_bytes = 256 * 1024;
  double latency_alpha = 0.2;   // EWMA weight of a new latency sample
};

// Not thread-safe: one estimator per link, updated and read by one thread (or under a lock).
class BandwidthEstimator {
 public:
  explicit BandwidthEstimator(BandwidthEstimatorOptions o = {}) : o_(o) {}
  // A completed transfer (or a probe) of `bytes` taking `seconds`, finished at `now`: below
  // min_bandwidth_bytes a latency sample, above it a throughput sample of bytes / (seconds less
  // the latency estimate, at most half of them).
  void AddSample(double bytes, double seconds, double now);
  void AddThroughput(double bytes_per_second, double now);
  bool has_estimate() const { return n_ > 0; }
  double estimate() const { return estimate_; }  // bytes per second, the current level
  // Seconds a transfer takes beyond its bytes at the estimated rate (0 until a small one is seen).
  double latency_seconds() const { return latency_; }
  // What to plan with: the smaller of the current level and the harmonic mean of the samples of
  // the last window. Transfer time is 1/B, so under a varying link its expectation follows the
  // harmonic mean, not the arithmetic one; on a steady link both equal the level.
  double PlanningEstimate(double now) const;
  // In [0, 1]: grows with agreeing samples, shrinks with their spread and with idle time.
  double Confidence(double now) const;
  bool NeedsProbe(double now) const { return n_ == 0 || now - last_time_ > o_.idle_seconds; }

 private:
  BandwidthEstimatorOptions o_;
  double estimate_ = 0, dev_ = 0, last_time_ = 0;
  double suspect_ = 0;  // a pending suspect sample (0: none)
  double latency_ = 0;
  bool has_latency_ = false;
  uint32_t n_ = 0;
  std::vector<std::pair<double, double>> history_;  // (time, throughput), oldest first
};

// ---- Decision -----------------------------------------------------------------------------------------
struct Request {
  uint64_t id = 0;
  std::string label = "chat";
  double kv_bytes = 0;      // fp16 KV to move
  uint32_t prompt_tokens = 0;
  double slo_seconds = 1;   // budget for the transfer path (model time excluded unless included below)
  double floor = 0.97;      // minimum relative accuracy
  double model_seconds = 0; // prefill time before the KV exists, common to every strategy
};

// When each shared resource is next free, relative to the request's arrival (seconds >= 0): a
// choice is predicted through the queue it joins, so it also accounts for work queued ahead.
struct QueueState {
  double encode_wait = 0, link_wait = 0, decode_wait = 0;
  // Requests at each resource (queued or in progress): under a backlog as many are expected to
  // queue behind this one as are ahead of it now, and each waits out this one's turn there.
  uint32_t encode_jobs = 0, link_jobs = 0, decode_jobs = 0;
};

// What a decided request's codec stages took, measured where they ran (seconds of the stage's
// own work, no queueing): the prefill or pool node times its encode, the decode node its decode
// and reports it back. 0: not measured.
struct StageTimes {
  double encode_s = 0, decode_s = 0;
  // The sending node's CPU time in its sends (the kernel's copies and protocol work, measured on
  // the sending thread) and the bytes they carried. 0: not measured.
  double send_cpu_s = 0, wire_bytes = 0;
};

// ---- Live codec speeds ----------------------------------------------------------------------------
// Measured over profiled codec speed, one factor per stage (encode, decode) shared by every
// strategy: a contended or slower CPU slows every strategy alike, so one request's timing
// corrects them all, and no strategy keeps a stale correction it cannot shed because it is no
// longer chosen. Each factor is an EWMA (weight `alpha`) of log(measured / profiled speed).
// Used by the controller (PD) and the pool node's fetch decision alike.
//
// Sends on the codec's cores. Every byte sent costs the sender CPU (a kernel copy, checksums,
// and over a veth the receiver's softirq work too). Where the node's codec threads fill its cores,
// that time comes out of the encoder's: a transfer's encode stage then takes its encode plus its
// wire bytes times the measured send CPU time per byte, so of two strategies that encode alike the
// one with fewer bytes finishes first even where the link is not the bottleneck (the pipelined
// model otherwise takes the fastest encoder whatever its ratio). The encode times observed there
// hold the sends that ran during them, so the send time is taken out of them before they teach
// the encode factor. Where the codec has cores to spare (or RDMA moves the bytes) the node says
// so and the term is off.
struct LiveSpeedOptions {
  double alpha = 0.3;
  // Stages that coded less KV than this teach nothing: their time is fixed costs (threads
  // waking, frame set-up), not throughput (as the bandwidth estimator's small transfers).
  double min_sample_bytes = 4 << 20;
  bool sends_share_codec_cores = false;  // the node's codec threads fill its cores (see above)
};

// Not thread-safe: one per node, updated and read under its lock.
class LiveCodecSpeeds {
 public:
  explicit LiveCodecSpeeds(LiveSpeedOptions o = {}) : o_(o) {}
  // Strategy `s` coded `bytes` of KV (counted as its profiled speeds count them) and its stages
  // took `t` of their own work. none, small requests and unmeasured stages are ignored.
  void Observe(const StrategyCost& s, double bytes, const StageTimes& t);
  double encode() const { return factor_[0]; }  // live over profiled; 1 until measured
  double decode() const { return factor_[1]; }
  bool measured_encode() const { return has_[0]; }
  bool measured_decode() const { return has_[1]; }
  // Send CPU seconds per wire byte (EWMA; 0 until measured) and what the encode stage pays for
  // it per wire byte: the same where sends share the codec's cores, else 0.
  double send_cpu_per_byte() const { return send_cpu_per_byte_; }
  double encode_send_cost_per_byte() const { return o_.sends_share_codec_cores ? send_cpu_per_byte_ : 0.0; }
  // `s`'s encode stage in KV bytes per second at the live speeds: its encode at the live factor
  // plus, where sends share the codec's cores, the CPU time of sending its frames.
  double EncodeStageBps(const StrategyCost& s) const {
    return 1.0 / (1.0 / (s.encode_Bps * factor_[0]) + encode_send_cost_per_byte() / s.ratio);
  }
  // `s` at the live speeds.
  StrategyCost Apply(StrategyCost s) const {
    s.encode_Bps *= factor_[0];
    s.decode_Bps *= factor_[1];
    return s;
  }

 private:
  LiveSpeedOptions o_;
  double log_factor_[2] = {0, 0};
  double factor_[2] = {1, 1};  // e^log_factor_, what predictions multiply by
  bool has_[2] = {false, false};
  double send_cpu_per_byte_ = 0;
  bool has_send_ = false;
};

enum class DropReason : uint8_t { kKept = 0, kFloor, kNoGain, kCooldown };
const char* DropReasonName(DropReason r);

struct CandidateNote {
  uint32_t strategy = 0;
  DropReason reason = DropReason::kKept;
  double predicted_seconds = 0;  // kept ones: model + queue + codec + transfer, residual-corrected
  // What the choice minimises: predicted_seconds plus (queue_aware) the delay its turn at each
  // backlogged resource adds to the requests expected behind it.
  double cost = 0;
};

struct Decision {
  uint32_t choice = 0;           // index into the controller's strategies (0 is none)
  double predicted_seconds = 0;  // of the choice, including model time and queueing
  bool meets_slo = false;
  bool explored = false;         // the bandit chose other than the predicted best
  double bandwidth_Bps = 0, confidence = 0, floor = 0;
  QueueState queues;                 // what the decision saw queued
  double encode_speed = 1, decode_speed = 1;  // live over profiled codec speed it planned with
  double send_cost_per_byte = 0;  // encode-stage CPU seconds per wire byte it planned with (LiveCodecSpeeds)
  std::vector<CandidateNote> notes;  // one per strategy
};

struct ControllerOptions {
  bool pipelined = false;     // predict with the layer-streamed form
  uint32_t n_layer = 32;      // chunks of the pipelined form
  // Live codec speeds (LiveCodecSpeeds): every strategy is planned with its profiled encode and
  // decode speeds times one measured factor per stage.
  bool live_speeds = true;
  LiveSpeedOptions speeds;
  // Queue-aware choice: minimise own latency plus, at each resource with a backlog, this
  // request's time there times the requests seen there (docs/CONTROLLER.md, "Queues").
  bool queue_aware = true;
  // (a) KVServe's residual correction per strategy: an EWMA of log(observed / predicted) of the
  // whole latency. Off by default: the live speeds correct the codec, the estimator the link, and
  // a per-strategy residual learned from a few early requests outlives the reason for it on the
  // strategies no longer chosen (docs/CONTROLLER.md). `KvServeRule()` turns it on.
  bool moving_average = false;
  uint32_t ma_window = 8;     // requests averaged (as an EWMA of weight 2/(window+1))
  uint32_t cooldown_after = 3;     // SLO violations in a row that put a strategy in cooldown
  uint32_t cooldown_requests = 30; // decisions it then sits out
  // A violation counts towards the cooldown only where the request took more than this much
  // longer than predicted: an SLO missed by a request predicted just inside it is the model's
  // rounding, not a strategy gone bad (KVServe's rule counts every one: 0).
  double cooldown_margin = 0.1;
  bool bandit = false;        // (b) discounted Thompson sampling among the top-k (policy adaptive-bandit)
  uint32_t top_k = 3;
  double discount = 0.9;      // per observation of the arm, of older evidence
  double prior_sd = 0.1;      // of the log correction of an untried arm
  double arm_margin = 1.15;    // arms predicted slower than this times the best are not tried
  uint64_t seed = 1;
  // Label floors: a request's floor is max(its own, its label's). `retrieval` needs more.
  std::vector<std::pair<std::string, double>> label_floors = {{"retrieval", 0.99}};

  // The KVServe artifact's online rule, kept to compare against (policy adaptive-ma): profiled
  // speeds, a residual EWMA per strategy, cooldown after every unforeseen SLO miss, no queue term.
  // `base` supplies everything else (pipelined form, seed, label floors).
  static ControllerOptions KvServeRule() { return KvServeRule(ControllerOptions{}); }
  static ControllerOptions KvServeRule(ControllerOptions base) {
    ControllerOptions o = std::move(base);
    o.live_speeds = false;
    o.queue_aware = false;
    o.moving_average = true;
    o.cooldown_margin = 0;
    o.bandit = false;
    return o;
  }
};

// Not thread-safe: Decide and Observe update the bandit and the moving averages. A server shares
// one Controller across connections behind a mutex (decisions take microseconds), or keeps one
// per link; const members (Predict, Explain, FloorFor) may run concurrently with each other.
class Controller {
 public:
  // `strategies` need not include none: it is added as strategy 0.
  Controller(std::vector<StrategyCost> strategies, ControllerOptions opts = {});
  static Result<Controller> FromProfile(const Profile& p, ControllerOptions opts = {});

  const std::vector<StrategyCost>& strategies() const { return s_; }
  const ControllerOptions& options() const { return o_; }
  double FloorFor(const Request& r) const;

  // Picks a strategy; `out` is reused across calls (no allocation once sized).
  void Decide(const Request& r, double bandwidth_Bps, double confidence, const QueueState& q, Decision* out);
  // Prediction for one strategy, before correction (seconds, including model time and queueing).
  double Predict(uint32_t strategy, const Request& r, double bandwidth_Bps, const QueueState& q) const;
  // The delay a choice adds to the requests expected behind it (0 without backlog or queue_aware).
  double QueueCost(uint32_t strategy, const Request& r, double bandwidth_Bps, const QueueState& q) const;
  // Reports the observed latency of a decided request (seconds, same span as the prediction) and,
  // where measured, its stage times (live_speeds).
  void Observe(const Decision& d, const Request& r, double observed_seconds, const StageTimes& stages = {});
  // One line a person can read.
  std::string Explain(const Request& r, const Decision& d) const;
  bool InCooldown(uint32_t strategy) const { return state_[strategy].cooldown_left > 0; }
  double Correction(uint32_t strategy) const;  // multiplicative, from the moving average
  // Measured over profiled codec speed (live_speeds; 1 until a stage time is observed).
  double EncodeSpeedFactor() const { return speeds_.encode(); }
  double DecodeSpeedFactor() const { return speeds_.decode(); }
  // Encode-stage CPU seconds per byte sent (sends on the codec's cores; 0 otherwise or unmeasured).
  double SendCostPerByte() const { return speeds_.encode_send_cost_per_byte(); }

 private:
  struct ArmState {
    double log_residual = 0;  // EWMA of log(observed / predicted)
    bool has_residual = false;
    uint32_t violations = 0, cooldown_left = 0;
    double w = 0, wsum = 0;  // discounted bandit evidence of log(observed / predicted)
  };
  std::vector<StrategyCost> s_;
  ControllerOptions o_;
  std::vector<ArmState> state_;
  LiveCodecSpeeds speeds_;
  uint64_t rng_ = 0;
  double Uniform();
  double Normal();
};

// ---- Pool fetch decision (KV disaggregation) ------------------------------------------------------
// A request whose prompt prefix is in the pool may fetch it (as any stored copy) and compute only
// the suffix, or recompute everything. First-token time of each choice:
//   fetch s of c tokens: max(fetch(s, c), gpu_wait) + (n - c) / P
//   recompute:           gpu_wait + n / P
// with fetch(s, c) = max(W, D) + one chunk's min(W, D) (chunks are decoded while the next is on
// the wire; nothing is encoded on this path), W = V/(r B) and D = V/Sd, V = c * raw bytes per
// token. B and Sd are live: B the node's measured GET throughput from its backend (a
// BandwidthEstimator over its fetches, round trips and copies included), Sd the profiled decode
// speed times the node's measured decode factor (LiveCodecSpeeds), the same for every copy.
// Work already in flight at the node is shared, not queued behind: the pool link with other
// fetches' GETs and stores' PUTs, the node's cores with their decodes and encodes. Under
// processor sharing a job that still needs x seconds of a resource delays one that needs y by
// min(x, y), so W grows by the sum of min(x_i, W) over the link's jobs and D by the sum of
// min(x_i, D) over the codec's, divided by the cores they share. Recomputing uses the GPU only.
struct PoolOption {
  uint32_t strategy = 0;       // index into the strategies (0: none, the uncompressed copy)
  uint32_t cached_tokens = 0;  // leading prompt tokens the pool holds in that copy
};
struct PoolFetchRequest {
  uint32_t prompt_tokens = 0;
  double kv_bytes_per_token = 0;        // raw, as the strategies' ratios and speeds count it
  double prefill_tokens_per_second = 0;
  double gpu_wait_s = 0;                // compute queued ahead of this request
  double floor = 0.97;
  uint32_t chunk_tokens = 256;
  double decode_speed = 1;  // live over profiled decode speed (LiveCodecSpeeds::decode())
  // The work in flight at the node (other requests): seconds each transfer still holds the pool
  // link for, at the planning bandwidth, and each codec job still needs on the node's cores.
  std::vector<double> link_ahead_s;
  std::vector<double> codec_ahead_s;
  double codec_cores = 1;  // cores the node's codec work shares
};
struct PoolFetchDecision {
  int option = -1;               // index into the options; -1: recompute
  double predicted_seconds = 0;  // to the first token
  double recompute_seconds = 0;
  std::string explanation;       // one line: the choice, its prediction, what it beat and why others fell
};
double PoolFetchSeconds(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_chunks);
// The same sharing the node's link and cores with the work in flight that `r` describes.
double PoolFetchSecondsShared(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_chunks,
                              const PoolFetchRequest& r);
PoolFetchDecision DecidePoolFetch(const std::vector<StrategyCost>& strategies, const std::vector<PoolOption>& options,
                                  const PoolFetchRequest& r, double bandwidth_Bps);

// Short strategy text: parameters at their registry default are left out.
std::string ShortSpec(std::string_view spec);

// The profile's Pareto strategies as controller costs.
std::vector<StrategyCost> StrategiesFromProfile(const Profile& p);

}  // namespace kvserve
