// The HTTP/1.1 front of the serving processes (router, prefill, pool, decode metrics): I/O is
// asynchronous (Boost.Beast on Boost.Asio), so a slow or idle client holds a socket and a few
// KiB, never a thread; handlers run on a bounded pool of workers because serving a request
// blocks for the length of a transfer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvserve/status.h"

namespace kvserve::serve_internal {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // as sent: path and query
  std::string path;    // target up to '?'
  HttpHeaders headers; // names lower-case, in arrival order
  std::string body;
};

// One request and its answer, given to a handler on a worker thread. A handler either calls
// Reply once, or BeginStream, Write any number of times and EndStream (a chunked body: server-
// sent events). Each call returns once its bytes are with the socket, or the client failed to
// take them within the write timeout; Write and BeginStream return false once the client is gone,
// so a handler can stop the work it streams. A handler that answers nothing gets a 500.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;
  virtual const HttpRequest& request() const = 0;
  virtual void Reply(int status, std::string_view content_type, std::string body, const HttpHeaders& extra = {}) = 0;
  virtual bool BeginStream(int status, std::string_view content_type, const HttpHeaders& extra = {}) = 0;
  virtual bool Write(std::string_view chunk) = 0;
  virtual void EndStream() = 0;
  virtual bool answered() const = 0;
};

using HttpHandler = std::function<void(HttpExchange&)>;

struct HttpServerOptions {
  std::string name = "kvserve";      // the Server header, and in log lines
  size_t max_body_bytes = 16 << 20;  // a longer body is answered 413
  size_t max_header_bytes = 16 << 10;
  // A request's header and body must have arrived this long after its first byte: a client that
  // sends a header line every few seconds is cut off, whatever it sends.
  double request_deadline_s = 10;
  double idle_timeout_s = 30;        // a keep-alive connection waiting for its next request
  double write_timeout_s = 30;       // a response, or one streamed chunk, the client does not take
  uint32_t max_connections = 1024;   // open at once; one more is answered 503 and closed
  uint32_t handler_threads = 16;     // requests handled at once; more wait in arrival order
  uint32_t io_threads = 1;
};

// Routes are exact (method, path) pairs; a path known for another method answers 405, an
// unknown one goes to the fallback (404 text unless set). Keep-alive and pipelining follow
// HTTP/1.1: a connection's requests are answered in order. The listen backlog is the system's
// maximum (SOMAXCONN).
class HttpServer {
 public:
  explicit HttpServer(HttpServerOptions opts = {});
  ~HttpServer();  // stops
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  void Handle(const std::string& method, const std::string& path, HttpHandler handler);  // before Start
  void SetFallback(HttpHandler handler);
  // The body limit from the next request on (a node learns its model's after it listens).
  void SetMaxBodyBytes(size_t bytes);
  // Listens on "host:port" (port 0: a free one) and serves; returns the port.
  Result<uint16_t> Start(const std::string& address);
  // Stops accepting, closes every connection, waits for running handlers to return.
  void Stop();

  struct Counters {
    uint64_t accepted = 0, refused = 0, timed_out = 0, malformed = 0, requests = 0;
    uint32_t open = 0;
  };
  Counters counters() const;

  struct Impl;  // in http_server.cc (the connections refer to it)

 private:
  std::shared_ptr<Impl> impl_;
};

// HTTP status text for a code ("Not Found").
std::string_view HttpReason(int status);

}  // namespace kvserve::serve_internal
