// The node and router HTTP APIs (serve/http_api.h): kvserve's /generate, the OpenAI API with
// streaming, /health, /metrics; the router's forwarding within each request's deadline.
#include "serve/http_api.h"

#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <ctime>
#include <nlohmann/json.hpp>

#include "serve/wire.h"

namespace kvserve::serve_internal {

using json = nlohmann::json;

namespace {

// vLLM's buckets (vllm/engine/metrics.py), so dashboards made for it read kvserve's.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                          1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                         0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kLatencyBuckets = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                                             30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
// kvserve's stage times reach below a millisecond on small models.
const std::vector<double> kStageBuckets = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                           0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0};
const std::vector<double> kRatioBuckets = {1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32};

std::string Num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return json(v).dump();
}

std::string Escape(const std::string& v) {
  std::string o;
  for (char c : v) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}

int HttpStatusFor(const Status& st) {
  switch (st.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kNotFound: return 400;
    case StatusCode::kUnavailable: return 503;
    default: return 500;
  }
}

// kvserve's own error shape on /generate: {"error": "<code>: <reason>"}.
void ReplyGenerateError(HttpExchange& ex, const Status& st) {
  ex.Reply(HttpStatusFor(st), "application/json", Dump(json{{"error", st.ToString()}}) + "\n");
}

void ReplyOpenAiError(HttpExchange& ex, const OpenAiError& e) { ex.Reply(e.status, "application/json", e.Json()); }

OpenAiError NotFound(const HttpRequest& r) {
  OpenAiError e;
  e.status = 404;
  e.type = "not_found_error";
  e.message = "no route " + r.method + " " + r.path + " (POST /v1/completions, POST /v1/chat/completions, GET /v1/models, "
              "POST /generate, GET /health, GET /metrics)";
  return e;
}

}  // namespace

// ---- Histogram, FrontMetrics ------------------------------------------------------------------------

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  if (!std::isfinite(v)) return;
  const size_t b = size_t(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mu_);
  counts_[b]++;
  sum_ += v;
}

uint64_t Histogram::count() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t n = 0;
  for (uint64_t c : counts_) n += c;
  return n;
}

void Histogram::Write(std::string* out, const std::string& name, const std::string& help, const std::string& labels) const {
  std::lock_guard<std::mutex> lock(mu_);
  *out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  const std::string sep = labels.empty() ? "" : ",";
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cum += counts_[i];
    const std::string le = i < bounds_.size() ? Num(bounds_[i]) : "+Inf";
    *out += name + "_bucket{" + labels + sep + "le=\"" + le + "\"} " + std::to_string(cum) + "\n";
  }
  *out += name + "_sum{" + labels + "} " + Num(sum_) + "\n";
  *out += name + "_count{" + labels + "} " + std::to_string(cum) + "\n";
}

FrontMetrics::FrontMetrics()
    : ttft_(kTtftBuckets), itl_(kItlBuckets), e2e_(kLatencyBuckets), queue_(kLatencyBuckets), encode_(kStageBuckets),
      wire_(kStageBuckets), decode_(kStageBuckets), ratio_(kRatioBuckets) {}

void FrontMetrics::ObserveAnswer(const ServeResponse& r, double e2e_s, uint32_t prompt_tokens, uint32_t completion_tokens) {
  e2e_.Observe(e2e_s);
  queue_.Observe(r.timings.queue_s);
  encode_.Observe(r.timings.encode_s);
  wire_.Observe(r.timings.wire_s);
  decode_.Observe(r.timings.decode_s);
  if (r.wire_bytes > 0) ratio_.Observe(double(r.kv_bytes) / double(r.wire_bytes));
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += prompt_tokens;
  completion_tokens_ += completion_tokens;
  cached_tokens_ += r.cached_tokens;
  const std::string s = r.strategy.empty() ? (r.pool_action.empty() ? "none" : r.pool_action) : r.strategy;
  for (auto& [name, v] : strategies_) {
    if (name == s) {
      v.first++;
      v.second += r.wire_bytes;
      return;
    }
  }
  if (strategies_.size() < 256) strategies_.push_back({s, {1, r.wire_bytes}});  // bounded: request-named strategies
}

