// fp8(format=e4m3|e5m2, scale=head|token): scaled 8-bit float quantisation, the lossy format
// serving engines already keep KV in (vLLM `--kv-cache-dtype fp8`, SGLang, TensorRT-LLM; Mooncake
// Store's codec). Each value is divided by its group's scale — one per (layer, K/V, head), or one
// per token row of a head — and converted to the FP8 format, rounding to nearest even and
// saturating; the scale is the smallest power of two at or above the group's largest magnitude
// over the format's largest value (so nothing saturates), stored as fp16. The codes are 8-bit
// symbols (rans codes them per channel, zstd takes them as bytes) and the scales fp16 metadata.
//
// Unlike min-max integer quantisation, the error is relative: a value keeps about 3 (E4M3) or 2
// (E5M2) significant bits whatever its size, which is what attention's outlier channels need.
//
// Payload: u8 version 1 | u8 dtype of the codes (e4m3, e5m2) | u8 scale mode (0 head, 1 token)
//          | 5 zero bytes | per slab in [layer][K|V][head] order: scales (fp16; 1 or n_token)
//          | codes (slab_numel, zero padded to a multiple of 8).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/stage.h"

namespace kvserve {
namespace {

constexpr uint8_t kVersion = 1;
constexpr size_t kHeader = 8;

uint64_t Padded8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// The largest magnitude of n values of a storage type (NaNs skipped). For f16 and f32 on the
// bits: masked magnitudes and an unsigned max, which order like the values and vectorise (a float
// max reduction does not without fast-math); a mask, not a select, for the same reason.
// An fp16 value's magnitude bits, or 0 for a NaN.
inline uint16_t HalfMagnitudeOrZero(uint16_t h) {
  const uint16_t b = h & 0x7fff;
  return uint16_t(b & (0u - uint16_t(b <= 0x7c00)));
}

float MaxMagnitude(DType dtype, const uint8_t* data, size_t n) {
  if (dtype == DType::kF16) {
    const uint16_t* __restrict h = reinterpret_cast<const uint16_t*>(data);
    uint16_t a = 0;
    for (size_t i = 0; i < n; ++i) a = std::max(a, HalfMagnitudeOrZero(h[i]));
    return HalfToFloat(a);
  }
  thread_local std::vector<float> buf;
  const uint32_t* __restrict bits = reinterpret_cast<const uint32_t*>(data);
  if (dtype != DType::kF32) {
    buf.resize(n);
    ConvertToF32(dtype, data, buf.data(), n);
    bits = reinterpret_cast<const uint32_t*>(buf.data());
  }
  uint32_t a = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i] & 0x7fffffffu;
    a = std::max(a, b & (0u - uint32_t(b <= 0x7f800000u)));
  }
  float f;
  std::memcpy(&f, &a, 4);
  return f;
}

// A paged f16 slab gathered into `scratch` with its largest magnitude (as MaxMagnitude) taken
// on the way, so the range pass does not read the slab a second time. Rows are a page row apart
// (every head's row of a token side by side), a stride the hardware prefetchers do not follow:
// rows kAhead on are asked for by hand.
const uint8_t* GatherSlabF16WithMax(const KvBlock& t, uint64_t slab, ByteBuffer& scratch, float* max_magnitude) {
  constexpr uint32_t kAhead = 16;
  thread_local std::vector<uint8_t*> rows;
  t.SlabRows(slab, &rows);
  const size_t D = t.shape().head_dim, n = rows.size();
  scratch.resize(n * D * 2);
  uint16_t* __restrict out = reinterpret_cast<uint16_t*>(scratch.data());
  uint16_t a = 0;
  for (size_t r = 0; r < n; ++r) {
    if (r + kAhead < n)
      for (size_t b = 0; b < D * 2; b += 64) __builtin_prefetch(rows[r + kAhead] + b);
    const uint16_t* __restrict in = reinterpret_cast<const uint16_t*>(rows[r]);
    uint16_t* __restrict o = out + r * D;
    for (size_t i = 0; i < D; ++i) {
      o[i] = in[i];
      a = std::max(a, HalfMagnitudeOrZero(in[i]));
    }
  }
  *max_magnitude = HalfToFloat(a);
  return scratch.data();
}

