// libFuzzer target: arbitrary text as a bandwidth trace and as a workload (the controller
// simulator's CSV inputs). Parsing must fail with a message naming the line, or give rows that
// passed validation (finite times that never go back; positive bandwidths, token counts and SLOs).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "control/simulator.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto trace = kvserve::ParseTrace(text, "fuzz");
  if (trace.ok()) {
    for (size_t i = 0; i < trace->size(); ++i) {
      const kvserve::TracePoint& p = (*trace)[i];
      if (!(p.gbps > 0) || !std::isfinite(p.t) || (i > 0 && p.t < (*trace)[i - 1].t)) __builtin_trap();
    }
  }
  auto work = kvserve::ParseWorkload(text, "fuzz");
  if (work.ok()) {
    for (size_t i = 0; i < work->size(); ++i) {
      const kvserve::WorkloadRequest& r = (*work)[i];
      if (!std::isfinite(r.arrival) || r.arrival < 0 || !(r.slo_ms > 0) || r.prompt_tokens == 0) __builtin_trap();
    }
  }
  return 0;
}
