// What a new large buffer costs: a 32 MiB value (one pool chunk of llama3-8b fp16 KV) copied
// into a ByteBuffer allocated each iteration (a huge-page mapping: the one the previous iteration
// freed), into memory from operator new each iteration (glibc maps blocks this large afresh; 4 KiB
// pages faulted in on first touch), and into one buffer reused across iterations (memcpy alone,
// the baseline). docs/results/alloc.md.
#include <benchmark/benchmark.h>

#include <cstring>
#include <new>

#include "kvserve/kv.h"

namespace kvserve {
namespace {

constexpr size_t kValueBytes = size_t{32} << 20;

const ByteBuffer& Source() {
  static const ByteBuffer src = [] {
    ByteBuffer b(kValueBytes);
    for (size_t i = 0; i < b.size(); ++i) b[i] = uint8_t(i * 131);
    return b;
  }();
  return src;
}

void NewByteBuffer(benchmark::State& state) {
  const ByteBuffer& src = Source();
  for (auto _ : state) {
    ByteBuffer copy = CopyBytes(src.data(), src.size());
    benchmark::DoNotOptimize(copy.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(kValueBytes));
}

void NewOperatorNew(benchmark::State& state) {
  const ByteBuffer& src = Source();
  for (auto _ : state) {
    auto* p = static_cast<uint8_t*>(::operator new(kValueBytes, std::align_val_t(64)));
    std::memcpy(p, src.data(), kValueBytes);
    benchmark::DoNotOptimize(p);
    ::operator delete(p, std::align_val_t(64));
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(kValueBytes));
}

void ReusedBuffer(benchmark::State& state) {
  const ByteBuffer& src = Source();
  ByteBuffer dst(kValueBytes);
  std::memset(dst.data(), 0, dst.size());
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kValueBytes);
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(kValueBytes));
}

BENCHMARK(NewByteBuffer)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(NewOperatorNew)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly(true);
BENCHMARK(ReusedBuffer)->Unit(benchmark::kMillisecond)->Repetitions(5)->ReportAggregatesOnly(true);

}  // namespace
}  // namespace kvserve
