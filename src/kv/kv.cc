// KvShape / KvBlock: validation, element access, chunking and error statistics.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "kvserve/kv.h"

#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace kvserve {

namespace {
// Hard ceiling on one block: 2^32 elements (8 GiB of f16). A frame that claims more is refused
// before anything is allocated.
constexpr uint64_t kMaxKvElements = uint64_t{1} << 32;
}  // namespace

Status KvShape::Validate() const {
  auto bad = [&](const char* field, uint32_t v, uint32_t hi) {
    return Status::InvalidArgument(std::string("shape field ") + field + "=" + std::to_string(v) +
                                   " out of range [1, " + std::to_string(hi) + "]");
  };
  if (n_layer == 0 || n_layer > 4096) return bad("n_layer", n_layer, 4096);
  if (n_head_kv == 0 || n_head_kv > 4096) return bad("n_head_kv", n_head_kv, 4096);
  if (head_dim == 0 || head_dim > 65536) return bad("head_dim", head_dim, 65536);
  if (numel() > kMaxKvElements) {
    return Status::OutOfRange("shape " + ToString() + " has " + std::to_string(numel()) +
                              " elements, above the limit of " + std::to_string(kMaxKvElements));
  }
  return Status::Ok();
}

std::string KvShape::ToString() const {
  return std::to_string(n_layer) + "x" + std::to_string(n_head_kv) + "x" + std::to_string(n_token) + "x" +
         std::to_string(head_dim);
}

Result<KvShape> ShapePreset(std::string_view name, uint32_t n_token) {
  if (name == "llama3-8b") return KvShape{32, 8, n_token, 128};
  if (name == "stories260k" || name == "stories260K") return KvShape{5, 4, n_token, 8};
  if (name == "babyllama105") return KvShape{5, 4, n_token, 16};
  return Status::InvalidArgument("unknown shape preset '" + std::string(name) +
                                 "' (expected llama3-8b, stories260k or babyllama105)");
}

Result<KvBlock> KvBlock::Create(const KvShape& shape, DType dtype) {
  KvBlock b;
  KV_RETURN_IF_ERROR(b.Reset(shape, dtype));
  std::fill(b.data_.begin(), b.data_.end(), 0);
  return b;
}

Result<KvBlock> KvBlock::View(const KvShape& shape, DType dtype, void* data, uint64_t slab_stride) {
  KV_RETURN_IF_ERROR(shape.Validate());
  if (data == nullptr) return Status::InvalidArgument("KV view over a null pointer");
  if (slab_stride == 0) slab_stride = shape.slab_numel();
  if (slab_stride < shape.slab_numel()) {
    return Status::InvalidArgument("KV view slab_stride=" + std::to_string(slab_stride) + " is below one slab (" +
                                   std::to_string(shape.slab_numel()) + " elements of shape " + shape.ToString() + ")");
  }
  KvBlock b;
  b.shape_ = shape;
  b.dtype_ = dtype;
  b.view_ = static_cast<uint8_t*>(data);
  b.view_stride_ = slab_stride;
  return b;
}

Result<KvBlock> KvBlock::PagedView(const KvShape& shape, DType dtype, KvPages pages) {
  KV_RETURN_IF_ERROR(shape.Validate());
  if (pages.layer_base.size() != shape.n_layer) {
    return Status::InvalidArgument("paged KV has " + std::to_string(pages.layer_base.size()) + " layer bases for " +
                                   std::to_string(shape.n_layer) + " layers");
  }
  for (size_t l = 0; l < pages.layer_base.size(); ++l) {
    if (pages.layer_base[l] == nullptr) return Status::InvalidArgument("paged KV layer " + std::to_string(l) + " base is null");
  }
  if (pages.block_size == 0) return Status::InvalidArgument("paged KV block_size=0 must be positive");
  const uint64_t need = (uint64_t{shape.n_token} + pages.block_size - 1) / pages.block_size;
  if (pages.block_table.size() < need) {
    return Status::InvalidArgument("paged KV block table has " + std::to_string(pages.block_table.size()) +
                                   " pages, " + std::to_string(shape.n_token) + " tokens of block_size " +
                                   std::to_string(pages.block_size) + " need " + std::to_string(need));
  }
  for (uint64_t i = 0; i < need; ++i) {
    if (pages.block_table[i] >= pages.num_blocks) {
      return Status::InvalidArgument("paged KV block table entry " + std::to_string(i) + " = " +
                                     std::to_string(pages.block_table[i]) + " is not below num_blocks=" +
                                     std::to_string(pages.num_blocks));
    }
  }
  const uint64_t part_elems = uint64_t{pages.num_blocks} * pages.block_size * shape.n_head_kv * shape.head_dim;
  if (pages.part_stride < part_elems) {
    return Status::InvalidArgument("paged KV part_stride=" + std::to_string(pages.part_stride) + " is below one part's " +
                                   std::to_string(part_elems) + " elements");
  }
  KvBlock b;
  b.shape_ = shape;
  b.dtype_ = dtype;
  b.pages_ = std::make_shared<const KvPages>(std::move(pages));
  return b;
}

