// CLI: `serve decode|prefill|pool|router` — the serving processes. Decode nodes take KV over the
// transport; prefill and pool nodes and the router speak HTTP (serve/http_api.h: /generate, the
// OpenAI API, /health, /metrics) on the asynchronous front of serve/http_server.h.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <ctime>
#include <cstdio>
#include <memory>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "kvserve/stats.h"
#include "kvserve/testbed.h"
#include "model_flags.h"
#include "serve/http_api.h"
#include "serve/http_server.h"
#include "serve/wire.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

enum class LogLevel { kQuiet, kInfo, kDebug };

LogLevel ParseLogLevel(const std::string& s) {
  return s == "quiet" ? LogLevel::kQuiet : s == "debug" ? LogLevel::kDebug : LogLevel::kInfo;
}

// Blocks SIGINT/SIGTERM in every thread started after this, and returns once one arrives: the
// servers are then stopped from the main thread instead of inside a signal handler.
void WaitForStopSignal() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  int sig = 0;
  sigwait(&set, &sig);
}
void BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// HTTP front options every serving process takes.
struct HttpFlags {
  uint32_t max_connections = serve_internal::HttpServerOptions{}.max_connections;
  uint32_t threads = serve_internal::HttpServerOptions{}.handler_threads;
  double request_deadline_s = serve_internal::HttpServerOptions{}.request_deadline_s;
  void Add(CLI::App* c) {
    c->add_option("--http-max-connections", max_connections, "HTTP connections open at once; one more is answered 503")
        ->capture_default_str()->check(InRange(1, 1 << 20));
    c->add_option("--http-threads", threads, "HTTP requests handled at once (more wait in line)")
        ->capture_default_str()->check(InRange(1, 4096));
    c->add_option("--http-request-deadline", request_deadline_s, "seconds a request's header and body may take to arrive")
        ->capture_default_str()->check(InRange(0.01, 3600));
  }
  serve_internal::HttpServerOptions Options(const std::string& role, size_t max_body) const {
    return {.name = "kvserve-" + role, .max_body_bytes = max_body, .request_deadline_s = request_deadline_s,
            .max_connections = max_connections, .handler_threads = threads};
  }
};

// Says where a process serves, on stdout, in the form scripts and tests read: "ROLE listening on
// HOST:PORT" — the host of the address it was given, the port it got (a free one for port 0).
void SayListening(const std::string& role, const std::string& address, uint16_t bound) {
  std::string host;
  uint16_t port;
  if (!ParseHostPort(address, &host, &port).ok()) host = address;
  std::printf("%s listening on %s:%u\n", role.c_str(), host.c_str(), unsigned(bound));
  std::fflush(stdout);
}

// Serves `server` on `address` until SIGINT/SIGTERM, saying where.
Status ServeHttpUntilSignal(serve_internal::HttpServer& server, const std::string& address, const char* role) {
  KV_ASSIGN_OR_RETURN(uint16_t bound, server.Start(address));
  SayListening(role, address, bound);
  WaitForStopSignal();
  server.Stop();
  return Status::Ok();
}

