// UCX transport: messages over UCP tagged sends (what NIXL and Mooncake deployments run on), so
// shared memory (posix, sysv, cma) between processes on one machine and RDMA between machines
// carry the frames; a TCP side channel exchanges worker addresses and tells when the peer is gone.
// The framing, deadlines, limits and failure semantics are the TCP transport's. A build without
// libucx compiles only the end of this file: the transport says it is unavailable.
#include "kvserve/transport.h"

#if KVSERVE_HAVE_UCX
#include "transfer/message_header.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace kvserve {
namespace {

constexpr size_t kHeader = transfer_internal::kHeaderBytes;
constexpr ucp_tag_t kTagHeader = 1, kTagBody = 2;
constexpr ucp_tag_t kTagMask = ~ucp_tag_t{0};
// A wait spins this long before it sleeps on the worker's event fd and the side channel. Shared
// memory transports do not all signal that fd, so the sleeps are short at first (a chunk in
// flight completes within them) and double up to kMaxSleepMicros (an idle connection wakes
// rarely).
constexpr int kSpinMicros = 2000, kFirstSleepMicros = 50, kMaxSleepMicros = 5000;
// A handshake an Accept started gets at least this long, whatever the accept's own deadline.
constexpr double kHandshakeSeconds = 10;
// Bodies travel in pieces of this size, a window of them in flight.
constexpr size_t kChunk = size_t(4) << 20;
constexpr size_t kWindow = 4;  // chunks in flight at once (more made 64 MiB messages slower here)

int PollMs(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return int(std::clamp<int64_t>(left, 0, 50));
}

std::string Ucs(ucs_status_t s) { return ucs_status_string(s); }

// The UCP context every connection's worker is made from.
struct UcxContext {
  ucp_context_h ctx = nullptr;
  ~UcxContext() {
    if (ctx) ucp_cleanup(ctx);
  }
};

// Blocking I/O on the side channel, bounded by the deadline.
Status SideIo(int fd, void* data, size_t n, bool write, Clock::time_point deadline, const std::string& peer) {
  auto* p = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < n) {
    const ssize_t r = write ? ::send(fd, p + done, n - done, MSG_NOSIGNAL) : ::recv(fd, p + done, n - done, 0);
    if (r > 0) {
      done += size_t(r);
      continue;
    }
    if (r == 0) return Status::Unavailable("ucx: " + peer + " closed the connection during the handshake");
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return Status::Unavailable("ucx: handshake with " + peer + ": " + std::strerror(errno));
    }
    if (Clock::now() >= deadline) return Status::Unavailable("ucx: handshake with " + peer + " missed its deadline");
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    ::poll(&pfd, 1, PollMs(deadline));
  }
  return Status::Ok();
}