void FrontMetrics::ObserveFirstToken(double s) { ttft_.Observe(s); }
void FrontMetrics::ObserveInterToken(double s) { itl_.Observe(s); }

void FrontMetrics::CountRequest(const std::string& api, int status) {
  const std::string key = api + "\x1f" + std::to_string(status);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [k, n] : requests_) {
    if (k == key) {
      n++;
      return;
    }
  }
  requests_.push_back({key, 1});
}

std::string FrontMetrics::Prometheus(const std::string& node) const {
  std::string out;
  const std::string l = "node=\"" + node + "\"";
  ttft_.Write(&out, "kvserve_time_to_first_token_seconds", "time from arrival to the first streamed token (vLLM's buckets)", l);
  itl_.Write(&out, "kvserve_inter_token_latency_seconds", "time between streamed tokens (vLLM's buckets)", l);
  e2e_.Write(&out, "kvserve_e2e_request_latency_seconds", "time from arrival to the last token (vLLM's buckets)", l);
  queue_.Write(&out, "kvserve_request_queue_time_seconds", "time a request waited for compute before its prefill", l);
  encode_.Write(&out, "kvserve_encode_seconds", "codec encode time per request", l);
  wire_.Write(&out, "kvserve_wire_seconds", "time sending a request's frames", l);
  decode_.Write(&out, "kvserve_decode_seconds", "codec decode time per request", l);
  ratio_.Write(&out, "kvserve_compression_ratio", "raw KV bytes over wire bytes per request", l);
  std::lock_guard<std::mutex> lock(mu_);
  out += "# HELP kvserve_decisions_total requests per strategy used\n# TYPE kvserve_decisions_total counter\n";
  for (const auto& [s, v] : strategies_) out += "kvserve_decisions_total{" + l + ",strategy=\"" + Escape(s) + "\"} " + std::to_string(v.first) + "\n";
  out += "# HELP kvserve_strategy_wire_bytes_total frame bytes sent per strategy used\n# TYPE kvserve_strategy_wire_bytes_total counter\n";
  for (const auto& [s, v] : strategies_) out += "kvserve_strategy_wire_bytes_total{" + l + ",strategy=\"" + Escape(s) + "\"} " + std::to_string(v.second) + "\n";
  out += "# HELP kvserve_prompt_tokens_total prompt tokens of answered requests\n# TYPE kvserve_prompt_tokens_total counter\n";
  out += "kvserve_prompt_tokens_total{" + l + "} " + std::to_string(prompt_tokens_) + "\n";
  out += "# HELP kvserve_generation_tokens_total tokens generated for answered requests\n# TYPE kvserve_generation_tokens_total counter\n";
  out += "kvserve_generation_tokens_total{" + l + "} " + std::to_string(completion_tokens_) + "\n";
  out += "# HELP kvserve_cached_prompt_tokens_total prompt tokens whose KV came from the pool\n# TYPE kvserve_cached_prompt_tokens_total counter\n";
  out += "kvserve_cached_prompt_tokens_total{" + l + "} " + std::to_string(cached_tokens_) + "\n";
  out += "# HELP kvserve_http_requests_total HTTP requests answered, by API and status code\n# TYPE kvserve_http_requests_total counter\n";
  for (const auto& [k, n] : requests_) {
    const size_t cut = k.find('\x1f');
    out += "kvserve_http_requests_total{" + l + ",api=\"" + Escape(k.substr(0, cut)) + "\",code=\"" + k.substr(cut + 1) + "\"} " +
           std::to_string(n) + "\n";
  }
  return out;
}

// ---- The node API ------------------------------------------------------------------------------------

