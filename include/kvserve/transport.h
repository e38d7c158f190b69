// Transport: whole messages between serving nodes, with deadlines. The nodes see only this
// interface, so a UCX/RDMA transport can stand beside TCP without touching them.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"

namespace kvserve {

using Clock = std::chrono::steady_clock;
inline Clock::time_point DeadlineIn(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// What a message carries. Bodies of kRequest/kResult/kError/kResend are JSON text; a kFrame body
// is one KV frame (frame.h), checksummed by the frame itself.
enum class MessageKind : uint8_t {
  kRequest = 1,  // prefill -> decode: request id, prompt, generation settings, KV shape
  kFrame = 2,    // prefill -> decode: the KV of some layers
  kEnd = 3,      // prefill -> decode: every frame of the request was sent
  kResend = 4,   // decode -> prefill: layers whose frames failed verification, to send once more
  kResult = 5,   // decode -> prefill: generated tokens and timings
  kError = 6,    // either way: the request failed, with the reason
  kTokens = 7,   // decode -> prefill: tokens as they are generated, when the request asked to stream
};
const char* MessageKindName(MessageKind kind);

struct Message {
  MessageKind kind = MessageKind::kError;
  ByteBuffer body;
};

// One connection. Send and Receive may run on two threads at once (one each); each returns
// kUnavailable when the peer is gone or the deadline passes, leaving the connection closed.
class Connection {
 public:
  virtual ~Connection() = default;
  virtual Status Send(MessageKind kind, std::span<const uint8_t> body, Clock::time_point deadline) = 0;
  // The next message. `storage`, when given, is a buffer whose allocation the body reuses (a
  // previous message's body handed back): a receiver of large frames then takes no fresh pages
  // per message. Its contents are replaced.
  virtual Result<Message> Receive(Clock::time_point deadline, ByteBuffer* storage = nullptr) = 0;
  // Receive refuses (kOutOfRange, closing the connection) a message announcing more than this,
  // before reading its body; a node narrows it to what the next message may hold. Starts at the
  // transport's max_message_bytes.
  virtual void set_max_message_bytes(uint64_t bytes) = 0;
  virtual void Close() = 0;
  virtual std::string peer() const = 0;
};

class Listener {
 public:
  virtual ~Listener() = default;
  virtual Result<std::unique_ptr<Connection>> Accept(Clock::time_point deadline) = 0;
  virtual uint16_t port() const = 0;  // the bound port (useful after listening on port 0)
  virtual void Close() = 0;           // wakes a blocked Accept
};

// A token bucket for machines without network namespaces: every byte sent through transports
// sharing it waits its turn at `gbps`, as one shaped link would make it.
class LinkShaper {
 public:
  explicit LinkShaper(double gbps, uint64_t burst_bytes = 1 << 20);
  // Blocks until `bytes` may go on the link.
  void Take(uint64_t bytes);
  // The same for bytes that began to cross at `started` (a pool value copied meanwhile): the
  // time since counts as link time, as on a wire the copy overlaps the bytes' arrival.
  void Take(uint64_t bytes, Clock::time_point started);
  double gbps() const { return gbps_; }

 private:
  double gbps_, bytes_per_second_;
  double burst_;
  std::mutex mu_;
  Clock::time_point next_;  // when the link is free of what was taken so far
};

struct TcpOptions {
  LinkShaper* shaper = nullptr;            // shared by every connection of the transport; null: off
  uint64_t max_message_bytes = 1ull << 32;  // a peer announcing more is refused before allocating
  // Test seam: extra sending time per body byte, an overhead the benchmark's calibration must
  // catch (bench e2e --inject-send-delay-ns). 0 in every real use.
  double send_delay_s_per_byte = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // "host:port"; port 0 listens on a free port.
  virtual Result<std::unique_ptr<Listener>> Listen(const std::string& address) = 0;
  virtual Result<std::unique_ptr<Connection>> Connect(const std::string& address, Clock::time_point deadline) = 0;
};

// TCP on standalone asio: each message is a 16-byte header (magic "KVSM", kind, length) and the
// body; TCP_NODELAY, so the last layer of a request is not held back.
std::unique_ptr<Transport> MakeTcpTransport(const TcpOptions& opts = {});

// UCX: UCP tagged messages — shared memory (posix, sysv, cma) between processes on one machine,
// RDMA between machines, as NIXL and Mooncake run — with TCP's framing, limits, deadlines and
// failure semantics; a TCP side channel swaps worker addresses and tells when a peer is gone.
// `opts.shaper` paces it too. kUnsupported in a build without libucx, saying so.
Result<std::unique_ptr<Transport>> MakeUcxTransport(const TcpOptions& opts = {});
bool UcxAvailable();  // whether this build has the UCX transport
// By name: "tcp" (the default everywhere) or "ucx".
Result<std::unique_ptr<Transport>> MakeTransport(const std::string& name, const TcpOptions& opts = {});
std::vector<std::string> TransportNames();

// "host:port" with a port in [0, 65535]; errors name the text.
Status ParseHostPort(const std::string& address, std::string* host, uint16_t* port);

}  // namespace kvserve