std::function<void(const std::string&)> LogTo(LogLevel level, LogLevel at_least) {
  if (level < at_least) return nullptr;
  return [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
}

// What a serving process runs: a real model (-m), or the synthetic stand-in of a production
// shape (--kv-shape, on a --gpu preset): synthetic KV of that shape and modelled GPU compute,
// with the codec, the transport and the link real. Requests to a synthetic node send 'tokens'.
struct NodeModelFlags {
  ModelFlags model;
  std::string kv_shape, gpu = "h100";
  std::vector<uint32_t> prepare_tokens;
  // `prepare`: the node synthesizes prompt KV (prefill, pool), so it takes --prepare-tokens.
  void Add(CLI::App* c, bool prepare) {
    model.Add(c);
    if (prepare) {
      c->add_option("--prepare-tokens", prepare_tokens,
                    "--kv-shape: prompt lengths whose synthetic KV is made at start, so the first requests of those "
                    "lengths do not wait for it (the stand-in's KV is not serving time)")
          ->delimiter(',')->check(InRange(1, 1 << 17));
    }
    c->add_option("--kv-shape", kv_shape,
                  "serve the synthetic stand-in of a production shape instead of -m (" + JoinNames(SyntheticShapeNames()) + ")")
        ->check(CLI::IsMember(SyntheticShapeNames()))
        ->excludes(c->get_option("--model"));
    c->add_option("--gpu", gpu, "GPU preset of --kv-shape's compute model (" + JoinNames(GpuPresetNames()) + ")")
        ->capture_default_str()->check(CLI::IsMember(GpuPresetNames()));
  }
};

struct NodeModel {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<SyntheticModel> synthetic;
  const Tokenizer* tokenizer() const { return model ? &model->tokenizer : nullptr; }
  uint32_t max_prompt() const { return model ? model->config.seq_len - 1 : synthetic->max_prompt_tokens; }
  serve_internal::OpenAiModel Api() const {
    serve_internal::OpenAiModel m;
    m.id = model ? model->name : synthetic->name;
    m.tokenizer = tokenizer();
    m.max_prompt = max_prompt();
    // A stand-in generates as many tokens as asked: its context is its longest prompt and as many more.
    m.context = model ? model->config.seq_len : 2 * synthetic->max_prompt_tokens;
    m.created = int64_t(std::time(nullptr));
    return m;
  }
  std::string Describe() const {
    if (model) return "model " + model->name;
    return "synthetic " + synthetic->name + " on " + synthetic->gpu + (synthetic->tensor_parallel > 1 ? " x" + std::to_string(synthetic->tensor_parallel) : "") +
           " (prefill " + std::to_string(int(synthetic->prefill_tokens_per_second)) + " tokens/s, decode " +
           std::to_string(int(synthetic->decode_tokens_per_second)) + " tokens/s, modelled)";
  }
  static Result<NodeModel> Load(const NodeModelFlags& f) {
    NodeModel m;
    if (!f.kv_shape.empty()) {
      KV_ASSIGN_OR_RETURN(SyntheticModel sm, SyntheticModelByName(f.kv_shape, f.gpu));
      m.synthetic = std::make_unique<SyntheticModel>(sm);
    } else {
      KV_ASSIGN_OR_RETURN(LlamaModel lm, f.model.Load());
      m.model = std::make_unique<LlamaModel>(std::move(lm));
    }
    return m;
  }
};

Status RunDecode(const NodeModelFlags& mf, const std::string& listen, const std::string& metrics_listen, double timeout_s,
                 uint32_t max_connections, LogLevel log, const std::string& transport_name) {
  BlockStopSignals();
  KV_ASSIGN_OR_RETURN(NodeModel model, NodeModel::Load(mf));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport, MakeTransport(transport_name));
  DecodeNode node(transport.get(), DecodeNodeOptions{.model = model.model.get(), .synthetic = model.synthetic.get(),
                                                     .env = Codec(), .request_timeout_s = timeout_s,
                                                     .max_connections = max_connections});
  for (uint32_t n : mf.prepare_tokens) KV_RETURN_IF_ERROR(node.Prepare(n));
  KV_RETURN_IF_ERROR(node.Start(listen));
  SayListening("decode", listen, node.port());
  if (log != LogLevel::kQuiet) std::fprintf(stderr, "decode node: %s, transport %s\n", model.Describe().c_str(), transport->name().c_str());
  serve_internal::HttpServer http({.name = "kvserve-decode", .max_body_bytes = 0});
  if (!metrics_listen.empty()) {
    http.Handle("GET", "/metrics", [&](serve_internal::HttpExchange& ex) {
      ex.Reply(200, "text/plain; version=0.0.4", node.metrics().Prometheus("decode"));
    });
    http.Handle("GET", "/health", [](serve_internal::HttpExchange& ex) { ex.Reply(200, "application/json", "{\"status\":\"ok\"}\n"); });
    KV_ASSIGN_OR_RETURN(uint16_t bound, http.Start(metrics_listen));
    SayListening("decode metrics", metrics_listen, bound);
  }
  WaitForStopSignal();
  http.Stop();
  node.Stop();
  if (log != LogLevel::kQuiet) {
    std::fprintf(stderr, "decode node: stopped after %llu requests\n", (unsigned long long)node.metrics().requests.load());
  }
  return Status::Ok();
}

