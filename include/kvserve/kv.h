// KV cache types: shape, dtype, and KvBlock — one contiguous buffer laid out
// [layer][K|V][head][token][dim], so a (layer, part, head) slab is a dense [n_token][head_dim] matrix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "kvserve/status.h"

namespace kvserve {

// Buffers of at least kHugePageAllocBytes are mapped on their own, 2 MiB-aligned and advised to
// the kernel's transparent huge pages. Why: KV blocks and frames are tens to hundreds of MiB,
// freshly allocated per request, and first touch of 4 KiB pages dominated their cost — on the
// 2-core VM a fresh 512 MiB copy took 1.4-1.9 s against 0.12 s into huge pages or reused memory
// (docs/results/alloc.md), which made the embedded pool's GETs ten times slower than a copy.
// Freed mappings are kept (up to 512 MiB a process) and handed to the next buffer of about their
// size, whose pages are then already in place.
// Smaller buffers, and every buffer under AddressSanitizer (which checks heap bounds), use
// operator new. AllocateLarge throws std::bad_alloc when the mapping fails, as operator new does.
inline constexpr size_t kHugePageAllocBytes = size_t{4} << 20;
void* AllocateLarge(size_t bytes);
void FreeLarge(void* p, size_t bytes) noexcept;
// Unmaps the idle mappings kept for reuse, returning their bytes: before measuring a peak
// resident size, so that what a run allocates counts even where an idle mapping would serve it.
size_t ReleaseIdleBuffers() noexcept;
#if defined(__SANITIZE_ADDRESS__)
inline constexpr bool kLargeAllocsMapped = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kLargeAllocsMapped = false;
#else
inline constexpr bool kLargeAllocsMapped = true;
#endif
#else
inline constexpr bool kLargeAllocsMapped = true;
#endif

// Allocator whose resize() leaves new elements uninitialised (buffers about to be overwritten,
// such as frames and decoded blocks, are not zero-filled first), aligned to 64 bytes for SIMD;
// large buffers on huge pages (above).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    if (kLargeAllocsMapped && n * sizeof(T) >= kHugePageAllocBytes) return static_cast<T*>(AllocateLarge(n * sizeof(T)));
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t n) noexcept {
    if (kLargeAllocsMapped && n * sizeof(T) >= kHugePageAllocBytes) return FreeLarge(p, n * sizeof(T));
    ::operator delete(p, std::align_val_t(64));
  }
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using ByteBuffer = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

// A copy of `bytes` made with one memcpy: a ByteBuffer's copy and range constructors go
// element by element through the allocator (3x slower on 32 MiB values).
ByteBuffer CopyBytes(const uint8_t* data, size_t size);

// Storage types of KV. The FP8 types are the OCP 8-bit floats serving engines keep KV in (vLLM
// `--kv-cache-dtype fp8`, SGLang `fp8_e4m3`/`fp8_e5m2`): E4M3 "FN" (bias 7, no infinities, NaN
// S.1111.111, largest 448) and E5M2 (bias 15, IEEE-like infinities and NaNs, largest 57344).
// Conversions into them round to nearest even and saturate: a finite value beyond the largest
// becomes the largest (what engines do by clamping after scaling), an infinity stays one in E5M2
// and saturates in E4M3; NaN stays NaN. A scale an engine applies to its FP8 cache is carried
// beside the codes (Fp8Scales), not in the dtype.
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kE4M3 = 3, kE5M2 = 4 };
inline constexpr DType kLastDType = DType::kE5M2;

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
Result<DType> ParseDType(std::string_view name);

enum class KvPart : uint8_t { kKey = 0, kValue = 1 };

// Default number of tokens in the chunk that the codec and the network move as one unit.
inline constexpr uint32_t kDefaultChunkTokens = 256;

struct KvShape {
  uint32_t n_layer = 0;
  uint32_t n_head_kv = 0;
  uint32_t n_token = 0;
  uint32_t head_dim = 0;

  uint64_t slab_numel() const { return uint64_t{n_token} * head_dim; }
  uint64_t n_slab() const { return uint64_t{n_layer} * 2 * n_head_kv; }
  uint64_t numel() const { return n_slab() * slab_numel(); }
  // Slab index of (layer, part, head) in the [layer][K|V][head] order.
  uint64_t slab_index(uint32_t layer, KvPart part, uint32_t head) const {
    return (uint64_t{layer} * 2 + static_cast<uint32_t>(part)) * n_head_kv + head;
  }
  // n_token may be 0 (an empty prompt); the other dimensions must be positive.
  Status Validate() const;
  std::string ToString() const;  // "5x4x384x8 (layer x head_kv x token x dim)"
  bool operator==(const KvShape&) const = default;
};

