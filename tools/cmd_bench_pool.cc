// CLI: `bench pool` — PUT/GET throughput of a pool backend for large values (1–16 MiB, the size
// of compressed prefix chunks), against `redis-benchmark` on the same server in the same run.
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvserve/pool.h"
#include "kvserve/transport.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

struct PoolBenchFlags {
  std::string backend = "embedded", address;
  std::vector<uint32_t> sizes_mib = {1, 4, 16};
  uint32_t count = 32;
  double shape_gbps = 0;
  bool as_json = false;
};

// redis-benchmark's SET and GET requests/s for values of `bytes` (CSV output), or -1 if it is
// not installed or failed.
std::pair<double, double> RedisBenchmark(const std::string& address, uint64_t bytes, uint32_t count) {
  std::string host;
  uint16_t port = 0;
  if (!ParseHostPort(address, &host, &port).ok()) return {-1, -1};
  const std::string cmd = "timeout 120 redis-benchmark -h " + host + " -p " + std::to_string(port) + " -t set,get -n " +
                          std::to_string(count) + " -c 1 -d " + std::to_string(bytes) + " --csv 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return {-1, -1};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  double set = -1, get = -1;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    // "SET","12345.67",...
    const size_t a = line.find("\",\"");
    if (a == std::string::npos) continue;
    const double rps = std::atof(line.c_str() + a + 3);
    if (line.rfind("\"SET\"", 0) == 0) set = rps;
    if (line.rfind("\"GET\"", 0) == 0) get = rps;
  }
  return {set, get};
}

Status RunPoolBench(const PoolBenchFlags& f) {
  std::unique_ptr<KvPool> pool;
  if (f.backend == "embedded") {
    pool = MakeEmbeddedPool();
  } else {
    if (f.address.empty()) return Status::InvalidArgument("--backend " + f.backend + " needs --pool-address HOST:PORT");
    RedisPoolOptions o;
    o.address = f.address;
    o.cluster = f.backend == "redis-cluster";
    o.timeout_s = 30;
    KV_ASSIGN_OR_RETURN(pool, MakeRedisPool(o));
  }
  std::unique_ptr<LinkShaper> shaper;
  if (f.shape_gbps > 0) shaper = std::make_unique<LinkShaper>(f.shape_gbps);
  json rows = json::array();
  for (uint32_t mib : f.sizes_mib) {
    KV_RETURN_IF_ERROR(pool->Clear());
    ByteBuffer value(size_t(mib) << 20);
    for (size_t i = 0; i < value.size(); ++i) value[i] = uint8_t(i * 2654435761u >> 13);
    auto t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < f.count; ++i) {
      if (shaper) shaper->Take(value.size());
      KV_RETURN_IF_ERROR(pool->Put("kvs:{bench}:" + std::to_string(i), value));
    }
    const double put_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    t0 = std::chrono::steady_clock::now();
    for (uint32_t i = 0; i < f.count; ++i) {
      KV_ASSIGN_OR_RETURN(auto v, pool->Get("kvs:{bench}:" + std::to_string(i)));
      if (!v || v->size() != value.size()) return Status::Internal("bench pool: value " + std::to_string(i) + " did not come back whole");
      if (shaper) shaper->Take(v->size());
    }
    const double get_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double bytes = double(value.size()) * f.count;
    json row = {{"value_mib", mib}, {"count", f.count}, {"put_gbps", bytes * 8 / put_s / 1e9}, {"get_gbps", bytes * 8 / get_s / 1e9}};
    if (f.backend == "redis" && !shaper) {
      const auto [set_rps, get_rps] = RedisBenchmark(f.address, value.size(), f.count);
      if (set_rps > 0) row["redis_benchmark_set_gbps"] = set_rps * value.size() * 8 / 1e9;
      if (get_rps > 0) row["redis_benchmark_get_gbps"] = get_rps * value.size() * 8 / 1e9;
    }
    rows.push_back(row);
  }
  KV_RETURN_IF_ERROR(pool->Clear());
  const json out = {{"backend", pool->name()}, {"shape_gbps", f.shape_gbps}, {"rows", rows},
                    {"note", "one client thread, values written then read back; redis-benchmark: -c 1, same server, same run"}};
  if (f.as_json) {
    std::printf("%s\n", out.dump(1).c_str());
    return Status::Ok();
  }
  std::printf("pool %s%s: %u values per size, one client\n", pool->name().c_str(),
              f.shape_gbps > 0 ? (" through a " + json(f.shape_gbps).dump() + " Gbit/s shaper").c_str() : "", f.count);
  std::printf("%9s %10s %10s %18s %18s\n", "value MiB", "PUT Gbit/s", "GET Gbit/s", "redis-bench SET", "redis-bench GET");
  for (const json& r : rows) {
    std::printf("%9u %10.2f %10.2f %18s %18s\n", r["value_mib"].get<uint32_t>(), r["put_gbps"].get<double>(), r["get_gbps"].get<double>(),
                r.contains("redis_benchmark_set_gbps") ? json(r["redis_benchmark_set_gbps"].get<double>()).dump().substr(0, 6).c_str() : "-",
                r.contains("redis_benchmark_get_gbps") ? json(r["redis_benchmark_get_gbps"].get<double>()).dump().substr(0, 6).c_str() : "-");
  }
  return Status::Ok();
}

}  // namespace

void AddBenchPoolCommand(CLI::App& bench) {
  auto* c = bench.add_subcommand("pool", "PUT/GET throughput of a pool backend for large values (vs redis-benchmark)");
  auto f = std::make_shared<PoolBenchFlags>();
  c->add_option("--backend", f->backend, "embedded | redis | redis-cluster")->capture_default_str()
      ->check(CLI::IsMember({"embedded", "redis", "redis-cluster"}));
  c->add_option("--pool-address", f->address, "HOST:PORT of the Redis server (or a cluster node)");
  c->add_option("--sizes-mib", f->sizes_mib, "value sizes")->delimiter(',')->capture_default_str()->check(InRange(1, 512));
  c->add_option("--count", f->count, "values per size")->capture_default_str()->check(InRange(1, 100000));
  c->add_option("--shape-gbps", f->shape_gbps, "pace through the in-process token bucket (0: off)")->capture_default_str()->check(InRange(0, 1e4));
  c->add_flag("--json", f->as_json, "machine-readable output");
  SetAction(c, [=]() { return RunPoolBench(*f); });
}

}  // namespace kvserve::cli