uint8_t* KvBlock::PagedRow(uint64_t slab_index, uint32_t token) const {
  const KvPages& p = *pages_;
  const uint64_t H = shape_.n_head_kv, head = slab_index % H, part = (slab_index / H) % 2, layer = slab_index / (2 * H);
  const uint64_t row = uint64_t{p.block_table[token / p.block_size]} * p.block_size + token % p.block_size;
  const uint64_t elem = part * p.part_stride + (row * H + head) * shape_.head_dim;
  return p.layer_base[layer] + elem * DTypeSize(dtype_);
}

const uint8_t* KvBlock::TokenRow(uint64_t slab_index, uint32_t token) const {
  if (pages_) return PagedRow(slab_index, token);
  return slab_at(slab_index) + size_t{token} * shape_.head_dim * DTypeSize(dtype_);
}

KvBlock::PagedSlab KvBlock::PagedSlabOf(uint64_t slab_index) const {
  const KvPages& p = *pages_;
  const uint64_t H = shape_.n_head_kv, head = slab_index % H, part = (slab_index / H) % 2, layer = slab_index / (2 * H);
  const uint64_t es = DTypeSize(dtype_), row_stride = H * shape_.head_dim * es;
  return {p.layer_base[layer] + (part * p.part_stride + head * shape_.head_dim) * es, row_stride,
          uint64_t{p.block_size} * row_stride};
}

void KvBlock::SlabRows(uint64_t slab_index, std::vector<uint8_t*>* rows) const {
  const uint32_t n = shape_.n_token;
  rows->resize(n);
  if (!pages_) {
    uint8_t* base = const_cast<KvBlock*>(this)->slab_at(slab_index);
    const size_t row = size_t{shape_.head_dim} * DTypeSize(dtype_);
    for (uint32_t t = 0; t < n; ++t) (*rows)[t] = base + t * row;
    return;
  }
  const uint32_t bs = pages_->block_size;
  const PagedSlab ps = PagedSlabOf(slab_index);
  for (uint32_t t0 = 0, pi = 0; t0 < n; t0 += bs, ++pi) {
    uint8_t* page = ps.base + pages_->block_table[pi] * ps.page_bytes;
    for (uint32_t r = 0; r < std::min(bs, n - t0); ++r) (*rows)[t0 + r] = page + r * ps.row_stride;
  }
}