class Fp8Stage final : public Stage {
 public:
  Fp8Stage(DType format, bool per_token)
      : format_(format), per_token_(per_token), max_(format == DType::kE4M3 ? 448.0f : 57344.0f) {}

  uint64_t Scales(const KvShape& shape) const { return per_token_ ? shape.n_token : 1; }
  uint64_t SlabBytes(const KvShape& shape) const { return Scales(shape) * 2 + Padded8(shape.slab_numel()); }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& shape = t.shape();
    const uint64_t n = shape.slab_numel(), slab_bytes = SlabBytes(shape), m = Scales(shape);
    const size_t start = out.bytes->size();
    out.bytes->resize(start + kHeader + shape.n_slab() * slab_bytes);
    uint8_t* hdr = out.bytes->data() + start;
    std::memset(hdr, 0, kHeader);
    hdr[0] = kVersion;
    hdr[1] = static_cast<uint8_t>(format_);
    hdr[2] = per_token_ ? 1 : 0;
    uint8_t* body = hdr + kHeader;
    std::vector<uint64_t> bad(shape.n_slab(), UINT64_MAX);
    const size_t es = DTypeSize(t.dtype());
    const uint64_t per_group = m ? n / m : 0;
    ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t s) {
      uint8_t* dst = body + s * slab_bytes;
      uint8_t* codes = dst + m * 2;
      // A paged slab is gathered whole: the range pass and the code pass then read it from
      // cache (reading its rows where they lie, twice, measured slower: 0.50 against 0.76 of
      // dense). An f16 slab under one scale has its range taken during the gather.
      thread_local ByteBuffer scratch;
      float gathered_max = -1;
      const uint8_t* src = t.is_paged() && t.dtype() == DType::kF16 && m == 1
                               ? GatherSlabF16WithMax(t, s, scratch, &gathered_max)
                               : t.ReadSlab(s, scratch);
      for (uint64_t g = 0; g < m; ++g) {
        const uint8_t* group = src + g * per_group * es;
        const float want = (gathered_max >= 0 ? gathered_max : MaxMagnitude(t.dtype(), group, per_group)) / max_;
        // The scale is the smallest power of two not below `want`: the largest value does not
        // saturate, dividing by it is exact, and f16 → FP8 then runs on 16-bit lanes (quarter the
        // instructions). An FP8 value keeps its relative precision at any scale, so a power of two
        // costs at most the lowest binade above the subnormals (OCP's MX formats share E8M0 scales
        // for the same reason). Zeros keep scale 0; fp16's range bounds it.
        float scale = 0;
        if (want > 0 && std::isfinite(want)) {
          int e = 0;
          const float f = std::frexp(want, &e);  // want = f * 2^e, f in [0.5, 1)
          scale = std::max(std::ldexp(1.0f, f == 0.5f ? e - 1 : e), std::ldexp(1.0f, -24));
        } else if (want != 0) {
          scale = INFINITY;
        }
        uint16_t h = FloatToHalf(scale);
        if (!std::isfinite(HalfToFloat(h))) {
          if (bad[s] == UINT64_MAX) bad[s] = g;
          h = 0x7bff;
          scale = 0;
        }
        std::memcpy(dst + g * 2, &h, 2);
        ConvertToFp8Scaled(t.dtype(), group, scale > 0 ? 1.0f / scale : 0.0f, format_, codes + g * per_group, per_group);
      }
      std::memset(codes + n, 0, Padded8(n) - n);
    });
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      if (bad[s] != UINT64_MAX) {
        const uint64_t h = shape.n_head_kv;
        return Status::InvalidArgument("fp8: a value range of layer " + std::to_string(s / (2 * h)) +
                                       ((s / h) % 2 ? " V" : " K") + " head " + std::to_string(s % h) +
                                       " is beyond what an fp16 scale holds (largest magnitude above " +
                                       std::to_string(65504.0 * max_) + ")");
      }
    }
    return Status::Ok();
  }

  std::vector<CodeSection> CodeSections(const KvShape& shape) const override {
    std::vector<CodeSection> out;
    const uint64_t n8 = Padded8(shape.slab_numel()), m = Scales(shape);
    if (n8 == 0) return out;
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      const uint32_t ctx = uint32_t(s / shape.n_head_kv);  // layer * 2 + part
      const uint64_t off = kHeader + s * SlabBytes(shape);
      out.push_back({off, uint32_t(m), 16, 1, ctx, CodeSection::Kind::kHalf});
      out.push_back({off + m * 2, uint32_t(n8), 8, shape.head_dim, ctx});
    }
    return out;
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const KvShape& shape = t.shape();
    const uint64_t n = shape.slab_numel(), slab_bytes = SlabBytes(shape), m = Scales(shape);
    const uint64_t want = kHeader + shape.n_slab() * slab_bytes;
    if (in.bytes.size() != want) {
      return Status::Corrupt("fp8 payload is " + std::to_string(in.bytes.size()) + " bytes, shape " +
                             shape.ToString() + " needs " + std::to_string(want));
    }
    if (in.bytes[0] != kVersion || in.bytes[1] != static_cast<uint8_t>(format_) || in.bytes[2] != (per_token_ ? 1 : 0)) {
      return Status::Corrupt("fp8 payload header (version " + std::to_string(in.bytes[0]) + ", format " +
                             std::to_string(in.bytes[1]) + ", scale mode " + std::to_string(in.bytes[2]) +
                             ") does not match its spec");
    }
    const uint8_t* body = in.bytes.data() + kHeader;
    const size_t es = DTypeSize(t.dtype());
    const uint64_t per_group = m ? n / m : 0;
    const uint32_t D = shape.head_dim, rows_per_group = per_token_ ? 1 : shape.n_token;
    ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t s) {
      const uint8_t* src = body + s * slab_bytes;
      // Into a paged slab row by row where its rows lie (no whole-slab scatter).
      thread_local std::vector<uint8_t*> rows;
      const bool paged = t.is_paged();
      uint8_t* dst = paged ? nullptr : t.slab_at(s);
      if (paged) t.SlabRows(s, &rows);
      for (uint64_t g = 0; g < m; ++g) {
        uint16_t h;
        std::memcpy(&h, src + g * 2, 2);
        const uint8_t* codes = src + m * 2 + g * per_group;
        if (paged) ConvertFromFp8ScaledRows(format_, codes, HalfToFloat(h), t.dtype(), rows.data() + g * rows_per_group, rows_per_group, D);
        else ConvertFromFp8Scaled(format_, codes, HalfToFloat(h), t.dtype(), dst + g * per_group * es, per_group);
      }
    });
    return Status::Ok();
  }

 private:
  DType format_;
  bool per_token_;
  float max_;
};

Result<std::unique_ptr<Stage>> MakeFp8(const StageSpec& spec, const CodecEnv&) {
  KV_ASSIGN_OR_RETURN(DType format, ParseDType(spec.Get("format")));
  return std::unique_ptr<Stage>(new Fp8Stage(format, spec.Get("scale") == "token"));
}

}  // namespace

StageRegistration Fp8StageRegistration() {
  StageInfo info;
  info.name = "fp8";
  info.summary = "scaled FP8 (E4M3 or E5M2) per head or per token, saturating; codes as 8-bit symbols";
  info.input = DataKind::kTensor;
  info.output = DataKind::kSymbols;
  using T = ParamSpec::Type;
  info.params = {
      {"format", T::kEnum, 0, 0, {"e4m3", "e5m2"}, "e4m3", "FP8 format: E4M3 (more precision) or E5M2 (more range)"},
      {"scale", T::kEnum, 0, 0, {"head", "token"}, "head", "one scale per (layer, K/V, head), or per token row of a head"},
  };
  return {info, &MakeFp8};
}

}  // namespace kvserve
