// TCP transport on standalone asio. Sockets are non-blocking and every wait is a poll() bounded
// by the caller's deadline, so a stalled or vanished peer costs at most that deadline and one
// thread may send while another receives on the same connection.
#include <poll.h>

#include <algorithm>
#include <asio.hpp>
#include <atomic>
#include <cstring>
#include <thread>

#include "kvserve/transport.h"
#include "transfer/message_header.h"

namespace kvserve {

const char* MessageKindName(MessageKind kind) {
  switch (kind) {
    case MessageKind::kRequest: return "request";
    case MessageKind::kFrame: return "frame";
    case MessageKind::kEnd: return "end";
    case MessageKind::kResend: return "resend";
    case MessageKind::kResult: return "result";
    case MessageKind::kError: return "error";
    case MessageKind::kTokens: return "tokens";
  }
  return "unknown";
}

LinkShaper::LinkShaper(double gbps, uint64_t burst_bytes)
    : gbps_(gbps), bytes_per_second_(gbps * 1e9 / 8), burst_(double(burst_bytes)), next_(Clock::now()) {}

void LinkShaper::Take(uint64_t bytes) { Take(bytes, Clock::now()); }

void LinkShaper::Take(uint64_t bytes, Clock::time_point started) {
  Clock::time_point wait_until;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // An idle link lends at most one burst of credit; a busy one queues behind what was taken.
    const auto credit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(burst_ / bytes_per_second_));
    if (next_ < started - credit) next_ = started - credit;
    next_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(double(bytes) / bytes_per_second_));
    wait_until = next_;
  }
  std::this_thread::sleep_until(wait_until);
}

Status ParseHostPort(const std::string& address, std::string* host, uint16_t* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return Status::InvalidArgument("address '" + address + "': want host:port, e.g. 127.0.0.1:7000");
  }
  const std::string p = address.substr(colon + 1);
  char* end = nullptr;
  const long v = std::strtol(p.c_str(), &end, 10);
  if (p.empty() || *end != '\0' || v < 0 || v > 65535) {
    return Status::InvalidArgument("address '" + address + "': port '" + p + "' is not in [0, 65535]");
  }
  *host = address.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  *port = uint16_t(v);
  return Status::Ok();
}

namespace {

constexpr size_t kHeader = transfer_internal::kHeaderBytes;

// Milliseconds to wait in poll() before `deadline`, in slices so a closed flag is seen soon.
int PollMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 50));
}

class TcpConnection final : public Connection {
 public:
  TcpConnection(std::unique_ptr<asio::io_context> io, asio::ip::tcp::socket socket, const TcpOptions& opts)
      : io_(std::move(io)), socket_(std::move(socket)), opts_(opts), max_message_bytes_(opts.max_message_bytes) {
    asio::error_code ec;
    socket_.non_blocking(true, ec);
    socket_.set_option(asio::ip::tcp::no_delay(true), ec);
    auto ep = socket_.remote_endpoint(ec);
    peer_ = ec ? std::string("(unknown peer)") : ep.address().to_string() + ":" + std::to_string(ep.port());
    fd_ = socket_.native_handle();
  }
  ~TcpConnection() override { Close(); }

  Status Send(MessageKind kind, std::span<const uint8_t> body, Clock::time_point deadline) override {
    std::lock_guard<std::mutex> lock(send_mu_);
    uint8_t header[kHeader];
    transfer_internal::WriteHeader(kind, body.size(), header);
    KV_RETURN_IF_ERROR(WriteAll(header, kHeader, deadline));
    // Shaped in slices so one large frame does not hold the link past its share of time.
    constexpr size_t kSlice = 256 << 10;
    for (size_t at = 0; at < body.size(); at += kSlice) {
      const size_t n = std::min(kSlice, body.size() - at);
      if (opts_.shaper != nullptr) opts_.shaper->Take(n);
      if (opts_.send_delay_s_per_byte > 0) std::this_thread::sleep_for(std::chrono::duration<double>(n * opts_.send_delay_s_per_byte));
      KV_RETURN_IF_ERROR(WriteAll(body.data() + at, n, deadline));
    }
    return Status::Ok();
  }

