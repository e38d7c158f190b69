// Internal stage interface. A stage is one step of a strategy; its Encode consumes the previous
// stage's output kind and produces its own, and Decode inverts it. Stages see only KV types and
// bytes: never the model, the network or the profiler.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvserve/codec.h"
#include "kv/parallel.h"
#include "kvserve/kv.h"

namespace kvserve {

// Where a symbols-producing stage put its quantisation codes in its byte output: `n_codes`
// codes (a multiple of 8) of `bits` bits, bit-planed as quant_kernels.h describes, from byte
// `offset`. Code j of the section belongs to channel j % n_channel; `context` groups sections
// that share statistics (one per layer and K/V part).
//
// A kHalf section instead marks `n_codes` fp16 values of quantisation metadata (ranges,
// scales) at `offset`; `bits` is 16, `n_channel` 1, and its `context` numbers the kind of value
// (say, layer 3's K minima) in a space of its own. Entropy coders model them separately from
// the codes; bytes outside every section pass through unchanged.
struct CodeSection {
  enum class Kind : uint8_t { kCodes, kHalf };
  uint64_t offset = 0;
  uint32_t n_codes = 0;
  uint8_t bits = 0;
  uint32_t n_channel = 1;
  uint32_t context = 0;
  Kind kind = Kind::kCodes;
};

struct StageContext {
  ThreadPool* pool = nullptr;  // null: the calling thread alone
  // Per-token importance of the block being encoded (higher = keep), when the caller has it.
  const std::vector<float>* token_scores = nullptr;
  uint64_t max_decoded_bytes = uint64_t{16} << 30;
  // For a stage consuming symbols: the producing stage's code sections (in offset order).
  const std::vector<CodeSection>* sections = nullptr;
  // Index, within the whole request, of the block's first slab (non-zero for a frame of later
  // layers): stages whose randomness is keyed by slab (rotation signs) key it by this plus the
  // local index, so a layer sent alone codes exactly as it does within the whole request.
  uint64_t first_slab = 0;
};

// A slab read or written a block of rows at a time, whatever the layout: a dense slab's blocks
// are its own memory; a paged slab's rows are gathered into (or scattered from) a buffer the size
// of one block, which stays in L1, and the next block's rows are prefetched meanwhile — so the
// page walk overlaps the codec's arithmetic instead of preceding it as a whole-slab pass
// (KvBlock::ReadSlab), which on paged caches cost as much again as the codec itself.
class RowBlocks {
 public:
  // `rows` and `buf` are the caller's (thread-local) storage, reused across slabs.
  RowBlocks(const KvBlock& t, uint64_t slab, std::vector<uint8_t*>& rows, ByteBuffer& buf)
      : rows_(&rows), buf_(&buf), row_bytes_(size_t{t.shape().head_dim} * DTypeSize(t.dtype())) {
    if (t.is_paged()) t.SlabRows(slab, &rows);
    else dense_ = const_cast<uint8_t*>(t.slab_at(slab));
  }
  // Rows [t0, t0 + n), contiguous; the `ahead` rows after them are prefetched.
  const uint8_t* Read(uint32_t t0, uint32_t n, uint32_t ahead) {
    if (dense_) return dense_ + t0 * row_bytes_;
    const std::vector<uint8_t*>& r = *rows_;
    for (uint32_t i = t0 + n; i < t0 + n + ahead; ++i)
      for (size_t b = 0; b < row_bytes_; b += 64) __builtin_prefetch(r[i] + b);
    buf_->resize(size_t{n} * row_bytes_);
    for (uint32_t i = 0; i < n; ++i) std::memcpy(buf_->data() + i * row_bytes_, r[t0 + i], row_bytes_);
    return buf_->data();
  }
  // The rows' own addresses from t0 (a paged slab), or null (a dense one: Read/Write give them).
  uint8_t* const* RowsFrom(uint32_t t0) const { return dense_ ? nullptr : rows_->data() + t0; }
  // Where to write rows [t0, t0 + n); Wrote(t0, n) then stores them to their rows.
  uint8_t* Write(uint32_t t0, uint32_t n) {
    if (dense_) return dense_ + t0 * row_bytes_;
    buf_->resize(size_t{n} * row_bytes_);
    return buf_->data();
  }
  // Decoded rows are not read back soon: where rows are 16-byte multiples at 16-byte aligned
  // addresses (an engine's cache), non-temporal stores skip reading each line first, which on a
  // page row's stride is most of a store's cost. Fence() once after the slab's last block.
  void Wrote(uint32_t t0, uint32_t n) {
    if (dense_) return;
    const std::vector<uint8_t*>& r = *rows_;
#ifdef __SSE2__
    if (row_bytes_ % 16 == 0 && (reinterpret_cast<uintptr_t>(r[t0]) | reinterpret_cast<uintptr_t>(buf_->data())) % 16 == 0) {
      for (uint32_t i = 0; i < n; ++i) {
        __m128i* dst = reinterpret_cast<__m128i*>(r[t0 + i]);
        const __m128i* src = reinterpret_cast<const __m128i*>(buf_->data() + i * row_bytes_);
        for (size_t k = 0; k < row_bytes_ / 16; ++k) _mm_stream_si128(dst + k, _mm_load_si128(src + k));
      }
      streamed_ = true;
      return;
    }
#endif
    for (uint32_t i = 0; i < n; ++i) std::memcpy(r[t0 + i], buf_->data() + i * row_bytes_, row_bytes_);
  }
  void Fence() {
#ifdef __SSE2__
    if (streamed_) _mm_sfence();
#endif
  }