const uint8_t* KvBlock::ReadSlab(uint64_t slab_index, ByteBuffer& scratch) const {
  if (!pages_) return slab_at(slab_index);
  const size_t row = size_t{shape_.head_dim} * DTypeSize(dtype_);
  const uint32_t n = shape_.n_token, bs = pages_->block_size;
  const std::vector<uint32_t>& table = pages_->block_table;
  const PagedSlab ps = PagedSlabOf(slab_index);
  scratch.resize(size_t(n) * row);
  // Rows are a page row's stride apart (n_head_kv rows of this size) and pages anywhere: too far
  // for the hardware prefetchers to follow, so the next page's rows are fetched by hand while
  // this page's are copied.
  uint8_t* out = scratch.data();
  for (uint32_t t0 = 0, pi = 0; t0 < n; t0 += bs, ++pi) {
    const uint8_t* page = ps.base + table[pi] * ps.page_bytes;
    const uint32_t rows = std::min(bs, n - t0);
    if (t0 + bs < n) {
      const uint8_t* next = ps.base + table[pi + 1] * ps.page_bytes;
      const uint32_t next_rows = std::min(bs, n - t0 - bs);
      for (uint32_t r = 0; r < next_rows; ++r)
        for (size_t b = 0; b < row; b += 64) __builtin_prefetch(next + r * ps.row_stride + b);
    }
    for (uint32_t r = 0; r < rows; ++r) std::memcpy(out + size_t(t0 + r) * row, page + r * ps.row_stride, row);
  }
  return scratch.data();
}

uint8_t* KvBlock::SlabToWrite(uint64_t slab_index, ByteBuffer& scratch) {
  if (!pages_) return slab_at(slab_index);
  scratch.resize(size_t(shape_.n_token) * shape_.head_dim * DTypeSize(dtype_));
  return scratch.data();
}

void KvBlock::WroteSlab(uint64_t slab_index, const uint8_t* written) {
  if (!pages_) return;
  const size_t row = size_t{shape_.head_dim} * DTypeSize(dtype_);
  const uint32_t n = shape_.n_token, bs = pages_->block_size;
  const std::vector<uint32_t>& table = pages_->block_table;
  const PagedSlab ps = PagedSlabOf(slab_index);
#ifdef __SSE2__
  // Decoded rows are written once and not read back soon: non-temporal stores skip reading each
  // destination line first (what the dense path's streaming stores do), where rows are 16-byte
  // multiples at 16-byte aligned addresses (an engine's cache is). Every row starts a whole
  // number of rows after the slab's base, so they are aligned when the row size, that base and
  // the written slab are.
  if (row % 16 == 0 && reinterpret_cast<uintptr_t>(ps.base) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(written) % 16 == 0) {
    for (uint32_t t0 = 0, pi = 0; t0 < n; t0 += bs, ++pi) {
      uint8_t* page = ps.base + table[pi] * ps.page_bytes;
      const uint32_t rows = std::min(bs, n - t0);
      for (uint32_t r = 0; r < rows; ++r) {
        __m128i* dst = reinterpret_cast<__m128i*>(page + r * ps.row_stride);
        const __m128i* src = reinterpret_cast<const __m128i*>(written + size_t(t0 + r) * row);
        for (size_t i = 0; i < row / 16; ++i) _mm_stream_si128(dst + i, _mm_load_si128(src + i));
      }
    }
    _mm_sfence();
    return;
  }
#endif
  for (uint32_t t0 = 0, pi = 0; t0 < n; t0 += bs, ++pi) {
    uint8_t* page = ps.base + table[pi] * ps.page_bytes;
    const uint32_t rows = std::min(bs, n - t0);
    for (uint32_t r = 0; r < rows; ++r) std::memcpy(page + r * ps.row_stride, written + size_t(t0 + r) * row, row);
  }
}

uint64_t Fp8Scales::Count(Granularity g, const KvShape& shape) {
  switch (g) {
    case Granularity::kNone: return 0;
    case Granularity::kTensor: return uint64_t{shape.n_layer} * 2;
    case Granularity::kHead: return shape.n_slab();
  }
  return 0;
}

Fp8Scales Fp8Scales::Layers(const KvShape& shape, uint32_t layer_begin, uint32_t n_layers) const {
  if (empty()) return {};
  const uint64_t per_layer = Count(granularity, shape) / shape.n_layer;
  Fp8Scales out;
  out.granularity = granularity;
  out.scale.assign(scale.begin() + layer_begin * per_layer, scale.begin() + (layer_begin + n_layers) * per_layer);
  return out;
}

const char* Fp8GranularityName(Fp8Scales::Granularity g) {
  switch (g) {
    case Fp8Scales::Granularity::kNone: return "none";
    case Fp8Scales::Granularity::kTensor: return "tensor";
    case Fp8Scales::Granularity::kHead: return "head";
  }
  return "?";
}

