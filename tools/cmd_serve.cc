// CLI: `serve decode|prefill|router` — the PD serving processes. Decode nodes take KV over the
// transport; the prefill node and the router speak HTTP+JSON (cpp-httplib) and export /metrics.
#include <httplib.h>
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <cstdio>
#include <memory>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "kvserve/testbed.h"
#include "model_flags.h"
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

// Binds an HTTP server to "host:port" (port 0: a free one) and says where, on stdout, in a form
// scripts and tests read: "listening on HOST:PORT".
Result<int> BindHttp(httplib::Server& svr, const std::string& address, const char* role) {
  std::string host;
  uint16_t port;
  KV_RETURN_IF_ERROR(ParseHostPort(address, &host, &port));
  int bound = port == 0 ? svr.bind_to_any_port(host) : (svr.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) return Status::IoError(std::string(role) + ": cannot listen on " + address);
  std::printf("%s listening on %s:%d\n", role, host.c_str(), bound);
  std::fflush(stdout);
  return bound;
}

// Serves `svr` on `address` until SIGINT/SIGTERM.
Status ServeHttpUntilSignal(httplib::Server& svr, const std::string& address, const char* role) {
  KV_ASSIGN_OR_RETURN(int port, BindHttp(svr, address, role));
  (void)port;
  std::thread http([&] { svr.listen_after_bind(); });
  WaitForStopSignal();
  svr.stop();
  http.join();
  return Status::Ok();
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

using serve_internal::Dump;  // JSON text that never throws on bytes that are not UTF-8

void ReplyError(httplib::Response& res, const Status& st) {
  res.status = HttpStatusFor(st);
  res.set_content(Dump(json{{"error", st.ToString()}}) + "\n", "application/json");
}

// A handler that throws answers 500 with the reason in JSON — not cpp-httplib's default, which
// puts the exception text in a response header — and the server goes on.
void AnswerExceptions(httplib::Server& svr) {
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string why = "unknown exception";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
    }
    ReplyError(res, Status::Internal("request failed: " + why));
  });
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
                 uint32_t max_connections, LogLevel log) {
  BlockStopSignals();
  KV_ASSIGN_OR_RETURN(NodeModel model, NodeModel::Load(mf));
  auto transport = MakeTcpTransport();
  DecodeNode node(transport.get(), DecodeNodeOptions{.model = model.model.get(), .synthetic = model.synthetic.get(),
                                                     .env = Codec(), .request_timeout_s = timeout_s,
                                                     .max_connections = max_connections});
  for (uint32_t n : mf.prepare_tokens) KV_RETURN_IF_ERROR(node.Prepare(n));
  KV_RETURN_IF_ERROR(node.Start(listen));
  std::string host;
  uint16_t port;
  KV_RETURN_IF_ERROR(ParseHostPort(listen, &host, &port));
  std::printf("decode listening on %s:%u\n", host.c_str(), unsigned(node.port()));
  std::fflush(stdout);
  if (log != LogLevel::kQuiet) std::fprintf(stderr, "decode node: %s, transport tcp\n", model.Describe().c_str());
  httplib::Server svr;
  std::thread http;
  if (!metrics_listen.empty()) {
    svr.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
      res.set_content(node.metrics().Prometheus("decode"), "text/plain; version=0.0.4");
    });
    KV_ASSIGN_OR_RETURN(int mport, BindHttp(svr, metrics_listen, "decode metrics"));
    (void)mport;
    http = std::thread([&] { svr.listen_after_bind(); });
  }
  WaitForStopSignal();
  if (http.joinable()) {
    svr.stop();
    http.join();
  }
  node.Stop();
  if (log != LogLevel::kQuiet) {
    std::fprintf(stderr, "decode node: stopped after %llu requests\n", (unsigned long long)node.metrics().requests.load());
  }
  return Status::Ok();
}

