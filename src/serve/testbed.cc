// The testbed's machinery: the arrival driver, node processes pinned to cores and placed in
// network namespaces, the kernel-shaped link between two namespaces, and the process testbed.
#include "kvserve/testbed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <future>

namespace kvserve {

using Clock = std::chrono::steady_clock;

std::vector<Result<ServeResponse>> DriveArrivals(const ServeFn& serve, const std::vector<ServeRequest>& requests,
                                                 const std::vector<double>& arrivals_s) {
  std::vector<std::future<Result<ServeResponse>>> futures;
  const auto start = Clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    const double at = i < arrivals_s.size() ? arrivals_s[i] : 0;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(at)));
    futures.push_back(std::async(std::launch::async, [&serve, &requests, start, at, i] {
      auto out = serve(requests[i]);
      if (out.ok()) {
        StageTimings& t = out->timings;
        const double jct = std::chrono::duration<double>(Clock::now() - start).count() - at;
        // The same lateness and client overhead; a pool node stores after its total, before it answers.
        if (t.first_token_s > 0) t.first_token_s += jct - t.total_s - t.store_s;
        t.total_s = jct;
      }
      return out;
    }));
  }
  std::vector<Result<ServeResponse>> answers;
  for (auto& f : futures) answers.push_back(f.get());
  return answers;
}

// ---- ScopedNetns ---------------------------------------------------------------------------------

Result<std::unique_ptr<ScopedNetns>> ScopedNetns::Enter(const std::string& name) {
  std::unique_ptr<ScopedNetns> s(new ScopedNetns());
  if (name.empty()) return s;
  s->saved_fd_ = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  if (s->saved_fd_ < 0) return Status::IoError("cannot open this thread's network namespace: " + std::string(strerror(errno)));
  const std::string path = "/var/run/netns/" + name;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotFound("network namespace '" + name + "' (" + path + "): " + strerror(errno));
  const int rc = ::setns(fd, CLONE_NEWNET);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Status::Unavailable("cannot enter network namespace '" + name + "': " + strerror(err));
  return s;
}

ScopedNetns::~ScopedNetns() {
  if (saved_fd_ < 0) return;
  (void)::setns(saved_fd_, CLONE_NEWNET);
  ::close(saved_fd_);
}

// ---- ChildProcess --------------------------------------------------------------------------------

Result<std::unique_ptr<ChildProcess>> ChildProcess::Start(const ChildSpec& spec) {
  if (spec.argv.empty()) return Status::InvalidArgument("child '" + spec.name + "': no executable");
  std::unique_ptr<ChildProcess> c(new ChildProcess());
  c->spec_ = spec;
  // A bare name ("redis-server") is looked up in the system's program directories (not $PATH:
  // library code reads no environment; a caller that wants $PATH resolves the name itself).
  if (c->spec_.argv[0].find('/') == std::string::npos) {
    std::string found;
    for (const char* dir : {"/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"}) {
      const std::string candidate = std::string(dir) + "/" + c->spec_.argv[0];
      if (::access(candidate.c_str(), X_OK) == 0) {
        found = candidate;
        break;
      }
    }
    if (found.empty()) {
      return Status::NotFound("child '" + spec.name + "': '" + spec.argv[0] + "' is in none of /usr/local/sbin, /usr/local/bin, "
                              "/usr/sbin, /usr/bin, /sbin, /bin (give its path)");
    }
    c->spec_.argv[0] = found;
  }
  // Everything the child needs is made before fork: after it, only async-signal-safe calls.
  std::vector<char*> argv;
  for (const std::string& a : c->spec_.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int ns_fd = -1;
  if (!spec.netns.empty()) {
    const std::string path = "/var/run/netns/" + spec.netns;
    ns_fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (ns_fd < 0) return Status::NotFound("child '" + spec.name + "': network namespace " + path + ": " + strerror(errno));
  }
  if (spec.cpu >= CPU_SETSIZE) return Status::InvalidArgument("child '" + spec.name + "': cpu " + std::to_string(spec.cpu));
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  if (spec.cpu >= 0) CPU_SET(spec.cpu, &cpus);
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) {
    if (ns_fd >= 0) ::close(ns_fd);
    return Status::IoError("child '" + spec.name + "': pipe: " + strerror(errno));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::close(out[0]), ::close(out[1]);
    if (ns_fd >= 0) ::close(ns_fd);
    return Status::Unavailable("child '" + spec.name + "': fork: " + strerror(err));
  }
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);  // the parent died before the line above
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the parent may block SIGTERM for its own use
    if (ns_fd >= 0 && ::setns(ns_fd, CLONE_NEWNET) != 0) ::_exit(125);
    if (spec.cpu >= 0 && ::sched_setaffinity(0, sizeof cpus, &cpus) != 0) ::_exit(124);
    ::dup2(out[1], 1);  // dup2 clears close-on-exec on the copy
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  if (ns_fd >= 0) ::close(ns_fd);
  ::close(out[1]);
  c->pid_ = pid;
  c->out_fd_ = out[0];
  // Its first line that says where it listens (or that it is ready), within the deadline.
  std::string text;
  const std::string ready = spec.ready_text.empty() ? "listening on " : spec.ready_text;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(spec.ready_timeout_s));
  while (true) {
    const size_t at = text.find(ready);
    const size_t eol = at == std::string::npos ? std::string::npos : text.find('\n', at);
    if (eol != std::string::npos) {
      c->address_ = spec.address.empty() ? text.substr(at + ready.size(), eol - at - ready.size()) : spec.address;
      break;
    }
    const int left_ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
    pollfd pfd{c->out_fd_, POLLIN, 0};
    char buf[512];
    ssize_t n = 0;
    const int polled = left_ms <= 0 ? 0 : ::poll(&pfd, 1, left_ms);
    if (polled < 0 && errno == EINTR) continue;  // a signal, not the child
    if (polled > 0) n = ::read(c->out_fd_, buf, sizeof buf);
    if (polled <= 0 || n <= 0) {
      // No line in time, or its stdout closed: it exited (a bad flag, a port in use) or hangs.
      const std::string said = spec.ready_text.empty() ? "say where it listens" : "say '" + spec.ready_text + "'";
      const std::string why = polled <= 0 ? "did not " + said + " within " + std::to_string(int(spec.ready_timeout_s)) + " s"
                                          : "exited before listening";
      c->Stop(0);
      return Status::Unavailable("child '" + spec.name + "' (" + spec.argv[0] + ") " + why +
                                 (text.empty() ? "" : "; its output: " + text.substr(text.size() > 400 ? text.size() - 400 : 0)) + " (its stderr is above)");
    }
    text.append(buf, size_t(n));
  }
  const int fd = c->out_fd_;
  c->drain_ = std::thread([fd] {
    char buf[4096];
    while (::read(fd, buf, sizeof buf) > 0) {
    }
  });
  return c;
}

