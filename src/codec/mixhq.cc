// mixhq: head-wise mixed-precision quantisation (MixHQ). Each (layer, KV head) is rotated by a
// random-sign Hadamard transform, then quantised symmetrically to integer levels in [-m, m]
// with absmax scales — keys per channel over groups of tokens, values per token — with a fine
// limit m for the heads that matter and a coarse one for the rest (published defaults: K/V
// limits 12/8 fine, 6/4 coarse, 80% of heads coarse). Which heads are fine is part of the spec —
// an explicit list (`heads`, indices layer * n_head_kv + head, from any ranking: retrieval
// score, measured sensitivity) or, with heads=auto, a seeded random choice of (1 - lo_frac) of
// them — so the levels of every head are known from the frame header alone. Beyond the published
// design, two budgets: `boost_layers` makes every head of the first layers fine, `sink` gives the
// first tokens (attention sinks) fine levels in every head; and `levels`, an explicit limit for
// every (layer, K/V, head), which is what a bit-budget solver (AllocateMixHqLevels, from measured
// sensitivities) writes. Output: symbols (codes of 2m+1 levels, bit-planed), for an entropy
// coder to follow.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "codec/hadamard.h"
#include "codec/quant_kernels.h"
#include "codec/stage.h"

namespace kvserve {
namespace {

constexpr uint32_t kVBlock = 64;  // tokens per packing block of V (ranges are per token)
constexpr size_t kHeader = 12;    // u8 version, u8[3] 0, u32 group, u32 n_token; then u8 m per slab

int BitsFor(int m) {
  int b = 1;
  while ((1 << b) < 2 * m + 1) ++b;
  return b;
}

struct Params {
  int kfine, vfine, kcoarse, vcoarse;
  double lo_frac;
  uint64_t seed;
  uint32_t group;
  std::string heads;       // "auto" or the canonical list
  uint32_t boost_layers;   // layer budget: every head of the first layers is fine
  uint32_t sink;           // token budget: the first tokens are quantised finely in every head
  std::string levels;      // "auto" or m for every slab, [layer][K|V][head], joined by '.'
};

// A run of tokens sharing one level limit: a K scale group, or a V packing block.
struct Block {
  uint32_t t0, bt;
  uint8_t m;
};

struct Layout {
  KvShape shape;
  uint32_t group = 0;                       // effective K token group
  std::vector<uint8_t> limit;               // the head's m for every slab, [layer][K|V][head]
  std::vector<std::vector<Block>> blocks;   // per slab
  std::vector<uint64_t> offset;             // byte offset of every slab after the header, plus the end