// Named shapes for synthetic KV: llama3-8b (32, 8, *, 128), stories260k (5, 4, *, 8),
// babyllama105 (5, 4, *, 16).
Result<KvShape> ShapePreset(std::string_view name, uint32_t n_token);

// A serving engine's paged cache, token-major: per layer, K pages then V pages, each page
// `block_size` token rows of [n_head_kv][head_dim] — vLLM's per-layer
// [2, num_blocks, block_size, num_kv_heads, head_size]. Token t of the sequence is row t % block_size
// of page block_table[t / block_size].
struct KvPages {
  std::vector<uint8_t*> layer_base;  // one per layer: that layer's K pages; its V pages part_stride elements on
  uint64_t part_stride = 0;          // elements from a layer's K pages to its V pages (num_blocks * block_size * H * D)
  uint32_t block_size = 0;           // tokens per page
  uint32_t num_blocks = 0;           // pages per part of a layer (page ids must be below it)
  std::vector<uint32_t> block_table; // page id of each block_size tokens of the sequence
};

// The dequantisation scales of an FP8 cache, as engines keep them: the value of a code is
// code * scale. vLLM's k_scale/v_scale are one per (layer, K/V) — kTensor; per-head scales are one
// per (layer, K/V, head) — kHead. `scale` is in slab order ([layer][K|V] or [layer][K|V][head]).
// Codec stages code the codes; the scales travel in the frame (flag bit 1) and a decoder
// converts codes to its destination's scales (see Pipeline::DecodeView).
struct Fp8Scales {
  enum class Granularity : uint8_t { kNone = 0, kTensor = 1, kHead = 2 };
  Granularity granularity = Granularity::kNone;
  std::vector<float> scale;

  bool empty() const { return granularity == Granularity::kNone; }
  // Scales a block of this shape needs: 2 * n_layer (kTensor), n_slab (kHead), 0 (kNone).
  static uint64_t Count(Granularity g, const KvShape& shape);
  // The scale of slab `slab_index` of a block of `shape` (1 when empty).
  float ForSlab(const KvShape& shape, uint64_t slab_index) const {
    if (granularity == Granularity::kNone) return 1.0f;
    return scale[granularity == Granularity::kHead ? slab_index : slab_index / shape.n_head_kv];
  }
  // Those of layers [layer_begin, layer_begin + n_layers).
  Fp8Scales Layers(const KvShape& shape, uint32_t layer_begin, uint32_t n_layers) const;
  bool operator==(const Fp8Scales&) const = default;
};
const char* Fp8GranularityName(Fp8Scales::Granularity g);  // "none", "tensor", "head"
Result<Fp8Scales::Granularity> ParseFp8Granularity(std::string_view name);

class KvBlock {
 public:
  KvBlock() = default;
  // Zero-filled block. Fails on an invalid shape or one above the 2^32-element limit.
  static Result<KvBlock> Create(const KvShape& shape, DType dtype);
  // A non-owning view over caller memory in the KV layout: slab (layer, part, head) starts
  // `slab_stride` elements after the previous one (0 = dense, slab_numel()); within a slab token
  // rows are dense. A decode node's cache with room for more tokens than the prompt is such a
  // view (stride = capacity * head_dim). The memory must outlive the view; copies of a view are
  // views of the same memory. Decoding into a view writes the caller's memory in place.
  static Result<KvBlock> View(const KvShape& shape, DType dtype, void* data, uint64_t slab_stride = 0);
  // A view over an engine's paged, token-major cache (KvPages): no copy. Its slabs are not
  // contiguous, so code reads them with ReadSlab (gathered into a scratch slab, L2-sized) and
  // writes them with SlabToWrite / WroteSlab (scattered back); slab_at() is not valid on it.
  // Fails on a table too short for n_token, a page id beyond num_blocks or a null layer base.
  static Result<KvBlock> PagedView(const KvShape& shape, DType dtype, KvPages pages);
  // A view of layers [layer_begin, layer_begin + n_layers) of this block (owning or a view);
  // the same memory, no copy. Const blocks give views that must only be read.
  Result<KvBlock> LayerView(uint32_t layer_begin, uint32_t n_layers) const;