size_t NodeBodyLimit(const OpenAiModel& model) {
  const size_t per_token = std::max<size_t>(12, model.tokenizer ? 6 * model.tokenizer->max_piece_bytes() : 0);
  return size_t(model.max_prompt) * per_token + (64 << 10);
}

namespace {

// One OpenAI completion or chat completion, whole or streamed.
void ServeCompletion(HttpExchange& ex, bool chat, const NodeFront& f, FrontMetrics& fm, std::atomic<uint64_t>& next_id) {
  const double t0 = NowSeconds();
  const std::string api = chat ? "chat" : "completions";
  OpenAiRequest req;
  OpenAiError err;
  if (!ParseOpenAiRequest(ex.request().body, chat, f.model, &req, &err)) {
    fm.CountRequest(api, err.status);
    return ReplyOpenAiError(ex, err);
  }
  req.serve.id = next_id++;
  const int64_t created = int64_t(std::time(nullptr));
  const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(f.model.created) + "-" + std::to_string(req.serve.id);
  const std::string& model = f.model.id;
  CompletionText text(f.model.tokenizer, req.stop);
  Result<ServeResponse> out = Status::Internal("not served");
  bool client_gone = false;
  if (!req.stream) {
    out = f.serve(req.serve, nullptr);
    if (out.ok()) {
      for (int t : out->tokens) {
        if (!text.Add(t)) break;
      }
    }
  } else {
    if (!ex.BeginStream(200, "text/event-stream")) return;
    if (chat && !ex.Write(StreamChunk(req, model, id, created, nullptr, ""))) return;
    double last = 0;
    out = f.serve(req.serve, [&](int token) {
      const double now = NowSeconds();
      if (last == 0) fm.ObserveFirstToken(now - t0);
      else fm.ObserveInterToken(now - last);
      last = now;
      const bool more = text.Add(token);
      const std::string piece = text.TakeReady();
      if (!piece.empty() && !ex.Write(StreamChunk(req, model, id, created, &piece, ""))) {
        client_gone = true;  // the node frees the request: generation ends here
        return false;
      }
      return more;
    });
  }
  if (!out.ok()) {
    OpenAiError e = ErrorFromStatus(out.status());
    fm.CountRequest(api, e.status);
    if (f.log) f.log(Dump(json{{"id", req.serve.id}, {"api", api}, {"error", out.status().ToString()}}));
    if (!req.stream) return ReplyOpenAiError(ex, e);
    // Mid-stream, the error is an event of its own, as OpenAI's API sends it.
    ex.Write("data: " + e.Json() + "\n");
    ex.Write(std::string(kStreamDone));
    return ex.EndStream();
  }
  const ServeResponse& r = out.value();
  const OpenAiUsage usage{uint32_t(req.serve.prompt.size()), text.tokens(), r.cached_tokens};
  const std::string finish = text.stopped() ? "stop" : "length";
  fm.ObserveAnswer(r, NowSeconds() - t0, usage.prompt, usage.completion);
  fm.CountRequest(api, client_gone ? 499 : 200);
  if (f.log) {
    json line = KvserveExtension(r);
    line["api"] = api;
    line["stream"] = req.stream;
    line["finish_reason"] = client_gone ? "client_left" : finish;
    f.log(Dump(line));
  }
  if (!req.stream) {
    return ex.Reply(200, "application/json", CompletionJson(req, model, id, created, text.TakeRest(), finish, usage, r));
  }
  if (client_gone) return;
  const std::string rest = text.TakeRest();
  if (!rest.empty() && !ex.Write(StreamChunk(req, model, id, created, &rest, ""))) return;
  const std::string empty;
  if (!ex.Write(StreamChunk(req, model, id, created, &empty, finish))) return;
  if (req.include_usage && !ex.Write(StreamUsageChunk(req, model, id, created, usage, r))) return;
  if (ex.Write(std::string(kStreamDone))) ex.EndStream();
}

// Until the node is ready, its APIs answer 503 (as llama.cpp's server does while loading).
bool Loading(const NodeFront& f, HttpExchange& ex, bool openai) {
  if (f.ready.load(std::memory_order_acquire)) return false;
  const Status st = Status::Unavailable("the node is loading its model; try again shortly (GET /health says when)");
  if (openai) {
    ReplyOpenAiError(ex, ErrorFromStatus(st));
  } else {
    ReplyGenerateError(ex, st);
  }
  return true;
}

}  // namespace