bool ChildProcess::Alive() {
  std::lock_guard<std::mutex> lock(mu_);
  if (reaped_ || pid_ <= 0) return false;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == pid_) {
    reaped_ = true;
    return false;
  }
  return true;
}

void ChildProcess::Stop(double grace_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGTERM);
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(grace_s));
      int status = 0;
      while (::waitpid(pid_, &status, WNOHANG) == 0) {
        if (Clock::now() >= deadline) {
          ::kill(pid_, SIGKILL);
          ::waitpid(pid_, &status, 0);
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      reaped_ = true;
    }
  }
  if (drain_.joinable() && drain_.get_id() != std::this_thread::get_id()) drain_.join();  // EOF: the child is gone
  std::lock_guard<std::mutex> lock(mu_);
  if (out_fd_ >= 0) ::close(out_fd_), out_fd_ = -1;
}

ChildProcess::~ChildProcess() { Stop(); }

// ---- NetnsLink ----------------------------------------------------------------------------------

namespace {

// Runs a shell command line; its exit code and its output (stdout and stderr together).
std::pair<int, std::string> RunShell(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "cannot run a shell: " + std::string(strerror(errno))};
  std::string out;
  char buf[1024];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// One netns-link.sh at a time in this process: a removal asked for while a link is being made
// (Ctrl-C's thread during a run's start) waits for it, so it does not run first and leave the
// namespaces the making then creates.
std::mutex& NetnsScriptMutex() {
  static std::mutex mu;
  return mu;
}

bool SafeName(const std::string& s) {
  if (s.empty() || s.size() > 11) return false;  // interface names PREFIX-va fit in IFNAMSIZ
  for (char ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) return false;
  return true;
}

}  // namespace

Result<std::unique_ptr<NetnsLink>> NetnsLink::Up(const std::string& script, const std::string& prefix, double gbps) {
  if (!SafeName(prefix)) return Status::InvalidArgument("netns prefix '" + prefix + "': 1 to 11 letters or digits");
  if (!(gbps >= 0 && gbps < 1e5)) return Status::InvalidArgument("netns link rate " + std::to_string(gbps) + " Gbit/s (0: not rate-shaped)");
  if (::access(script.c_str(), R_OK) != 0) return Status::NotFound("netns link script '" + script + "': " + strerror(errno));
  std::unique_ptr<NetnsLink> l(new NetnsLink());
  l->script_ = script, l->prefix_ = prefix, l->gbps_ = gbps;
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.6g", gbps);
  std::unique_lock<std::mutex> one_script(NetnsScriptMutex());
  auto [code, out] = RunShell("KVSERVE_NETNS_PREFIX=" + prefix + " bash '" + script + "' up " + rate);
  one_script.unlock();
  if (code == 77) return Status::Unavailable("kernel-shaped link: " + out.substr(0, out.find_last_not_of('\n') + 1));
  l->up_ = true;  // whatever part of it exists is removed from here on
  if (code != 0) return Status::IoError("netns-link.sh up " + std::string(rate) + " failed (exit " + std::to_string(code) + "): " + out);
  return l;
}

