// The serving testbed as separate machines: node processes of the kvserve CLI (router, prefill,
// decode), each pinned to its own core, optionally in two network namespaces joined by a veth
// the kernel shapes (tc tbf, scripts/netns-link.sh); and the driver that offers a request list
// at its arrival times to whatever serves it (docs/SERVING.md, "The testbed").
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvserve/serve.h"

namespace kvserve {

// ---- The driver --------------------------------------------------------------------------------

using ServeFn = std::function<Result<ServeResponse>(const ServeRequest&)>;

// Offers requests[i] at arrivals_s[i] seconds from now (sorted), each on its own thread, and
// returns the answers in order. A response's timings.total_s is the request's job completion time
// from its scheduled arrival to the answer (a thread the driver starts a little late does not
// shorten it); a first_token_s the node gave is moved by as much. The serve function runs on those threads; it may be called concurrently.
std::vector<Result<ServeResponse>> DriveArrivals(const ServeFn& serve, const std::vector<ServeRequest>& requests,
                                                 const std::vector<double>& arrivals_s);

// A node's /generate answer (ServeResponseJson) back into a ServeResponse: ids, strategy,
// byte counts, timings and the pool fields. Every field is checked (kCorrupt naming it).
Result<ServeResponse> ServeResponseFromJson(std::string_view body);

// ---- Processes and namespaces ---------------------------------------------------------------

// Enters network namespace `name` (/var/run/netns/NAME, as `ip netns` makes them) for the calling
// thread until destroyed, then returns it to the namespace it was in. Sockets made meanwhile stay
// in `name`. Empty: stays where it is. Needs CAP_SYS_ADMIN.
class ScopedNetns {
 public:
  static Result<std::unique_ptr<ScopedNetns>> Enter(const std::string& name);
  ~ScopedNetns();
  ScopedNetns(const ScopedNetns&) = delete;
  ScopedNetns& operator=(const ScopedNetns&) = delete;

 private:
  ScopedNetns() = default;
  int saved_fd_ = -1;
};

struct ChildSpec {
  std::string name;               // for messages: "decode", "prefill", "router"
  std::vector<std::string> argv;  // argv[0]: the executable's path, or a name in /usr/bin and the like
  int cpu = -1;                   // pinned to this core (-1: not pinned)
  std::string netns;              // started in this network namespace ("": this one)
  double ready_timeout_s = 120;   // until it prints "listening on HOST:PORT"
  // A child that does not print where it listens (redis-server): the text that says it is
  // ready, and the address it was told to listen on.
  std::string ready_text = {}, address = {};
};

// A node process. Start returns once the child printed "... listening on HOST:PORT" (or the
// spec's ready_text) on stdout (its stderr is the caller's). The child gets SIGKILL if the
// thread that started it exits (PR_SET_PDEATHSIG), so start children from a thread that
// outlives them (the main thread).
class ChildProcess {
 public:
  static Result<std::unique_ptr<ChildProcess>> Start(const ChildSpec& spec);
  ~ChildProcess();  // Stop()
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  const std::string& name() const { return spec_.name; }
  const std::string& address() const { return address_; }  // HOST:PORT it printed
  pid_t pid() const { return pid_; }
  int cpu() const { return spec_.cpu; }
  // Whether it still runs (reaps it when it has ended).
  bool Alive();
  // SIGTERM, SIGKILL after `grace_s`, reaped. Idempotent and safe from any thread.
  void Stop(double grace_s = 5);

 private:
  ChildProcess() = default;
  ChildSpec spec_;
  std::string address_;
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::thread drain_;  // reads the child's stdout after the ready line, so it never blocks
  std::mutex mu_;
  bool reaped_ = false;
};

// Two network namespaces PREFIX-a (10.77.0.1) and PREFIX-b (10.77.0.2) joined by a veth pair
// whose ends the kernel shapes to `gbps` (tbf; 0: not rate-shaped, what the veth carries), made
// and removed by scripts/netns-link.sh.
class NetnsLink {
 public:
  static constexpr const char* kSenderIp = "10.77.0.1";
  static constexpr const char* kReceiverIp = "10.77.0.2";
  // Exit code 77 of the script (no privilege, or no way to enter a namespace) is kUnavailable
  // with its reason; any other failure kIoError. A link of this prefix left by a killed run is
  // replaced.
  static Result<std::unique_ptr<NetnsLink>> Up(const std::string& script, const std::string& prefix, double gbps);
  ~NetnsLink();  // Down()
  NetnsLink(const NetnsLink&) = delete;
  NetnsLink& operator=(const NetnsLink&) = delete;
  std::string sender() const { return prefix_ + "-a"; }
  std::string receiver() const { return prefix_ + "-b"; }
  double gbps() const { return gbps_; }
  // Removes both namespaces (and so the veth). Idempotent and safe from any thread.
  void Down();
  // The same for a link this object does not hold (one a run was making when it was stopped).
  static void Remove(const std::string& script, const std::string& prefix);