void AddNodeRoutes(HttpServer* server, std::shared_ptr<NodeFront> front) {
  auto fm = std::make_shared<FrontMetrics>();
  auto next_id = std::make_shared<std::atomic<uint64_t>>(1);
  server->Handle("POST", "/generate", [front, fm, next_id](HttpExchange& ex) {
    const double t0 = NowSeconds();
    const NodeFront& f = *front;
    if (Loading(f, ex, false)) return;
    auto parsed = ParseServeRequest(ex.request().body, f.model.tokenizer, f.model.max_prompt);
    if (!parsed.ok()) {
      fm->CountRequest("generate", HttpStatusFor(parsed.status()));
      return ReplyGenerateError(ex, parsed.status());
    }
    ServeRequest r = std::move(parsed).value();
    if (r.id == 0) r.id = (*next_id)++;
    auto out = f.serve(r, nullptr);
    if (!out.ok()) {
      if (f.log) f.log(Dump(json{{"id", r.id}, {"error", out.status().ToString()}}));
      fm->CountRequest("generate", HttpStatusFor(out.status()));
      return ReplyGenerateError(ex, out.status());
    }
    fm->ObserveAnswer(out.value(), NowSeconds() - t0, uint32_t(r.prompt.size()), uint32_t(out->tokens.size()));
    fm->CountRequest("generate", 200);
    json answer = ServeResponseObject(out.value(), f.model.tokenizer);
    ex.Reply(200, "application/json", Dump(answer) + "\n");
    if (f.log) {
      // One structured line per request: what was chosen and why, and where the time went.
      answer.erase("tokens");
      answer.erase("text");
      f.log(Dump(answer));
    }
  });
  server->Handle("POST", "/v1/completions", [front, fm, next_id](HttpExchange& ex) {
    if (!Loading(*front, ex, true)) ServeCompletion(ex, false, *front, *fm, *next_id);
  });
  server->Handle("POST", "/v1/chat/completions", [front, fm, next_id](HttpExchange& ex) {
    if (!Loading(*front, ex, true)) ServeCompletion(ex, true, *front, *fm, *next_id);
  });
  server->Handle("GET", "/v1/models", [front](HttpExchange& ex) {
    if (!Loading(*front, ex, true)) ex.Reply(200, "application/json", ModelsJson(front->model, "kvserve"));
  });
  server->Handle("GET", "/health", [front](HttpExchange& ex) {
    const bool ready = front->ready.load(std::memory_order_acquire);
    ex.Reply(ready ? 200 : 503, "application/json", ready ? "{\"status\":\"ok\"}\n" : "{\"status\":\"loading\"}\n");
  });
  server->Handle("GET", "/metrics", [front, fm](HttpExchange& ex) {
    const NodeFront& f = *front;
    const bool ready = f.ready.load(std::memory_order_acquire);
    std::string m = ready && f.metrics ? f.metrics() : "";
    m += fm->Prometheus(f.role);
    const std::string labels = "node=\"" + f.role + "\"" + (f.backend.empty() ? "" : ",backend=\"" + f.backend + "\"");
    if (ready && f.bandwidth_gbps) {
      m += "# HELP kvserve_bandwidth_estimate_gbps the estimator's current link bandwidth (pool nodes: GET throughput from the backend)\n"
           "# TYPE kvserve_bandwidth_estimate_gbps gauge\nkvserve_bandwidth_estimate_gbps{" + labels + "} " +
           Num(f.bandwidth_gbps()) + "\n";
    }
    if (ready && f.latency_seconds) {
      m += "# HELP kvserve_link_latency_seconds the estimator's per-transfer latency, from transfers under 256 KiB\n"
           "# TYPE kvserve_link_latency_seconds gauge\nkvserve_link_latency_seconds{" + labels + "} " +
           Num(f.latency_seconds()) + "\n";
    }
    if (ready && f.codec_speed) {
      const std::array<double, 2> v = f.codec_speed();
      m += "# HELP kvserve_codec_speed_factor measured over profiled codec speed, per stage (1 until measured)\n"
           "# TYPE kvserve_codec_speed_factor gauge\n"
           "kvserve_codec_speed_factor{" + labels + ",stage=\"encode\"} " + Num(v[0]) + "\n"
           "kvserve_codec_speed_factor{" + labels + ",stage=\"decode\"} " + Num(v[1]) + "\n";
    }
    if (ready && f.send_cost) {
      m += "# HELP kvserve_send_cpu_seconds_per_byte CPU a frame send takes from the codec's cores per byte on the wire, as the adaptive rule charges it (0 where sends do not share those cores, or until measured)\n"
           "# TYPE kvserve_send_cpu_seconds_per_byte gauge\nkvserve_send_cpu_seconds_per_byte{" + labels + "} " +
           Num(f.send_cost()) + "\n";
    }
    // A gauge per resource: `name`{labels,resource="link"} and {…,resource=second}.
    auto per_resource = [&](const std::string& name, const std::string& help, const std::string& second,
                            const std::string& link_value, const std::string& second_value) {
      m += "# HELP " + name + " " + help + "\n# TYPE " + name + " gauge\n" + name + "{" + labels +
           ",resource=\"link\"} " + link_value + "\n" + name + "{" + labels + ",resource=\"" + second + "\"} " +
           second_value + "\n";
    };
    if (ready && f.queues) {
      const QueueState q = f.queues();
      per_resource("kvserve_queue_seconds", "work the transfers in flight have left, per resource (what the adaptive rule plans behind)",
                   "encode", Num(q.link_wait), Num(q.encode_wait));
      per_resource("kvserve_queue_transfers", "transfers in flight holding each resource", "encode",
                   std::to_string(q.link_jobs), std::to_string(q.encode_jobs));
    }
    if (ready && f.pool_work) {
      const PoolWorkState w = f.pool_work();
      per_resource("kvserve_work_in_flight_seconds",
                   "work the fetches and stores in flight have left, per resource (what a fetch decision shares)", "codec",
                   Num(w.link_s), Num(w.codec_s));
      per_resource("kvserve_work_in_flight_jobs", "fetches and stores in flight holding each resource", "codec",
                   std::to_string(w.link_jobs), std::to_string(w.codec_jobs));
    }
    ex.Reply(200, "text/plain; version=0.0.4", m);
  });
  server->SetFallback([](HttpExchange& ex) { ReplyOpenAiError(ex, NotFound(ex.request())); });
}

