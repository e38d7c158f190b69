// fpsplit(dtype=f16|bf16|e4m3|e5m2): the float-aware half of the lossless float coder
// (`fpsplit|rans`). Each 16-bit value, stored in `dtype`, is cut into its exponent and the rest
// (sign and mantissa). The exponents become 4-bit symbols, reported as code sections (a section per
// slab, a channel per head dimension, a context per layer and K/V part), so `rans` codes them with
// a table per channel; the rest — close to uniform, nothing to gain — is stored in bit planes. An
// FP8 value is one 8-bit symbol whole: with 3 or 2 mantissa bits the mantissa is not uniform
// (small values, subnormals), and storing it raw lost to plain zstd on FP8 bytes. Lossless from
// data already in `dtype`; other input is rounded to it first, like `cast`.
//
// Why this shape: LZ matching finds nothing in float noise (zstd: 1.08x on llama3-8b fp16); KV's
// redundancy is in the exponents' skewed, per-channel distributions (an outlier channel's values
// are all large), which an order-0 coder with per-channel tables takes directly. Exponents are
// windowed to a 4-bit alphabet because that is rans's fast path (tables that fit registers, byte
// counters): per (slab, channel) the window covers the 15 exponents up to the channel's largest,
// symbol e - base + 1; an exponent below the window (a value about 2^14 times smaller than the
// channel's largest, or an exact zero) is symbol 0 with the exponent stored aside as an escape.
//
// Payload: u8 version 1 | u8 dtype | 6 zero bytes
//          | per slab in [layer][K|V][head] order: the symbols (slab_numel rounded up to 8, as
//            quant_kernels.h's bit planes: 4-bit exponent symbols, or FP8 bytes)
//            | for 16-bit formats the rest's low bytes (slab_numel), and for f16 its top 3 bits
//              (sign, 2 mantissa bits) as 3-bit codes
//            | each channel's window base (head_dim bytes; zero for FP8)
//          | u32 escape count per slab | the escapes: u32 index within the slab, u8 exponent.
#include <algorithm>
#include <cstring>
#include <utility>

#include "codec/quant_kernels.h"
#include "codec/stage.h"
#include "kvserve/cpu.h"

#ifdef KVSERVE_HAVE_AVX512_REGION
#include <immintrin.h>
// GCC 12 reports the intrinsics' own _mm512_undefined_*() operands as "may be used
// uninitialized" once inlined (as in quant_kernels.cc); the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace kvserve {
namespace {

constexpr uint8_t kVersion = 1;
constexpr size_t kHeader = 8;
constexpr int kSymbolBits = 4;
constexpr uint32_t kWindow = (1u << kSymbolBits) - 1;  // exponents per window; symbol 0 escapes
constexpr size_t kEscapeBytes = 5;

uint64_t Padded8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// A float format: sign, exp_bits of exponent, man_bits of mantissa, in `bytes` bytes.
struct FloatFormat {
  int exp_bits = 5, man_bits = 10, bytes = 2;
  int rest_bits() const { return 1 + man_bits; }  // sign and mantissa
  uint32_t exp_mask() const { return (1u << exp_bits) - 1; }
};
FloatFormat FormatOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {8, 7, 2};
    case DType::kE4M3: return {4, 3, 1};
    case DType::kE5M2: return {5, 2, 1};
    default: return {5, 10, 2};
  }
}

// Byte layout of one slab's part of the payload.
struct SlabLayout {
  uint64_t n = 0, n8 = 0;
  uint32_t head_dim = 0;
  int sym_bits = kSymbolBits;  // 8 for FP8: the whole value is the symbol
  uint64_t low_n = 0;  // bytes of the rest's low byte plane: n for 16-bit formats
  int top_bits = 0;    // bits of the rest above that plane (f16: 3)
  uint64_t symbols() const { return 0; }
  uint64_t low() const { return quant::PackedBytes(n8, sym_bits); }
  uint64_t top() const { return low() + low_n; }
  uint64_t bases() const { return top() + (top_bits ? quant::PackedBytes(n8, top_bits) : 0); }
  uint64_t bytes() const { return bases() + head_dim; }
};