// The HTTP API of a node that serves requests itself (prefill, pool): POST /generate, GET
// /metrics (Prometheus, with the estimator's bandwidth and latency), GET /health; a JSON log
// line per request.
void AddNodeRoutes(httplib::Server& svr, const NodeModel& model, LogLevel log, const std::string& role,
                   std::function<Result<ServeResponse>(const ServeRequest&)> serve, std::function<std::string()> metrics,
                   std::function<double()> bandwidth_gbps, std::function<double()> latency_seconds) {
  auto next_id = std::make_shared<std::atomic<uint64_t>>(1);
  // The longest body a valid request can have: its prompt as text (every token at most the
  // longest piece, escaped) or as ids, and the other fields.
  const Tokenizer* tokenizer = model.tokenizer();
  const uint32_t max_prompt = model.max_prompt();
  svr.set_payload_max_length(size_t(max_prompt) * std::max<size_t>(12, tokenizer ? 6 * tokenizer->max_piece_bytes() : 0) +
                             (64 << 10));
  AnswerExceptions(svr);
  svr.Post("/generate", [tokenizer, max_prompt, log, serve, next_id](const httplib::Request& req, httplib::Response& res) {
    auto parsed = ParseServeRequest(req.body, tokenizer, max_prompt);
    if (!parsed.ok()) return ReplyError(res, parsed.status());
    ServeRequest r = std::move(parsed).value();
    if (r.id == 0) r.id = (*next_id)++;
    auto out = serve(r);
    if (!out.ok()) {
      if (log != LogLevel::kQuiet) std::fprintf(stderr, "%s\n", Dump(json{{"id", r.id}, {"error", out.status().ToString()}}).c_str());
      return ReplyError(res, out.status());
    }
    const std::string body = ServeResponseJson(out.value(), tokenizer);
    if (log != LogLevel::kQuiet) {
      // One structured line per request: what was chosen and why, and where the time went.
      json line = json::parse(body);
      line.erase("tokens");
      line.erase("text");
      std::fprintf(stderr, "%s\n", Dump(line).c_str());
    }
    res.set_content(body + "\n", "application/json");
  });
  svr.Get("/metrics", [role, metrics, bandwidth_gbps, latency_seconds](const httplib::Request&, httplib::Response& res) {
    std::string m = metrics();
    m += "# HELP kvserve_bandwidth_estimate_gbps the estimator's current link bandwidth\n"
         "# TYPE kvserve_bandwidth_estimate_gbps gauge\nkvserve_bandwidth_estimate_gbps{node=\"" + role + "\"} " +
         std::to_string(bandwidth_gbps()) + "\n";
    m += "# HELP kvserve_link_latency_seconds the estimator's per-transfer latency, from transfers under 256 KiB\n"
         "# TYPE kvserve_link_latency_seconds gauge\nkvserve_link_latency_seconds{node=\"" + role + "\"} " +
         std::to_string(latency_seconds()) + "\n";
    res.set_content(m, "text/plain; version=0.0.4");
  });
  svr.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
}

// The profile at `path`, or null when no path was given; warns when its speeds were measured
// with another codec thread count than this node's.
Result<std::unique_ptr<Profile>> OptionalProfile(const std::string& path, int threads, LogLevel log) {
  if (path.empty()) return std::unique_ptr<Profile>();
  KV_ASSIGN_OR_RETURN(Profile p, LoadProfile(path));
  const std::string note = SpeedThreadsMismatch(p, threads);
  if (!note.empty() && log != LogLevel::kQuiet) std::fprintf(stderr, "warning: %s\n", note.c_str());
  return std::make_unique<Profile>(std::move(p));
}

struct PrefillFlags {
  NodeModelFlags model;
  std::string listen = "127.0.0.1:8080", profile, strategy = "none", log_level = "info";
  std::vector<std::string> peers;
  double timeout_s = 30, assume_gbps = 10, shape_gbps = 0;
  uint32_t corrupt_every = 0;
  double send_delay_ns = 0;  // test seam: the calibration must catch this overhead
  int threads = 1;
};