class UcxConnection final : public Connection {
 public:
  UcxConnection(std::shared_ptr<UcxContext> ctx, int side_fd, std::string peer, const TcpOptions& opts)
      : ctx_(std::move(ctx)), side_fd_(side_fd), peer_(std::move(peer)), opts_(opts), max_message_bytes_(opts.max_message_bytes) {}
  ~UcxConnection() override {
    Close();
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_) {
      if (address_) ucp_worker_release_address(worker_, address_);
      ucp_worker_destroy(worker_);
    }
    if (side_fd_ >= 0) ::close(side_fd_);
  }

  // Makes the worker, swaps worker addresses over the side channel, connects the endpoint.
  Status Handshake(Clock::time_point deadline) {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // serialized by mu_
    ucs_status_t s = ucp_worker_create(ctx_->ctx, &wp, &worker_);
    if (s != UCS_OK) return Status::Unavailable("ucx: cannot make a worker: " + Ucs(s));
    size_t len = 0;
    s = ucp_worker_get_address(worker_, &address_, &len);
    if (s != UCS_OK) return Status::Unavailable("ucx: worker address: " + Ucs(s));
    s = ucp_worker_get_efd(worker_, &efd_);
    if (s != UCS_OK) return Status::Unavailable("ucx: worker event fd: " + Ucs(s));
    const uint32_t mine = uint32_t(len);
    KV_RETURN_IF_ERROR(SideIo(side_fd_, const_cast<uint32_t*>(&mine), 4, true, deadline, peer_));
    KV_RETURN_IF_ERROR(SideIo(side_fd_, address_, len, true, deadline, peer_));
    uint32_t theirs = 0;
    KV_RETURN_IF_ERROR(SideIo(side_fd_, &theirs, 4, false, deadline, peer_));
    if (theirs == 0 || theirs > (1u << 20)) return Status::Corrupt("ucx: " + peer_ + " sent a worker address of " + std::to_string(theirs) + " bytes");
    std::vector<uint8_t> remote(theirs);
    KV_RETURN_IF_ERROR(SideIo(side_fd_, remote.data(), theirs, false, deadline, peer_));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(remote.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) { static_cast<UcxConnection*>(arg)->failed_ = true; };
    ep.err_handler.arg = this;
    s = ucp_ep_create(worker_, &ep, &ep_);
    if (s != UCS_OK) return Status::Unavailable("ucx: cannot connect to " + peer_ + ": " + Ucs(s));
    return Status::Ok();
  }

  Status Send(MessageKind kind, std::span<const uint8_t> body, Clock::time_point deadline) override {
    std::lock_guard<std::mutex> lock(send_mu_);
    uint8_t header[kHeader];
    transfer_internal::WriteHeader(kind, body.size(), header);
    KV_RETURN_IF_ERROR(SendTagged(header, kHeader, kTagHeader, deadline));
    // The body in kChunk pieces from the caller's memory, all posted before any is waited for,
    // so UCX pipelines them (its rendezvous: one copy or none); the shaper paces the posting.
    std::deque<void*> pending;
    Status st;
    for (size_t at = 0; at < body.size() && st.ok(); at += kChunk) {
      const size_t n = std::min(kChunk, body.size() - at);
      if (pending.size() >= kWindow) st = WaitFirst(pending, deadline, "sending to");
      if (!st.ok()) break;
      if (opts_.shaper != nullptr) opts_.shaper->Take(n);
      if (opts_.send_delay_s_per_byte > 0) std::this_thread::sleep_for(std::chrono::duration<double>(n * opts_.send_delay_s_per_byte));
      st = Post(const_cast<uint8_t*>(body.data() + at), n, kTagBody, nullptr, &pending);  // only read
    }
    return WaitAll(pending, st, deadline, "sending to");
  }

  Result<Message> Receive(Clock::time_point deadline, ByteBuffer* storage) override {
    std::lock_guard<std::mutex> lock(recv_mu_);
    uint8_t header[kHeader];
    KV_ASSIGN_OR_RETURN(size_t got, RecvTagged(header, kHeader, kTagHeader, deadline));
    Message m;
    uint64_t len = 0;
    Status st = got == kHeader ? transfer_internal::ReadHeader(header, peer_, max_message_bytes_.load(), &m.kind, &len)
                               : Status::Corrupt("message from " + peer_ + " does not start with a kvserve message header");
    if (!st.ok()) {
      Close();
      return st;
    }
    if (storage != nullptr) {
      m.body = std::move(*storage);
      m.body.clear();
    }
    // The chunks' receives posted into their places, a window at a time (the length passed the
    // limit above, so the buffer is what the node allows the next message).
    m.body.resize(len);
    const size_t n_chunks = size_t((len + kChunk - 1) / kChunk);
    std::vector<ucp_tag_recv_info_t> info(n_chunks);
    std::deque<void*> pending;
    for (size_t i = 0; i < n_chunks && st.ok(); ++i) {
      const size_t at = i * kChunk;
      if (pending.size() >= kWindow) st = WaitFirst(pending, deadline, "receiving from");
      if (st.ok()) st = Post(m.body.data() + at, size_t(std::min<uint64_t>(kChunk, len - at)), kTagBody, &info[i], &pending);
    }
    KV_RETURN_IF_ERROR(WaitAll(pending, st, deadline, "receiving from"));
    for (size_t i = 0; i < n_chunks; ++i) {
      if (info[i].length != std::min<uint64_t>(kChunk, len - i * kChunk)) {
        Close();
        return Status::Corrupt("message from " + peer_ + ": body chunk " + std::to_string(i) + " holds " +
                               std::to_string(info[i].length) + " bytes, not what its header announced");
      }
    }
    return m;
  }

  void set_max_message_bytes(uint64_t bytes) override { max_message_bytes_ = std::min(bytes, opts_.max_message_bytes); }

  void Close() override {
    if (closed_.exchange(true)) return;
    // The side channel's end tells the peer at once; the endpoint is closed without flushing.
    if (side_fd_ >= 0) ::shutdown(side_fd_, SHUT_RDWR);
    std::lock_guard<std::mutex> lock(mu_);
    if (ep_ == nullptr) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void* r = ucp_ep_close_nbx(ep_, &p);
    if (UCS_PTR_IS_PTR(r)) {
      const Clock::time_point until = DeadlineIn(2);
      while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    ep_ = nullptr;
  }

  std::string peer() const override { return peer_; }

 private:
  // Posts a tagged send (`info` null) or receive (`info` filled at completion); a request still
  // in flight goes to `pending`.
  Status Post(void* data, size_t n, ucp_tag_t tag, ucp_tag_recv_info_t* info, std::deque<void*>* pending) {
    void* r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || ep_ == nullptr) return Status::Unavailable("ucx: connection to " + peer_ + " is closed");
      ucp_request_param_t p{};
      if (info == nullptr) {
        r = ucp_tag_send_nbx(ep_, data, n, tag, &p);
      } else {
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
        p.cb.recv = [](void*, ucs_status_t, const ucp_tag_recv_info_t* i, void* user) {
          if (i != nullptr) *static_cast<ucp_tag_recv_info_t*>(user) = *i;
        };
        p.user_data = info;
        r = ucp_tag_recv_nbx(worker_, data, n, tag, kTagMask, &p);
      }
    }
    if (UCS_PTR_IS_ERR(r)) return Status::Unavailable("ucx: " + peer_ + ": " + Ucs(UCS_PTR_STATUS(r)));
    if (r != nullptr) pending->push_back(r);
    return Status::Ok();
  }

  // Waits for every pending request in turn; after a failure (`st`, or one of them) the rest are
  // cancelled and the connection closed.
  // The oldest pending request (kWindow are in flight at most).
  Status WaitFirst(std::deque<void*>& pending, Clock::time_point deadline, const char* what) {
    void* r = pending.front();
    pending.pop_front();
    return Wait(r, deadline, what);
  }

  Status WaitAll(std::deque<void*>& pending, Status st, Clock::time_point deadline, const char* what) {
    size_t i = 0;
    for (; i < pending.size() && st.ok(); ++i) st = Wait(pending[i], deadline, what);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      for (; i < pending.size(); ++i) {
        ucp_request_cancel(worker_, pending[i]);
        const Clock::time_point until = DeadlineIn(1);
        while (ucp_request_check_status(pending[i]) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
        ucp_request_free(pending[i]);
      }
    }
    pending.clear();
    if (!st.ok()) Close();
    return st;
  }

  // One tagged send or receive, waited for; a receive gives the length that arrived.
  Status SendTagged(const void* data, size_t n, ucp_tag_t tag, Clock::time_point deadline) {
    std::deque<void*> pending;
    const Status st = Post(const_cast<void*>(data), n, tag, nullptr, &pending);  // only read
    return WaitAll(pending, st, deadline, "sending to");
  }

  Result<size_t> RecvTagged(void* data, size_t n, ucp_tag_t tag, Clock::time_point deadline) {
    std::deque<void*> pending;
    ucp_tag_recv_info_t info{};
    const Status st = Post(data, n, tag, &info, &pending);
    KV_RETURN_IF_ERROR(WaitAll(pending, st, deadline, "receiving from"));
    return size_t(info.length);
  }

  // Progresses the worker until `r` completes; sleeps on the worker's event fd and the side
  // channel meanwhile. A peer gone, an endpoint error or the deadline cancels it and closes.
  Status Wait(void* r, Clock::time_point deadline, const char* what) {
    // Spins first: shared-memory transports complete in microseconds and do not all signal the
    // worker's event fd, so sleeping at once would add the poll interval to every message.
    const Clock::time_point spin_until = Clock::now() + std::chrono::microseconds(kSpinMicros);
    int sleep_us = kFirstSleepMicros;
    while (true) {
      std::string why;
      {
        std::unique_lock<std::mutex> lock(mu_);
        while (ucp_worker_progress(worker_) != 0) {
        }
        const ucs_status_t s = ucp_request_check_status(r);
        if (s != UCS_INPROGRESS) {
          ucp_request_free(r);
          if (s == UCS_OK) return Status::Ok();
          why = Ucs(s);
        } else {
          if (failed_ || closed_ || PeerGone()) {
            why = "the peer is gone";
          } else if (Clock::now() >= deadline) {
            why = "missed its deadline";
          } else if (Clock::now() < spin_until) {
            lock.unlock();
            sched_yield();  // spinning, but a thread that shares this core (an encoder) runs first
            continue;
          } else if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
            continue;  // more to progress before sleeping
          }
          if (!why.empty()) {
            ucp_request_cancel(worker_, r);
            const Clock::time_point until = DeadlineIn(1);
            while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
            ucp_request_free(r);
          }
        }
      }
      if (!why.empty()) {
        Close();
        return Status::Unavailable(std::string("ucx: ") + what + " " + peer_ + ": " + why);
      }
      pollfd pfds[2] = {{efd_, POLLIN, 0}, {side_fd_, POLLIN, 0}};
      const int64_t left_us = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
      const int64_t us = std::clamp<int64_t>(left_us, 0, sleep_us);
      const timespec ts{time_t(us / 1000000), long(us % 1000000) * 1000};
      ::ppoll(pfds, 2, &ts, nullptr);
      sleep_us = std::min(2 * sleep_us, kMaxSleepMicros);
    }
  }

  // The side channel carries nothing after the handshake: readable means closed.
  bool PeerGone() {
    char c;
    const ssize_t r = ::recv(side_fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  }

  std::shared_ptr<UcxContext> ctx_;
  int side_fd_;
  std::string peer_;
  TcpOptions opts_;
  std::atomic<uint64_t> max_message_bytes_;
  std::mutex mu_;                  // the worker and the endpoint
  std::mutex send_mu_, recv_mu_;   // one sender and one receiver at a time
  ucp_worker_h worker_ = nullptr;
  ucp_address_t* address_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  int efd_ = -1;
  std::atomic<bool> failed_{false}, closed_{false};
};

