// Codec measurement: median wall time of encode/decode into reused buffers, so allocation and
// page faults are not charged to the codec (memcpy gets the same treatment).
#include "kvserve/codec_bench.h"

#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <numeric>
#include <vector>

#include "kvserve/synth.h"

namespace kvserve {
namespace {
double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
struct Medians {
  double encode_s = 0, decode_s = 0;
};
// Runs encode then decode once to warm up (sizing the buffers), then `runs` times timed.
Result<Medians> TimeRoundTrips(int runs, const std::function<Status()>& encode, const std::function<Status()>& decode) {
  KV_RETURN_IF_ERROR(encode());
  KV_RETURN_IF_ERROR(decode());
  std::vector<double> enc, dec;
  for (int r = 0; r < std::max(1, runs); ++r) {
    const double t0 = Now();
    KV_RETURN_IF_ERROR(encode());
    const double t1 = Now();
    KV_RETURN_IF_ERROR(decode());
    enc.push_back(t1 - t0);
    dec.push_back(Now() - t1);
  }
  return Medians{MedianOf(enc), MedianOf(dec)};
}
}  // namespace

double MedianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

Result<KvBlock> BenchBlock(uint32_t n_token, ThreadPool* pool, DType dtype) {
  KV_ASSIGN_OR_RETURN(KvShape shape, ShapePreset("llama3-8b", n_token));
  SynthOptions o;
  o.seed = 1;
  o.dtype = dtype;
  o.pool = pool;
  return SynthesizeKv(shape, o);
}

Result<CodecMeasurement> MeasureCodec(const KvBlock& block, std::string_view spec, const BenchOptions& opts) {
  KV_ASSIGN_OR_RETURN(Pipeline p, Pipeline::Create(spec, opts.env));
  std::unique_ptr<ThreadPool> own;
  if (opts.pool == nullptr && opts.threads > 1) own = std::make_unique<ThreadPool>(opts.threads);
  CodecOptions co;
  co.pool = opts.pool ? opts.pool : own.get();
  ByteBuffer frame;
  KvBlock out;
  KV_ASSIGN_OR_RETURN(Medians whole, TimeRoundTrips(opts.runs, [&] { return p.Encode(block, &frame, co); },
                                                    [&] { return p.Decode(frame, &out, co); }));
  CodecMeasurement m;
  m.spec = p.spec();
  const double gb = double(block.bytes()) / 1e9;
  if (opts.per_layer && m.spec.find("lowrank") == std::string::npos) {
    // Scores from a hash of the token index: any fixed vector costs the codec the same.
    std::vector<float> scores(block.shape().n_token);
    for (size_t i = 0; i < scores.size(); ++i) scores[i] = float((uint32_t(i) * 2654435761u) >> 8);
    CodecOptions lo = co;
    lo.token_scores = &scores;
    const uint32_t n_layer = block.shape().n_layer;
    std::vector<ByteBuffer> frames(n_layer);
    KV_ASSIGN_OR_RETURN(KvBlock dest, KvBlock::Create(out.shape(), block.dtype()));
    auto encode = [&]() -> Status {
      for (uint32_t l = 0; l < n_layer; ++l) KV_RETURN_IF_ERROR(p.EncodeLayers(block, l, 1, &frames[l], lo));
      return Status::Ok();
    };
    auto decode = [&]() -> Status {
      LayerAssembler assembler(0, &dest, opts.env);
      for (const ByteBuffer& f : frames) KV_RETURN_IF_ERROR(assembler.Add(f, lo));
      return Status::Ok();
    };
    KV_ASSIGN_OR_RETURN(Medians layered, TimeRoundTrips(opts.runs, encode, decode));
    m.layer_encode_gbps = gb / layered.encode_s;
    m.layer_decode_gbps = gb / layered.decode_s;
    for (const ByteBuffer& f : frames) m.layer_frame_bytes += f.size();
  }
  m.encode_gbps = gb / whole.encode_s;
  m.decode_gbps = gb / whole.decode_s;
  m.frame_bytes = frame.size();
  m.ratio = double(block.bytes()) / double(frame.size());
  // After token selection the error is measured over the kept tokens.
  KvBlock kept;
  const KvBlock* ref = &block;
  if (!out.positions().empty()) {
    KV_ASSIGN_OR_RETURN(kept, KvBlock::Create(out.shape(), block.dtype()));
    const size_t row = size_t(block.shape().head_dim) * DTypeSize(block.dtype());
    for (uint64_t sl = 0; sl < block.shape().n_slab(); ++sl)
      for (uint32_t j = 0; j < out.shape().n_token; ++j)
        std::memcpy(kept.slab_at(sl) + j * row, block.slab_at(sl) + (out.positions()[j] - block.token_offset()) * row, row);
    ref = &kept;
  }
  KV_ASSIGN_OR_RETURN(KvCompareResult c, CompareKv(*ref, out));
  m.snr_db_k = c.k.snr_db;
  m.snr_db_v = c.v.snr_db;
  return m;
}

namespace {
// The process's resident and peak resident bytes (VmRSS, VmHWM), 0 where /proc has no answer.
std::pair<int64_t, int64_t> ResidentBytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return {0, 0};
  char line[256];
  int64_t rss = 0, hwm = 0;
  while (std::fgets(line, sizeof line, f)) {
    long long kb = 0;
    if (std::sscanf(line, "VmRSS: %lld kB", &kb) == 1) rss = kb * 1024;
    if (std::sscanf(line, "VmHWM: %lld kB", &kb) == 1) hwm = kb * 1024;
  }
  std::fclose(f);
  return {rss, hwm};
}
// Resets the peak to the current resident size (Linux >= 4.0); false where that is refused.
bool ResetPeakResident() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (f == nullptr) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}
}  // namespace