// Per-slab scratch, reused by each worker thread.
struct Scratch {
  std::vector<uint8_t> cast;
  std::vector<float> f32;
  std::vector<uint8_t> exp, sym, top;
  void Resize(uint64_t n8) {
    exp.resize(n8);
    sym.resize(n8);
    top.resize(n8);
  }
};

#ifdef KVSERVE_HAVE_AVX512_REGION
KVSERVE_BEGIN_AVX512
// The decode join of a 16-bit slab read straight from the packed planes, 64 values of each of the
// eight plane segments per step (no unpacked symbol or top-bit arrays): with Q = n / 8, value
// j + k*Q is nibble k / 4 of symbol byte j + (k % 4) * Q, bits 2*(k / 2) of the 2-bit top plane's
// byte j + (k % 2) * Q, and bit k of the 1-bit plane's byte j (quant_kernels.h's layout). Needs
// n a multiple of 8 * D and D of 64, so the 64 values of a step are channels j % D onwards in
// every segment. Each output half is built as bytes (high: sign, exponent, top mantissa bits;
// low: the stored byte) and interleaved into 16-bit values. Escapes are put in afterwards.
template <bool kF16, int K>
inline void JoinSegment(const __m512i* sym, const __m512i* top2, __m512i top1, const uint8_t* low, __m512i base,
                        uint16_t* out) {
  const __m512i nib = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
  const __m512i s = K < 4 ? _mm512_and_si512(sym[K % 4], nib) : _mm512_and_si512(_mm512_srli_epi16(sym[K % 4], 4), nib);
  // e = s ? (s - 1 + base) & emask : 0, in byte lanes (the sum wraps as the scalar one does).
  __m512i e = _mm512_maskz_sub_epi8(_mm512_test_epi8_mask(s, s), _mm512_add_epi8(s, base), one);
  const __m512i lo_in = _mm512_loadu_si512(low);
  __m512i hi, lo;
  if constexpr (kF16) {
    e = _mm512_and_si512(e, _mm512_set1_epi8(0x1F));
    const __m512i t2 = _mm512_and_si512(_mm512_srli_epi16(top2[K % 2], 2 * (K / 2)), _mm512_set1_epi8(3));
    const __m512i t1 = _mm512_and_si512(_mm512_slli_epi16(_mm512_srli_epi16(top1, K), 7), _mm512_set1_epi8(char(0x80)));
    // sign << 7 | e << 2 | mantissa bits 8-9 (e < 32, so the 16-bit shift moves nothing across bytes)
    hi = _mm512_or_si512(_mm512_or_si512(t1, _mm512_slli_epi16(e, 2)), t2);
    lo = lo_in;
  } else {
    // bf16: the stored byte is sign << 7 | mantissa; the exponent's low bit goes into bit 7 of the low byte.
    const __m512i top_bit = _mm512_set1_epi8(char(0x80));
    // (0xCA: a ? b : c, bit by bit; the shifts' bits crossing a byte land where the select drops them)
    hi = _mm512_ternarylogic_epi32(top_bit, lo_in, _mm512_srli_epi16(e, 1), 0xCA);
    lo = _mm512_ternarylogic_epi32(top_bit, _mm512_slli_epi16(e, 7), lo_in, 0xCA);
  }
  // Interleave low and high bytes: qwords ordered so that the in-lane unpacks give values 0-31, 32-63.
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  lo = _mm512_permutexvar_epi64(order, lo);
  hi = _mm512_permutexvar_epi64(order, hi);
  _mm512_storeu_si512(out, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(out + 32, _mm512_unpackhi_epi8(lo, hi));
}

template <bool kF16, int... K>
void JoinPackedAvx512(const uint8_t* sym_planes, const uint8_t* top_planes, const uint8_t* low, const uint8_t* base,
                      uint32_t D, uint64_t n, uint16_t* dst, std::integer_sequence<int, K...>) {
  const uint64_t Q = n / 8;
  for (uint64_t j = 0; j < Q; j += 64) {
    const __m512i b = _mm512_loadu_si512(base + j % D);
    const __m512i sym[4] = {_mm512_loadu_si512(sym_planes + j), _mm512_loadu_si512(sym_planes + j + Q),
                            _mm512_loadu_si512(sym_planes + j + 2 * Q), _mm512_loadu_si512(sym_planes + j + 3 * Q)};
    __m512i top2[2] = {}, top1 = _mm512_setzero_si512();
    if constexpr (kF16) {
      top2[0] = _mm512_loadu_si512(top_planes + j);
      top2[1] = _mm512_loadu_si512(top_planes + j + Q);
      top1 = _mm512_loadu_si512(top_planes + 2 * Q + j);
    }
    (JoinSegment<kF16, K>(sym, top2, top1, low + j + K * Q, b, dst + j + K * Q), ...);
  }
}
KVSERVE_END_TIER
#endif

class FpSplitStage final : public Stage {
 public:
  explicit FpSplitStage(DType dtype) : dtype_(dtype), f_(FormatOf(dtype)) {}

  SlabLayout Layout(const KvShape& shape) const {
    SlabLayout l;
    l.n = shape.slab_numel();
    l.n8 = Padded8(l.n);
    l.head_dim = shape.head_dim;
    if (f_.bytes == 1) {
      l.sym_bits = 8;
    } else {
      l.low_n = l.n;
      l.top_bits = f_.rest_bits() - 8;
    }
    return l;
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& shape = t.shape();
    const SlabLayout l = Layout(shape);
    const uint64_t n_slab = shape.n_slab(), fixed = kHeader + n_slab * l.bytes();
    const size_t start = out.bytes->size();
    out.bytes->resize(start + fixed + n_slab * 4);
    uint8_t* hdr = out.bytes->data() + start;
    std::memset(hdr, 0, kHeader);
    hdr[0] = kVersion;
    hdr[1] = static_cast<uint8_t>(dtype_);
    std::vector<std::vector<uint8_t>> escapes(n_slab);
    ParallelFor(ctx.pool, n_slab, [&](uint64_t s) {
      thread_local Scratch sc;
      sc.Resize(l.n8);
      thread_local ByteBuffer gathered;
      const uint8_t* src = t.ReadSlab(s, gathered);
      if (t.dtype() != dtype_) {
        sc.f32.resize(l.n);
        sc.cast.resize(l.n * f_.bytes);
        ConvertToF32(t.dtype(), src, sc.f32.data(), l.n);
        ConvertFromF32(dtype_, sc.f32.data(), sc.cast.data(), l.n);
        src = sc.cast.data();
      }
      EncodeSlab(src, l, hdr + kHeader + s * l.bytes(), sc, escapes[s]);
    });
    size_t total = 0;
    for (uint64_t s = 0; s < n_slab; ++s) {
      const uint32_t count = uint32_t(escapes[s].size() / kEscapeBytes);
      std::memcpy(out.bytes->data() + start + fixed + s * 4, &count, 4);
      total += escapes[s].size();
    }
    out.bytes->reserve(out.bytes->size() + total);
    for (const auto& e : escapes) out.bytes->insert(out.bytes->end(), e.begin(), e.end());
    return Status::Ok();
  }

  std::vector<CodeSection> CodeSections(const KvShape& shape) const override {
    std::vector<CodeSection> out;
    const SlabLayout l = Layout(shape);
    if (l.n8 == 0) return out;
    out.reserve(shape.n_slab());
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      const uint32_t context = uint32_t(s / shape.n_head_kv);  // layer * 2 + part
      out.push_back({kHeader + s * l.bytes() + l.symbols(), uint32_t(l.n8), uint8_t(l.sym_bits), shape.head_dim, context});
    }
    return out;
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const KvShape& shape = t.shape();
    const SlabLayout l = Layout(shape);
    const uint64_t n_slab = shape.n_slab(), fixed = kHeader + n_slab * l.bytes();
    if (in.bytes.size() < fixed + n_slab * 4) {
      return Status::Corrupt("fpsplit payload is " + std::to_string(in.bytes.size()) + " bytes, shape " +
                             shape.ToString() + " needs at least " + std::to_string(fixed + n_slab * 4));
    }
    if (in.bytes[0] != kVersion) {
      return Status::Corrupt("fpsplit payload version " + std::to_string(in.bytes[0]) + ", expected " +
                             std::to_string(kVersion));
    }
    if (in.bytes[1] != static_cast<uint8_t>(dtype_)) {
      return Status::Corrupt("fpsplit payload holds dtype code " + std::to_string(in.bytes[1]) + ", its spec says " +
                             DTypeName(dtype_));
    }
    // Escapes are checked here, before any value is written: the payload's length, each index
    // inside its slab and in increasing order, each exponent inside the format.
    const uint8_t* counts = in.bytes.data() + fixed;
    std::vector<uint64_t> first(n_slab + 1, 0);
    for (uint64_t s = 0; s < n_slab; ++s) {
      uint32_t c;
      std::memcpy(&c, counts + s * 4, 4);
      first[s + 1] = first[s] + c;
    }
    const uint8_t* esc = counts + n_slab * 4;
    if (in.bytes.size() - fixed - n_slab * 4 != first[n_slab] * kEscapeBytes) {
      return Status::Corrupt("fpsplit payload has " + std::to_string(in.bytes.size() - fixed - n_slab * 4) +
                             " bytes of escapes, its counts say " + std::to_string(first[n_slab] * kEscapeBytes));
    }
    for (uint64_t s = 0; s < n_slab; ++s) {
      int64_t prev = -1;
      for (uint64_t k = first[s]; k < first[s + 1]; ++k) {
        uint32_t idx;
        std::memcpy(&idx, esc + k * kEscapeBytes, 4);
        const uint8_t e = esc[k * kEscapeBytes + 4];
        if (int64_t{idx} <= prev || idx >= l.n || e > f_.exp_mask()) {
          return Status::Corrupt("fpsplit escape " + std::to_string(k) + " (index " + std::to_string(idx) +
                                 ", exponent " + std::to_string(e) + ") is out of order or out of range in slab " +
                                 std::to_string(s));
        }
        prev = idx;
      }
    }
    const uint8_t* body = in.bytes.data() + kHeader;
    ParallelFor(ctx.pool, n_slab, [&](uint64_t s) {
      thread_local Scratch sc;
      sc.Resize(l.n8);
      const uint8_t* src = body + s * l.bytes();
      const uint8_t* e = esc + first[s] * kEscapeBytes;
      const uint64_t n_esc = first[s + 1] - first[s];
      thread_local ByteBuffer scratch;
      uint8_t* dst = t.SlabToWrite(s, scratch);
      if (t.dtype() == dtype_) {
        DecodeSlab(src, l, e, n_esc, dst, sc);
      } else {
        sc.cast.resize(l.n * f_.bytes);
        sc.f32.resize(l.n);
        DecodeSlab(src, l, e, n_esc, sc.cast.data(), sc);
        ConvertToF32(dtype_, sc.cast.data(), sc.f32.data(), l.n);
        ConvertFromF32(t.dtype(), sc.f32.data(), dst, l.n);
      }
      t.WroteSlab(s, dst);
    });
    return Status::Ok();
  }

 private:
  // Plain loops for the auto-vectoriser, each over contiguous arrays.
  void EncodeSlab(const uint8_t* src, const SlabLayout& l, uint8_t* dst, Scratch& sc,
                  std::vector<uint8_t>& escapes) const {
    escapes.clear();
    if (l.n == 0) {  // an empty prompt: only the (zero) bases
      std::memset(dst + l.bases(), 0, l.head_dim);
      return;
    }
    if (l.sym_bits == 8) {  // FP8: the bytes are the symbols
      std::memcpy(dst + l.symbols(), src, l.n);
      std::memset(dst + l.symbols() + l.n, 0, l.n8 - l.n);
      std::memset(dst + l.bases(), 0, l.head_dim);
      return;
    }
    if (dtype_ == DType::kBF16) return EncodeSlabOf<7, 8>(src, l, dst, sc, escapes);
    return EncodeSlabOf<10, 5>(src, l, dst, sc, escapes);
  }
  void DecodeSlab(const uint8_t* src, const SlabLayout& l, const uint8_t* esc, uint64_t n_esc, uint8_t* dst,
                  Scratch& sc) const {
    if (l.n == 0) return;
    if (l.sym_bits == 8) {
      std::memcpy(dst, src + l.symbols(), l.n);
      return;
    }
    if (dtype_ == DType::kBF16) return DecodeSlabOf<7, 8>(src, l, esc, n_esc, dst, sc);
    return DecodeSlabOf<10, 5>(src, l, esc, n_esc, dst, sc);
  }

  // M mantissa and E exponent bits of a 16-bit format as constants, so the loops vectorise.
  template <int M, int E>
  static void EncodeSlabOf(const uint8_t* src_bytes, const SlabLayout& l, uint8_t* __restrict dst, Scratch& sc,
                           std::vector<uint8_t>& escapes) {
    constexpr uint32_t emask = (1u << E) - 1, mmask = (1u << M) - 1;
    const uint16_t* __restrict src = reinterpret_cast<const uint16_t*>(src_bytes);
    const uint64_t n = l.n;  // a local: the byte stores below may alias anything the compiler cannot see
    uint8_t* __restrict exp = sc.exp.data();
    uint8_t* __restrict low = dst + l.low();
    uint8_t* __restrict top = sc.top.data();
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t u = src[i];
      const uint32_t rest = ((u >> 15) << M) | (u & mmask);
      exp[i] = uint8_t((u >> M) & emask);
      low[i] = uint8_t(rest);
      top[i] = uint8_t(rest >> 8);
    }
    const uint32_t D = l.head_dim;
    uint8_t* __restrict base = dst + l.bases();
    std::memset(base, 0, D);
    for (uint64_t i = 0; i < n; i += D)
      for (uint32_t d = 0; d < D; ++d) base[d] = std::max(base[d], exp[i + d]);
    for (uint32_t d = 0; d < D; ++d) base[d] = base[d] >= kWindow - 1 ? uint8_t(base[d] - (kWindow - 1)) : 0;
    uint8_t* __restrict sym = sc.sym.data();
    uint32_t n_escape = 0;
    for (uint64_t i = 0; i < n; i += D) {
      for (uint32_t d = 0; d < D; ++d) {
        const uint8_t v = uint8_t(exp[i + d] - base[d]);
        const uint8_t s = v < kWindow ? uint8_t(v + 1) : 0;
        sym[i + d] = s;
        n_escape += s == 0;
      }
    }
    std::memset(sym + n, 0, l.n8 - n);
    std::memset(top + n, 0, l.n8 - n);
    quant::PackCodes(sym, l.n8, kSymbolBits, dst + l.symbols());
    if (l.top_bits) quant::PackCodes(top, l.n8, l.top_bits, dst + l.top());
    if (n_escape == 0) return;  // EncodeSlab cleared `escapes`
    escapes.reserve(size_t{n_escape} * kEscapeBytes);
    for (const uint8_t* at = sym; (at = static_cast<const uint8_t*>(std::memchr(at, 0, sym + n - at))) != nullptr;
         ++at) {
      const uint64_t i = at - sym;
      const uint32_t idx = uint32_t(i);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&idx);
      escapes.insert(escapes.end(), b, b + 4);
      escapes.push_back(exp[i]);
    }
  }

  template <int M, int E>
  static void DecodeSlabOf(const uint8_t* __restrict src, const SlabLayout& l, const uint8_t* esc, uint64_t n_esc,
                           uint8_t* dst_bytes, Scratch& sc) {
    constexpr uint32_t emask = (1u << E) - 1, mmask = (1u << M) - 1;
    uint16_t* __restrict dst = reinterpret_cast<uint16_t*>(dst_bytes);
    const uint64_t n = l.n;
#ifdef KVSERVE_HAVE_AVX512_REGION
    if (cpu::Use(cpu::Tier::kAvx512) && l.head_dim % 64 == 0 && n % (8 * uint64_t{l.head_dim}) == 0 &&
        l.top_bits == (M == 10 ? 3 : 0)) {
      JoinPackedAvx512<M == 10>(src + l.symbols(), src + l.top(), src + l.low(), src + l.bases(), l.head_dim, n, dst,
                                std::make_integer_sequence<int, 8>{});
      PatchEscapes<M, E>(esc, n_esc, dst);
      return;
    }
#endif
    uint8_t* __restrict sym = sc.sym.data();
    uint8_t* __restrict top = sc.top.data();
    quant::UnpackCodes(src + l.symbols(), l.n8, kSymbolBits, sym);
    if (l.top_bits) quant::UnpackCodes(src + l.top(), l.n8, l.top_bits, top);
    else std::memset(top, 0, n);
    const uint8_t* __restrict base = src + l.bases();
    const uint32_t D = l.head_dim;
    const uint8_t* __restrict low = src + l.low();
    // The exponent from its symbol and the channel's window, joined with sign and mantissa in one
    // pass (an escape's symbol 0 leaves the exponent 0; escaped exponents are put in after).
    for (uint64_t i = 0; i < n; i += D) {
      for (uint32_t d = 0; d < D; ++d) {
        const uint32_t s = sym[i + d];
        const uint32_t e = s ? (s - 1 + base[d]) & emask : 0;
        const uint32_t rest = uint32_t(low[i + d] | (top[i + d] << 8));
        dst[i + d] = uint16_t(((rest >> M) << 15) | (e << M) | (rest & mmask));
      }
    }
    PatchEscapes<M, E>(esc, n_esc, dst);
  }

  // Escaped exponents into values joined with exponent 0.
  template <int M, int E>
  static void PatchEscapes(const uint8_t* esc, uint64_t n_esc, uint16_t* dst) {
    constexpr uint32_t emask = (1u << E) - 1;
    for (uint64_t k = 0; k < n_esc; ++k) {
      uint32_t idx;
      std::memcpy(&idx, esc + k * kEscapeBytes, 4);
      dst[idx] = uint16_t((dst[idx] & ~(emask << M)) | ((esc[k * kEscapeBytes + 4] & emask) << M));
    }
  }

  DType dtype_;
  FloatFormat f_;
};

Result<std::unique_ptr<Stage>> MakeFpSplit(const StageSpec& spec, const CodecEnv&) {
  KV_ASSIGN_OR_RETURN(DType dt, ParseDType(spec.Get("dtype")));
  return std::unique_ptr<Stage>(new FpSplitStage(dt));
}

}  // namespace

StageRegistration FpSplitStageRegistration() {
  StageInfo info;
  info.name = "fpsplit";
  info.summary = "lossless float coding with rans after it: exponents as per-channel symbols, sign and mantissa stored";
  info.input = DataKind::kTensor;
  info.output = DataKind::kSymbols;
  info.params = {{"dtype", ParamSpec::Type::kEnum, 0, 0, {"f16", "bf16", "e4m3", "e5m2"}, "f16", "storage type the values are coded in"}};
  return {info, &MakeFpSplit};
}

}  // namespace kvserve