Result<Fp8Scales::Granularity> ParseFp8Granularity(std::string_view name) {
  for (auto g : {Fp8Scales::Granularity::kNone, Fp8Scales::Granularity::kTensor, Fp8Scales::Granularity::kHead}) {
    if (name == Fp8GranularityName(g)) return g;
  }
  return Status::InvalidArgument("FP8 scale granularity '" + std::string(name) + "' is not none, tensor or head");
}

Status KvBlock::set_fp8_scales(Fp8Scales scales) {
  if (scales.empty()) {
    if (!scales.scale.empty()) return Status::InvalidArgument("FP8 scales of granularity none hold " +
                                                              std::to_string(scales.scale.size()) + " values");
    scales_ = Fp8Scales{};
    return Status::Ok();
  }
  if (!IsFp8(dtype_)) {
    return Status::InvalidArgument(std::string("FP8 scales on a ") + DTypeName(dtype_) + " block; only e4m3 and e5m2 carry them");
  }
  const uint64_t want = Fp8Scales::Count(scales.granularity, shape_);
  if (scales.scale.size() != want) {
    return Status::InvalidArgument(std::string("FP8 scales per ") + Fp8GranularityName(scales.granularity) + " hold " +
                                   std::to_string(scales.scale.size()) + " values, shape " + shape_.ToString() +
                                   " needs " + std::to_string(want));
  }
  for (size_t i = 0; i < scales.scale.size(); ++i) {
    if (!std::isfinite(scales.scale[i]) || !(scales.scale[i] > 0)) {
      return Status::InvalidArgument("FP8 scale " + std::to_string(i) + " = " + std::to_string(scales.scale[i]) +
                                     " is not finite and positive");
    }
  }
  scales_ = std::move(scales);
  return Status::Ok();
}

void KvBlock::ScaleSlabs(const std::vector<float>& mul) {
  const size_t n = shape_.slab_numel();
  std::vector<float> tmp;
  ByteBuffer scratch;
  for (uint64_t s = 0; s < shape_.n_slab(); ++s) {
    if (mul[s] == 1.0f) continue;
    // A paged slab is gathered, scaled and scattered back; any other is scaled where it lies.
    uint8_t* dst = pages_ ? const_cast<uint8_t*>(ReadSlab(s, scratch)) : slab_at(s);
    if (IsFp8(dtype_)) {
      tmp.resize(n);
      ConvertFromFp8Scaled(dtype_, dst, mul[s], DType::kF32, tmp.data(), n);
      ConvertToFp8Scaled(DType::kF32, tmp.data(), 1.0f, dtype_, dst, n);
    } else if (dtype_ == DType::kF32) {
      float* f = reinterpret_cast<float*>(dst);
      for (size_t i = 0; i < n; ++i) f[i] *= mul[s];
    } else {
      tmp.resize(n);
      ConvertToF32(dtype_, dst, tmp.data(), n);
      for (size_t i = 0; i < n; ++i) tmp[i] *= mul[s];
      ConvertFromF32(dtype_, tmp.data(), dst, n);
    }
    WroteSlab(s, dst);
  }
}