 private:
  uint8_t* dense_ = nullptr;
  std::vector<uint8_t*>* rows_;
  ByteBuffer* buf_;
  size_t row_bytes_;
  bool streamed_ = false;
};

// The n_head_kv slabs of one (layer, K/V) part of a paged cache, taken a block of tokens at a
// time and head after head. A page row holds every head's row of a token side by side; asking
// for whole page rows of the next block while this one is coded reads each page in address order,
// overlapped with the arithmetic, where taking a slab at a time reads one head's row (256 bytes
// for llama3-8b) of every 2 KiB page row, at a stride the hardware prefetchers do not follow.
class PagedPartRows {
 public:
  // `rows` and `buf` are the caller's (thread-local) storage, reused across parts. `part` counts
  // (layer, K/V) pairs: its slabs are part * n_head_kv .. part * n_head_kv + n_head_kv - 1.
  PagedPartRows(const KvBlock& t, uint64_t part, std::vector<uint8_t*>& rows, ByteBuffer& buf)
      : rows_(&rows), buf_(&buf), n_head_(t.shape().n_head_kv),
        row_bytes_(size_t{t.shape().head_dim} * DTypeSize(t.dtype())) {
    t.SlabRows(part * n_head_, &rows);  // head 0's rows; head h's row lies h rows further on
  }
  uint32_t n_head() const { return n_head_; }
  size_t row_bytes() const { return row_bytes_; }
  size_t page_row_bytes() const { return n_head_ * row_bytes_; }
  // Page rows (every head's row of one token) from token t0 on.
  const uint8_t* const* PageRows(uint32_t t0) const { return rows_->data() + t0; }
  // Asks for the page rows of tokens [t0, t0 + n).
  void Ask(uint32_t t0, uint32_t n) const {
    for (uint32_t i = t0; i < t0 + n; ++i)
      for (size_t o = 0; o < page_row_bytes(); o += 64) __builtin_prefetch((*rows_)[i] + o);
  }
  // Head h's rows [t0, t0 + n) where they lie.
  void HeadRows(uint32_t h, uint32_t t0, uint32_t n, std::vector<const uint8_t*>* out) const {
    out->resize(n);
    for (uint32_t i = 0; i < n; ++i) (*out)[i] = (*rows_)[t0 + i] + h * row_bytes_;
  }
  // The same rows gathered, contiguous (for kernels that read only a dense block).
  const uint8_t* ReadHead(uint32_t h, uint32_t t0, uint32_t n) {
    buf_->resize(size_t{n} * row_bytes_);
    uint8_t* b = buf_->data();
    for (uint32_t i = 0; i < n; ++i) std::memcpy(b + i * row_bytes_, (*rows_)[t0 + i] + h * row_bytes_, row_bytes_);
    return b;
  }

 private:
  std::vector<uint8_t*>* rows_;
  ByteBuffer* buf_;
  uint32_t n_head_;
  size_t row_bytes_;
};

// Exactly one of tensor / bytes is set, by the kind the stage declares.
struct StageInput {
  const KvBlock* tensor = nullptr;
  std::span<const uint8_t> bytes;
};
struct StageOutput {
  KvBlock* tensor = nullptr;            // Decode to a tensor: shape and dtype are preset by the caller
  ByteBuffer* bytes = nullptr;  // Encode to bytes: append (the vector may hold a frame header)
};

class Stage {
 public:
  virtual ~Stage() = default;
  virtual Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const = 0;
  // For a stage that outputs a tensor when encoding, the decoder receives the tensor and writes
  // `out.tensor`; for bytes output it receives bytes. `out.tensor`'s shape/dtype say what to produce.
  virtual Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const = 0;
  // For stages producing symbols: where the codes are, for a tensor of this shape. A pure
  // function of the stage's parameters and the shape, so the decoder can ask it before decoding.
  virtual std::vector<CodeSection> CodeSections(const KvShape& shape) const { return {}; }
  // Shape of the tensor this stage's encoder produces from one of `in` (token selection keeps
  // fewer tokens); a pure function, so the decoder knows every level's shape up front.
  virtual KvShape OutputShape(const KvShape& in) const { return in; }
};

using StageFactory = Result<std::unique_ptr<Stage>> (*)(const StageSpec& spec, const CodecEnv& env);
// The spec that encodes layers [layer_begin, layer_begin + n_layers) of a request of shape `full`
// on their own as the whole spec encodes them within the request: a stage whose parameters name
// absolute layers (boosted first layers, per-layer level limits) rewrites them for the range.
using LayerSlicer = Result<StageSpec> (*)(const StageSpec& spec, const KvShape& full, uint32_t layer_begin,
                                          uint32_t n_layers);

struct StageRegistration {
  StageInfo info;
  StageFactory factory;
  LayerSlicer slice_layers = nullptr;  // null: the stage treats every layer alike
};

// Each stage file defines one of these; registry.cc lists them.
StageRegistration CastStageRegistration();
StageRegistration FpSplitStageRegistration();
StageRegistration QuantStageRegistration();
StageRegistration Fp8StageRegistration();
StageRegistration ZstdStageRegistration();
StageRegistration RansStageRegistration();
StageRegistration RotateStageRegistration();
StageRegistration DeltaStageRegistration();
StageRegistration MixHqStageRegistration();
StageRegistration PruneStageRegistration();
StageRegistration LowRankStageRegistration();

const std::vector<StageRegistration>& StageRegistry();
Result<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec, const CodecEnv& env);

}  // namespace kvserve