  const KvShape& shape() const { return shape_; }
  DType dtype() const { return dtype_; }
  bool is_view() const { return view_ != nullptr || pages_ != nullptr; }
  bool is_paged() const { return pages_ != nullptr; }
  // Whether slabs follow each other without gaps, so data() .. data() + bytes() is the block.
  bool is_dense() const { return !pages_ && slab_stride() == shape_.slab_numel(); }
  // Elements between the starts of consecutive slabs.
  uint64_t slab_stride() const { return view_ ? view_stride_ : shape_.slab_numel(); }
  // numel() * dtype size: the block's bytes, which a strided view does not hold contiguously.
  size_t bytes() const { return shape_.numel() * DTypeSize(dtype_); }
  uint8_t* data() { return view_ ? view_ : data_.data(); }
  const uint8_t* data() const { return view_ ? view_ : data_.data(); }
  // First position of these tokens in the request's sequence (chunks of one prompt differ here).
  uint32_t token_offset() const { return token_offset_; }
  void set_token_offset(uint32_t offset) { token_offset_ = offset; }
  // Sequence positions of the tokens when they are not contiguous (after token selection); empty
  // means token i sits at token_offset() + i. RoPE was applied at these positions.
  const std::vector<uint32_t>& positions() const { return positions_; }
  void set_positions(std::vector<uint32_t> positions) { positions_ = std::move(positions); }
  uint32_t position(uint32_t token) const { return positions_.empty() ? token_offset_ + token : positions_[token]; }
  // An FP8 block's scales (empty: every code is its value). Setting them checks the dtype is FP8,
  // the count fits the shape and every scale is finite and positive, naming the first that is not.
  const Fp8Scales& fp8_scales() const { return scales_; }
  Status set_fp8_scales(Fp8Scales scales);
  // Multiplies the values of each slab by mul[slab] in place (FP8 codes are re-rounded,
  // saturating), any layout; slabs whose factor is 1 are not touched.
  void ScaleSlabs(const std::vector<float>& mul);

  // The dense [n_token][head_dim] slab of (layer, part, head), in this block's dtype.
  uint8_t* slab(uint32_t layer, KvPart part, uint32_t head) { return slab_at(shape_.slab_index(layer, part, head)); }
  const uint8_t* slab(uint32_t layer, KvPart part, uint32_t head) const {
    return const_cast<KvBlock*>(this)->slab(layer, part, head);
  }
  uint8_t* slab_at(uint64_t slab_index) { return data() + slab_index * slab_stride() * DTypeSize(dtype_); }
  const uint8_t* slab_at(uint64_t slab_index) const {
    return const_cast<KvBlock*>(this)->slab_at(slab_index);
  }
  // Slab access whatever the layout. ReadSlab: the slab's own memory when its token rows are dense
  // in place (an owning block, a strided view), else the slab gathered into `scratch`.
  // SlabToWrite: where to write slab s (its memory, or `scratch` sized for it); WroteSlab then
  // scatters a scratch slab back to the pages (nothing to do for the slab's own memory).
  const uint8_t* ReadSlab(uint64_t slab_index, ByteBuffer& scratch) const;
  uint8_t* SlabToWrite(uint64_t slab_index, ByteBuffer& scratch);
  void WroteSlab(uint64_t slab_index, const uint8_t* written);
  // Token `token`'s [head_dim] row of slab `slab_index`, in any layout.
  const uint8_t* TokenRow(uint64_t slab_index, uint32_t token) const;
  // The addresses of all n_token rows of slab `slab_index`, in any layout (a paged view's walked
  // page by page). Code that reads or writes a paged slab a block of rows at a time takes them
  // instead of ReadSlab's whole-slab gather, so its memory traffic overlaps its arithmetic.
  void SlabRows(uint64_t slab_index, std::vector<uint8_t*>* rows) const;

  float* f32() { return reinterpret_cast<float*>(data()); }
  const float* f32() const { return reinterpret_cast<const float*>(data()); }

  // Element access for tests and tools (values: an FP8 code times its scale); hot code works on slabs.
  float Get(uint32_t layer, KvPart part, uint32_t head, uint32_t token, uint32_t d) const;
  void Set(uint32_t layer, KvPart part, uint32_t head, uint32_t token, uint32_t d, float v);

  // An owning, dense copy in `dtype` (views too). From FP8 with scales to another dtype the values
  // are scaled; to the same FP8 dtype the codes and scales are copied.
  Result<KvBlock> ConvertTo(DType dtype) const;
  // Copy of tokens [begin, begin + count); the copy's token_offset is this one's plus begin.
  Result<KvBlock> SliceTokens(uint32_t begin, uint32_t count) const;
  // Reshapes to a new shape/dtype, reusing the allocation where it is large enough, and forgets
  // positions and (owning blocks) scales. A view cannot change: it accepts only its own shape and
  // dtype, and keeps its scales (they are its destination's).
  Status Reset(const KvShape& shape, DType dtype);