// The HTTP front of a node that serves requests itself (prefill, pool). It listens before the
// node loads — /health answers 503 meanwhile, as llama.cpp's server does — and says "ROLE
// listening on HOST:PORT" once the node serves, so scripts reading that line get a ready node.
class NodeHttp {
 public:
  NodeHttp(const HttpFlags& flags, const char* role, LogLevel log)
      : role_(role), front_(std::make_shared<serve_internal::NodeFront>()), server_(flags.Options(role, 64 << 10)) {
    front_->role = role;
    front_->log = LogTo(log, LogLevel::kInfo);
    serve_internal::AddNodeRoutes(&server_, front_);
  }
  ~NodeHttp() { server_.Stop(); }
  Status Listen(const std::string& address) {
    address_ = address;
    KV_ASSIGN_OR_RETURN(port_, server_.Start(address));
    return Status::Ok();
  }
  // The node is loaded: the APIs serve from it from now on. Prefill and pool nodes answer alike
  // (Serve, metrics, the link's bandwidth and latency estimates).
  template <typename Node>
  void Ready(const NodeModel& model, Node* n) {
    serve_internal::NodeFront& f = *front_;
    f.model = model.Api();
    f.serve = [n](const ServeRequest& r, const TokenSink& sink) { return n->Serve(r, sink); };
    f.metrics = [n, role = role_] { return n->metrics().Prometheus(role); };
    f.bandwidth_gbps = [n] { return n->bandwidth_estimate_gbps(); };
    f.latency_seconds = [n] { return n->link_latency_seconds(); };
    f.codec_speed = [n] { return n->codec_speed_factors(); };
    if constexpr (requires { n->pool_backend(); }) f.backend = n->pool_backend();
    if constexpr (requires { n->queues(); }) f.queues = [n] { return n->queues(); };
    if constexpr (requires { n->work_in_flight(); }) f.pool_work = [n] { return n->work_in_flight(); };
    if constexpr (requires { n->send_cost_seconds_per_byte(); }) f.send_cost = [n] { return n->send_cost_seconds_per_byte(); };
    server_.SetMaxBodyBytes(serve_internal::NodeBodyLimit(f.model));
    f.ready.store(true, std::memory_order_release);
    SayListening(role_, address_, port_);
  }
  void ServeUntilSignal() {
    WaitForStopSignal();
    server_.Stop();
  }

 private:
  const char* role_;
  std::string address_;
  uint16_t port_ = 0;
  std::shared_ptr<serve_internal::NodeFront> front_;
  serve_internal::HttpServer server_;
};

// The profile at `path`, or null when no path was given; warns when its speeds were measured
// with another codec thread count than this node's.
Result<std::unique_ptr<Profile>> OptionalProfile(const std::string& path, int threads, LogLevel log) {
  if (path.empty()) return std::unique_ptr<Profile>();
  KV_ASSIGN_OR_RETURN(Profile p, LoadProfile(path));
  const std::string note = SpeedThreadsMismatch(p, threads);
  if (!note.empty() && log != LogLevel::kQuiet) std::fprintf(stderr, "warning: %s\n", note.c_str());
  return std::make_unique<Profile>(std::move(p));
}

// A node's front listens (its /health says 503), then the model and the profile load (after the
// test seam's delay).
Status ListenThenLoad(NodeHttp* http, const std::string& listen, double delay_s, const NodeModelFlags& mf,
                      const std::string& profile_path, int threads, LogLevel log, NodeModel* model,
                      std::unique_ptr<Profile>* profile) {
  KV_RETURN_IF_ERROR(http->Listen(listen));
  if (delay_s > 0) std::this_thread::sleep_for(std::chrono::duration<double>(delay_s));
  KV_ASSIGN_OR_RETURN(*model, NodeModel::Load(mf));
  KV_ASSIGN_OR_RETURN(*profile, OptionalProfile(profile_path, threads, log));
  return Status::Ok();
}

struct PrefillFlags {
  NodeModelFlags model;
  std::string listen = "127.0.0.1:8080", profile, strategy = "none", log_level = "info";
  std::vector<std::string> peers;
  double timeout_s = 30, assume_gbps = 10, shape_gbps = 0;
  uint32_t corrupt_every = 0;
  double send_delay_ns = 0;  // test seam: the calibration must catch this overhead
  double load_delay_s = 0;   // test seam: /health answers 503 this long before loading
  std::string transport = "tcp";
  int threads = 1;
  HttpFlags http;
};