Result<KvBlock> ToScaledFp8(const KvBlock& values, DType fp8, Fp8Scales::Granularity granularity) {
  if (!IsFp8(fp8)) return Status::InvalidArgument(std::string("ToScaledFp8 to ") + DTypeName(fp8) + ", not e4m3 or e5m2");
  const KvShape& shape = values.shape();
  KvBlock out;
  KV_RETURN_IF_ERROR(out.Reset(shape, fp8));
  out.set_token_offset(values.token_offset());
  out.set_positions(values.positions());
  const size_t n = shape.slab_numel();
  const float largest = fp8 == DType::kE4M3 ? 448.0f : 57344.0f;
  // Largest finite magnitude of every scale group (a (layer, K/V) or a slab).
  const uint64_t per_group = granularity == Fp8Scales::Granularity::kTensor ? shape.n_head_kv : 1;
  std::vector<float> amax(shape.n_slab() / per_group, 0.0f), x(n);
  ByteBuffer scratch;
  auto read = [&](uint64_t s) {
    const float mul = values.fp8_scales().ForSlab(shape, s);
    ConvertToF32(values.dtype(), values.ReadSlab(s, scratch), x.data(), n);
    if (mul != 1.0f) for (float& v : x) v *= mul;
  };
  Fp8Scales scales;
  scales.granularity = granularity;
  if (granularity != Fp8Scales::Granularity::kNone) {
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      read(s);
      float& m = amax[s / per_group];
      for (float v : x) {
        const float a = std::fabs(v);
        if (std::isfinite(a) && a > m) m = a;
      }
    }
    for (float m : amax) scales.scale.push_back(m > 0 ? std::max(m / largest, FLT_MIN) : 1.0f);
  }
  for (uint64_t s = 0; s < shape.n_slab(); ++s) {
    read(s);
    ConvertToFp8Scaled(DType::kF32, x.data(), 1.0f / scales.ForSlab(shape, s), fp8, out.slab_at(s), n);
  }
  KV_RETURN_IF_ERROR(out.set_fp8_scales(std::move(scales)));
  return out;
}

Result<KvBlock> KvBlock::LayerView(uint32_t layer_begin, uint32_t n_layers) const {
  if (n_layers == 0 || uint64_t{layer_begin} + n_layers > shape_.n_layer) {
    return Status::InvalidArgument("layer range [" + std::to_string(layer_begin) + ", " +
                                   std::to_string(uint64_t{layer_begin} + n_layers) + ") is not within the block's " +
                                   std::to_string(shape_.n_layer) + " layers");
  }
  KvShape s = shape_;
  s.n_layer = n_layers;
  if (pages_) {
    KvPages p = *pages_;
    p.layer_base.assign(pages_->layer_base.begin() + layer_begin, pages_->layer_base.begin() + layer_begin + n_layers);
    KV_ASSIGN_OR_RETURN(KvBlock v, PagedView(s, dtype_, std::move(p)));
    v.token_offset_ = token_offset_;
    v.positions_ = positions_;
    v.scales_ = scales_.Layers(shape_, layer_begin, n_layers);
    return v;
  }
  const uint8_t* base = slab(layer_begin, KvPart::kKey, 0);
  KV_ASSIGN_OR_RETURN(KvBlock v, View(s, dtype_, const_cast<uint8_t*>(base), slab_stride()));
  v.token_offset_ = token_offset_;
  v.positions_ = positions_;
  v.scales_ = scales_.Layers(shape_, layer_begin, n_layers);
  return v;
}

Status KvBlock::Reset(const KvShape& shape, DType dtype) {
  KV_RETURN_IF_ERROR(shape.Validate());
  if (is_view()) {
    if (!(shape == shape_) || dtype != dtype_) {
      return Status::InvalidArgument("a KV view of shape " + shape_.ToString() + " " + DTypeName(dtype_) +
                                     " cannot hold " + shape.ToString() + " " + DTypeName(dtype));
    }
    positions_.clear();
    dtype_ = dtype;
    return Status::Ok();
  }
  positions_.clear();
  scales_ = Fp8Scales{};
  shape_ = shape;
  dtype_ = dtype;
  data_.resize(shape.numel() * DTypeSize(dtype));
  return Status::Ok();
}

float KvBlock::Get(uint32_t layer, KvPart part, uint32_t head, uint32_t token, uint32_t d) const {
  size_t i = size_t{token} * shape_.head_dim + d;
  const uint8_t* s = nullptr;
  if (pages_) {
    s = PagedRow(shape_.slab_index(layer, part, head), token);
    i = d;
  } else {
    s = slab(layer, part, head);
  }
  switch (dtype_) {
    case DType::kF32: { float f; std::memcpy(&f, s + 4 * i, 4); return f; }
    case DType::kF16: { uint16_t h; std::memcpy(&h, s + 2 * i, 2); return HalfToFloat(h); }
    case DType::kBF16: { uint16_t h; std::memcpy(&h, s + 2 * i, 2); return BFloat16ToFloat(h); }
    case DType::kE4M3: return E4M3ToFloat(s[i]) * scales_.ForSlab(shape_, shape_.slab_index(layer, part, head));
    case DType::kE5M2: return E5M2ToFloat(s[i]) * scales_.ForSlab(shape_, shape_.slab_index(layer, part, head));
  }
  return 0;
}

