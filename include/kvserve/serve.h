// PD-separated serving: a prefill node computes a request's KV, chooses how to compress it
// (fixed strategy or the Controller over a profile), and streams it layer by layer to a decode
// node, which decodes each layer on arrival and generates. Nodes talk only through Transport.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvserve/calib.h"
#include "kvserve/controller.h"
#include "kvserve/model.h"
#include "kvserve/pool.h"
#include "kvserve/transport.h"

namespace kvserve {

// How generated tokens are picked: greedy (temperature 0), or seeded sampling from the top-p
// nucleus of softmax(logits / temperature) — the draws `kvserve generate --temperature T
// --top-p P --seed S` makes, so a node's text equals local generation's for the same settings.
struct Sampling {
  float temperature = 0;
  float top_p = 1;
  uint64_t seed = 1;
};

struct ServeRequest {
  uint64_t id = 0;
  std::vector<int> prompt;  // token ids, BOS first
  uint32_t max_new_tokens = 16;
  double slo_ms = 1000;     // budget for the transfer path (encode + wire + decode)
  double floor = 0.97;      // minimum relative accuracy of the strategy chosen
  std::string label;        // workload tag (chat, retrieval, ...): raises the floor per ControllerOptions
  std::string strategy;     // force one strategy (empty: the node's policy)
  Sampling sampling;
};

// Receives each generated token as the node has it (the first from prefill, then the decode
// node's, message by message); returning false ends the request's generation there (a stop
// text was reached, or the client left) and the answer holds the tokens so far.
using TokenSink = std::function<bool(int token)>;

// Seconds per stage. encode/wire/decode overlap (layers are pipelined): transfer_s is the wall
// time from the first layer's encode to the last layer decoded, at most their sum.
struct StageTimings {
  double queue_s = 0, prefill_s = 0, encode_s = 0, wire_s = 0, decode_s = 0, transfer_s = 0, generate_s = 0;
  double total_s = 0;
  double send_cpu_s = 0;  // prefill node: CPU time of its frame sends (the sending thread's)
  // Pool node: fetching the cached prefix (wall time, decode included), arrival to the first
  // token, and storing the prompt's chunks (after the last token, so outside total_s).
  double fetch_s = 0, first_token_s = 0, store_s = 0;
};

struct ServeResponse {
  uint64_t id = 0;
  std::vector<int> tokens;  // the generated tokens (the first comes from the prefill node)
  std::string strategy;     // canonical spec used
  std::string explanation;  // the controller's one line (or "fixed strategy")
  StageTimings timings;
  uint64_t kv_bytes = 0;    // of the prompt KV, in the model's dtype
  uint64_t wire_bytes = 0;  // frames sent, retries included
  uint32_t resent_layers = 0;
  std::string decode_node;
  // Pool node: prompt tokens whose KV came from the pool, and what was done: "fetch" (of
  // `strategy`), "recompute" (chosen over the stored copies), "miss" (nothing usable stored).
  uint32_t cached_tokens = 0;
  std::string pool_action;
  uint64_t stored_bytes = 0;
};

// Counters a node exports on /metrics (Prometheus text).
struct NodeMetrics {
  std::atomic<uint64_t> requests{0}, errors{0}, kv_bytes{0}, wire_bytes{0}, resent_layers{0}, corrupt_frames{0};
  std::atomic<uint64_t> encode_us{0}, wire_us{0}, decode_us{0};
  std::atomic<uint64_t> pool_hits{0}, pool_misses{0}, pool_recomputes{0}, pool_corrupt{0}, pool_errors{0};
  std::atomic<uint64_t> cached_tokens{0}, computed_tokens{0}, stored_bytes{0};
  std::string Prometheus(const std::string& node) const;
};

// Stands in for GPU prefill and decode of a production model whose KV has this shape: the KV
// is synthetic (kv/synth.h, fp16) and compute is time at these rates. The codec, the transport
// and the link are real. Defaults: Llama-3-8B (32 layers, 8 KV heads, head_dim 128: 128 KiB of
// fp16 KV per token) on one H100 SXM, from its datasheet: prefill is compute-bound, 2 x 8e9
// FLOP per token at 40% of 989 dense BF16 TFLOP/s = ~25,000 tokens/s, one prompt at a time;
// decode is memory-bound, 16 GB of weights and 0.5 GB of KV per step at 3.35 TB/s = ~200
// tokens/s per request. SyntheticModelByName derives the same for other shapes and GPUs.
struct SyntheticModel {
  std::string name = "llama3-8b";
  uint32_t n_layer = 32, n_head_kv = 8, head_dim = 128;
  uint32_t max_prompt_tokens = 32768;  // the longest prompt a node of this shape takes
  double prefill_tokens_per_second = 25000;
  double decode_tokens_per_second = 200;
  std::string gpu = "h100";       // the preset the rates come from
  uint32_t tensor_parallel = 1;   // GPUs the weights are split over
  uint64_t kv_bytes_per_token() const { return uint64_t{2} * 2 * n_layer * n_head_kv * head_dim; }
};
// A production shape ("llama3-8b", "qwen2.5-32b", "llama3-70b") on a GPU preset ("h100",
// "a100", "l40s"): its KV shape, and compute rates by the rule of docs/SERVING.md (prefill at
// 40% of dense BF16 peak, decode reading weights and 4096 tokens of KV per step at memory
// bandwidth; tensor parallel over the fewest GPUs that hold the weights; two significant
// figures). Errors name the text and list what is known.
Result<SyntheticModel> SyntheticModelByName(const std::string& name, const std::string& gpu = "h100");
std::vector<std::string> SyntheticShapeNames();
std::vector<std::string> GpuPresetNames();

namespace serve_internal {
class Compute;  // what a node computes with: the llama engine, or a production shape's stand-in
class ComputeSession;
}  // namespace serve_internal

struct DecodeNodeOptions {
  const LlamaModel* model = nullptr;
  const SyntheticModel* synthetic = nullptr;  // instead of `model`: KV checked, then generation time
  CodecEnv env;
  double request_timeout_s = 30;  // a request whose frames stop arriving fails after this
  // Connections served at once (a thread each); beyond, a connection is told so and closed.
  uint32_t max_connections = 64;
  // Request buffers (a KV slot and a frame buffer each) kept for the next requests once their
  // connection ends, so serving does not fault in fresh memory per request.
  uint32_t kept_buffers = 4;
};

// Serves connections from prefill nodes, one thread per connection (at most max_connections),
// until Stop(). Every message is bounded before it is read: a request message by
// kControlMessageBytes, a frame by twice the raw KV of the prompt it announced.
class DecodeNode {
 public:
  DecodeNode(Transport* transport, DecodeNodeOptions opts);
  ~DecodeNode();
  Status Start(const std::string& listen_address);
  // A request buffer for prompts of up to n_token tokens — a KV slot and a frame buffer —
  // allocated and written now, as an engine allocates its KV cache at start, so the first
  // requests do not fault their memory in while they are timed. Kept among kept_buffers.
  Status Prepare(uint32_t n_token);
  uint16_t port() const { return port_; }
  void Stop();
  const NodeMetrics& metrics() const { return metrics_; }

