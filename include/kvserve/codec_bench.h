// Codec speed and size measurement, shared by `kvserve codec bench`, the strategy table and the
// profiler. Throughputs are GB/s of the uncompressed input bytes, medians over `runs`.
#pragma once

#include <string>
#include <string_view>

#include "kvserve/codec.h"
#include "kvserve/kv.h"

namespace kvserve {

struct CodecMeasurement {
  std::string spec;
  double encode_gbps = 0, decode_gbps = 0;
  double ratio = 0;            // input bytes (fp16 if the input is fp16) / frame bytes
  uint64_t frame_bytes = 0;
  double snr_db_k = 0, snr_db_v = 0;  // over the kept tokens, for strategies that select tokens
  // The serving path (BenchOptions::per_layer): one frame per layer as the prefill node encodes
  // them, decoded through a LayerAssembler as the decode node does; 0 where not measured.
  double layer_encode_gbps = 0, layer_decode_gbps = 0;
  uint64_t layer_frame_bytes = 0;  // all layers' frames together
};

struct BenchOptions {
  int runs = 5;
  int threads = 1;              // codec workers (zstd: its own worker threads)
  ThreadPool* pool = nullptr;   // runs them; null: a pool of `threads` for the measurement
  CodecEnv env;
  // Also measure per-layer frames (strategies with a whole-request basis, lowrank, go as one
  // frame on the serving path and are not measured so). Token-selecting strategies get
  // per-token scores, as the nodes pass them: a fixed pseudo-random vector.
  bool per_layer = false;
};

// The median of `v` (the mean of the middle two for an even count; 0 for none).
double MedianOf(std::vector<double> v);

// The reference KV block of the speed goals: llama3-8b shape, fp16 (or `dtype`), synthetic, seed 1.
Result<KvBlock> BenchBlock(uint32_t n_token = 1024, ThreadPool* pool = nullptr, DType dtype = DType::kF16);

Result<CodecMeasurement> MeasureCodec(const KvBlock& block, std::string_view spec, const BenchOptions& opts = {});
// The paged serving layout against the dense one, in one run: `block` copied into a paged,
// token-major cache (vLLM's per-layer [2, num_blocks, block_size, n_head, head_dim], pages of
// `block_size` tokens in a shuffled block table, an eighth spare) and encoded from it, then the
// frame decoded back into the same pages; the dense block encoded and decoded as MeasureCodec does.
struct PagedMeasurement {
  std::string spec;
  double dense_encode_gbps = 0, dense_decode_gbps = 0, paged_encode_gbps = 0, paged_decode_gbps = 0;
  bool same_frame = false;  // the paged frame equals the dense one byte for byte
  uint64_t frame_bytes = 0, cache_bytes = 0;
  // Memory the paged runs added to what was resident before them (the process's peak RSS, reset
  // first through /proc/self/clear_refs; -1 where the kernel does not allow it): a full-block copy
  // would add about cache_bytes.
  int64_t added_peak_bytes = -1;
};
Result<PagedMeasurement> MeasurePaged(const KvBlock& block, std::string_view spec, const BenchOptions& opts = {},
                                      uint32_t block_size = 16);

// memcpy of `bytes` bytes between two pre-touched buffers.
double MeasureMemcpyGbps(size_t bytes, int runs);

struct ZstdMeasurement {
  double encode_gbps = 0, decode_gbps = 0, ratio = 0;
  uint64_t compressed_bytes = 0;
};
ZstdMeasurement MeasureZstd(const uint8_t* data, size_t bytes, int level, const BenchOptions& opts = {});

}  // namespace kvserve
