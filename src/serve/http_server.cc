// HttpServer on Boost.Beast: one strand per connection for its reads and writes, a timer (the
// tcp_stream's expiry) on every wait, and handlers on a worker pool that hand their writes back
// to the connection's strand and wait for them.
#include "serve/http_server.h"

#include <algorithm>
#include <atomic>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "kvserve/transport.h"

namespace kvserve::serve_internal {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

std::string Str(beast::string_view v) { return std::string(v.data(), v.size()); }

std::chrono::steady_clock::duration Dur(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

std::string_view HttpReason(int status) {
  const beast::string_view r = http::obsolete_reason(http::int_to_status(unsigned(status)));
  return r.empty() ? std::string_view("Unknown") : std::string_view(r.data(), r.size());
}

class HttpSession;

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  explicit Impl(HttpServerOptions o) : opts(std::move(o)), max_body(opts.max_body_bytes), acceptor(ioc) {}

  HttpServerOptions opts;
  std::atomic<size_t> max_body;
  std::map<std::pair<std::string, std::string>, HttpHandler> routes;
  std::set<std::string> paths;
  HttpHandler fallback;

  net::io_context ioc;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  tcp::acceptor acceptor;
  std::vector<std::thread> io_threads;

  // Handler workers.
  std::mutex jobs_mu;
  std::condition_variable jobs_cv;
  std::deque<std::function<void()>> jobs;
  std::vector<std::thread> workers;
  bool workers_stopping = false;

  std::mutex sessions_mu;
  std::unordered_map<HttpSession*, std::weak_ptr<HttpSession>> sessions;

  std::atomic<uint64_t> accepted{0}, refused{0}, timed_out{0}, malformed{0}, requests{0};
  std::atomic<uint32_t> open{0};
  std::atomic<bool> stopping{false};

  void Post(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(jobs_mu);
    jobs.push_back(std::move(job));
    jobs_cv.notify_one();
  }
  void WorkerLoop() {
    while (true) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(jobs_mu);
        jobs_cv.wait(lock, [&] { return workers_stopping || !jobs.empty(); });
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
      }
      job();
    }
  }
  void Accept();
  void Refuse(tcp::socket socket);
  const HttpHandler* Find(const HttpRequest& r, int* status) const {
    auto it = routes.find({r.method, r.path});
    if (it != routes.end()) return &it->second;
    *status = paths.count(r.path) ? 405 : 404;
    return nullptr;
  }
};