Status RunPrefill(const PrefillFlags& f) {
  BlockStopSignals();
  const LogLevel log = ParseLogLevel(f.log_level);
  // Declared before the front, so they outlive it.
  NodeModel model;
  std::unique_ptr<Profile> profile;
  std::unique_ptr<LinkShaper> shaper;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<PrefillNode> node;
  NodeHttp http(f.http, "prefill", log);
  KV_RETURN_IF_ERROR(ListenThenLoad(&http, f.listen, f.load_delay_s, f.model, f.profile, f.threads, log, &model, &profile));
  if (f.shape_gbps > 0) shaper = std::make_unique<LinkShaper>(f.shape_gbps);
  KV_ASSIGN_OR_RETURN(transport, MakeTransport(f.transport, {.shaper = shaper.get(), .send_delay_s_per_byte = f.send_delay_ns * 1e-9}));
  PrefillNodeOptions o;
  o.model = model.model.get();
  o.synthetic = model.synthetic.get();
  o.env = Codec();
  o.decode_peers = f.peers;
  o.profile = profile.get();
  o.strategy = f.strategy;
  o.assume_gbps = f.shape_gbps > 0 ? f.shape_gbps : f.assume_gbps;
  o.request_timeout_s = f.timeout_s;
  o.corrupt_every = f.corrupt_every;
  o.pool = Pool(f.threads);
  KV_ASSIGN_OR_RETURN(node, PrefillNode::Create(transport.get(), o));
  for (uint32_t n : f.model.prepare_tokens) KV_RETURN_IF_ERROR(node->Prepare(n));
  if (log != LogLevel::kQuiet) std::fprintf(stderr, "prefill node: %s, transport %s\n", model.Describe().c_str(), transport->name().c_str());
  http.Ready(model, node.get());
  http.ServeUntilSignal();
  return Status::Ok();
}

struct PoolServeFlags {
  NodeModelFlags model;
  std::string listen = "127.0.0.1:8090", pool = "embedded", policy = "none", profile, log_level = "info";
  uint32_t chunk_tokens = kDefaultChunkTokens;
  uint64_t capacity_mib = 4096;
  double assume_gbps = 10, shape_gbps = 0;
  bool no_probe = false;
  double load_delay_s = 0;  // test seam
  int threads = 1;
  HttpFlags http;
};

Status RunPoolServe(const PoolServeFlags& f) {
  BlockStopSignals();
  const LogLevel log = ParseLogLevel(f.log_level);
  if (f.policy == "adaptive" && f.profile.empty()) return Status::InvalidArgument("--policy adaptive needs --profile");
  NodeModel model;
  std::unique_ptr<Profile> profile;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<LinkShaper> shaper;
  std::unique_ptr<PoolNode> node;
  NodeHttp http(f.http, "pool", log);
  KV_RETURN_IF_ERROR(ListenThenLoad(&http, f.listen, f.load_delay_s, f.model, f.profile, f.threads, log, &model, &profile));
  KV_ASSIGN_OR_RETURN(pool, MakePool(f.pool, f.capacity_mib << 20));
  if (f.shape_gbps > 0) shaper = std::make_unique<LinkShaper>(f.shape_gbps);
  PoolNodeOptions o;
  o.model = model.model.get();
  o.synthetic = model.synthetic.get();
  o.env = Codec();
  o.pool = pool.get();
  o.pool_link = shaper.get();
  o.chunk_tokens = f.chunk_tokens;
  o.policy = f.policy;
  o.profile = profile.get();
  o.assume_gbps = f.shape_gbps > 0 ? f.shape_gbps : f.assume_gbps;
  o.probe = !f.no_probe;
  o.threads = Pool(f.threads);
  KV_ASSIGN_OR_RETURN(node, PoolNode::Create(o));
  for (uint32_t n : f.model.prepare_tokens) KV_RETURN_IF_ERROR(node->Prepare(n));
  if (log != LogLevel::kQuiet) {
    std::fprintf(stderr, "pool node: %s, pool %s, policy %s\n", model.Describe().c_str(), pool->name().c_str(), f.policy.c_str());
  }
  http.Ready(model, node.get());
  http.ServeUntilSignal();
  return Status::Ok();
}

// The router: one HTTP front for several prefill nodes. It labels each request's workload (its
// tag if given, else by prompt length) and forwards to the prefill nodes in turn, measuring the
// job completion time it saw (arrival here to the last token back).
Status RunRouter(const std::string& listen, const std::vector<std::string>& peers, double timeout_s, uint32_t long_prompt,
                 LogLevel log, const HttpFlags& http) {
  BlockStopSignals();
  if (peers.empty()) return Status::InvalidArgument("router needs at least one --peer (a prefill node's host:port)");
  for (const std::string& p : peers) {
    std::string h;
    uint16_t port;
    KV_RETURN_IF_ERROR(ParseHostPort(p, &h, &port));
  }
  serve_internal::HttpServer server(http.Options("router", 16 << 20));
  serve_internal::AddRouterRoutes(&server, {.peers = peers, .timeout_s = timeout_s, .long_prompt = long_prompt,
                                            .log = LogTo(log, LogLevel::kDebug)});
  return ServeHttpUntilSignal(server, listen, "router");
}