  Result<Message> Receive(Clock::time_point deadline, ByteBuffer* storage) override {
    std::lock_guard<std::mutex> lock(recv_mu_);
    uint8_t header[kHeader];
    KV_RETURN_IF_ERROR(ReadAll(header, kHeader, deadline));
    Message m;
    uint64_t len = 0;
    if (Status st = transfer_internal::ReadHeader(header, peer_, max_message_bytes_.load(), &m.kind, &len); !st.ok()) {
      Close();
      return st;
    }
    if (storage != nullptr) {
      m.body = std::move(*storage);
      m.body.clear();  // keeps the allocation; the element type is not zero-filled on resize
    }
    // Grown as bytes arrive, so a lying length costs memory only for what was really sent.
    constexpr size_t kChunk = 4 << 20;
    while (m.body.size() < len) {
      const size_t at = m.body.size(), n = std::min<uint64_t>(kChunk, len - at);
      m.body.resize(at + n);
      KV_RETURN_IF_ERROR(ReadAll(m.body.data() + at, n, deadline));
    }
    return m;
  }

  void set_max_message_bytes(uint64_t bytes) override { max_message_bytes_ = std::min(bytes, opts_.max_message_bytes); }

  void Close() override {
    if (closed_.exchange(true)) return;
    asio::error_code ec;
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    // The descriptor stays open until destruction: the other direction's thread may be in poll().
  }

  std::string peer() const override { return peer_; }

 private:
  // Moves n bytes in one direction, waiting in poll() whenever the socket would block.
  Status Pump(bool write, uint8_t* p, size_t n, Clock::time_point deadline) {
    while (n > 0) {
      if (closed_) return Status::Unavailable("connection to " + peer_ + " is closed");
      asio::error_code ec;
      const size_t k = write ? socket_.write_some(asio::buffer(p, n), ec) : socket_.read_some(asio::buffer(p, n), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again) {
        if (Clock::now() >= deadline) {
          return Fail(write ? "sending to " + peer_ + " missed its deadline (peer stalled)"
                            : "waiting for " + peer_ + " missed its deadline");
        }
        pollfd pfd{fd_, short(write ? POLLOUT : POLLIN), 0};
        ::poll(&pfd, 1, PollMs(deadline));
        continue;
      }
      if (ec == asio::error::eof) return Fail("peer " + peer_ + " closed the connection");
      if (ec) return Fail((write ? "sending to " : "receiving from ") + peer_ + ": " + ec.message());
      p += k, n -= k;
    }
    return Status::Ok();
  }
  Status WriteAll(const uint8_t* p, size_t n, Clock::time_point deadline) {
    return Pump(true, const_cast<uint8_t*>(p), n, deadline);  // only read from when writing
  }
  Status ReadAll(uint8_t* p, size_t n, Clock::time_point deadline) { return Pump(false, p, n, deadline); }
  Status Fail(const std::string& why) {
    Close();
    return Status::Unavailable(why);
  }

  std::unique_ptr<asio::io_context> io_;
  asio::ip::tcp::socket socket_;
  TcpOptions opts_;
  std::atomic<uint64_t> max_message_bytes_;
  std::string peer_;
  int fd_ = -1;
  std::atomic<bool> closed_{false};
  std::mutex send_mu_, recv_mu_;
};

class TcpListener final : public Listener {
 public:
  TcpListener(std::unique_ptr<asio::io_context> io, asio::ip::tcp::acceptor acceptor, const TcpOptions& opts)
      : io_(std::move(io)), acceptor_(std::move(acceptor)), opts_(opts) {
    asio::error_code ec;
    acceptor_.non_blocking(true, ec);
    port_ = acceptor_.local_endpoint(ec).port();
  }
  ~TcpListener() override { Close(); }

  Result<std::unique_ptr<Connection>> Accept(Clock::time_point deadline) override {
    // asio throws where it cannot make its reactor's descriptors (EMFILE): an error, not a throw.
    try {
      return AcceptOrThrow(deadline);
    } catch (const std::exception& e) {
      return Status::IoError("accept on port " + std::to_string(port_) + ": " + e.what());
    }
  }
  uint16_t port() const override { return port_; }
  void Close() override { closed_ = true; }