 private:
  KvShape shape_;
  DType dtype_ = DType::kF32;
  uint32_t token_offset_ = 0;
  std::vector<uint32_t> positions_;
  Fp8Scales scales_;
  ByteBuffer data_;
  uint8_t* view_ = nullptr;  // caller memory when a view
  uint64_t view_stride_ = 0;
  std::shared_ptr<const KvPages> pages_;  // a paged view: the engine's pages
  // Address of token `token`'s row of slab `slab_index` in a paged view.
  uint8_t* PagedRow(uint64_t slab_index, uint32_t token) const;
  // Where a paged slab's rows lie: row r of page id P at base + P * page_bytes + r * row_stride.
  // Walking pages with it costs no division per row (PagedRow's five did cost more than the copy).
  struct PagedSlab {
    uint8_t* base;
    uint64_t row_stride, page_bytes;
  };
  PagedSlab PagedSlabOf(uint64_t slab_index) const;
};

// Values to an FP8 cache as engines make one: each (layer, K/V) (kTensor) or (layer, K/V, head)
// (kHead) scaled so its largest finite magnitude becomes the format's largest value (vLLM's
// amax / 448 for E4M3), codes rounded to nearest even; kNone converts unscaled. A slab of zeros
// gets scale 1. The input may be any dtype and layout (an FP8 input's scales are applied first).
Result<KvBlock> ToScaledFp8(const KvBlock& values, DType fp8, Fp8Scales::Granularity granularity);

// Splits a block into chunks of at most chunk_tokens tokens (the last may be shorter).
Result<std::vector<KvBlock>> SplitIntoChunks(const KvBlock& block, uint32_t chunk_tokens = kDefaultChunkTokens);
// Joins chunks in token order back into one block; shapes must agree except n_token.
Result<KvBlock> JoinChunks(const std::vector<KvBlock>& chunks);

// Element-wise conversions between storage dtypes and float. Vectorised (F16C) on CPUs that
// have it, with scalar references below that tests compare against.
void ConvertToF32(DType src_dtype, const void* src, float* dst, size_t n);
void ConvertFromF32(DType dst_dtype, const float* src, void* dst, size_t n);
// As ConvertFromF32, with non-temporal stores where possible: for output that is written once
// and not read back soon (decoding a large block), so the stores skip the read-for-ownership.
void ConvertFromF32Streaming(DType dst_dtype, const float* src, void* dst, size_t n);
// Row r of `src` (row_len values each) to rows[r], as ConvertFromF32Streaming, with one fence
// after the last row rather than one per row: for the scattered rows of a paged cache.
void ConvertFromF32StreamingRows(DType dst_dtype, const float* src, size_t row_len, uint8_t* const* rows,
                                 size_t n_rows);
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);       // round to nearest even, overflow to inf, NaN kept
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);   // round to nearest even, NaN kept quiet
// value * mul to FP8 (`fp8` is kE4M3 or kE5M2), and FP8 * mul to `dst_dtype`: what a scaled FP8
// codec does, with every rounding as ConvertFromF32 / ConvertToF32 would do it on the product;
// fused in one pass (no float buffer) for f16, the common case.
void ConvertToFp8Scaled(DType src_dtype, const void* src, float mul, DType fp8, uint8_t* dst, size_t n);
void ConvertFromFp8Scaled(DType fp8, const uint8_t* src, float mul, DType dst_dtype, void* dst, size_t n);
// ConvertFromFp8Scaled of n_rows rows of row_len values, src contiguous, row r written to
// dst_rows[r] (a paged cache's rows): prepared once for all rows, so long runs' table lookup
// applies however short each row is.
void ConvertFromFp8ScaledRows(DType fp8, const uint8_t* src, float mul, DType dst_dtype, uint8_t* const* dst_rows,
                              size_t n_rows, size_t row_len);
bool IsFp8(DType dtype);
float E4M3ToFloat(uint8_t b);
uint8_t FloatToE4M3(float f);        // round to nearest even, saturating (see DType)
float E5M2ToFloat(uint8_t b);
uint8_t FloatToE5M2(float f);        // round to nearest even, saturating, infinities kept
// Whether ConvertToF32/ConvertFromF32 run their F16C/AVX2 loops now: the CPU has them and the
// SIMD tier (kvserve/cpu.h) is not capped below avx2; else the scalar loops.
bool HaveF16cConversions();
namespace scalar {
void HalfToFloat(const uint16_t* src, float* dst, size_t n);
void FloatToHalf(const float* src, uint16_t* dst, size_t n);
// The FP8 definitions by arithmetic (frexp, ldexp, nearbyint), the reference the bit-level
// conversions of every tier are tested against.
float Fp8ToFloatReference(DType dtype, uint8_t b);
uint8_t FloatToFp8Reference(DType dtype, float f);
}  // namespace scalar

// Error statistics between two blocks of the same shape, per part.
struct KvErrorStats {
  double max_abs = 0, mean_abs = 0, snr_db = 0, cosine = 0;
};
struct KvCompareResult {
  KvErrorStats k, v;
};
Result<KvCompareResult> CompareKv(const KvBlock& reference, const KvBlock& test);

}  // namespace kvserve