// `bench link`: what the transport carries over this machine's link. With --listen it is the
// receiving end (run it in the other namespace); with --connect the sending end; with neither,
// both ends in this process over loopback. A memcpy of the same bytes is the baseline.
// The receiving end of a link measurement: takes frames until `end`, then confirms the count;
// echoes a request back as a result at once (round trips).
Status ReceiveUntilEnd(Connection* c) {
  uint64_t got = 0;
  ByteBuffer storage;
  while (true) {
    KV_ASSIGN_OR_RETURN(Message m, c->Receive(DeadlineIn(120), &storage));
    if (m.kind == MessageKind::kEnd) break;
    if (m.kind == MessageKind::kRequest) {
      KV_RETURN_IF_ERROR(c->Send(MessageKind::kResult, m.body, DeadlineIn(10)));
    } else {
      got += m.body.size();
    }
    storage = std::move(m.body);
  }
  const std::string body = json{{"bytes", got}}.dump();
  return c->Send(MessageKind::kResult, std::span(reinterpret_cast<const uint8_t*>(body.data()), body.size()), DeadlineIn(10));
}

}  // namespace

Result<LinkMeasurement> MeasureLink(Transport* transport, const std::string& connect, uint32_t mib, const LinkEnds& ends) {
  LinkMeasurement m;
  m.target = connect;
  std::unique_ptr<Listener> listener;
  std::thread server;
  Status server_status;
  if (connect.empty()) {
    {
      // A socket stays in the namespace it was made in; this thread returns to its own.
      KV_ASSIGN_OR_RETURN(std::unique_ptr<ScopedNetns> ns, ScopedNetns::Enter(ends.listen_netns));
      KV_ASSIGN_OR_RETURN(listener, transport->Listen(ends.listen_ip + ":0"));
    }
    m.target = ends.listen_ip + ":" + std::to_string(listener->port());
    server = std::thread([&] {
      auto c = listener->Accept(DeadlineIn(30));
      server_status = c.ok() ? ReceiveUntilEnd(c.value().get()) : c.status();
    });
  }
  const uint64_t chunk = 4 << 20;
  m.bytes = uint64_t(mib) << 20;
  const ByteBuffer buf(chunk, 0x5a);
  Status st = [&]() -> Status {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<ScopedNetns> ns, ScopedNetns::Enter(ends.connect_netns));
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Connection> c, transport->Connect(m.target, DeadlineIn(10)));
    const double t0 = NowSeconds();
    for (uint64_t sent = 0; sent < m.bytes; sent += chunk) KV_RETURN_IF_ERROR(c->Send(MessageKind::kFrame, buf, DeadlineIn(60)));
    KV_RETURN_IF_ERROR(c->Send(MessageKind::kEnd, {}, DeadlineIn(10)));
    KV_ASSIGN_OR_RETURN(Message reply, c->Receive(DeadlineIn(120)));
    m.seconds = NowSeconds() - t0;
    return reply.kind == MessageKind::kResult ? Status::Ok() : Status::Corrupt("unexpected reply");
  }();
  if (listener) listener->Close();  // a receiver still waiting to accept gives up
  if (server.joinable()) server.join();
  KV_RETURN_IF_ERROR(st);
  KV_RETURN_IF_ERROR(server_status);
  m.gbps = double(m.bytes) * 8 / m.seconds / 1e9;
  return m;
}

