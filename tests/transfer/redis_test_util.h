// Redis servers for tests: started by the test on free loopback ports (no persistence, in a
// temporary folder), stopped and waited for when the object goes — a test leaves none running.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvserve/pool.h"
#include "tools/cli_test_util.h"

namespace kvserve::testing {

// Pool options for a server of these tests: short timeouts and back-off, so failure cases run fast.
inline RedisPoolOptions TestPoolOptions(const std::string& address, bool cluster = false) {
  RedisPoolOptions o;
  o.address = address;
  o.cluster = cluster;
  o.timeout_s = 0.5;
  o.reconnect_backoff_s = 0.05;
  return o;
}

// scripts/setup.sh installs both: a machine without them is set up wrong, and the tests say so.
inline bool HaveRedis() { return Shell("command -v redis-server >/dev/null && command -v redis-cli >/dev/null").code == 0; }

// Binds `port` on loopback (0: the kernel picks) and lets it go: the port, or 0 if taken.
inline int ProbePort(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  int got = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    socklen_t len = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    got = ntohs(a.sin_port);
  }
  close(fd);
  return got;
}
// A port nothing listens on now (the kernel's choice for port 0).
inline int FreePort() { return ProbePort(0); }
// A free port whose cluster bus port (port + 10000) is free too: below the ephemeral range, so
// the bus port stays a valid port.
inline int FreeClusterPort() {
  static std::mt19937 rng{uint32_t(getpid())};
  for (int i = 0; i < 1000; ++i) {
    const int p = 20000 + int(rng() % 20000);
    if (ProbePort(p) == p && ProbePort(p + 10000) == p + 10000) return p;
  }
  return 0;
}

class RedisServer {
 public:
  // `extra`: further redis-server arguments ("--maxmemory", "10mb", ...).
  explicit RedisServer(std::vector<std::string> extra = {}, bool cluster = false) : extra_(std::move(extra)), cluster_(cluster) {
    char tmpl[] = "/tmp/kvserve-redis-XXXXXX";
    dir_ = mkdtemp(tmpl);
    port_ = cluster ? FreeClusterPort() : FreePort();
    Start();
  }
  ~RedisServer() {
    Stop();
    std::filesystem::remove_all(dir_);
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  int port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  bool running() const { return pid_ > 0; }

  // Starts (again, on the same port and folder); waits until it answers PING (at most 10 s).
  bool Start() {
    if (pid_ > 0) return true;
    std::vector<std::string> args = {"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1",
                                     "--save", "", "--appendonly", "no", "--dir", dir_, "--daemonize", "no",
                                     "--loglevel", "warning", "--protected-mode", "no"};
    if (cluster_) {
      for (const char* a : {"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"})
        args.push_back(a);
    }
    args.insert(args.end(), extra_.begin(), extra_.end());
    pid_ = fork();
    if (pid_ == 0) {
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      const std::string log = dir_ + "/redis.log";
      freopen(log.c_str(), "w", stdout);
      freopen(log.c_str(), "a", stderr);
      execvp("redis-server", argv.data());
      _exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      if (Cli("PING").find("PONG") != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  // SIGKILL, as a crash: nothing is flushed or said to clients.
  void Stop() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // redis-cli against this server: its output.
  std::string Cli(const std::string& args) const {
    return Shell("timeout 10 redis-cli -h 127.0.0.1 -p " + std::to_string(port_) + " " + args + " 2>&1").out;
  }

 private:
  std::vector<std::string> extra_;
  bool cluster_;
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// A Redis Cluster of `n` masters, no replicas, made with `redis-cli --cluster create`.
class RedisCluster {
 public:
  explicit RedisCluster(int n = 3) {
    std::string nodes;
    for (int i = 0; i < n; ++i) {
      servers_.push_back(std::make_unique<RedisServer>(std::vector<std::string>{}, true));
      nodes += " " + servers_.back()->address();
    }
    const CliRun r = Shell("timeout 30 redis-cli --cluster create" + nodes + " --cluster-replicas 0 --cluster-yes 2>&1");
    ok_ = r.code == 0;
    for (int i = 0; ok_ && i < 200; ++i) {
      bool all = true;
      for (auto& s : servers_) all &= s->Cli("CLUSTER INFO").find("cluster_state:ok") != std::string::npos;
      if (all) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ok_ = false;
  }
  bool ok() const { return ok_; }
  RedisServer& node(size_t i) { return *servers_[i]; }
  size_t size() const { return servers_.size(); }

 private:
  std::vector<std::unique_ptr<RedisServer>> servers_;
  bool ok_ = false;
};

}  // namespace kvserve::testing
