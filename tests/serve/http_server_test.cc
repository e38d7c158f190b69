// HttpServer: routing, keep-alive and pipelining, limits, deadlines, the connection cap, chunked
// streaming and a client that leaves mid-stream, over raw loopback sockets.
#include "serve/http_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace kvserve::serve_internal {
namespace {

// A raw client socket: what a test sends is exactly what the server reads.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~RawClient() { Close(); }
  bool ok() const { return ok_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  bool Send(const std::string& s) { return send(fd_, s.data(), s.size(), MSG_NOSIGNAL) == ssize_t(s.size()); }
  // Reads until the server closes, `until` appears, or `seconds` pass.
  std::string Read(double seconds, const std::string& until = "") {
    std::string got;
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      got.append(buf, size_t(n));
      if (!until.empty() && got.find(until) != std::string::npos) break;
    }
    return got;
  }
  bool closed() const { return closed_; }

 private:
  int fd_ = -1;
  bool ok_ = false, closed_ = false;
};

size_t Count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

struct Fixture {
  explicit Fixture(HttpServerOptions o = {}) : server(std::move(o)) {
    server.Handle("GET", "/hello", [](HttpExchange& ex) { ex.Reply(200, "text/plain", "hello\n"); });
    server.Handle("POST", "/echo", [](HttpExchange& ex) { ex.Reply(200, "text/plain", "got:" + ex.request().body); });
    server.Handle("GET", "/throws", [](HttpExchange&) { throw std::runtime_error("boom"); });
    server.Handle("GET", "/silent", [](HttpExchange&) {});
  }
  uint16_t Start() {
    auto p = server.Start("127.0.0.1:0");
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? *p : 0;
  }
  HttpServer server;
};