namespace {

// `bench link --compare`: each transport between two processes, per message size (library
// harness CompareLinks), as a table or JSON.
Status RunBenchLinkCompare(const LinkCompareOptions& o, bool as_json) {
  KV_ASSIGN_OR_RETURN(LinkCompareResult r, CompareLinks(o, [](const std::string& what) {
    std::fprintf(stderr, "bench link: %s\n", what.c_str());
  }));
  if (as_json) {
    std::printf("%s\n", LinkCompareJson(o, r).c_str());
    return Status::Ok();
  }
  std::printf("%-10s %8s %28s %10s\n", "transport", "message", "Gbit/s median (min-max)", "vs first");
  for (const LinkComparePoint& p : r.points) {
    const auto first = std::find_if(r.points.begin(), r.points.end(), [&](const LinkComparePoint& q) { return q.message_mib == p.message_mib; });
    std::printf("%-10s %5u MiB %14.2f (%5.2f-%5.2f) %9.2fx\n", p.transport.c_str(), p.message_mib, p.median_gbps(),
                *std::min_element(p.gbps.begin(), p.gbps.end()), *std::max_element(p.gbps.begin(), p.gbps.end()),
                p.median_gbps() / first->median_gbps());
  }
  for (const auto& [name, us] : r.round_trip_us) {
    std::printf("%-10s %u KiB round trip: median %.1f us (p10 %.1f, p90 %.1f) over %zu\n", name.c_str(), o.pingpong_kib,
                Percentile(us, 0.5), Percentile(us, 0.1), Percentile(us, 0.9), us.size());
  }
  std::printf("memcpy baseline: %.1f Gbit/s (one core)\n", r.memcpy_gbps);
  return Status::Ok();
}

Status RunBenchLink(const std::string& listen, const std::string& connect, uint32_t mib, double shape_gbps, bool as_json,
                    const std::string& transport_name) {
  std::unique_ptr<LinkShaper> shaper;
  if (shape_gbps > 0) shaper = std::make_unique<LinkShaper>(shape_gbps);
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport, MakeTransport(transport_name, {.shaper = shaper.get()}));
  if (!listen.empty()) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Listener> listener, transport->Listen(listen));
    SayListening("bench link", listen, listener->port());
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Connection> c, listener->Accept(DeadlineIn(600)));
    return ReceiveUntilEnd(c.get());
  }
  KV_ASSIGN_OR_RETURN(LinkMeasurement link, MeasureLink(transport.get(), connect, mib));
  const std::string& target = link.target;
  const uint64_t chunk = 4 << 20, total = link.bytes;
  const double seconds = link.seconds, gbps = link.gbps;
  const ByteBuffer buf(chunk, 0x5a);
  // Baseline in the same run: one memcpy of the same bytes.
  ByteBuffer dst(chunk);
  const double m0 = NowSeconds();
  for (uint64_t done = 0; done < total; done += chunk) std::memcpy(dst.data(), buf.data(), chunk);
  const double memcpy_s = std::max(1e-9, NowSeconds() - m0);
  const json out = {{"target", target}, {"transport", transport_name}, {"loopback", connect.empty()}, {"bytes", total}, {"seconds", seconds},
                    {"gbps", gbps}, {"shaped_gbps", shape_gbps}, {"memcpy_gbps", double(total) * 8 / memcpy_s / 1e9}};
  if (as_json) {
    std::printf("%s\n", out.dump(1).c_str());
  } else {
    std::printf("link to %s over %s: %.2f Gbit/s over %.0f MiB (%s; memcpy %.1f Gbit/s)\n", target.c_str(), transport_name.c_str(), gbps, double(mib),
                shape_gbps > 0 ? ("shaped in-process to " + json(shape_gbps).dump() + " Gbit/s").c_str() : "unshaped",
                out["memcpy_gbps"].get<double>());
  }
  return Status::Ok();
}

}  // namespace