void NetnsLink::Remove(const std::string& script, const std::string& prefix) {
  if (!SafeName(prefix)) return;
  std::lock_guard<std::mutex> one_script(NetnsScriptMutex());
  RunShell("KVSERVE_NETNS_PREFIX=" + prefix + " bash '" + script + "' down");
}

void NetnsLink::Down() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!up_) return;
  Remove(script_, prefix_);
  up_ = false;
}

NetnsLink::~NetnsLink() { Down(); }

std::vector<std::string> NetnsWithPrefix(const std::string& prefix) {
  std::vector<std::string> out;
  auto [code, text] = RunShell("ip netns list");
  if (code != 0) return out;
  size_t at = 0;
  while (at < text.size()) {
    size_t eol = text.find('\n', at);
    if (eol == std::string::npos) eol = text.size();
    const std::string line = text.substr(at, eol - at);
    const std::string name = line.substr(0, line.find(' '));
    if (name.rfind(prefix + "-", 0) == 0) out.push_back(name);
    at = eol + 1;
  }
  return out;
}

// ---- ProcessTestbed -------------------------------------------------------------------------------

namespace {
// "4096,512": a flag's list of token counts.
std::string CommaList(const std::vector<uint32_t>& v) {
  std::string out;
  for (uint32_t n : v) out += (out.empty() ? "" : ",") + std::to_string(n);
  return out;
}
}  // namespace

Result<std::unique_ptr<ProcessTestbed>> ProcessTestbed::Start(const ProcessTestbedOptions& o) {
  if (o.link != "shaper" && o.link != "netns") return Status::InvalidArgument("link '" + o.link + "': shaper | netns");
  if (o.mode != "pd" && o.mode != "pool") return Status::InvalidArgument("process testbed mode '" + o.mode + "': pd | pool");
  if (o.kvserve.empty()) return Status::InvalidArgument("process testbed: no kvserve binary to run the nodes");
  std::unique_ptr<ProcessTestbed> t(new ProcessTestbed());
  if (o.link == "netns") {
    KV_ASSIGN_OR_RETURN(t->link_, NetnsLink::Up(o.netns_script, o.netns_prefix, o.gbps));
  }
  const std::string timeout = std::to_string(o.timeout_s);
  char gbps[64];
  std::snprintf(gbps, sizeof gbps, "%.6g", o.gbps);
  const std::string here = "127.0.0.1:0";
  KV_RETURN_IF_ERROR(o.mode == "pool" ? t->StartPool(o, gbps, here) : t->StartPd(o, gbps, here, timeout));
  // The router, in front of the node that takes requests.
  const ChildProcess* front = t->pool_node_ ? t->pool_node_.get() : t->prefill_.get();
  KV_ASSIGN_OR_RETURN(t->router_, ChildProcess::Start({"router",
                                                       {o.kvserve, "serve", "router", "--listen", here, "--peer", front->address(),
                                                        "--timeout", timeout, "--log-level", "quiet"},
                                                       o.cpu_router,
                                                       t->client_netns()}));
  return t;
}

// The decode node (in the link's receiver namespace), then the prefill node sending to it.
Status ProcessTestbed::StartPd(const ProcessTestbedOptions& o, const std::string& gbps, const std::string& here,
                               const std::string& timeout) {
  ChildSpec decode{"decode",
                   {o.kvserve, "serve", "decode", "--kv-shape", o.kv_shape, "--gpu", o.gpu, "--listen",
                    link_ ? std::string(NetnsLink::kReceiverIp) + ":0" : here, "--timeout", timeout, "--log-level", "quiet",
                    "--transport", o.transport},
                   o.cpu_decode,
                   link_ ? link_->receiver() : ""};
  const std::string prepare = CommaList(o.prepare_tokens);
  // Four request buffers for the longest prompt (the decode node keeps four; shorter prompts
  // reshape them), so requests in flight together find theirs ready too.
  if (!o.prepare_tokens.empty()) {
    const uint32_t longest = *std::max_element(o.prepare_tokens.begin(), o.prepare_tokens.end());
    decode.argv.insert(decode.argv.end(), {"--prepare-tokens", CommaList(std::vector<uint32_t>(4, longest))});
  }
  KV_ASSIGN_OR_RETURN(decode_, ChildProcess::Start(decode));
  std::vector<std::string> prefill_argv = {o.kvserve, "serve", "prefill", "--kv-shape", o.kv_shape, "--gpu", o.gpu,
                                           "--listen", here, "--peer", decode_->address(), "--assume-gbps", gbps,
                                           "--timeout", timeout, "--threads", std::to_string(o.threads), "--log-level", "quiet",
                                           "--transport", o.transport};
  if (!prepare.empty()) prefill_argv.insert(prefill_argv.end(), {"--prepare-tokens", prepare});
  if (!o.profile.empty()) {
    prefill_argv.insert(prefill_argv.end(), {"--profile", o.profile});
  } else {
    prefill_argv.insert(prefill_argv.end(), {"--strategy", o.strategy});
  }
  if (!link_) prefill_argv.insert(prefill_argv.end(), {"--shape-gbps", gbps});
  if (o.send_delay_ns > 0) prefill_argv.insert(prefill_argv.end(), {"--inject-send-delay-ns", std::to_string(o.send_delay_ns)});
  KV_ASSIGN_OR_RETURN(prefill_, ChildProcess::Start({"prefill", prefill_argv, o.cpu_prefill, client_netns()}));
  return Status::Ok();
}