Result<PagedMeasurement> MeasurePaged(const KvBlock& block, std::string_view spec, const BenchOptions& opts,
                                      uint32_t block_size) {
  KV_ASSIGN_OR_RETURN(Pipeline p, Pipeline::Create(spec, opts.env));
  std::unique_ptr<ThreadPool> own;
  if (opts.pool == nullptr && opts.threads > 1) own = std::make_unique<ThreadPool>(opts.threads);
  CodecOptions co;
  co.pool = opts.pool ? opts.pool : own.get();
  const KvShape& shape = block.shape();
  if (block_size == 0) return Status::InvalidArgument("paged block_size=0 must be positive");
  // The cache: an eighth more pages than needed, used in a shuffled order.
  const uint32_t need = (shape.n_token + block_size - 1) / block_size, num_blocks = need + need / 8 + 1;
  KvPages pages;
  pages.block_size = block_size;
  pages.num_blocks = num_blocks;
  pages.part_stride = uint64_t{num_blocks} * block_size * shape.n_head_kv * shape.head_dim;
  std::vector<uint32_t> order(num_blocks);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  pages.block_table.assign(order.begin(), order.begin() + need);
  const size_t layer_bytes = 2 * pages.part_stride * DTypeSize(block.dtype());
  std::vector<ByteBuffer> memory(shape.n_layer);
  for (uint32_t l = 0; l < shape.n_layer; ++l) {
    memory[l].assign(layer_bytes, 0);
    pages.layer_base.push_back(memory[l].data());
  }
  KV_ASSIGN_OR_RETURN(KvBlock cache, KvBlock::PagedView(shape, block.dtype(), std::move(pages)));
  auto fill = [&] {  // the block's values into the pages
    ByteBuffer scratch;
    for (uint64_t sl = 0; sl < shape.n_slab(); ++sl) {
      uint8_t* dst = cache.SlabToWrite(sl, scratch);
      std::memcpy(dst, block.slab_at(sl), shape.slab_numel() * DTypeSize(block.dtype()));
      cache.WroteSlab(sl, dst);
    }
  };
  fill();
  PagedMeasurement m;
  m.spec = p.spec();
  m.cache_bytes = uint64_t(shape.n_layer) * layer_bytes;
  const double gb = double(block.bytes()) / 1e9;
  // Paged first: what these runs add to the resident memory (the cache and `block` are already
  // there) is what encoding from and decoding into the pages needs.
  ByteBuffer frame, dense_frame;
  (void)ReleaseIdleBuffers();  // else a mapping the setup freed would serve the runs unseen
  const bool reset = ResetPeakResident();
  const int64_t before = ResidentBytes().first;
  Result<Medians> paged_runs = TimeRoundTrips(opts.runs, [&] { return p.Encode(cache, &frame, co); },
                                              [&] { return p.Decode(frame, &cache, co); });
  if (!paged_runs.ok()) {
    return paged_runs.status().WithContext("paged layout (only strategies that keep every token decode into pages)");
  }
  const Medians paged = paged_runs.value();
  if (reset) m.added_peak_bytes = ResidentBytes().second - before;
  KvBlock out;
  KV_ASSIGN_OR_RETURN(Medians dense, TimeRoundTrips(opts.runs, [&] { return p.Encode(block, &dense_frame, co); },
                                                    [&] { return p.Decode(dense_frame, &out, co); }));
  // The last paged encode read pages that already held a decoded frame; encode them once more
  // from the original values to compare frames.
  fill();
  KV_RETURN_IF_ERROR(p.Encode(cache, &frame, co));
  KV_RETURN_IF_ERROR(p.Encode(block, &dense_frame, co));
  m.same_frame = frame == dense_frame;
  m.frame_bytes = frame.size();
  m.paged_encode_gbps = gb / paged.encode_s;
  m.paged_decode_gbps = gb / paged.decode_s;
  m.dense_encode_gbps = gb / dense.encode_s;
  m.dense_decode_gbps = gb / dense.decode_s;
  return m;
}