std::string PeerOf(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "(unknown peer)";
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return "(unknown peer)";
  }
  return std::string(host) + ":" + serv;
}

Result<std::unique_ptr<Connection>> Establish(std::shared_ptr<UcxContext> ctx, int fd, const TcpOptions& opts,
                                              Clock::time_point deadline) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto c = std::make_unique<UcxConnection>(std::move(ctx), fd, PeerOf(fd), opts);
  KV_RETURN_IF_ERROR(c->Handshake(deadline));
  return std::unique_ptr<Connection>(std::move(c));
}

Result<sockaddr_in> Resolve(const std::string& address) {
  std::string host;
  uint16_t port = 0;
  KV_RETURN_IF_ERROR(ParseHostPort(address, &host, &port));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (host == "localhost") host = "127.0.0.1";
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) {
    return Status::InvalidArgument("ucx: address '" + address + "': the host must be an IPv4 address");
  }
  return a;
}

class UcxListener final : public Listener {
 public:
  UcxListener(std::shared_ptr<UcxContext> ctx, int fd, uint16_t port, const TcpOptions& opts)
      : ctx_(std::move(ctx)), fd_(fd), port_(port), opts_(opts) {}
  ~UcxListener() override {
    Close();
    ::close(fd_);
  }
  Result<std::unique_ptr<Connection>> Accept(Clock::time_point deadline) override {
    while (!closed_) {
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) return Establish(ctx_, c, opts_, std::max(deadline, DeadlineIn(kHandshakeSeconds)));
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        // Out of descriptors and the like: back off rather than spin.
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (Clock::now() >= deadline) return Status::Unavailable("ucx: no connection before the deadline");
      pollfd pfd{fd_, POLLIN, 0};
      ::poll(&pfd, 1, PollMs(deadline));
    }
    return Status::Unavailable("ucx: listener closed");
  }
  uint16_t port() const override { return port_; }
  void Close() override { closed_ = true; }

 private:
  std::shared_ptr<UcxContext> ctx_;
  int fd_;
  uint16_t port_;
  TcpOptions opts_;
  std::atomic<bool> closed_{false};
};