void KvBlock::Set(uint32_t layer, KvPart part, uint32_t head, uint32_t token, uint32_t d, float v) {
  if (!scales_.empty()) v /= scales_.ForSlab(shape_, shape_.slab_index(layer, part, head));
  if (pages_) {
    ConvertFromF32(dtype_, &v, PagedRow(shape_.slab_index(layer, part, head), token) + DTypeSize(dtype_) * d, 1);
    return;
  }
  const size_t i = size_t{token} * shape_.head_dim + d;
  ConvertFromF32(dtype_, &v, slab(layer, part, head) + DTypeSize(dtype_) * i, 1);
}

Result<KvBlock> KvBlock::ConvertTo(DType dtype) const {
  KvBlock out;
  KV_RETURN_IF_ERROR(out.Reset(shape_, dtype));
  out.token_offset_ = token_offset_;
  out.positions_ = positions_;
  if (dtype == dtype_) out.scales_ = scales_;
  if (dtype == dtype_ && is_dense()) {
    std::memcpy(out.data(), data(), bytes());
    return out;
  }
  const size_t n = shape_.slab_numel();
  std::vector<float> tmp(dtype_ == DType::kF32 || dtype == DType::kF32 ? 0 : n);
  ByteBuffer scratch;
  for (uint64_t s = 0; s < shape_.n_slab(); ++s) {
    const uint8_t* src = ReadSlab(s, scratch);
    if (dtype != dtype_ && !scales_.empty()) {
      // Values, not codes: each code times its slab's scale.
      ConvertFromFp8Scaled(dtype_, src, scales_.ForSlab(shape_, s), dtype, out.slab_at(s), n);
    } else if (dtype == dtype_) {
      std::memcpy(out.slab_at(s), src, n * DTypeSize(dtype));
    } else if (dtype_ == DType::kF32) {
      ConvertFromF32(dtype, reinterpret_cast<const float*>(src), out.slab_at(s), n);
    } else if (dtype == DType::kF32) {
      ConvertToF32(dtype_, src, reinterpret_cast<float*>(out.slab_at(s)), n);
    } else {
      ConvertToF32(dtype_, src, tmp.data(), n);
      ConvertFromF32(dtype, tmp.data(), out.slab_at(s), n);
    }
  }
  return out;
}

Result<KvBlock> KvBlock::SliceTokens(uint32_t begin, uint32_t count) const {
  if (uint64_t{begin} + count > shape_.n_token) {
    return Status::InvalidArgument("token slice [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                                   ") exceeds n_token=" + std::to_string(shape_.n_token));
  }
  KvShape s = shape_;
  s.n_token = count;
  KvBlock out;
  KV_RETURN_IF_ERROR(out.Reset(s, dtype_));
  out.token_offset_ = token_offset_ + begin;
  out.scales_ = scales_;
  if (!positions_.empty()) out.positions_.assign(positions_.begin() + begin, positions_.begin() + begin + count);
  const size_t row = size_t{shape_.head_dim} * DTypeSize(dtype_);
  ByteBuffer scratch;
  for (uint64_t i = 0; i < shape_.n_slab(); ++i) {
    std::memcpy(out.slab_at(i), ReadSlab(i, scratch) + begin * row, count * row);
  }
  return out;
}

Result<std::vector<KvBlock>> SplitIntoChunks(const KvBlock& block, uint32_t chunk_tokens) {
  if (chunk_tokens == 0) return Status::InvalidArgument("chunk_tokens=0 must be positive");
  std::vector<KvBlock> chunks;
  for (uint32_t t = 0; t < block.shape().n_token; t += chunk_tokens) {
    KV_ASSIGN_OR_RETURN(KvBlock c, block.SliceTokens(t, std::min(chunk_tokens, block.shape().n_token - t)));
    chunks.push_back(std::move(c));
  }
  return chunks;
}