// One connection: reads a request, hands it to a worker, writes what the handler answers, and
// reads the next (keep-alive, pipelined requests in order) or closes.
class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(tcp::socket socket, std::shared_ptr<HttpServer::Impl> srv) : stream_(std::move(socket)), srv_(std::move(srv)) {}

  void Start() {
    {
      std::lock_guard<std::mutex> lock(srv_->sessions_mu);
      srv_->sessions[this] = weak_from_this();
    }
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] {
      if (self->srv_->stopping) return self->Close();
      self->WaitForRequest(true);
    });
  }
  ~HttpSession() {
    std::lock_guard<std::mutex> lock(srv_->sessions_mu);
    srv_->sessions.erase(this);
    srv_->open--;
  }
  void CloseFromServer() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->Close(); });
  }

  // A write on the strand, waited for by a handler's thread. False when it failed (the client
  // is gone or too slow: the connection is then closed).
  template <typename Start>
  bool RunWrite(Start start) {
    if (gone_) return false;
    auto done = std::make_shared<std::promise<beast::error_code>>();
    std::future<beast::error_code> f = done->get_future();
    net::dispatch(stream_.get_executor(), [self = shared_from_this(), start, done]() mutable {
      if (self->closed_) {
        done->set_value(net::error::not_connected);
        return;
      }
      self->stream_.expires_after(Dur(self->srv_->opts.write_timeout_s));
      start(self->stream_, [done](beast::error_code ec, size_t) { done->set_value(ec); });
    });
    const beast::error_code ec = f.get();
    if (ec) {
      gone_ = true;
      CloseFromServer();
      return false;
    }
    return true;
  }

  // After the handler: read the next request or close.
  void Done(bool keep_alive) {
    net::dispatch(stream_.get_executor(), [self = shared_from_this(), keep_alive] {
      if (keep_alive && !self->gone_ && !self->closed_ && !self->srv_->stopping) {
        self->WaitForRequest(false);
      } else {
        self->Close();
      }
    });
  }

  const HttpServerOptions& opts() const { return srv_->opts; }

 private:
  void WaitForRequest(bool first) {
    if (closed_) return;
    if (buffer_.size() > 0) return ReadHeader();  // a pipelined request already here
    // Waiting for a request's first byte: an idle keep-alive connection gets the idle timeout.
    stream_.expires_after(Dur(first ? srv_->opts.request_deadline_s : srv_->opts.idle_timeout_s));
    stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) {
        if (ec == beast::error::timeout) self->srv_->timed_out++;
        return self->Close();
      }
      self->buffer_.commit(n);
      self->ReadHeader();
    });
  }

  void ReadHeader() {
    parser_.emplace();
    parser_->header_limit(uint32_t(srv_->opts.max_header_bytes));
    parser_->body_limit(srv_->max_body.load());
    // One deadline for the whole request from here: header and body, however it trickles in.
    stream_.expires_after(Dur(srv_->opts.request_deadline_s));
    http::async_read_header(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->ReadFailed(ec);
      const auto& h = self->parser_->get();
      auto expect = h.find(http::field::expect);
      if (expect != h.end() && beast::iequals(expect->value(), "100-continue") && !self->parser_->is_done()) {
        auto cont = std::make_shared<http::response<http::empty_body>>(http::status::continue_, h.version());
        http::async_write(self->stream_, *cont, [self, cont](beast::error_code ec2, size_t) {
          if (ec2) return self->Close();
          self->ReadBody();
        });
        return;
      }
      self->ReadBody();
    });
  }

  void ReadBody() {
    http::async_read(stream_, buffer_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
      if (ec) return self->ReadFailed(ec);
      self->Dispatch();
    });
  }

  void ReadFailed(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == net::error::operation_aborted) return Close();
    if (ec == beast::error::timeout) {
      srv_->timed_out++;
      return Close();
    }
    srv_->malformed++;
    int status = 400;
    std::string why = "malformed HTTP request: " + ec.message();
    if (ec == http::error::header_limit) status = 431, why = "request header over " + std::to_string(srv_->opts.max_header_bytes) + " bytes";
    if (ec == http::error::body_limit) status = 413, why = "request body over " + std::to_string(srv_->max_body.load()) + " bytes";
    auto res = std::make_shared<http::response<http::string_body>>(http::int_to_status(unsigned(status)), 11);
    res->set(http::field::server, srv_->opts.name);
    res->set(http::field::content_type, "text/plain");
    res->keep_alive(false);
    res->body() = why + "\n";
    res->prepare_payload();
    stream_.expires_after(Dur(1));
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code, size_t) { self->Close(); });
  }

  void Dispatch();

  void Close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::shared_ptr<HttpServer::Impl> srv_;
  bool closed_ = false;              // on the strand
  std::atomic<bool> gone_{false};    // a write failed
};

namespace {

class Exchange final : public HttpExchange {
 public:
  Exchange(std::shared_ptr<HttpSession> session, HttpRequest req, unsigned version, bool keep_alive)
      : session_(std::move(session)), req_(std::move(req)), version_(version), keep_alive_(keep_alive) {}

  const HttpRequest& request() const override { return req_; }
  bool answered() const override { return state_ != State::kNone; }
  bool keep_alive() const { return keep_alive_ && ok_; }

  void Reply(int status, std::string_view content_type, std::string body, const HttpHeaders& extra) override {
    if (state_ != State::kNone) return;
    state_ = State::kReplied;
    auto res = std::make_shared<http::response<http::string_body>>(http::int_to_status(unsigned(status)), version_);
    Fill(*res, content_type, extra);
    res->body() = std::move(body);
    res->prepare_payload();
    ok_ = session_->RunWrite([res](beast::tcp_stream& s, auto done) { http::async_write(s, *res, [res, done](beast::error_code ec, size_t n) { done(ec, n); }); });
  }

  bool BeginStream(int status, std::string_view content_type, const HttpHeaders& extra) override {
    if (state_ != State::kNone) return false;
    state_ = State::kStreaming;
    auto res = std::make_shared<http::response<http::empty_body>>(http::int_to_status(unsigned(status)), version_);
    Fill(*res, content_type, extra);
    res->set(http::field::cache_control, "no-cache");
    res->chunked(true);
    auto sr = std::make_shared<http::response_serializer<http::empty_body>>(*res);
    ok_ = session_->RunWrite([res, sr](beast::tcp_stream& s, auto done) {
      http::async_write_header(s, *sr, [res, sr, done](beast::error_code ec, size_t n) { done(ec, n); });
    });
    return ok_;
  }