void AddServeCommands(CLI::App& app) {
  {
    CLI::App* bench = app.add_subcommand("bench", "Serving benchmarks: the link, end to end, the pool");
    bench->require_subcommand(1);
    auto* c = bench->add_subcommand("link", "Throughput the transport reaches over a link (the ceiling to report)");
    auto listen = std::make_shared<std::string>();
    auto connect = std::make_shared<std::string>();
    auto mib = std::make_shared<uint32_t>(256);
    auto shape = std::make_shared<double>(0);
    auto as_json = std::make_shared<bool>(false);
    auto transport = std::make_shared<std::string>("tcp");
    auto compare = std::make_shared<LinkCompareOptions>();
    compare->transports.clear();
    auto* l = c->add_option("--listen", *listen, "be the receiving end on host:port (one connection; port 0: a free one, printed)");
    c->add_option("--connect", *connect, "be the sending end, to host:port")->excludes(l);
    c->add_option("--mib", *mib, "MiB to send (per point with --compare)")->capture_default_str()->check(InRange(4, 1 << 16));
    c->add_option("--shape-gbps", *shape, "pace with the in-process token bucket (0: off)")->capture_default_str()->check(InRange(0, 1e4));
    c->add_flag("--json", *as_json, "machine-readable output");
    c->add_option("--transport", *transport, "tcp | ucx")->capture_default_str()->check(CLI::IsMember(TransportNames()));
    auto* cmp = c->add_option("--compare", compare->transports,
                              "transports to compare between two processes of this machine (e.g. tcp,ucx): a receiver "
                              "process each, per message size and repeat, then small-message round trips")
                    ->delimiter(',')->check(CLI::IsMember(TransportNames()))->excludes(l);
    c->add_option("--message-mib", compare->message_mib, "--compare: message sizes in MiB")->delimiter(',')->capture_default_str()
        ->check(InRange(1, 1024));
    c->add_option("--repeats", compare->repeats, "--compare: repeats per point")->capture_default_str()->check(InRange(1, 100));
    c->add_option("--pingpong-kib", compare->pingpong_kib, "--compare: round-trip message size in KiB")->capture_default_str()
        ->check(InRange(1, 1 << 16));
    (void)cmp;
    SetAction(c, [=]() -> Status {
      if (!compare->transports.empty()) {
        LinkCompareOptions o = *compare;
        char exe[4096];
        const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0) return Status::IoError("cannot find this executable (/proc/self/exe) to start the receivers");
        o.cli.assign(exe, size_t(n));
        o.total_mib = *mib;
        return RunBenchLinkCompare(o, *as_json);
      }
      return RunBenchLink(*listen, *connect, *mib, *shape, *as_json, *transport);
    });
    AddBenchE2eCommand(*bench);
    AddBenchPoolCommand(*bench);
  }
  CLI::App* serve = app.add_subcommand("serve", "Serving processes: decode node, prefill node, router (PD separation); pool node (KV disaggregation)");
  serve->require_subcommand(1);
  const auto levels = CLI::IsMember({"quiet", "info", "debug"});
  {
    auto* c = serve->add_subcommand("decode", "Decode node: receives per-layer KV frames, decodes them on arrival, generates");
    auto mf = std::make_shared<NodeModelFlags>();
    auto listen = std::make_shared<std::string>("127.0.0.1:7001");
    auto timeout = std::make_shared<double>(30);
    auto log = std::make_shared<std::string>("info");
    auto metrics = std::make_shared<std::string>();
    auto max_connections = std::make_shared<uint32_t>(DecodeNodeOptions{}.max_connections);
    mf->Add(c, false);
    c->add_option("--prepare-tokens", mf->prepare_tokens,
                  "prompt lengths whose request buffers (KV slot, frame buffer) are allocated and written at start, as an "
                  "engine allocates its KV cache, so the first requests do not fault memory in while timed")
        ->delimiter(',')->check(InRange(1, 1 << 17));
    c->add_option("--listen", *listen, "host:port for prefill nodes (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--metrics", *metrics, "HTTP host:port serving /metrics (default: none)");
    c->add_option("--timeout", *timeout, "seconds a request's frames may take to arrive")->capture_default_str()->check(InRange(0.01, 3600));
    c->add_option("--max-connections", *max_connections, "connections served at once (a thread each); more are refused")
        ->capture_default_str()->check(InRange(1, 1 << 16));
    c->add_option("--log-level", *log, "quiet | info | debug")->capture_default_str()->check(levels);
    auto transport = std::make_shared<std::string>("tcp");
    c->add_option("--transport", *transport, "from the prefill nodes: tcp | ucx (shared memory here, RDMA between machines)")
        ->capture_default_str()->check(CLI::IsMember(TransportNames()));
    SetAction(c, [=]() { return RunDecode(*mf, *listen, *metrics, *timeout, *max_connections, ParseLogLevel(*log), *transport); });
  }
  {
    auto* c = serve->add_subcommand("prefill", "Prefill node: HTTP POST /generate and the OpenAI API (/v1/completions, /v1/chat/completions); prefills, chooses a strategy, streams KV to a decode node");
    auto f = std::make_shared<PrefillFlags>();
    f->model.Add(c, true);
    c->add_option("--listen", f->listen, "HTTP host:port (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--peer", f->peers, "decode node host:port (repeatable; tried in turn)")->required();
    c->add_option("--profile", f->profile, "profile file: choose per request with the controller (default: --strategy)");
    c->add_option("--strategy", f->strategy, "fixed strategy without a profile")->capture_default_str();
    c->add_option("--assume-gbps", f->assume_gbps, "link bandwidth assumed before the first transfer is measured")
        ->capture_default_str()->check(InRange(1e-6, 1e4));
    c->add_option("--shape-gbps", f->shape_gbps, "pace sends to this rate (in-process token bucket; 0: off)")
        ->capture_default_str()->check(InRange(0, 1e4));
    c->add_option("--timeout", f->timeout_s, "seconds per request's transfer and reply")->capture_default_str()->check(InRange(0.01, 3600));
    c->add_option("--threads", f->threads, "codec threads")->capture_default_str()->check(InRange(1, 256));
    c->add_option("--inject-send-delay-ns", f->send_delay_ns, "test seam: extra sending time per byte (0: none)")
        ->capture_default_str()->check(InRange(0, 1e6));
    c->add_option("--fault-corrupt-every", f->corrupt_every, "fault injection: corrupt every Nth frame sent (0: never)")
        ->capture_default_str()->check(InRange(0, 1e9));
    c->add_option("--log-level", f->log_level, "quiet | info (a JSON line per request) | debug")->capture_default_str()->check(levels);
    f->http.Add(c);
    c->add_option("--inject-load-delay", f->load_delay_s, "test seam: seconds the node waits before loading (its /health answers 503)")
        ->capture_default_str()->check(InRange(0, 600));
    c->add_option("--transport", f->transport, "to the decode nodes: tcp | ucx (shared memory here, RDMA between machines)")
        ->capture_default_str()->check(CLI::IsMember(TransportNames()));
    SetAction(c, [=]() { return RunPrefill(*f); });
  }
  {
    auto* c = serve->add_subcommand("pool", "Pool node (KV disaggregation): HTTP POST /generate and the OpenAI API; fetches cached prefix KV or recomputes, generates");
    auto f = std::make_shared<PoolServeFlags>();
    f->model.Add(c, true);
    c->add_option("--listen", f->listen, "HTTP host:port (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--pool", f->pool, "embedded | redis://HOST:PORT | redis-cluster://HOST:PORT")->capture_default_str();
    c->add_option("--policy", f->policy, "adaptive (needs --profile) | recompute | a strategy stored and fetched")->capture_default_str();
    c->add_option("--profile", f->profile, "profile file for --policy adaptive");
    c->add_option("--chunk-tokens", f->chunk_tokens, "tokens per stored chunk")->capture_default_str()->check(InRange(1, 1 << 16));
    c->add_option("--capacity-mib", f->capacity_mib, "embedded pool capacity (LRU beyond)")->capture_default_str()->check(InRange(1, 1 << 24));
    c->add_option("--assume-gbps", f->assume_gbps, "pool bandwidth assumed before the first fetch (or probe) is measured")
        ->capture_default_str()->check(InRange(1e-6, 1e4));
    c->add_flag("--no-probe", f->no_probe,
                "adaptive: do not store, fetch and delete one chunk-sized value at start to measure the pool's GET throughput");
    c->add_option("--shape-gbps", f->shape_gbps, "pace pool traffic to this rate (in-process token bucket; 0: off)")
        ->capture_default_str()->check(InRange(0, 1e4));
    c->add_option("--threads", f->threads, "codec threads")->capture_default_str()->check(InRange(1, 256));
    c->add_option("--log-level", f->log_level, "quiet | info (a JSON line per request) | debug")->capture_default_str()->check(levels);
    f->http.Add(c);
    c->add_option("--inject-load-delay", f->load_delay_s, "test seam: seconds the node waits before loading (its /health answers 503)")
        ->capture_default_str()->check(InRange(0, 600));
    SetAction(c, [=]() { return RunPoolServe(*f); });
  }
  {
    auto* c = serve->add_subcommand("router", "Router: HTTP front (/generate, the OpenAI API, /health, /metrics) that labels workloads and forwards to prefill nodes");
    auto listen = std::make_shared<std::string>("127.0.0.1:8000");
    auto peers = std::make_shared<std::vector<std::string>>();
    auto timeout = std::make_shared<double>(60);
    auto long_prompt = std::make_shared<uint32_t>(256);
    auto log = std::make_shared<std::string>("info");
    c->add_option("--listen", *listen, "HTTP host:port (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--peer", *peers, "prefill node HTTP host:port (repeatable)")->required();
    c->add_option("--timeout", *timeout, "a request's deadline in seconds, over every prefill node it is tried on")->capture_default_str()->check(InRange(0.01, 3600));
    c->add_option("--long-prompt", *long_prompt, "prompt tokens from which an untagged request is labelled 'long'")
        ->capture_default_str()->check(InRange(1, 1 << 24));
    c->add_option("--log-level", *log, "quiet | info | debug")->capture_default_str()->check(levels);
    auto http = std::make_shared<HttpFlags>();
    http->Add(c);
    SetAction(c, [=]() { return RunRouter(*listen, *peers, *timeout, *long_prompt, ParseLogLevel(*log), *http); });
  }
}

}  // namespace kvserve::cli