 private:
  void AcceptLoop();
  void Serve(std::shared_ptr<Connection> c);
  void ServeRequests(Connection* c);
  struct Scratch {
    KvBlock kv;        // the request's KV, reshaped per request
    ByteBuffer frame;  // the last frame's allocation, received into again
  };
  Status MakeComputeOnce();
  std::unique_ptr<Scratch> TakeScratch();
  void GiveScratch(std::unique_ptr<Scratch> s);
  std::mutex scratch_mu_;
  std::vector<std::unique_ptr<Scratch>> scratch_;
  Transport* transport_;
  DecodeNodeOptions opts_;
  std::unique_ptr<Listener> listener_;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> workers_;
  std::vector<std::thread::id> finished_;  // workers whose connection ended, to be joined
  std::vector<Connection*> open_;
  NodeMetrics metrics_;
  std::unique_ptr<serve_internal::Compute> compute_;
};

struct PrefillNodeOptions {
  const LlamaModel* model = nullptr;
  const SyntheticModel* synthetic = nullptr;  // instead of `model`: synthetic KV, prefill time
  CodecEnv env;
  std::vector<std::string> decode_peers;  // tried in turn from a rotating start; a dead one is skipped
  const Profile* profile = nullptr;       // adaptive choice over its Pareto set; null: `strategy`
  std::string strategy = "none";          // used without a profile
  ControllerOptions controller;
  double assume_gbps = 10;                // bandwidth before the first measured transfer
  double request_timeout_s = 30;
  ThreadPool* pool = nullptr;             // codec threads; null: the calling thread
  // Fault injection for tests: flip a byte of every Nth frame sent (0: never). Only first sends:
  // resent frames go out intact, as after a transient wire fault.
  uint32_t corrupt_every = 0;
};

// The frames a request's KV goes as under `spec`: one per layer, pipelined, or one for a
// strategy that codes the whole request together (lowrank).
uint32_t TransferFrames(const std::string& spec, uint32_t n_layer);

// Runs requests: prefill, choose, stream, wait for the decode node's tokens. Thread-safe; the
// model is shared read-only, the controller and estimator behind one lock.
class PrefillNode {
 public:
  static Result<std::unique_ptr<PrefillNode>> Create(Transport* transport, PrefillNodeOptions opts);
  ~PrefillNode();
  // With `on_token`, the decode node streams tokens as it generates them; a request that streamed
  // some is not handed to another decode node when its own fails (the client has them already).
  Result<ServeResponse> Serve(const ServeRequest& request, const TokenSink& on_token = nullptr);
  // With a synthetic model: makes the KV of an n_token prompt now, so that serving does not.
  // Either way: frame buffers for such a prompt's largest per-layer frame, their pages faulted
  // in, so that the first requests do not pay for fresh memory (on a VM a first touch can cost
  // 50x a warm write: 0.35 against 20 GB/s on this project's machines).
  Status Prepare(uint32_t n_token);
  const NodeMetrics& metrics() const { return metrics_; }
  double bandwidth_estimate_gbps() const;
  double link_latency_seconds() const;  // the estimator's per-transfer latency (0 until measured)
  // The controller's live over profiled codec speed, {encode, decode} (1 until measured).
  std::array<double, 2> codec_speed_factors() const;
  // CPU seconds a frame send takes from the codec's cores per byte on the wire, as the adaptive
  // rule charges it to the encode stage (0 where sends do not share those cores, or until measured).
  double send_cost_seconds_per_byte() const;
  // What the transfers in flight have left, as a request whose KV is ready now finds it: seconds
  // of link work (at the bandwidth estimate) and of encode work (at the live speeds of their
  // strategies; 0 for strategies outside the profile), and how many transfers hold each. The
  // adaptive rule decides through this (QueueState, docs/CONTROLLER.md "Queues").
  QueueState queues() const;