Status RunPrefill(const PrefillFlags& f) {
  BlockStopSignals();
  const LogLevel log = ParseLogLevel(f.log_level);
  KV_ASSIGN_OR_RETURN(NodeModel model, NodeModel::Load(f.model));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Profile> profile, OptionalProfile(f.profile, f.threads, log));
  std::unique_ptr<LinkShaper> shaper;
  if (f.shape_gbps > 0) shaper = std::make_unique<LinkShaper>(f.shape_gbps);
  auto transport = MakeTcpTransport({.shaper = shaper.get(), .send_delay_s_per_byte = f.send_delay_ns * 1e-9});
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
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PrefillNode> node, PrefillNode::Create(transport.get(), o));
  for (uint32_t n : f.model.prepare_tokens) KV_RETURN_IF_ERROR(node->Prepare(n));
  if (log != LogLevel::kQuiet) std::fprintf(stderr, "prefill node: %s, transport tcp\n", model.Describe().c_str());
  httplib::Server svr;
  AddNodeRoutes(svr, model, log, "prefill", [&](const ServeRequest& r) { return node->Serve(r); },
                [&] { return node->metrics().Prometheus("prefill"); }, [&] { return node->bandwidth_estimate_gbps(); },
                [&] { return node->link_latency_seconds(); });
  return ServeHttpUntilSignal(svr, f.listen, "prefill");
}

struct PoolServeFlags {
  NodeModelFlags model;
  std::string listen = "127.0.0.1:8090", pool = "embedded", policy = "none", profile, log_level = "info";
  uint32_t chunk_tokens = kDefaultChunkTokens;
  uint64_t capacity_mib = 4096;
  double assume_gbps = 10, shape_gbps = 0;
  int threads = 1;
};

Status RunPoolServe(const PoolServeFlags& f) {
  BlockStopSignals();
  const LogLevel log = ParseLogLevel(f.log_level);
  KV_ASSIGN_OR_RETURN(NodeModel model, NodeModel::Load(f.model));
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Profile> profile, OptionalProfile(f.profile, f.threads, log));
  if (f.policy == "adaptive" && !profile) return Status::InvalidArgument("--policy adaptive needs --profile");
  KV_ASSIGN_OR_RETURN(std::unique_ptr<KvPool> pool, MakePool(f.pool, f.capacity_mib << 20));
  std::unique_ptr<LinkShaper> shaper;
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
  o.threads = Pool(f.threads);
  KV_ASSIGN_OR_RETURN(std::unique_ptr<PoolNode> node, PoolNode::Create(o));
  for (uint32_t n : f.model.prepare_tokens) KV_RETURN_IF_ERROR(node->Prepare(n));
  if (log != LogLevel::kQuiet) {
    std::fprintf(stderr, "pool node: %s, pool %s, policy %s\n", model.Describe().c_str(), pool->name().c_str(), f.policy.c_str());
  }
  httplib::Server svr;
  AddNodeRoutes(svr, model, log, "pool", [&](const ServeRequest& r) { return node->Serve(r); },
                [&] { return node->metrics().Prometheus("pool"); }, [&] { return node->bandwidth_estimate_gbps(); },
                [&] { return node->link_latency_seconds(); });
  return ServeHttpUntilSignal(svr, f.listen, "pool");
}