class UcxTransport final : public Transport {
 public:
  UcxTransport(std::shared_ptr<UcxContext> ctx, const TcpOptions& opts) : ctx_(std::move(ctx)), opts_(opts) {}
  std::string name() const override { return "ucx"; }

  Result<std::unique_ptr<Listener>> Listen(const std::string& address) override {
    KV_ASSIGN_OR_RETURN(sockaddr_in a, Resolve(address));
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::IoError(std::string("ucx: socket: ") + std::strerror(errno));
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      return Status::IoError("ucx: cannot listen on " + address + ": " + why);
    }
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    return std::unique_ptr<Listener>(std::make_unique<UcxListener>(ctx_, fd, ntohs(a.sin_port), opts_));
  }

  Result<std::unique_ptr<Connection>> Connect(const std::string& address, Clock::time_point deadline) override {
    KV_ASSIGN_OR_RETURN(sockaddr_in a, Resolve(address));
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return Status::IoError(std::string("ucx: socket: ") + std::strerror(errno));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      return Status::Unavailable("ucx: cannot connect to " + address + ": " + why);
    }
    while (true) {
      pollfd pfd{fd, POLLOUT, 0};
      if (::poll(&pfd, 1, PollMs(deadline)) > 0) break;
      if (Clock::now() >= deadline) {
        ::close(fd);
        return Status::Unavailable("ucx: connecting to " + address + " missed its deadline");
      }
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      ::close(fd);
      return Status::Unavailable("ucx: cannot connect to " + address + ": " + std::strerror(err));
    }
    return Establish(ctx_, fd, opts_, deadline);
  }

 private:
  std::shared_ptr<UcxContext> ctx_;
  TcpOptions opts_;
};

}  // namespace