// ---- The router --------------------------------------------------------------------------------------

namespace {

struct RouterState {
  RouterOptions opts;
  std::atomic<uint64_t> next{0}, routed{0}, failed{0}, streams{0};
  Histogram e2e{kLatencyBuckets}, ttft{kTtftBuckets};
};

// The workload label of an OpenAI or /generate body: its own, else "long" or "short" by the
// prompt's length (text at about 4 bytes a token).
std::string LabelOf(const json& j, uint32_t long_prompt) {
  if (j.contains("label") && j["label"].is_string() && !j["label"].get_ref<const std::string&>().empty()) return j["label"].get<std::string>();
  size_t n = 0;
  if (j.contains("tokens") && j["tokens"].is_array()) n = j["tokens"].size();
  if (j.contains("prompt")) {
    const json& p = j["prompt"];
    if (p.is_string()) n = p.get_ref<const std::string&>().size() / 4;
    else if (p.is_array()) n = p.size();
  }
  if (j.contains("messages") && j["messages"].is_array()) {
    for (const json& m : j["messages"]) {
      if (m.is_object() && m.contains("content") && m["content"].is_string()) n += m["content"].get_ref<const std::string&>().size() / 4;
    }
  }
  return n >= long_prompt ? "long" : "short";
}

// One try of one node: the answer's status and body, or the transport's failure. With
// `relay`, a 200 answer's body goes to the client as it arrives (a stream).
struct Upstream {
  bool reached = false;
  int status = 0;
  std::string body;
  bool relayed = false;      // the client has (part of) this answer
  bool client_gone = false;  // the client left before it could be relayed
  std::string error;
};

Upstream Call(const std::string& peer, const std::string& method, const std::string& path, const std::string& body,
              double seconds, HttpExchange* relay, RouterState* st, double t0) {
  Upstream u;
  httplib::Client cli("http://" + peer);
  cli.set_connection_timeout(std::chrono::duration<double>(std::min(2.0, seconds)));
  cli.set_read_timeout(std::chrono::duration<double>(seconds));
  cli.set_write_timeout(std::chrono::duration<double>(seconds));
  httplib::Request req;
  req.method = method;
  req.path = path;
  req.body = body;
  if (!body.empty()) req.set_header("Content-Type", "application/json");
  bool first = true;
  req.response_handler = [&](const httplib::Response& r) {
    u.status = r.status;
    if (relay && r.status == 200) {
      u.relayed = relay->BeginStream(200, r.has_header("Content-Type") ? r.get_header_value("Content-Type") : "text/event-stream");
      u.client_gone = !u.relayed;
    }
    return !u.client_gone;
  };
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    if (!u.relayed) {
      if (u.body.size() + n > (64u << 20)) return false;  // an answer is bounded
      u.body.append(data, n);
      return true;
    }
    if (first) st->ttft.Observe(NowSeconds() - t0);
    first = false;
    return relay->Write(std::string_view(data, n));
  };
  auto res = cli.send(req);
  u.reached = bool(res) || u.status != 0;
  if (!res) u.error = httplib::to_string(res.error());
  if (res && u.body.empty() && !res->body.empty()) u.body = res->body;
  return u;
}

