// The HTTP APIs of the serving processes, on HttpServer: a node that serves requests itself
// (prefill, pool) answers kvserve's POST /generate and the OpenAI API (/v1/completions,
// /v1/chat/completions with server-sent-event streaming, /v1/models), /health and /metrics
// (Prometheus text with vLLM's latency histograms); the router forwards the same paths to its
// prefill nodes within each request's deadline and relays streams as they come.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvserve/serve.h"
#include "serve/http_server.h"
#include "serve/openai.h"

namespace kvserve::serve_internal {

// A fixed-bucket Prometheus histogram. Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double v);
  // "# HELP", "# TYPE" and the _bucket/_sum/_count series, with `labels` (`a="b"`) on each.
  void Write(std::string* out, const std::string& name, const std::string& help, const std::string& labels) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
};

// What the front of one node measures per request, exported beside the node's counters: the
// latency histograms vLLM exports, with its buckets (time to first token, inter-token latency,
// end-to-end latency, queue time), kvserve's stage times and compression ratio, and decisions
// and bytes per chosen strategy. TTFT and inter-token latency come from streamed requests (a
// whole answer's tokens reach the client together).
class FrontMetrics {
 public:
  FrontMetrics();
  void ObserveAnswer(const ServeResponse& r, double e2e_s, uint32_t prompt_tokens, uint32_t completion_tokens);
  void ObserveFirstToken(double s);
  void ObserveInterToken(double s);
  void CountRequest(const std::string& api, int status);
  std::string Prometheus(const std::string& node) const;

 private:
  Histogram ttft_, itl_, e2e_, queue_, encode_, wire_, decode_, ratio_;
  mutable std::mutex mu_;
  std::vector<std::pair<std::string, std::pair<uint64_t, uint64_t>>> strategies_;  // decisions, wire bytes
  std::vector<std::pair<std::string, uint64_t>> requests_;                         // api + status code
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0;
};

// A node that serves requests itself.
struct NodeFront {
  std::string role;  // "prefill" | "pool"
  OpenAiModel model;
  std::function<Result<ServeResponse>(const ServeRequest&, const TokenSink&)> serve;
  std::function<std::string()> metrics;          // the node's own counters (Prometheus text)
  std::function<double()> bandwidth_gbps, latency_seconds;
  std::function<std::array<double, 2>()> codec_speed;  // live over profiled {encode, decode} speed
  std::function<double()> send_cost;  // prefill nodes: send CPU on the codec's cores, seconds per wire byte
  std::function<QueueState()> queues;  // prefill nodes: what the transfers in flight have left
  std::function<PoolWorkState()> pool_work;  // pool nodes: what the fetches and stores in flight have left
  std::string backend;  // pool nodes: the pool's backend, a label on the link gauges
  std::function<void(const std::string&)> log;   // one JSON line per request; null: quiet
  // False while the node loads (its model, profile, prepared KV): /health answers 503 and the
  // APIs 503 "loading"; every field above is set before it turns true, and not after.
  std::atomic<bool> ready{false};
};
// Registers /generate, /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics and
// an OpenAI-shaped 404 for the rest. Once ready, set the server's body limit to NodeBodyLimit's.
void AddNodeRoutes(HttpServer* server, std::shared_ptr<NodeFront> front);
// The longest body a valid request can have: its prompt as text (every token at most the
// longest piece, escaped) or as ids, and the other fields.
size_t NodeBodyLimit(const OpenAiModel& model);

struct RouterOptions {
  std::vector<std::string> peers;  // prefill (or pool) nodes' HTTP host:port
  double timeout_s = 60;           // a request's whole deadline, over every node it is tried on
  uint32_t long_prompt = 256;      // prompt tokens from which an untagged request is "long"
  std::function<void(const std::string&)> log;  // debug lines; null: quiet
};
void AddRouterRoutes(HttpServer* server, RouterOptions opts);

}  // namespace kvserve::serve_internal
