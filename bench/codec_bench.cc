// Micro-benchmarks of the codec hot paths (Google Benchmark). Bytes/s counters are of fp16 input.
// The whole-pipeline comparison with memcpy and zstd is `kvserve codec bench`.
#include <benchmark/benchmark.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "codec/quant_kernels.h"
#include "codec/rans_kernels.h"
#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/codec_bench.h"
#include "kvserve/frame.h"
#include "kvserve/thread_pool.h"

namespace kvserve {
namespace {

const KvBlock& Block() {
  static KvBlock b = BenchBlock(256).value();  // 32 MiB of fp16
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

// The write ceiling of a decoder: filling the block's bytes with memset (streaming stores for
// sizes past the cache, as glibc picks). A decoder writes the whole block and reads less, so
// this, not memcpy, bounds its speed.
void BM_Memset(benchmark::State& state) {
  const KvBlock& b = Block();
  ByteBuffer dst(b.bytes(), 0);
  int value = 0;
  for (auto _ : state) {
    std::memset(dst.data(), ++value & 0xff, b.bytes());
    benchmark::DoNotOptimize(dst.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
BENCHMARK(BM_Memset)->Unit(benchmark::kMillisecond);

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
// The block's 4-bit quant frame, stamped as frame `version` (its checksum in that version's form).
ByteBuffer Quant4FrameAs(uint16_t version) {
  ByteBuffer frame;
  (void)Pipeline::Create("quant(kbits=4,vbits=4)").value().Encode(Block(), &frame);
  std::memcpy(frame.data() + 4, &version, 2);
  frame.resize(frame.size() - kFrameChecksumBytes);
  (void)FinishFrame(&frame, 0);
  return frame;
}

// Whole 4-bit quant decode, the frame's checksum in the form of version arg0 (2: one XXH3 over
// the frame, serial; 3: 256 KiB chunks, shared by the pool) on arg1 threads: what the chunked
// checksum buys a decode at two threads, in one process (machine noise cancels).
void BM_DecodeChecksum(benchmark::State& state) {
  const KvBlock& b = Block();
  Pipeline p = Pipeline::Create("quant(kbits=4,vbits=4)").value();
  const ByteBuffer frame = Quant4FrameAs(uint16_t(state.range(0)));
  ThreadPool pool(int(state.range(1)));
  CodecOptions o;
  o.pool = state.range(1) > 1 ? &pool : nullptr;
  KvBlock out;
  for (auto _ : state) {
    if (!p.Decode(frame, &out, o).ok()) state.SkipWithError("decode failed");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
BENCHMARK(BM_DecodeChecksum)->ArgsProduct({{2, 3}, {1, 2}})->Unit(benchmark::kMillisecond);

// The checksum alone, as an encoder finishes a frame: the 4-bit quant frame's bytes, version
// arg0's form, arg1 threads. Bytes/s are of the frame.
void BM_FinishFrame(benchmark::State& state) {
  ByteBuffer frame = Quant4FrameAs(uint16_t(state.range(0)));
  const size_t body = frame.size() - kFrameChecksumBytes;
  ThreadPool pool(int(state.range(1)));
  for (auto _ : state) {
    frame.resize(body);
    if (!FinishFrame(&frame, 0, state.range(1) > 1 ? &pool : nullptr).ok()) state.SkipWithError("finish failed");
    benchmark::DoNotOptimize(frame.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * body);
}
BENCHMARK(BM_FinishFrame)->ArgsProduct({{2, 3}, {1, 2}})->Unit(benchmark::kMillisecond);

BENCHMARK_CAPTURE(BM_Encode, quant4, "quant(kbits=4,vbits=4)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant4, "quant(kbits=4,vbits=4)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, quant2, "quant(kbits=2,vbits=2)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant2, "quant(kbits=2,vbits=2)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, quant3, "quant(kbits=3,vbits=3)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant3, "quant(kbits=3,vbits=3)")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, quant4_rans, "quant(kbits=4,vbits=4)|rans")->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, quant4_rans, "quant(kbits=4,vbits=4)|rans")->Unit(benchmark::kMillisecond);

// lowrank alone (`kvserve codec bench` has no llama3-8b basis to name): a basis fitted on the
// benchmark block itself, saved to a temporary directory; arg = rank.
void BM_LowRank(benchmark::State& state, bool decode) {
  const KvBlock& b = Block();
  static const std::string dir = std::filesystem::temp_directory_path() / ("kvserve-bench-" + std::to_string(getpid()));
  static const LowRankBasis basis = FitLowRankBasis({&b}).value();
  static CalibrationStore store = [] {
    (void)SaveLowRankBasis(basis, dir).value();
    return CalibrationStore(dir);
  }();
  CodecEnv env;
  env.calibration = &store;
  const std::string spec = "lowrank(rank=" + std::to_string(state.range(0)) + ",basis=" + std::to_string(basis.id) + ")";
  Pipeline p = Pipeline::Create(spec, env).value();
  ByteBuffer frame;
  if (!p.Encode(b, &frame).ok()) state.SkipWithError("encode failed");
  KvBlock out;
  for (auto _ : state) {
    const Status st = decode ? p.Decode(frame, &out) : p.Encode(b, &frame);
    if (!st.ok()) state.SkipWithError(st.ToString().c_str());
    benchmark::DoNotOptimize(frame.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * b.bytes());
}
BENCHMARK_CAPTURE(BM_LowRank, encode, false)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_LowRank, decode, true)->Arg(32)->Arg(64)->Unit(benchmark::kMillisecond);

// A rANS table (entries start | freq << 16) of A symbols shaped like quantisation codes: a
// discretised Gaussian of standard deviation `width` symbols, every symbol present.
std::vector<uint32_t> CodeShapedTable(uint32_t A, double width) {
  std::vector<double> p(A);
  double total = 0;
  for (uint32_t s = 0; s < A; ++s) total += p[s] = std::exp(-0.5 * std::pow((s - A / 2.0) / width, 2));
  std::vector<uint32_t> entries(A);
  uint32_t start = 0;
  for (uint32_t s = 0; s < A; ++s) {
    const uint32_t f = s + 1 == A ? rans::kProbScale - start
                                  : std::max<uint32_t>(1, uint32_t(p[s] / total * (rans::kProbScale - A)));
    entries[s] = start | f << 16;
    start += f;
  }
  return entries;
}

// The rANS decode loop alone, per symbol: scalar reference (arg 0) against the SIMD kernel
// (arg 1), 128 channels with a table each of 2^bits symbols shaped like quantisation codes
// (a discretised Gaussian), or (third arg 1) the first of them for every channel, as `rans`
// picks where the channels' statistics agree. The stream is random bytes: decoding costs the
// same either way.
void BM_RansDecodeRun(benchmark::State& state) {
  const bool simd = state.range(0) != 0;
  const int bits = int(state.range(1));
  const bool shared = state.range(2) != 0;
  const uint32_t A = 1u << bits, C = 128, n = 1u << 20;
  std::vector<uint32_t> entries;
  for (uint32_t ch = 0; ch < C; ++ch) {
    const std::vector<uint32_t> t = CodeShapedTable(A, A / 5.0 + ch % 3);
    entries.insert(entries.end(), t.begin(), t.end());
  }
  const rans::Run run{entries.data(), shared ? 0 : A, C, bits};
  const std::vector<uint32_t> lanes = simd ? rans::LaneTables(run) : std::vector<uint32_t>{};
  const std::vector<uint32_t> slots = simd && lanes.empty() ? rans::SlotTables(run) : std::vector<uint32_t>{};
  std::vector<uint8_t> stream(size_t(n) * 2 + 64), out(n);
  std::mt19937 rng(1);
  for (auto& b : stream) b = uint8_t(rng());
  for (auto _ : state) {
    rans::DecoderState st;
    for (int l = 0; l < rans::kLanes; ++l) st.x[l] = rans::kLow + uint32_t(l);
    st.ptr = stream.data();
    st.end = stream.data() + stream.size();
    const bool ok =
        simd ? rans::DecodeRun(st, run, lanes, slots, n, out.data()) : rans::DecodeRunScalar(st, run, 0, n, out.data());
    if (!ok) state.SkipWithError("stream ran out");
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * n);
}
BENCHMARK(BM_RansDecodeRun)->ArgsProduct({{0, 1}, {2, 4, 8}, {0, 1}})->Unit(benchmark::kMillisecond);

// Two streams with one table each decoded side by side over bucket tables (the `rans` stage's
// path for code contexts), against BM_RansDecodeRun/1/bits/1 on one; per symbol of both streams.
void BM_RansDecodePair(benchmark::State& state) {
  const int bits = int(state.range(0));
  const uint32_t A = 1u << bits, n = 1u << 20;
  const std::vector<uint32_t> entries = CodeShapedTable(A, A / 5.0);
  const rans::Run run{entries.data(), 0, 1, bits};
  const std::vector<uint32_t> buckets = rans::BucketTables(run);
  if (buckets.empty()) state.SkipWithError("no bucket tables");
  std::vector<uint8_t> stream(size_t(n) * 4 + 128), out_a(n), out_b(n);
  std::mt19937 rng(1);
  for (auto& b : stream) b = uint8_t(rng());
  for (auto _ : state) {
    rans::DecoderState a, b;
    for (int l = 0; l < rans::kLanes; ++l) a.x[l] = b.x[l] = rans::kLow + uint32_t(l);
    a.ptr = stream.data();
    a.end = b.ptr = stream.data() + stream.size() / 2;
    b.end = stream.data() + stream.size();
    if (rans::DecodeRunPair(a, buckets, out_a.data(), b, buckets, out_b.data(), n) != n) {
      state.SkipWithError("no AVX-512 or a stream ran out");
    }
    benchmark::DoNotOptimize(out_a.data());
    benchmark::DoNotOptimize(out_b.data());
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * 2 * n);
}
BENCHMARK(BM_RansDecodePair)->Arg(2)->Arg(4)->Unit(benchmark::kMillisecond);

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