  size_t block_bytes(bool v, const Block& b) const {
    const size_t scales = v ? b.bt : shape.head_dim;
    return scales * 2 + quant::PackedBytes(size_t(b.bt) * shape.head_dim, BitsFor(b.m));
  }
};

// Blocks of one slab: V in runs of kVBlock tokens, the sink tokens in a run of their own; K in
// scale groups. Blocks that hold sink tokens get the fine limit.
std::vector<Block> MakeBlocks(bool v, uint32_t n_token, uint32_t group, uint32_t sink, uint8_t m, uint8_t fine_m) {
  std::vector<Block> out;
  uint32_t t0 = 0;
  const uint32_t s = std::min(sink, n_token);
  if (v && s > 0) {
    out.push_back({0, s, fine_m});
    t0 = s;
  }
  const uint32_t step = v ? kVBlock : group;
  for (; t0 < n_token; t0 += step) {
    const uint32_t bt = std::min(step, n_token - t0);
    out.push_back({t0, bt, t0 < s ? fine_m : m});
  }
  return out;
}

// The integers of a list parameter ("3.1.4"; empty for ""); the parser has checked the text.
std::vector<uint64_t> DotList(const std::string& text) {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < text.size();) {
    const size_t j = std::min(text.find('.', i), text.size());
    out.push_back(std::stoull(text.substr(i, j - i)));
    i = j + 1;
  }
  return out;
}

Result<Layout> MakeLayout(const Params& p, const KvShape& shape) {
  Layout L;
  L.shape = shape;
  L.group = std::max<uint32_t>(1, std::min(p.group, shape.n_token));
  const uint32_t n_heads = shape.n_layer * shape.n_head_kv;
  std::vector<bool> fine(n_heads, false);
  if (p.heads == "auto") {
    std::vector<uint32_t> order(n_heads);
    std::iota(order.begin(), order.end(), 0u);
    uint64_t key = p.seed ^ 0x6d69786871ull;
    Rng rng(SplitMix(key));
    for (uint32_t i = n_heads; i > 1; --i) std::swap(order[i - 1], order[rng.Next() % i]);
    const uint32_t n_fine = uint32_t(std::lround((1.0 - p.lo_frac) * n_heads));
    for (uint32_t i = 0; i < n_fine; ++i) fine[order[i]] = true;
  } else {
    for (uint64_t h : DotList(p.heads)) {
      if (h >= n_heads) {
        return Status::InvalidArgument("mixhq heads lists head " + std::to_string(h) + ", but the block has " +
                                       std::to_string(n_heads) + " (layer x KV head)");
      }
      fine[h] = true;
    }
  }
  for (uint32_t h = 0; h < std::min(n_heads, p.boost_layers * shape.n_head_kv); ++h) fine[h] = true;
  std::vector<uint64_t> levels;  // 1..127, checked by the parser
  if (p.levels != "auto") {
    levels = DotList(p.levels);
    if (levels.size() != shape.n_slab()) {
      return Status::InvalidArgument("mixhq levels lists " + std::to_string(levels.size()) + " limits, but the block has " +
                                     std::to_string(shape.n_slab()) + " (layer x K/V x KV head)");
    }
  }
  L.limit.resize(shape.n_slab());
  L.blocks.resize(shape.n_slab());
  L.offset.resize(shape.n_slab() + 1, 0);
  for (uint64_t s = 0; s < shape.n_slab(); ++s) {
    const bool v = (s / shape.n_head_kv) % 2;
    const uint32_t head = uint32_t(s / (2 * shape.n_head_kv) * shape.n_head_kv + s % shape.n_head_kv);
    uint8_t fine_m = uint8_t(v ? p.vfine : p.kfine);
    L.limit[s] = fine[head] ? fine_m : uint8_t(v ? p.vcoarse : p.kcoarse);
    if (!levels.empty()) {
      L.limit[s] = uint8_t(levels[s]);
      fine_m = std::max(fine_m, L.limit[s]);  // sink tokens never get fewer levels than their head
    }
    L.blocks[s] = MakeBlocks(v, shape.n_token, L.group, p.sink, L.limit[s], fine_m);
    uint64_t bytes = 0;
    for (const Block& b : L.blocks[s]) bytes += L.block_bytes(v, b);
    L.offset[s + 1] = L.offset[s] + bytes;
  }
  return L;
}

// Absmax scale in fp16, rounded up so |x| / scale <= m.
inline float Scale(float absmax, int m, uint16_t* h) {
  const float s = absmax / float(m);
  uint16_t v = FloatToHalf(s);
  if (HalfToFloat(v) < s) ++v;
  *h = v;
  return HalfToFloat(v);
}

Params ParamsOf(const StageSpec& spec) {
  return Params{int(spec.GetInt("kfine")), int(spec.GetInt("vfine")), int(spec.GetInt("kcoarse")),
                int(spec.GetInt("vcoarse")), spec.GetFloat("lo_frac"), uint64_t(spec.GetInt("seed")),
                uint32_t(spec.GetInt("group")), spec.Get("heads"), uint32_t(spec.GetInt("boost_layers")),
                uint32_t(spec.GetInt("sink")), spec.Get("levels")};
}

// One slab's buffers, per thread and kept between calls; Start sizes them for a slab and draws
// its rotation signs.
struct SlabScratch {
  std::vector<float> x, sign, scale;
  std::vector<uint16_t> scale_h;
  std::vector<uint8_t> codes;
  void Start(size_t n_values, uint32_t head_dim, uint64_t seed, uint64_t slab) {
    x.resize(n_values);
    sign.resize(head_dim);
    Signs(seed, slab, head_dim, sign.data());
  }
};

class MixHqStage final : public Stage {
 public:
  explicit MixHqStage(Params p) : p_(std::move(p)) {}