Result<KvBlock> JoinChunks(const std::vector<KvBlock>& chunks) {
  if (chunks.empty()) return Status::InvalidArgument("no chunks to join");
  KvShape s = chunks[0].shape();
  s.n_token = 0;
  for (const KvBlock& c : chunks) {
    KvShape cs = c.shape();
    if (cs.n_layer != s.n_layer || cs.n_head_kv != s.n_head_kv || cs.head_dim != s.head_dim ||
        c.dtype() != chunks[0].dtype()) {
      return Status::InvalidArgument("chunk shape " + cs.ToString() + " does not match " + chunks[0].shape().ToString());
    }
    if (!(c.fp8_scales() == chunks[0].fp8_scales())) {
      return Status::InvalidArgument("chunk at token_offset=" + std::to_string(c.token_offset()) +
                                     " has other FP8 scales than the first chunk");
    }
    if (c.token_offset() != chunks[0].token_offset() + s.n_token) {
      return Status::InvalidArgument("chunk at token_offset=" + std::to_string(c.token_offset()) +
                                     " is out of order (expected " +
                                     std::to_string(chunks[0].token_offset() + s.n_token) + ")");
    }
    s.n_token += cs.n_token;
  }
  KvBlock out;
  KV_RETURN_IF_ERROR(out.Reset(s, chunks[0].dtype()));
  KV_RETURN_IF_ERROR(out.set_fp8_scales(chunks[0].fp8_scales()));
  out.set_token_offset(chunks[0].token_offset());
  const size_t row = size_t{s.head_dim} * DTypeSize(out.dtype());
  size_t t0 = 0;
  ByteBuffer scratch;
  for (const KvBlock& c : chunks) {
    for (uint64_t i = 0; i < s.n_slab(); ++i) {
      std::memcpy(out.slab_at(i) + t0 * row, c.ReadSlab(i, scratch), c.shape().n_token * row);
    }
    t0 += c.shape().n_token;
  }
  return out;
}

Result<KvCompareResult> CompareKv(const KvBlock& reference, const KvBlock& test) {
  if (!(reference.shape() == test.shape())) {
    return Status::InvalidArgument("shapes differ: " + reference.shape().ToString() + " vs " +
                                   test.shape().ToString());
  }
  const KvShape& s = reference.shape();
  const size_t n = s.slab_numel();
  std::vector<float> a(n), b(n);
  ByteBuffer scratch_a, scratch_b;
  KvCompareResult out;
  for (int part = 0; part < 2; ++part) {
    double sum_ref2 = 0, sum_err2 = 0, sum_abs = 0, max_abs = 0, dot = 0, sum_test2 = 0;
    for (uint32_t l = 0; l < s.n_layer; ++l) {
      for (uint32_t h = 0; h < s.n_head_kv; ++h) {
        const uint64_t si = s.slab_index(l, KvPart(part), h);
        ConvertToF32(reference.dtype(), reference.ReadSlab(si, scratch_a), a.data(), n);
        ConvertToF32(test.dtype(), test.ReadSlab(si, scratch_b), b.data(), n);
        for (size_t i = 0; i < n; ++i) {
          const double r = a[i], t = b[i], e = std::fabs(r - t);
          sum_ref2 += r * r;
          sum_test2 += t * t;
          sum_err2 += e * e;
          sum_abs += e;
          dot += r * t;
          max_abs = std::max(max_abs, e);
        }
      }
    }
    const double count = double(s.numel()) / 2;
    KvErrorStats& st = part == 0 ? out.k : out.v;
    st.max_abs = max_abs;
    st.mean_abs = count > 0 ? sum_abs / count : 0;
    // An exact copy has infinite SNR; 200 dB stands for it so JSON stays finite.
    st.snr_db = sum_err2 > 0 ? std::min(200.0, 10 * std::log10(sum_ref2 / sum_err2)) : 200.0;
    st.cosine = (sum_ref2 > 0 && sum_test2 > 0) ? dot / std::sqrt(sum_ref2 * sum_test2) : 1.0;
  }
  return out;
}

}  // namespace kvserve
