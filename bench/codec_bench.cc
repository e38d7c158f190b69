// Micro-benchmarks of the codec hot paths (Google Benchmark). Bytes/s counters are of fp16 input.
// The whole-pipeline comparison with memcpy and zstd is `kvserve codec bench`.
#include <benchmark/benchmark.h>

#include <cstring>

#include "codec/quant_kernels.h"
#include "kvserve/codec.h"
#include "kvserve/codec_bench.h"

namespace kvserve {
namespace {

const KvBlock& Block() {
  static KvBlock b = BenchBlock(256, 2).value();  // 32 MiB of fp16
  return b;
}

void BM_Memcpy(benchmark::State& state) {
  const KvBlock& b = Block();
  ByteBuffer dst(b.bytes(), 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), b.data(), b.bytes());
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);

void BM_Encode(benchmark::State& state, const char* spec) {
  const KvBlock& b = Block();
  Pipeline p = Pipeline::Create(spec).value();
  ByteBuffer frame;
  for (auto _ : state) {
    if (!p.Encode(b, &frame).ok()) state.SkipWithError("encode failed");
    benchmark::DoNotOptimize(frame.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
void BM_Decode(benchmark::State& state, const char* spec) {
  const KvBlock& b = Block();
  Pipeline p = Pipeline::Create(spec).value();
  ByteBuffer frame;
  (void)p.Encode(b, &frame);
  KvBlock out;
  for (auto _ : state) {
    if (!p.Decode(frame, &out).ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
BENCHMARK_CAPTURE(BM_Encode, quant4, "quant(kbits=4,vbits=4)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant4, "quant(kbits=4,vbits=4)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, quant2, "quant(kbits=2,vbits=2)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant2, "quant(kbits=2,vbits=2)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, quant3, "quant(kbits=3,vbits=3)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant3, "quant(kbits=3,vbits=3)")->Unit(benchmark::kMillisecond);

void BM_Pack(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  ByteBuffer codes(4096), out(4096);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i * 7) & ((1 << bits) - 1);
  for (auto _ : state) {
    quant::PackCodes(codes.data(), codes.size(), bits, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * codes.size());
}
BENCHMARK(BM_Pack)->Arg(2)->Arg(3)->Arg(4);

}  // namespace
}  // namespace kvserve