  std::vector<CodeSection> CodeSections(const KvShape& shape) const override {
    auto lay = MakeLayout(p_, shape);
    std::vector<CodeSection> out;
    if (!lay.ok()) return out;  // Encode/Decode report the error
    const Layout& L = lay.value();
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      const bool v = (s / shape.n_head_kv) % 2;
      const uint32_t layer = uint32_t(s / (2 * shape.n_head_kv));
      uint64_t off = kHeader + shape.n_slab() + L.offset[s];
      for (const Block& b : L.blocks[s]) {
        const size_t n8 = (size_t(b.bt) * shape.head_dim + 7) & ~size_t{7};
        // Blocks of other widths (fine and coarse heads, or solver levels) get separate statistics.
        const uint32_t bits = uint32_t(BitsFor(b.m));
        const uint32_t scales = v ? b.bt : shape.head_dim, ctx = (layer * 2 + uint32_t(v)) * 8 + bits - 1;
        out.push_back({off, scales, 16, 1, ctx, CodeSection::Kind::kHalf});
        out.push_back({off + scales * 2, uint32_t(n8), uint8_t(BitsFor(b.m)), shape.head_dim, ctx});
        off += L.block_bytes(v, b);
      }
    }
    return out;
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& sh = t.shape();
    const uint32_t D = sh.head_dim;
    if (D & (D - 1)) return Status::InvalidArgument("mixhq needs head_dim a power of two, got " + std::to_string(D));
    KV_ASSIGN_OR_RETURN(Layout L, MakeLayout(p_, sh));
    const size_t start = out.bytes->size();
    out.bytes->resize(start + kHeader + sh.n_slab() + L.offset.back());
    uint8_t* hdr = out.bytes->data() + start;
    std::memset(hdr, 0, kHeader);
    hdr[0] = 1;
    std::memcpy(hdr + 4, &L.group, 4);
    std::memcpy(hdr + 8, &sh.n_token, 4);
    std::memcpy(hdr + kHeader, L.limit.data(), sh.n_slab());
    uint8_t* body = hdr + kHeader + sh.n_slab();
    std::vector<Status> errors(sh.n_slab());
    ParallelFor(ctx.pool, sh.n_slab(), [&](uint64_t s) {
      const bool v = (s / sh.n_head_kv) % 2;
      // Shadows the captured head_dim: byte stores may alias a captured variable, and loops
      // whose bound may change do not vectorise.
      const uint32_t D = sh.head_dim;
      thread_local SlabScratch scratch;
      scratch.Start(sh.slab_numel(), D, p_.seed, ctx.first_slab + s);
      auto& [x, sign, scale, scale_h, codes] = scratch;
      thread_local ByteBuffer gathered;
      ConvertToF32(t.dtype(), t.ReadSlab(s, gathered), x.data(), x.size());
      RotateRows(x.data(), sh.n_token, D, sign.data(), false);
      uint8_t* dst = body + L.offset[s];
      for (const Block& blk : L.blocks[s]) {
        const uint32_t t0 = blk.t0, bt = blk.bt;
        const int m = blk.m;
        const size_t n = size_t(bt) * D, n8 = (n + 7) & ~size_t{7};
        const float* xb = x.data() + size_t(t0) * D;
        const size_t ns = v ? bt : D;
        // Absolute maxima per token (V) or per channel (K). `a > max ? a : max` skips NaN as
        // std::max did and vectorises to max instructions.
        scale.assign(ns, 0.0f);
        scale_h.resize(ns);
        for (uint32_t r = 0; r < bt; ++r) {
          const float* row = xb + size_t(r) * D;
          if (v) {
            float mx = 0.0f;
#pragma omp simd reduction(max : mx)
            for (uint32_t d = 0; d < D; ++d) mx = std::fabs(row[d]) > mx ? std::fabs(row[d]) : mx;
            scale[r] = mx;
          } else {
            float* sc = scale.data();
            for (uint32_t d = 0; d < D; ++d) sc[d] = std::fabs(row[d]) > sc[d] ? std::fabs(row[d]) : sc[d];
          }
        }
        for (size_t i = 0; i < ns; ++i) {
          if (!std::isfinite(scale[i]) || scale[i] > 65504.0f * m) {
            errors[s] = Status::InvalidArgument("mixhq: a value of magnitude " + std::to_string(scale[i]) +
                                                " does not fit fp16 scales");
            return;
          }
          scale[i] = Scale(scale[i], m, &scale_h[i]);
        }
        codes.resize(n8);
        std::fill(codes.begin() + n, codes.end(), uint8_t{0});
        for (uint32_t r = 0; r < bt; ++r) {
          const float* row = xb + size_t(r) * D;
          uint8_t* out_row = codes.data() + size_t(r) * D;
          // A zero scale codes 0. The division is by a safe value and its result selected
          // after, so the loop has no conditional division and vectorises. The clamp is in float
          // before the conversion: a NaN value (skipped by the maxima) gives a NaN quotient,
          // whose conversion to int is undefined; it codes -m, as the conversion gave on x86.
          const float fm = float(m);
          auto code = [m, fm](float value, float sc) {
            const float q = std::nearbyint(value / (sc > 0 ? sc : 1.0f));
            const float c = q >= -fm ? (q <= fm ? q : fm) : -fm;
            return uint8_t(int(sc > 0 ? c : 0.0f) + m);
          };
          if (v) {
            const float sc = scale[r];
            for (uint32_t d = 0; d < D; ++d) out_row[d] = code(row[d], sc);
          } else {
            // Through a local pointer, for the same reason.
            const float* sc = scale.data();
            for (uint32_t d = 0; d < D; ++d) out_row[d] = code(row[d], sc[d]);
          }
        }
        std::memcpy(dst, scale_h.data(), ns * 2);
        quant::PackCodes(codes.data(), n8, BitsFor(m), dst + ns * 2);
        dst += L.block_bytes(v, blk);
      }
    });
    for (const Status& st : errors) KV_RETURN_IF_ERROR(st);
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const KvShape& sh = t.shape();
    const uint32_t D = sh.head_dim;
    if (D & (D - 1)) return Status::Corrupt("mixhq frame with head_dim " + std::to_string(D));
    KV_ASSIGN_OR_RETURN(Layout L, MakeLayout(p_, sh));
    const size_t want = kHeader + sh.n_slab() + L.offset.back();
    if (in.bytes.size() != want) {
      return Status::Corrupt("mixhq payload is " + std::to_string(in.bytes.size()) + " bytes, shape " + sh.ToString() +
                             " needs " + std::to_string(want));
    }
    const uint8_t* hdr = in.bytes.data();
    uint32_t group, n_token;
    std::memcpy(&group, hdr + 4, 4);
    std::memcpy(&n_token, hdr + 8, 4);
    if (hdr[0] != 1 || group != L.group || n_token != sh.n_token ||
        std::memcmp(hdr + kHeader, L.limit.data(), sh.n_slab()) != 0) {
      return Status::Corrupt("mixhq payload header (levels per head) does not match the frame's strategy and shape");
    }
    const uint8_t* body = hdr + kHeader + sh.n_slab();
    ParallelFor(ctx.pool, sh.n_slab(), [&](uint64_t s) {
      const bool v = (s / sh.n_head_kv) % 2;
      // Shadows the captured head_dim: byte stores may alias a captured variable, and loops
      // whose bound may change do not vectorise.
      const uint32_t D = sh.head_dim;
      thread_local SlabScratch scratch;
      scratch.Start(sh.slab_numel(), D, p_.seed, ctx.first_slab + s);
      auto& [x, sign, scale, scale_h, codes] = scratch;
      const uint8_t* src = body + L.offset[s];
      for (const Block& blk : L.blocks[s]) {
        const uint32_t t0 = blk.t0, bt = blk.bt;
        const int m = blk.m;
        const size_t n = size_t(bt) * D, n8 = (n + 7) & ~size_t{7};
        const size_t ns = v ? bt : D;
        scale_h.resize(ns);
        scale.resize(ns);
        std::memcpy(scale_h.data(), src, ns * 2);
        ConvertToF32(DType::kF16, scale_h.data(), scale.data(), ns);
        codes.resize(n8);
        quant::UnpackCodes(src + ns * 2, n8, BitsFor(m), codes.data());
        float* xb = x.data() + size_t(t0) * D;
        for (uint32_t r = 0; r < bt; ++r) {
          const uint8_t* in_row = codes.data() + size_t(r) * D;
          float* row = xb + size_t(r) * D;
          if (v) {
            const float sc = scale[r];
            for (uint32_t d = 0; d < D; ++d) row[d] = float(int(in_row[d]) - m) * sc;
          } else {
            const float* sc = scale.data();
            for (uint32_t d = 0; d < D; ++d) row[d] = float(int(in_row[d]) - m) * sc[d];
          }
        }
        src += L.block_bytes(v, blk);
      }
      RotateRows(x.data(), sh.n_token, D, sign.data(), true);
      thread_local ByteBuffer gathered;
      uint8_t* dst = t.SlabToWrite(s, gathered);
      ConvertFromF32(t.dtype(), x.data(), dst, x.size());
      t.WroteSlab(s, dst);
    });
    return Status::Ok();
  }