void Forward(HttpExchange& ex, RouterState& st, bool openai) {
  const double t0 = NowSeconds();
  const std::string& path = ex.request().path;
  auto parsed = ParseJsonObject(ex.request().body);
  if (!parsed.ok()) {
    st.failed++;
    if (openai) return ReplyOpenAiError(ex, ErrorFromStatus(parsed.status()));
    return ReplyGenerateError(ex, parsed.status());
  }
  json j = std::move(parsed).value();
  const std::string label = LabelOf(j, st.opts.long_prompt);
  std::string body;
  if (openai) {
    j["label"] = label;  // the node validates every field
    body = Dump(j);
  } else {
    auto routed = RouteRequest(ex.request().body, st.opts.long_prompt);
    if (!routed.ok()) {
      st.failed++;
      return ReplyGenerateError(ex, routed.status());
    }
    body = routed->body;
  }
  const bool stream = openai && j.contains("stream") && j["stream"] == true;
  const double deadline = t0 + st.opts.timeout_s;
  Status last = Status::Unavailable("no prefill node answered");
  const std::vector<std::string>& peers = st.opts.peers;
  const uint64_t start = st.next++;
  for (size_t k = 0; k < peers.size(); ++k) {
    const double left = deadline - NowSeconds();
    if (left <= 0) {
      last = Status::Unavailable("the request's deadline of " + Num(st.opts.timeout_s) + " s passed");
      break;
    }
    const std::string& peer = peers[(start + k) % peers.size()];
    Upstream u = Call(peer, "POST", path, body, left, stream ? &ex : nullptr, &st, t0);
    if (u.client_gone) return;  // nobody to answer, and no other node to bother
    if (u.relayed) {
      // The stream went to the client as it came (its end included, or cut off if the node failed).
      if (ex.answered()) ex.EndStream();
      st.routed++;
      st.streams++;
      st.e2e.Observe(NowSeconds() - t0);
      return;
    }
    if (!u.reached) {
      last = Status::Unavailable("prefill node " + peer + ": " + u.error);
      continue;
    }
    if (u.status == 200) {
      json out = CheckJsonNesting(u.body, kMaxRequestJsonDepth).ok() ? json::parse(u.body, nullptr, false) : json();
      if (!out.is_discarded() && out.is_object()) {
        const json info = {{"label", label}, {"prefill_node", peer}, {"jct_ms", (NowSeconds() - t0) * 1e3}};
        if (openai && out.contains("kvserve") && out["kvserve"].is_object()) out["kvserve"]["router"] = info;
        else out["router"] = info;
        st.routed++;
        st.e2e.Observe(NowSeconds() - t0);
        if (st.opts.log) st.opts.log(Dump(info));
        return ex.Reply(200, "application/json", Dump(out) + "\n");
      }
      last = Status::Unavailable("prefill node " + peer + " answered 200 with a body that is not a JSON object");
      continue;
    }
    // A 4xx is the request's fault: no other node would answer differently.
    if (u.status >= 400 && u.status < 500) return ex.Reply(u.status, "application/json", u.body);
    last = Status::Unavailable("prefill node " + peer + " answered " + std::to_string(u.status));
  }
  st.failed++;
  if (openai) return ReplyOpenAiError(ex, ErrorFromStatus(last));
  ReplyGenerateError(ex, last);
}

}  // namespace