// The pool's server (redis), then the pool node. With link netns the server is alone in
// the receiver namespace, so every byte to and from the pool crosses the shaped veth; otherwise
// the pool node's token bucket paces its pool traffic.
Status ProcessTestbed::StartPool(const ProcessTestbedOptions& o, const std::string& gbps, const std::string& here) {
  if (o.pool_backend != "embedded" && o.pool_backend != "redis") {
    return Status::InvalidArgument("process testbed pool backend '" + o.pool_backend + "': embedded | redis");
  }
  if (o.pool_backend == "embedded" && link_) {
    return Status::InvalidArgument("an embedded pool lives in the pool node: no link between namespaces to shape (link shaper)");
  }
  std::string pool = "embedded";
  if (o.pool_backend == "redis") {
    std::string ip = "127.0.0.1";
    uint16_t port = 6379;  // the receiver namespace is new: nothing else listens there
    if (link_) {
      ip = NetnsLink::kReceiverIp;
    } else {
      KV_ASSIGN_OR_RETURN(port, FreeLoopbackPort());
    }
    const std::string address = ip + ":" + std::to_string(port);
    ChildSpec redis{"redis-server",
                    {o.redis_server, "--bind", ip, "--port", std::to_string(port), "--save", "", "--appendonly", "no",
                     "--dir", "/tmp", "--daemonize", "no", "--protected-mode", "no", "--logfile", "", "--loglevel", "notice",
                     "--maxmemory", std::to_string(o.pool_capacity_mib) + "mb", "--maxmemory-policy", "allkeys-lru"},
                    o.cpu_decode,
                    link_ ? link_->receiver() : "",
                    30,
                    "Ready to accept connections",
                    address};
    KV_ASSIGN_OR_RETURN(pool_server_, ChildProcess::Start(redis));
    pool = "redis://" + address;
  }
  std::vector<std::string> argv = {o.kvserve, "serve", "pool", "--kv-shape", o.kv_shape, "--gpu", o.gpu, "--listen", here,
                                   "--pool", pool, "--policy", o.pool_policy, "--chunk-tokens", std::to_string(o.chunk_tokens),
                                   "--capacity-mib", std::to_string(o.pool_capacity_mib), "--assume-gbps", gbps,
                                   "--threads", std::to_string(o.threads), "--log-level", "quiet"};
  if (!o.prepare_tokens.empty()) argv.insert(argv.end(), {"--prepare-tokens", CommaList(o.prepare_tokens)});
  if (!o.profile.empty()) argv.insert(argv.end(), {"--profile", o.profile});
  if (!link_) argv.insert(argv.end(), {"--shape-gbps", gbps});
  KV_ASSIGN_OR_RETURN(pool_node_, ChildProcess::Start({"pool", argv, o.cpu_prefill, client_netns()}));
  return Status::Ok();
}

std::vector<pid_t> ProcessTestbed::pids() const {
  std::vector<pid_t> out;
  for (const auto* c : {router_.get(), prefill_.get(), pool_node_.get(), decode_.get(), pool_server_.get()})
    if (c) out.push_back(c->pid());
  return out;
}

void ProcessTestbed::Stop() {
  // Front to back, so no node sees its peer vanish before its own stop.
  for (ChildProcess* c : {router_.get(), prefill_.get(), pool_node_.get(), decode_.get(), pool_server_.get()})
    if (c) c->Stop();
  if (link_) link_->Down();
}

Result<uint16_t> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::IoError(std::string("socket: ") + strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::IoError(std::string("cannot find a free loopback port: ") + strerror(err));
  return uint16_t(ntohs(a.sin_port));
}

ProcessTestbed::~ProcessTestbed() { Stop(); }

}  // namespace kvserve