 private:
  NetnsLink() = default;
  std::string script_, prefix_;
  double gbps_ = 0;
  std::mutex mu_;
  bool up_ = false;
};

// Which namespaces exist whose names start with `prefix` + "-" (`ip netns list`).
std::vector<std::string> NetnsWithPrefix(const std::string& prefix);

// ---- The process testbed ----------------------------------------------------------------------

struct ProcessTestbedOptions {
  std::string kvserve;  // the CLI binary the nodes run
  std::string mode = "pd";  // pd: decode, prefill, router | pool: the pool's server, a pool node, router
  std::string kv_shape = "llama3-8b", gpu = "h100";
  // Prompt lengths made ready at start: the prefill node synthesizes their KV, the decode node
  // allocates and writes their request buffers.
  std::vector<uint32_t> prepare_tokens;
  std::string profile;                   // the prefill node's controller; empty: `strategy`
  std::string strategy = "none";
  double gbps = 10;  // link rate: the kernel's (netns) or the prefill node's token bucket (shaper)
  std::string link = "shaper";  // shaper | netns
  std::string netns_script;     // scripts/netns-link.sh (link netns)
  std::string netns_prefix = "kvb";
  int threads = 1;  // codec threads per node
  int cpu_prefill = -1, cpu_decode = -1, cpu_router = -1;
  double timeout_s = 600;
  double send_delay_ns = 0;  // test seam: the prefill node's extra sending time per byte
  std::string transport = "tcp";  // between prefill and decode: tcp | ucx
  // mode pool. Backend "embedded": the pool lives in the pool node, whose token bucket paces
  // its traffic (link shaper only). "redis": a redis-server process of its own (on the decode
  // node's core; with link netns in the receiver namespace, so pool traffic crosses the veth).
  std::string pool_backend = "embedded";
  std::string redis_server = "redis-server";
  std::string pool_policy = "none";  // the pool node's --policy; adaptive takes `profile`
  uint32_t chunk_tokens = 256;
  uint64_t pool_capacity_mib = 8192;
};

// A decode node, a prefill node and a router as processes, started in that order (each given the
// address the previous printed); with link netns the decode node runs in the link's receiver
// namespace and the prefill node and router in its sender namespace, so KV crosses the shaped
// veth. In pool mode: the pool's server (redis backend) where the decode node would be, a pool
// node where the prefill node would be, and the router. Requests go to the router's HTTP
// /generate; a client must be in client_netns() to reach it. Stop (or destruction) stops every
// process and removes the namespaces, whatever state they are in.
class ProcessTestbed {
 public:
  static Result<std::unique_ptr<ProcessTestbed>> Start(const ProcessTestbedOptions& o);
  ~ProcessTestbed();  // Stop()
  const std::string& router_address() const { return router_->address(); }
  std::string client_netns() const { return link_ ? link_->sender() : ""; }
  ChildProcess* decode() { return decode_.get(); }
  ChildProcess* prefill() { return prefill_.get(); }
  ChildProcess* router() { return router_.get(); }
  ChildProcess* pool_node() { return pool_node_.get(); }
  ChildProcess* pool_server() { return pool_server_.get(); }  // redis-server (pool mode, backend redis)
  std::vector<pid_t> pids() const;
  // Every process stopped and reaped, the namespaces removed. Idempotent; safe from another
  // thread (a signal handler's thread) while requests are in flight.
  void Stop();

 private:
  ProcessTestbed() = default;
  Status StartPd(const ProcessTestbedOptions& o, const std::string& gbps, const std::string& here, const std::string& timeout);
  Status StartPool(const ProcessTestbedOptions& o, const std::string& gbps, const std::string& here);
  std::unique_ptr<NetnsLink> link_;
  std::unique_ptr<ChildProcess> decode_, prefill_, router_, pool_node_, pool_server_;
};

// A TCP port on 127.0.0.1 that was free a moment ago (for a server that cannot be told port 0).
Result<uint16_t> FreeLoopbackPort();

// `bench link --compare`: each transport between two processes of this machine in one run. A
// receiver process (`cli bench link --listen 127.0.0.1:0 --transport T`) takes `total_mib` in
// messages of each size after one untimed message, and confirms the count; transports alternate
// within each repeat. Then small messages' round trips (the receiver echoes them), and a memcpy
// of the same bytes as the baseline.
struct LinkCompareOptions {
  std::string cli;  // the kvserve executable that runs the receivers
  std::vector<std::string> transports = {"tcp", "ucx"};
  std::vector<uint32_t> message_mib = {4, 16, 64};
  uint32_t total_mib = 512;
  int repeats = 3;
  uint32_t pingpong_kib = 64;
  int pingpongs = 200;
  int receiver_cpu = -1;  // pin the receiver (-1: not pinned)
};
struct LinkComparePoint {
  std::string transport;
  uint32_t message_mib = 0;
  std::vector<double> gbps;  // one per repeat
  double median_gbps() const;
};
struct LinkCompareResult {
  std::vector<LinkComparePoint> points;
  std::vector<std::pair<std::string, std::vector<double>>> round_trip_us;  // per transport
  double memcpy_gbps = 0;
};
Result<LinkCompareResult> CompareLinks(const LinkCompareOptions& opts, const std::function<void(const std::string&)>& progress = nullptr);
// The result as JSON text (points with median, min, max; round-trip median, p10, p90).
std::string LinkCompareJson(const LinkCompareOptions& opts, const LinkCompareResult& r);

}  // namespace kvserve