 private:
  PrefillNode(Transport* transport, PrefillNodeOptions opts);
  // One transfer in flight, as far as the queue-aware rule needs it. Its wire bytes are the
  // strategy's profiled ratio until its first frame is encoded, then extrapolated from the frames
  // encoded so far (every frame codes one layer, or one frame the whole request; each attempt
  // sets n_frames and starts its counts over).
  struct InFlight {
    double kv_bytes = 0, wire_predicted = 0;
    double encode_Bps = 0;  // profiled, per KV byte; 0: not known (a strategy outside the profile)
    uint32_t n_frames = 1, frames_encoded = 0;
    double wire_encoded = 0, wire_sent = 0;
    double WireLeft() const;
    double KvLeftToEncode() const { return kv_bytes * (1 - double(frames_encoded) / n_frames); }
  };
  struct Choice {
    std::string spec;
    std::string explanation;
    Decision decision;
    Request request;
    bool adaptive = false;
    uint64_t transfer = 0;  // its entry in in_flight_
  };
  // Decides and enters the transfer in flight under one lock, so concurrent decisions see each other.
  Choice Choose(const ServeRequest& req, double kv_bytes, double model_seconds);
  QueueState QueuesLocked(double bandwidth_Bps, double ready_seconds) const;  // mu_ held
  void TransferEnded(uint64_t transfer);
  Status Transfer(Connection* c, const ServeRequest& req, const KvBlock& kv, const std::vector<float>& scores,
                  const std::string& spec, uint64_t transfer, int first_token, const TokenSink& on_token,
                  uint32_t* streamed, ServeResponse* out);
  // Frame buffers whose allocations the encoder reuses (pages already faulted in).
  ByteBuffer TakeFrameBuffer();
  void GiveFrameBuffer(ByteBuffer b);
  Transport* transport_;
  PrefillNodeOptions opts_;
  std::mutex buffers_mu_;
  std::vector<ByteBuffer> buffers_;
  std::unique_ptr<Controller> controller_;
  mutable std::mutex mu_;  // controller_, estimator_, in_flight_, next_transfer_
  BandwidthEstimator estimator_;
  std::map<uint64_t, InFlight> in_flight_;
  uint64_t next_transfer_ = 0;
  std::atomic<uint64_t> next_peer_{0}, frames_sent_{0};
  NodeMetrics metrics_;
  std::unique_ptr<serve_internal::Compute> compute_;
};

struct PoolNodeOptions {
  const LlamaModel* model = nullptr;
  const SyntheticModel* synthetic = nullptr;  // instead of `model`: synthetic KV, timed compute
  CodecEnv env;
  KvPool* pool = nullptr;
  LinkShaper* pool_link = nullptr;  // paces bytes to and from the pool (its link); null: unpaced
  uint32_t chunk_tokens = kDefaultChunkTokens;
  KeyPlacement placement = KeyPlacement::kPrefix;
  // "adaptive" (needs `profile`): stores the copy fastest to fetch at the expected bandwidth
  // within the floor (and one at safe_floor if it is below), fetches or recomputes by
  // DecidePoolFetch. "recompute": never uses the pool. Otherwise a strategy, stored and always
  // fetched when present ("none": the uncompressed pool).
  std::string policy = "adaptive";
  const Profile* profile = nullptr;
  double safe_floor = 0.99;
  // A request's floor is max(its own, its label's), as in the controller.
  std::vector<std::pair<std::string, double>> label_floors = ControllerOptions{}.label_floors;
  double assume_gbps = 10;          // pool bandwidth before the first measured fetch (or probe)
  // Adaptive: at creation one value the size of a chunk's frame at ratio 4 (8 MiB for llama3-8b
  // and 256-token chunks) is stored, fetched (timed) and deleted, a first measurement of the
  // backend's GET throughput. Off: plan at assume_gbps until the first fetch.
  bool probe = true;
  double prefill_tokens_per_second = 0;  // real model: for the decision (0: measured as it runs)
  ThreadPool* threads = nullptr;    // codec threads
};

// KV-disaggregated serving: one node that computes and generates, with its prompts' prefix KV
// in a pool. A request fetches its longest cached prefix (chunks decoded while the next is on
// the wire) and computes only the suffix, or recomputes when that is faster; afterwards the
// chunks the pool lacked are stored. A bad value (checksum, shape) is deleted and recomputed,
// never used. Thread-safe.
// What the fetches and stores in flight at a pool node have left (its fetch decision shares it):
// seconds on the pool link at the planning bandwidth, codec seconds on the node's cores, and how
// many jobs hold each.
struct PoolWorkState {
  double link_s = 0, codec_s = 0;
  uint32_t link_jobs = 0, codec_jobs = 0;
};

class PoolNode {
 public:
  static Result<std::unique_ptr<PoolNode>> Create(PoolNodeOptions opts);
  ~PoolNode();
  Result<ServeResponse> Serve(const ServeRequest& request, const TokenSink& on_token = nullptr);
  Status Prepare(uint32_t n_token);  // synthetic: makes an n_token prompt's KV before timing
  const NodeMetrics& metrics() const { return metrics_; }
  double bandwidth_estimate_gbps() const;
  double link_latency_seconds() const;  // the estimator's per-fetch latency (0 until measured)
  // Live over profiled codec speed, {encode, decode} (1 until measured; LiveCodecSpeeds).
  std::array<double, 2> codec_speed_factors() const;
  PoolWorkState work_in_flight() const;  // adaptive nodes (others keep none)
  std::string pool_backend() const { return opts_.pool ? opts_.pool->name() : "none"; }
  // Strategy 0 is none; adaptive nodes have the profile's after it.
  const std::vector<StrategyCost>& strategies() const { return s_; }