 private:
  Params p_;
};

}  // namespace

StageRegistration MixHqStageRegistration() {
  StageInfo info;
  info.name = "mixhq";
  info.summary = "head-wise mixed precision: Hadamard + symmetric absmax levels, finer for chosen heads";
  info.input = DataKind::kTensor;
  info.output = DataKind::kSymbols;
  using T = ParamSpec::Type;
  info.params = {
      {"kfine", T::kInt, 1, 127, {}, "12", "K level limit m (levels -m..m) of fine heads", ParamSpec::Scale::kInverse},
      {"vfine", T::kInt, 1, 127, {}, "8", "V level limit of fine heads", ParamSpec::Scale::kInverse},
      {"kcoarse", T::kInt, 1, 127, {}, "6", "K level limit of coarse heads", ParamSpec::Scale::kInverse},
      {"vcoarse", T::kInt, 1, 127, {}, "4", "V level limit of coarse heads", ParamSpec::Scale::kInverse},
      {"lo_frac", T::kFloat, 0, 1, {}, "0.8", "share of coarse heads when heads=auto (chosen at random)"},
      {"heads", T::kList, 0, 1 << 20, {}, "auto", "fine heads, layer * n_head_kv + head, joined by '.'"},
      {"group", T::kInt, 1, 65536, {}, "32", "tokens sharing a K scale per channel", ParamSpec::Scale::kLog},
      {"seed", T::kInt, 0, 1e9, {}, "1", "seed of the rotation signs and of heads=auto"},
      {"boost_layers", T::kInt, 0, 4096, {}, "0", "layer budget: every head of the first layers is fine"},
      {"sink", T::kInt, 0, 1 << 20, {}, "0", "token budget: the first tokens get fine levels in every head", ParamSpec::Scale::kLog1p},
      {"levels", T::kList, 1, 127, {}, "auto",
       "level limit of every (layer, K/V, head), in that order, joined by '.' (overrides the fine/coarse choice)",
       ParamSpec::Scale::kLinear, true},
  };
  return {info,
          [](const StageSpec& spec, const CodecEnv&) -> Result<std::unique_ptr<Stage>> {
            return std::unique_ptr<Stage>(new MixHqStage(ParamsOf(spec)));
          },
          // A layer range gets the level limits its slabs have within the whole request, spelled
          // out (heads=auto draws from all of the request's heads).
          [](const StageSpec& spec, const KvShape& full, uint32_t layer_begin, uint32_t n_layers) -> Result<StageSpec> {
            KV_ASSIGN_OR_RETURN(Layout L, MakeLayout(ParamsOf(spec), full));
            const uint64_t per_layer = 2 * uint64_t{full.n_head_kv};
            std::string levels;
            for (uint64_t s = layer_begin * per_layer; s < (layer_begin + n_layers) * per_layer; ++s) {
              levels += (levels.empty() ? "" : ".") + std::to_string(L.limit[s]);
            }
            StageSpec out = spec;
            out.Set("levels", levels);
            out.Set("heads", "auto");
            out.Set("boost_layers", "0");
            return out;
          }};
}

}  // namespace kvserve