double MeasureMemcpyGbps(size_t bytes, int runs) {
  ByteBuffer a(bytes, 1), b(bytes, 2);
  std::memcpy(b.data(), a.data(), bytes);
  std::vector<double> t;
  for (int r = 0; r < std::max(1, runs); ++r) {
    a[r % bytes] = uint8_t(r);
    double t0 = Now();
    std::memcpy(b.data(), a.data(), bytes);
    t.push_back(Now() - t0);
  }
  volatile uint8_t sink = b[bytes / 2];
  (void)sink;
  return double(bytes) / 1e9 / MedianOf(t);
}

ZstdMeasurement MeasureZstd(const uint8_t* data, size_t bytes, int level, const BenchOptions& opts) {
  ZstdMeasurement m;
  ByteBuffer comp(ZSTD_compressBound(bytes)), back(bytes);
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_DCtx* dctx = ZSTD_createDCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
  if (opts.threads > 1) ZSTD_CCtx_setParameter(cctx, ZSTD_c_nbWorkers, opts.threads);
  std::vector<double> enc, dec;
  size_t n = 0;
  for (int r = 0; r < std::max(1, opts.runs); ++r) {
    double t0 = Now();
    n = ZSTD_compress2(cctx, comp.data(), comp.size(), data, bytes);
    double t1 = Now();
    ZSTD_decompressDCtx(dctx, back.data(), bytes, comp.data(), n);
    double t2 = Now();
    enc.push_back(t1 - t0);
    dec.push_back(t2 - t1);
  }
  ZSTD_freeCCtx(cctx);
  ZSTD_freeDCtx(dctx);
  m.compressed_bytes = n;
  m.ratio = double(bytes) / double(n);
  m.encode_gbps = double(bytes) / 1e9 / MedianOf(enc);
  m.decode_gbps = double(bytes) / 1e9 / MedianOf(dec);
  return m;
}

}  // namespace kvserve