 private:
  explicit PoolNode(PoolNodeOptions opts);
  struct Fetch;
  // A fetch's or a store's work in flight at this node, which a fetch shares (DecidePoolFetch):
  // the bytes it still moves over the pool link and the codec seconds it still needs here.
  struct Work {
    double link_bytes = 0, codec_s = 0;
    bool shared = false;  // another job was in flight beside it at some time
  };
  uint64_t AddWorkLocked(Work w);  // registers a job (mu_ held); marks it and those in flight shared
  // Each job's remaining seconds on the pool link (at bw) and on the codec (mu_ held): what a fetch shares.
  void WorkAheadLocked(double bw, std::vector<double>* link_s, std::vector<double>* codec_s) const;
  class WorkScope;  // one job's entry in work_, updated as its chunks move, removed at its end
  Status FetchPrefix(const std::vector<std::string>& keys, size_t n_chunks, serve_internal::ComputeSession* session,
                     WorkScope* work, Fetch* out);
  Status ProbeBackend();
  double PrefillTokensPerSecond() const;
  std::vector<size_t> StoreChoice(double floor, uint32_t prefix_tokens, double tps, std::string* note) const;
  PoolNodeOptions opts_;
  std::vector<StrategyCost> s_;
  std::vector<size_t> candidates_;  // strategies looked up per request
  double bytes_per_token_ = 0;      // raw KV in the node's dtype
  mutable std::mutex mu_;           // estimator_, speeds_, measured prefill rate, work_
  BandwidthEstimator estimator_;    // GET throughput from the pool's backend
  std::map<uint64_t, Work> work_;   // adaptive: fetches and stores in flight
  uint64_t next_work_ = 0;
  double codec_cores_ = 1;          // cores this process may run on (its affinity)
  LiveCodecSpeeds speeds_;          // decode (fetches) and encode (stores) over profiled speed
  double last_get_sample_s_ = 0;    // when a fetch or probe last measured the backend
  static constexpr double kReprobeSeconds = 30;  // adaptive: probe again after this long without one
  double measured_tps_ = 0;
  std::mutex compute_mu_;           // one prompt computes at a time, as on one GPU
  std::atomic<uint64_t> queued_tokens_{0};
  NodeMetrics metrics_;
  std::unique_ptr<serve_internal::Compute> compute_;
};

// ---- What one request may ask for ---------------------------------------------------------------
// Bodies nest at most this deep (a JSON array or object per level); deeper is refused before it
// is parsed.
inline constexpr int kMaxRequestJsonDepth = 16;
// A strategy a request names: at most this long and this many stages, each stage once, so a
// request cannot buy seconds of codec time per KV byte (270 zstd(level=19) stages did).
inline constexpr size_t kMaxRequestStrategyBytes = 1024;
inline constexpr size_t kMaxRequestStrategyStages = 8;
// InvalidArgument when `text` nests arrays or objects deeper than max_depth (strings skipped).
Status CheckJsonNesting(std::string_view text, int max_depth);
// The canonical form of a strategy a request names, within the limits above.
Result<std::string> RequestStrategy(const std::string& text);

// JSON bodies of the HTTP API and the wire messages (one place, so both ends agree).
// `max_prompt` bounds the prompt in tokens; text that cannot fit is refused before tokenizing.
Result<ServeRequest> ParseServeRequest(const std::string& json, const Tokenizer* tokenizer, uint32_t max_prompt);
std::string ServeResponseJson(const ServeResponse& r, const Tokenizer* tokenizer);

// The router's view of a request: its workload label (the request's own, a string, or "long" /
// "short" by prompt length) and the body to forward — only the fields a node reads, so what the
// router re-serialises is bounded by what it validated.
struct RoutedRequest {
  std::string label;
  std::string body;
};
Result<RoutedRequest> RouteRequest(const std::string& body, uint32_t long_prompt_tokens);

}  // namespace kvserve