// The router: one HTTP front for several prefill nodes. It labels each request's workload (its
// tag if given, else by prompt length) and forwards to the prefill nodes in turn, measuring the
// job completion time it saw (arrival here to the last token back).
Status RunRouter(const std::string& listen, const std::vector<std::string>& peers, double timeout_s, uint32_t long_prompt,
                 LogLevel log) {
  BlockStopSignals();
  if (peers.empty()) return Status::InvalidArgument("router needs at least one --peer (a prefill node's host:port)");
  for (const std::string& p : peers) {
    std::string h;
    uint16_t port;
    KV_RETURN_IF_ERROR(ParseHostPort(p, &h, &port));
  }
  std::atomic<uint64_t> next{0}, routed_count{0}, failed{0};
  httplib::Server svr;
  svr.set_payload_max_length(16 << 20);
  AnswerExceptions(svr);
  svr.Post("/generate", [&](const httplib::Request& req, httplib::Response& res) {
    const double t0 = NowSeconds();
    // Validated and re-built from the fields a node reads (nesting bounded), never forwarded
    // as the client sent it.
    auto routed = RouteRequest(req.body, long_prompt);
    if (!routed.ok()) return ReplyError(res, routed.status());
    Status last = Status::Unavailable("no prefill node answered");
    for (size_t k = 0; k < peers.size(); ++k) {
      const std::string& peer = peers[(next++ + k) % peers.size()];
      httplib::Client cli("http://" + peer);
      cli.set_connection_timeout(std::chrono::seconds(2));
      cli.set_read_timeout(std::chrono::duration<double>(timeout_s));
      auto r = cli.Post("/generate", routed->body, "application/json");
      if (!r) {
        last = Status::Unavailable("prefill node " + peer + ": " + httplib::to_string(r.error()));
        continue;
      }
      json out = CheckJsonNesting(r->body, kMaxRequestJsonDepth).ok() ? json::parse(r->body, nullptr, false) : json();
      if (!out.is_discarded() && out.is_object() && r->status == 200) {
        out["router"] = {{"label", routed->label}, {"prefill_node", peer}, {"jct_ms", (NowSeconds() - t0) * 1e3}};
        routed_count++;
        if (log == LogLevel::kDebug) std::fprintf(stderr, "%s\n", Dump(out["router"]).c_str());
        res.set_content(Dump(out) + "\n", "application/json");
        return;
      }
      // A 4xx is the request's fault: no other node would answer differently.
      res.status = r->status;
      res.set_content(r->body, "application/json");
      if (r->status < 500 && r->status >= 400) return;
      last = Status::Unavailable("prefill node " + peer + " answered " + std::to_string(r->status));
    }
    failed++;
    ReplyError(res, last);
  });
  svr.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    std::string m;
    auto counter = [&](const char* name, const char* help, uint64_t v) {
      m += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " counter\n" + name + "{node=\"router\"} " +
           std::to_string(v) + "\n";
    };
    counter("kvserve_router_requests_total", "requests answered by a prefill node", routed_count.load());
    counter("kvserve_router_errors_total", "requests no prefill node answered", failed.load());
    res.set_content(m, "text/plain; version=0.0.4");
  });
  // Ready once listening: the router holds no model.
  svr.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  return ServeHttpUntilSignal(svr, listen, "router");
}