TEST(HttpServer, RoutesKnownPathsAnd404sOr405sTheRest) {
  Fixture f;
  const uint16_t port = f.Start();
  for (const auto& [req, want] : std::vector<std::pair<std::string, std::string>>{
           {"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "HTTP/1.1 200 OK"},
           {"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "HTTP/1.1 404"},
           {"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "HTTP/1.1 405"},
           {"GET /throws HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "HTTP/1.1 500"},
           {"GET /silent HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "HTTP/1.1 500"},
           {"NOT HTTP AT ALL\r\n\r\n", "HTTP/1.1 400"}}) {
    RawClient c(port);
    ASSERT_TRUE(c.ok());
    ASSERT_TRUE(c.Send(req));
    const std::string got = c.Read(5);
    EXPECT_EQ(got.rfind(want, 0), 0u) << req << " -> " << got;
  }
  const std::string thrown = [&] {
    RawClient c(port);
    c.Send("GET /throws HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    return c.Read(5);
  }();
  EXPECT_NE(thrown.find("boom"), std::string::npos);
}

TEST(HttpServer, KeepAliveAndPipelinedRequestsAreAnsweredInOrder) {
  Fixture f;
  const uint16_t port = f.Start();
  RawClient c(port);
  ASSERT_TRUE(c.ok());
  // Three requests in one write: the last closes.
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\noneGET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
                     "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nthree"));
  const std::string got = c.Read(5);
  EXPECT_EQ(Count(got, "HTTP/1.1 200 OK"), 3u) << got;
  const size_t a = got.find("got:one"), b = got.find("hello\n"), d = got.find("got:three");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  ASSERT_NE(d, std::string::npos);
  EXPECT_LT(a, b);
  EXPECT_LT(b, d);
  EXPECT_TRUE(c.closed());
  // Keep-alive across separate writes.
  RawClient k(port);
  ASSERT_TRUE(k.Send("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_NE(k.Read(5, "hello\n").find("hello\n"), std::string::npos);
  ASSERT_TRUE(k.Send("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"));
  EXPECT_NE(k.Read(5, "hello\n").find("hello\n"), std::string::npos);
  EXPECT_FALSE(k.closed());
}

TEST(HttpServer, ExpectContinueGetsA100BeforeTheBody) {
  Fixture f;
  const uint16_t port = f.Start();
  RawClient c(port);
  ASSERT_TRUE(c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"));
  EXPECT_NE(c.Read(5, "100 Continue").find("HTTP/1.1 100 Continue"), std::string::npos);
  ASSERT_TRUE(c.Send("body"));
  EXPECT_NE(c.Read(5).find("got:body"), std::string::npos);
}

TEST(HttpServer, OversizedBodiesAndHeadersAreRefusedWithTheirStatus) {
  Fixture f(HttpServerOptions{.max_body_bytes = 100, .max_header_bytes = 1024});
  const uint16_t port = f.Start();
  {
    RawClient c(port);
    c.Send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n" + std::string(101, 'x'));
    const std::string got = c.Read(5);
    EXPECT_EQ(got.rfind("HTTP/1.1 413", 0), 0u) << got;
    EXPECT_NE(got.find("over 100 bytes"), std::string::npos);
  }
  {
    RawClient c(port);
    c.Send("GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(2000, 'y') + "\r\n\r\n");
    EXPECT_EQ(c.Read(5).rfind("HTTP/1.1 431", 0), 0u);
  }
  EXPECT_GE(f.server.counters().malformed, 2u);
}

TEST(HttpServer, SlowClientsHoldNoWorkerAndAreCutOffAtTheRequestDeadline) {
  Fixture f(HttpServerOptions{.request_deadline_s = 0.5, .handler_threads = 2});
  const uint16_t port = f.Start();
  // 40 clients that send half a header and then a line now and then: more than the workers.
  std::vector<std::unique_ptr<RawClient>> slow;
  for (int i = 0; i < 40; ++i) {
    slow.push_back(std::make_unique<RawClient>(port));
    ASSERT_TRUE(slow.back()->Send("GET /hello HTTP/1.1\r\nHost: x\r\n"));
  }
  // A normal request is answered meanwhile.
  RawClient c(port);
  ASSERT_TRUE(c.Send("GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"));
  EXPECT_NE(c.Read(5).find("hello\n"), std::string::npos);
  // Trickling more lines does not extend the deadline: every slow client is closed.
  for (int step = 0; step < 4; ++step) {
    for (auto& s : slow) s->Send("X-Drip: 1\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  int closed = 0;
  for (auto& s : slow) {
    s->Read(3);
    closed += s->closed();
  }
  EXPECT_EQ(closed, 40);
  EXPECT_GE(f.server.counters().timed_out, 40u);
}

TEST(HttpServer, ConnectionsBeyondTheCapAreAnswered503) {
  Fixture f(HttpServerOptions{.max_connections = 3});
  const uint16_t port = f.Start();
  std::vector<std::unique_ptr<RawClient>> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(std::make_unique<RawClient>(port));
    held.back()->Send("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    ASSERT_NE(held.back()->Read(5, "hello\n").find("hello"), std::string::npos);
  }
  RawClient extra(port);
  const std::string got = extra.Read(5);
  EXPECT_EQ(got.rfind("HTTP/1.1 503", 0), 0u) << got;
  EXPECT_NE(got.find("3 connections open"), std::string::npos);
  EXPECT_EQ(f.server.counters().refused, 1u);
  // Once one closes, a new connection is served.
  held.pop_back();
  bool served = false;
  for (int attempt = 0; attempt < 50 && !served; ++attempt) {
    RawClient again(port);
    again.Send("GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    served = again.Read(5).find("hello\n") != std::string::npos;
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(served);
}

TEST(HttpServer, StreamsChunksAndTellsTheHandlerWhenTheClientLeaves) {
  HttpServer server;
  std::atomic<int> writes_before_gone{-1};
  server.Handle("GET", "/three", [](HttpExchange& ex) {
    ASSERT_TRUE(ex.BeginStream(200, "text/event-stream"));
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(ex.Write("data: " + std::to_string(i) + "\n\n"));
    ex.EndStream();
  });
  server.Handle("GET", "/forever", [&](HttpExchange& ex) {
    ex.BeginStream(200, "text/event-stream");
    const std::string chunk(16 << 10, 'z');
    // Bounded: 5,000 chunks of 16 KiB at most.
    for (int i = 0; i < 5000; ++i) {
      if (!ex.Write(chunk)) {
        writes_before_gone = i;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  auto port = server.Start("127.0.0.1:0");
  ASSERT_TRUE(port.ok());
  {
    RawClient c(*port);
    c.Send("GET /three HTTP/1.1\r\nHost: x\r\n\r\n");
    const std::string got = c.Read(5, "0\r\n\r\n");
    EXPECT_NE(got.find("Transfer-Encoding: chunked"), std::string::npos) << got;
    EXPECT_NE(got.find("Content-Type: text/event-stream"), std::string::npos);
    const size_t a = got.find("data: 0"), b = got.find("data: 1"), d = got.find("data: 2"), e = got.rfind("0\r\n\r\n");
    ASSERT_NE(d, std::string::npos);
    EXPECT_LT(a, b);
    EXPECT_LT(b, d);
    EXPECT_GT(e, d);
    // The connection stays usable after a stream.
    c.Send("GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_NE(c.Read(5, "404").find("404"), std::string::npos);
  }
  {
    RawClient c(*port);
    c.Send("GET /forever HTTP/1.1\r\nHost: x\r\n\r\n");
    c.Read(0.2);
    c.Close();
  }
  for (int i = 0; i < 500 && writes_before_gone < 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GE(writes_before_gone.load(), 0) << "the handler never saw the client leave";
  server.Stop();
}

TEST(HttpServer, StopEndsIdleConnectionsAndRunningStreams) {
  HttpServer server;
  std::atomic<bool> streaming{false};
  server.Handle("GET", "/forever", [&](HttpExchange& ex) {
    ex.BeginStream(200, "text/event-stream");
    streaming = true;
    for (int i = 0; i < 100000 && ex.Write("data: x\n\n"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  auto port = server.Start("127.0.0.1:0");
  ASSERT_TRUE(port.ok());
  RawClient idle(*port), streamer(*port);
  streamer.Send("GET /forever HTTP/1.1\r\nHost: x\r\n\r\n");
  for (int i = 0; i < 500 && !streaming; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto t0 = std::chrono::steady_clock::now();
  server.Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  idle.Read(2);
  EXPECT_TRUE(idle.closed());
}

TEST(HttpServer, RefusesAListenAddressItCannotUse) {
  HttpServer server;
  auto bad = server.Start("not-an-ip:80");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("not-an-ip"), std::string::npos);
}

}  // namespace
}  // namespace kvserve::serve_internal