bool UcxAvailable() { return true; }

Result<std::unique_ptr<Transport>> MakeUcxTransport(const TcpOptions& opts) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Unavailable("ucx: cannot read its configuration: " + Ucs(s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 1;  // connections' workers run on different threads
  auto ctx = std::make_shared<UcxContext>();
  s = ucp_init(&params, config, &ctx->ctx);
  ucp_config_release(config);
  if (s != UCS_OK) {
    ctx->ctx = nullptr;
    return Status::Unavailable("ucx: cannot initialise UCP: " + Ucs(s) + " (ucx_info -d lists the transports this machine has)");
  }
  return std::unique_ptr<Transport>(std::make_unique<UcxTransport>(std::move(ctx), opts));
}

}  // namespace kvserve

#else  // !KVSERVE_HAVE_UCX

namespace kvserve {

bool UcxAvailable() { return false; }

Result<std::unique_ptr<Transport>> MakeUcxTransport(const TcpOptions&) {
  return Status::Unsupported("ucx: this build has no UCX transport (install Debian's libucx-dev and rebuild; `kvserve version` says what a build has)");
}

}  // namespace kvserve

#endif  // KVSERVE_HAVE_UCX

namespace kvserve {

std::vector<std::string> TransportNames() { return {"tcp", "ucx"}; }

Result<std::unique_ptr<Transport>> MakeTransport(const std::string& name, const TcpOptions& opts) {
  if (name == "tcp") return MakeTcpTransport(opts);
  if (name == "ucx") return MakeUcxTransport(opts);
  return Status::InvalidArgument("transport '" + name + "': tcp or ucx");
}

}  // namespace kvserve