// `bench link`: what the transport carries over this machine's link. With --listen it is the
// receiving end (run it in the other namespace); with --connect the sending end; with neither,
// both ends in this process over loopback. A memcpy of the same bytes is the baseline.
// The receiving end of a link measurement: takes frames until `end`, then confirms the count.
Status ReceiveUntilEnd(Connection* c) {
  uint64_t got = 0;
  while (true) {
    KV_ASSIGN_OR_RETURN(Message m, c->Receive(DeadlineIn(120)));
    if (m.kind == MessageKind::kEnd) break;
    got += m.body.size();
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

Status RunBenchLink(const std::string& listen, const std::string& connect, uint32_t mib, double shape_gbps, bool as_json) {
  std::unique_ptr<LinkShaper> shaper;
  if (shape_gbps > 0) shaper = std::make_unique<LinkShaper>(shape_gbps);
  auto transport = MakeTcpTransport({.shaper = shaper.get()});
  if (!listen.empty()) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Listener> listener, transport->Listen(listen));
    std::printf("bench link listening on %s\n", listen.c_str());
    std::fflush(stdout);
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
  const json out = {{"target", target}, {"loopback", connect.empty()}, {"bytes", total}, {"seconds", seconds},
                    {"gbps", gbps}, {"shaped_gbps", shape_gbps}, {"memcpy_gbps", double(total) * 8 / memcpy_s / 1e9}};
  if (as_json) {
    std::printf("%s\n", out.dump(1).c_str());
  } else {
    std::printf("link to %s: %.2f Gbit/s over %.0f MiB (%s; memcpy %.1f Gbit/s)\n", target.c_str(), gbps, double(mib),
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
    auto* l = c->add_option("--listen", *listen, "be the receiving end on host:port");
    c->add_option("--connect", *connect, "be the sending end, to host:port")->excludes(l);
    c->add_option("--mib", *mib, "MiB to send")->capture_default_str()->check(InRange(4, 1 << 16));
    c->add_option("--shape-gbps", *shape, "pace with the in-process token bucket (0: off)")->capture_default_str()->check(InRange(0, 1e4));
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() { return RunBenchLink(*listen, *connect, *mib, *shape, *as_json); });
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
    SetAction(c, [=]() { return RunDecode(*mf, *listen, *metrics, *timeout, *max_connections, ParseLogLevel(*log)); });
  }
  {
    auto* c = serve->add_subcommand("prefill", "Prefill node: HTTP POST /generate; prefills, chooses a strategy, streams KV to a decode node");
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
    SetAction(c, [=]() { return RunPrefill(*f); });
  }
  {
    auto* c = serve->add_subcommand("pool", "Pool node (KV disaggregation): HTTP POST /generate; fetches cached prefix KV or recomputes, generates");
    auto f = std::make_shared<PoolServeFlags>();
    f->model.Add(c, true);
    c->add_option("--listen", f->listen, "HTTP host:port (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--pool", f->pool, "embedded | redis://HOST:PORT | redis-cluster://HOST:PORT")->capture_default_str();
    c->add_option("--policy", f->policy, "adaptive (needs --profile) | recompute | a strategy stored and fetched")->capture_default_str();
    c->add_option("--profile", f->profile, "profile file for --policy adaptive");
    c->add_option("--chunk-tokens", f->chunk_tokens, "tokens per stored chunk")->capture_default_str()->check(InRange(1, 1 << 16));
    c->add_option("--capacity-mib", f->capacity_mib, "embedded pool capacity (LRU beyond)")->capture_default_str()->check(InRange(1, 1 << 24));
    c->add_option("--assume-gbps", f->assume_gbps, "pool bandwidth assumed before the first fetch is measured")
        ->capture_default_str()->check(InRange(1e-6, 1e4));
    c->add_option("--shape-gbps", f->shape_gbps, "pace pool traffic to this rate (in-process token bucket; 0: off)")
        ->capture_default_str()->check(InRange(0, 1e4));
    c->add_option("--threads", f->threads, "codec threads")->capture_default_str()->check(InRange(1, 256));
    c->add_option("--log-level", f->log_level, "quiet | info (a JSON line per request) | debug")->capture_default_str()->check(levels);
    SetAction(c, [=]() { return RunPoolServe(*f); });
  }
  {
    auto* c = serve->add_subcommand("router", "Router: HTTP front that labels workloads and forwards to prefill nodes");
    auto listen = std::make_shared<std::string>("127.0.0.1:8000");
    auto peers = std::make_shared<std::vector<std::string>>();
    auto timeout = std::make_shared<double>(60);
    auto long_prompt = std::make_shared<uint32_t>(256);
    auto log = std::make_shared<std::string>("info");
    c->add_option("--listen", *listen, "HTTP host:port (port 0: a free one, printed)")->capture_default_str();
    c->add_option("--peer", *peers, "prefill node HTTP host:port (repeatable)")->required();
    c->add_option("--timeout", *timeout, "seconds to wait for a prefill node")->capture_default_str()->check(InRange(0.01, 3600));
    c->add_option("--long-prompt", *long_prompt, "prompt tokens from which an untagged request is labelled 'long'")
        ->capture_default_str()->check(InRange(1, 1 << 24));
    c->add_option("--log-level", *log, "quiet | info | debug")->capture_default_str()->check(levels);
    SetAction(c, [=]() { return RunRouter(*listen, *peers, *timeout, *long_prompt, ParseLogLevel(*log)); });
  }
}

}  // namespace kvserve::cli