  bool Write(std::string_view chunk) override {
    if (state_ != State::kStreaming || !ok_) return false;
    if (chunk.empty()) return true;  // an empty chunk would end the body
    ok_ = session_->RunWrite([chunk](beast::tcp_stream& s, auto done) {
      auto c = std::make_shared<http::chunk_body<net::const_buffer>>(http::make_chunk(net::const_buffer(chunk.data(), chunk.size())));
      net::async_write(s, *c, [c, done](beast::error_code ec, size_t n) { done(ec, n); });
    });
    return ok_;
  }

  void EndStream() override {
    if (state_ != State::kStreaming) return;
    state_ = State::kEnded;
    if (!ok_) return;
    ok_ = session_->RunWrite([](beast::tcp_stream& s, auto done) {
      auto c = std::make_shared<decltype(http::make_chunk_last())>(http::make_chunk_last());
      net::async_write(s, *c, [c, done](beast::error_code ec, size_t n) { done(ec, n); });
    });
  }

  void Finish() {
    if (state_ == State::kNone) Reply(500, "text/plain", "the handler gave no answer\n", {});
    if (state_ == State::kStreaming) EndStream();
    session_->Done(keep_alive());
  }

 private:
  template <typename Res>
  void Fill(Res& res, std::string_view content_type, const HttpHeaders& extra) {
    res.set(http::field::server, session_->opts().name);
    res.set(http::field::content_type, content_type);
    for (const auto& [k, v] : extra) res.set(k, v);
    res.keep_alive(keep_alive_);
  }
  enum class State { kNone, kReplied, kStreaming, kEnded };
  std::shared_ptr<HttpSession> session_;
  HttpRequest req_;
  unsigned version_;
  bool keep_alive_;
  bool ok_ = true;
  State state_ = State::kNone;
};

}  // namespace

void HttpSession::Dispatch() {
  stream_.expires_never();
  srv_->requests++;
  auto& m = parser_->get();
  HttpRequest r;
  r.method = Str(m.method_string());
  r.target = Str(m.target());
  r.path = r.target.substr(0, r.target.find('?'));
  for (const auto& f : m) {
    std::string name = Str(f.name_string());
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    r.headers.emplace_back(std::move(name), Str(f.value()));
  }
  r.body = std::move(m.body());
  const bool keep_alive = m.keep_alive();
  const unsigned version = m.version();
  parser_.reset();
  auto ex = std::make_shared<Exchange>(shared_from_this(), std::move(r), version, keep_alive);
  std::shared_ptr<HttpServer::Impl> srv = srv_;
  srv_->Post([srv, ex] {
    int status = 404;
    const HttpHandler* h = srv->Find(ex->request(), &status);
    try {
      if (h) {
        (*h)(*ex);
      } else if (status == 404 && srv->fallback) {
        srv->fallback(*ex);
      } else {
        ex->Reply(status, "text/plain", std::string(HttpReason(status)) + ": " + ex->request().method + " " + ex->request().path + "\n", {});
      }
    } catch (const std::exception& e) {
      ex->Reply(500, "text/plain", std::string("request failed: ") + e.what() + "\n", {});
    } catch (...) {
      ex->Reply(500, "text/plain", "request failed\n", {});
    }
    ex->Finish();
  });
}

void HttpServer::Impl::Accept() {
  acceptor.async_accept(net::make_strand(ioc), [self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
    if (ec) {
      if (ec == net::error::operation_aborted || self->stopping) return;
      // Out of descriptors and the like: keep accepting (after a pause) rather than stop serving.
      auto t = std::make_shared<net::steady_timer>(self->ioc, std::chrono::milliseconds(50));
      t->async_wait([self, t](beast::error_code) { self->Accept(); });
      return;
    }
    self->accepted++;
    if (self->open >= self->opts.max_connections) {
      self->Refuse(std::move(socket));
    } else {
      self->open++;
      std::make_shared<HttpSession>(std::move(socket), self)->Start();
    }
    self->Accept();
  });
}

