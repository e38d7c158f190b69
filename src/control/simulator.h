// Internal: the controller's offline test bench — bandwidth traces, workloads and drift from CSV
// and flags, and the shared-link / codec-worker simulation that replays a policy over them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvserve/controller.h"

namespace kvserve {

// ---- Simulator --------------------------------------------------------------------------------------
struct TracePoint {
  double t = 0, gbps = 0;  // link bandwidth from t on (gigabits per second)
};
Result<std::vector<TracePoint>> ParseTrace(std::string_view csv, std::string_view origin = "trace");
Result<std::vector<TracePoint>> LoadTrace(const std::string& path);
double TraceBandwidthGbps(const std::vector<TracePoint>& trace, double t);

struct WorkloadRequest {
  double arrival = 0;
  uint32_t prompt_tokens = 0;
  std::string label;
  double slo_ms = 0, floor = 0;
};
Result<std::vector<WorkloadRequest>> ParseWorkload(std::string_view csv, std::string_view origin = "workload");
Result<std::vector<WorkloadRequest>> LoadWorkload(const std::string& path);

struct Drift {
  double codec_slowdown = 1.0, codec_at = 0;  // codec this much slower than profiled from codec_at
  double link_slowdown = 1.0, link_at = 0;    // link this much slower than the trace says from link_at
  bool any() const { return codec_slowdown != 1.0 || link_slowdown != 1.0; }
  double at() const;
};
Result<Drift> ParseDrift(const std::vector<std::string>& specs);  // "codec:1.5@20", "link:2@30"

struct SimOptions {
  double kv_bytes_per_token = 131072;  // llama3-8b fp16: 32 layers x 2 x 8 heads x 128 x 2 B
  double prefill_tokens_per_second = 20000;
  double codec_threads = 1;            // codec speed multiplier (workers per side)
  Drift drift;
  ControllerOptions controller;
  bool explain = false;                // collect one explanation line per request
};

struct PolicyReport {
  std::string policy;
  double mean_ms = 0, p50_ms = 0, p99_ms = 0, slo_attainment = 0;
  uint32_t floor_violations = 0, requests = 0;
  int64_t recovery_requests = -1;  // after the drift; -1: no drift or never
  std::vector<std::pair<std::string, uint32_t>> choices;  // strategy name -> requests
  std::vector<std::string> explanations;
  std::vector<double> latencies_ms;
};

// policy: "adaptive" (MA + cooldown + bandit), "adaptive-ma" (MA + cooldown), "oracle", "none",
// or "static:SPEC" (SPEC when it meets the request's floor, else none).
Result<PolicyReport> Simulate(const std::vector<StrategyCost>& strategies, const std::vector<TracePoint>& trace,
                              const std::vector<WorkloadRequest>& workload, std::string_view policy,
                              const SimOptions& opts);
}  // namespace kvserve