 private:
  Result<std::unique_ptr<Connection>> AcceptOrThrow(Clock::time_point deadline) {
    while (!closed_) {
      auto io = std::make_unique<asio::io_context>();
      asio::ip::tcp::socket s(*io);
      asio::error_code ec;
      acceptor_.accept(s, ec);
      if (!ec) return std::unique_ptr<Connection>(new TcpConnection(std::move(io), std::move(s), opts_));
      if (ec != asio::error::would_block && ec != asio::error::try_again) {
        return Status::IoError("accept on port " + std::to_string(port_) + ": " + ec.message());
      }
      if (Clock::now() >= deadline) return Status::Unavailable("no connection before the deadline");
      pollfd pfd{acceptor_.native_handle(), POLLIN, 0};
      ::poll(&pfd, 1, PollMs(deadline));
    }
    return Status::Unavailable("listener on port " + std::to_string(port_) + " is closed");
  }

  std::unique_ptr<asio::io_context> io_;
  asio::ip::tcp::acceptor acceptor_;
  TcpOptions opts_;
  uint16_t port_ = 0;
  std::atomic<bool> closed_{false};
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TcpOptions& opts) : opts_(opts) {}
  std::string name() const override { return "tcp"; }

  Result<std::unique_ptr<Listener>> Listen(const std::string& address) override {
    try {
      return ListenOrThrow(address);
    } catch (const std::exception& e) {
      return Status::IoError("listen on " + address + ": " + e.what());
    }
  }

  Result<std::unique_ptr<Connection>> Connect(const std::string& address, Clock::time_point deadline) override {
    try {
      return ConnectOrThrow(address, deadline);
    } catch (const std::exception& e) {
      return Status::Unavailable("connecting to " + address + ": " + e.what());
    }
  }

 private:
  Result<std::unique_ptr<Connection>> ConnectOrThrow(const std::string& address, Clock::time_point deadline) {
    std::string host;
    uint16_t port;
    KV_RETURN_IF_ERROR(ParseHostPort(address, &host, &port));
    auto io = std::make_unique<asio::io_context>();
    asio::ip::tcp::resolver resolver(*io);
    asio::error_code ec;
    auto endpoints = resolver.resolve(host, std::to_string(port), ec);
    if (ec) return Status::Unavailable("cannot resolve '" + host + "': " + ec.message());
    asio::ip::tcp::socket s(*io);
    bool done = false;
    asio::async_connect(s, endpoints, [&](const asio::error_code& e, const asio::ip::tcp::endpoint&) {
      ec = e;
      done = true;
    });
    io->run_until(deadline);
    if (!done) {
      asio::error_code ignored;
      s.close(ignored);
      io->restart();
      io->run();
      return Status::Unavailable("connecting to " + address + " missed its deadline");
    }
    if (ec) return Status::Unavailable("cannot connect to " + address + ": " + ec.message());
    io->restart();
    return std::unique_ptr<Connection>(new TcpConnection(std::move(io), std::move(s), opts_));
  }

  Result<std::unique_ptr<Listener>> ListenOrThrow(const std::string& address) {
    std::string host;
    uint16_t port;
    KV_RETURN_IF_ERROR(ParseHostPort(address, &host, &port));
    auto io = std::make_unique<asio::io_context>();
    asio::error_code ec;
    const asio::ip::address ip = asio::ip::make_address(host, ec);
    if (ec) return Status::InvalidArgument("listen address '" + address + "': '" + host + "' is not an IP address");
    asio::ip::tcp::acceptor acc(*io);
    const asio::ip::tcp::endpoint ep(ip, port);
    acc.open(ep.protocol(), ec);
    if (!ec) acc.set_option(asio::ip::tcp::acceptor::reuse_address(true), ec);
    if (!ec) acc.bind(ep, ec);
    if (!ec) acc.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) return Status::IoError("listen on " + address + ": " + ec.message());
    return std::unique_ptr<Listener>(new TcpListener(std::move(io), std::move(acc), opts_));
  }

  TcpOptions opts_;
};

}  // namespace

std::unique_ptr<Transport> MakeTcpTransport(const TcpOptions& opts) { return std::make_unique<TcpTransport>(opts); }

}  // namespace kvserve