// Beyond max_connections: a 503 saying so, then close (without reading the request).
void HttpServer::Impl::Refuse(tcp::socket socket) {
  refused++;
  auto s = std::make_shared<beast::tcp_stream>(std::move(socket));
  auto res = std::make_shared<http::response<http::string_body>>(http::status::service_unavailable, 11);
  res->set(http::field::server, opts.name);
  res->set(http::field::content_type, "application/json");
  res->set(http::field::retry_after, "1");
  res->keep_alive(false);
  res->body() = "{\"error\":{\"message\":\"" + opts.name + ": " + std::to_string(opts.max_connections) +
                " connections open, the most it serves at once\",\"type\":\"server_overloaded\",\"param\":null,\"code\":503}}\n";
  res->prepare_payload();
  s->expires_after(std::chrono::seconds(1));
  http::async_write(*s, *res, [s, res](beast::error_code, size_t) {
    beast::error_code ignored;
    s->socket().shutdown(tcp::socket::shutdown_both, ignored);
    s->close();
  });
}

HttpServer::HttpServer(HttpServerOptions opts) : impl_(std::make_shared<Impl>(std::move(opts))) {}

HttpServer::~HttpServer() { Stop(); }

void HttpServer::Handle(const std::string& method, const std::string& path, HttpHandler handler) {
  impl_->routes[{method, path}] = std::move(handler);
  impl_->paths.insert(path);
}

void HttpServer::SetFallback(HttpHandler handler) { impl_->fallback = std::move(handler); }

void HttpServer::SetMaxBodyBytes(size_t bytes) { impl_->max_body = bytes; }

Result<uint16_t> HttpServer::Start(const std::string& address) {
  Impl& s = *impl_;
  if (!s.io_threads.empty()) return Status::InvalidArgument(s.opts.name + ": already serving");
  std::string host;
  uint16_t port = 0;
  KV_RETURN_IF_ERROR(ParseHostPort(address, &host, &port));
  beast::error_code ec;
  const net::ip::address ip = net::ip::make_address(host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) return Status::InvalidArgument(s.opts.name + ": listen address '" + address + "': host must be an IP address");
  const tcp::endpoint ep(ip, port);
  s.acceptor.open(ep.protocol(), ec);
  if (!ec) s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(ep, ec);
  if (!ec) s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return Status::IoError(s.opts.name + ": cannot listen on " + address + ": " + ec.message());
  const uint16_t bound = s.acceptor.local_endpoint().port();
  s.work.emplace(net::make_work_guard(s.ioc));
  for (uint32_t i = 0; i < std::max<uint32_t>(1, s.opts.handler_threads); ++i) s.workers.emplace_back([&s] { s.WorkerLoop(); });
  s.Accept();
  for (uint32_t i = 0; i < std::max<uint32_t>(1, s.opts.io_threads); ++i) s.io_threads.emplace_back([&s] { s.ioc.run(); });
  return bound;
}

void HttpServer::Stop() {
  Impl& s = *impl_;
  if (s.io_threads.empty() || s.stopping.exchange(true)) return;
  net::dispatch(s.acceptor.get_executor(), [&s] {
    beast::error_code ignored;
    s.acceptor.close(ignored);
  });
  // Close every connection: a handler's pending write fails, so the handler returns; a read
  // waiting for a request ends. Twice: a handler that finished meanwhile may have restarted one.
  auto close_all = [&s] {
    std::vector<std::shared_ptr<HttpSession>> live;
    {
      std::lock_guard<std::mutex> lock(s.sessions_mu);
      for (auto& [p, w] : s.sessions) {
        if (auto sp = w.lock()) live.push_back(std::move(sp));
      }
    }
    for (auto& sp : live) sp->CloseFromServer();
  };
  close_all();
  {
    std::lock_guard<std::mutex> lock(s.jobs_mu);
    s.workers_stopping = true;
    s.jobs_cv.notify_all();
  }
  for (auto& t : s.workers) t.join();
  s.workers.clear();
  close_all();
  // No connection, accept or handler is pending now: run() returns once the aborted operations'
  // handlers have run and released their connections.
  s.work.reset();
  for (auto& t : s.io_threads) t.join();
}

HttpServer::Counters HttpServer::counters() const {
  const Impl& s = *impl_;
  return Counters{s.accepted.load(), s.refused.load(), s.timed_out.load(), s.malformed.load(), s.requests.load(), s.open.load()};
}

}  // namespace kvserve::serve_internal
