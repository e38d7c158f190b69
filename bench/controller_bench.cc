// Decision latency of the online controller with a 50-strategy profile (goal: <= 10 us): the
// default rule (live codec speeds, queue-aware cost), with the bandit, KVServe's rule; and the
// explanation line (only built when asked for).
#include <benchmark/benchmark.h>

#include "kvserve/controller.h"

namespace kvserve {
namespace {

std::vector<StrategyCost> FiftyStrategies() {
  std::vector<StrategyCost> s;
  for (int i = 0; i < 50; ++i) {
    const double ratio = 1.5 + 0.2 * i;
    s.push_back({"quant(kbits=" + std::to_string(1 + i % 8) + ")|s" + std::to_string(i), "s" + std::to_string(i),
                 1.0 - 0.001 * i, ratio, (2 + i % 5) * 1e9, (4 + i % 7) * 1e9});
  }
  return s;
}

void Decide(benchmark::State& state) {
  ControllerOptions o = state.range(0) == 2 ? ControllerOptions::KvServeRule() : ControllerOptions{};
  o.bandit = state.range(0) == 1;
  Controller c(FiftyStrategies(), o);
  Request r;
  r.kv_bytes = 512e6;
  r.prompt_tokens = 4096;
  r.floor = 0.97;
  r.slo_seconds = 0.8;
  Decision d;
  double bw = 1e9;
  for (auto _ : state) {
    // Codec work queued, the link idle: the queue term is computed and the bandit path runs.
    c.Decide(r, bw, 0.9, QueueState{0.01, 0.0, 0.02, 1, 0, 1}, &d);
    benchmark::DoNotOptimize(d.choice);
    bw = bw < 3e9 ? bw * 1.01 : 0.5e9;  // vary the link so the choice varies
  }
  state.SetLabel(state.range(0) == 1   ? "50 strategies, live speeds + queue cost + bandit"
                 : state.range(0) == 2 ? "50 strategies, KVServe's rule (moving average)"
                                       : "50 strategies, live speeds + queue cost");
}
BENCHMARK(Decide)->Arg(0)->Arg(1)->Arg(2);

void DecideAndObserve(benchmark::State& state) {
  Controller c(FiftyStrategies());
  Request r;
  r.kv_bytes = 512e6;
  r.slo_seconds = 0.8;
  Decision d;
  for (auto _ : state) {
    c.Decide(r, 1e9, 0.9, {}, &d);
    const StrategyCost& s = c.strategies()[d.choice];
    c.Observe(d, r, d.predicted_seconds * 1.1,
              s.none() ? StageTimes{} : StageTimes{1.1 * r.kv_bytes / s.encode_Bps, 1.1 * r.kv_bytes / s.decode_Bps});
  }
}
BENCHMARK(DecideAndObserve);

void Explain(benchmark::State& state) {
  Controller c(FiftyStrategies());
  Request r;
  r.kv_bytes = 512e6;
  Decision d;
  c.Decide(r, 1e9, 0.9, {}, &d);
  for (auto _ : state) benchmark::DoNotOptimize(c.Explain(r, d));
}
BENCHMARK(Explain);

}  // namespace
}  // namespace kvserve