void AddRouterRoutes(HttpServer* server, RouterOptions opts) {
  auto st = std::make_shared<RouterState>();
  st->opts = std::move(opts);
  server->Handle("POST", "/generate", [st](HttpExchange& ex) { Forward(ex, *st, false); });
  server->Handle("POST", "/v1/completions", [st](HttpExchange& ex) { Forward(ex, *st, true); });
  server->Handle("POST", "/v1/chat/completions", [st](HttpExchange& ex) { Forward(ex, *st, true); });
  // The nodes' model, from the first that answers; /health: ready when one node is.
  server->Handle("GET", "/v1/models", [st](HttpExchange& ex) {
    for (const std::string& peer : st->opts.peers) {
      Upstream u = Call(peer, "GET", "/v1/models", "", 2, nullptr, st.get(), NowSeconds());
      if (u.status == 200) return ex.Reply(200, "application/json", u.body);
    }
    ReplyOpenAiError(ex, ErrorFromStatus(Status::Unavailable("no prefill node answered /v1/models")));
  });
  server->Handle("GET", "/health", [st](HttpExchange& ex) {
    for (const std::string& peer : st->opts.peers) {
      if (Call(peer, "GET", "/health", "", 1, nullptr, st.get(), NowSeconds()).status == 200) {
        return ex.Reply(200, "application/json", "{\"status\":\"ok\"}\n");
      }
    }
    ex.Reply(503, "application/json", "{\"status\":\"no prefill node is ready\"}\n");
  });
  server->Handle("GET", "/metrics", [st](HttpExchange& ex) {
    std::string m;
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      m += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + "{node=\"router\"} " +
           std::to_string(v) + "\n";
    };
    counter("kvserve_router_requests_total", "requests answered by a prefill node", st->routed.load());
    counter("kvserve_router_streams_total", "answers relayed as streams", st->streams.load());
    counter("kvserve_router_errors_total", "requests no prefill node answered", st->failed.load());
    st->e2e.Write(&m, "kvserve_router_e2e_request_latency_seconds", "time from arrival to the answer's end at the router", "node=\"router\"");
    st->ttft.Write(&m, "kvserve_router_time_to_first_token_seconds", "time from arrival to a stream's first bytes at the router", "node=\"router\"");
    ex.Reply(200, "text/plain; version=0.0.4", m);
  });
  server->SetFallback([](HttpExchange& ex) { ReplyOpenAiError(ex, NotFound(ex.request())); });
}

}  // namespace kvserve::serve_internal
