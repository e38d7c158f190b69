// quant(kbits, vbits, kaxis, vaxis, group, residual, boost_layers, boost_bits): asymmetric uniform min-max quantisation,
// 1-8 bits, separately for K and V, KIVI-style: K per channel (groups of `group` tokens share a
// range per channel), V per token (groups of `group` channels share a range per token); the most
// recent `residual` tokens stay fp16. Group sizes larger than the axis are clamped per frame and
// the effective values are recorded in the payload.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "codec/quant_kernels.h"
#include "codec/stage.h"

namespace kvserve {

namespace {

// Tokens per packing block along the token axis (per-token V): only the packing granularity,
// the quantisation groups are per token.
constexpr uint32_t kTokenAxisBlock = 64;
constexpr size_t kPayloadHeader = 24;

struct PartLayout {
  int bits = 4;
  bool channel_axis = true;  // ranges per channel over groups of tokens
  uint32_t group = 32;       // effective: tokens (channel axis) or channels (token axis)
  uint32_t head_dim = 0;
  uint32_t n_quant = 0;      // tokens quantised
  uint32_t residual = 0;     // tokens kept fp16 at the end

  int levels() const { return (1 << bits) - 1; }
  uint32_t block_tokens() const { return channel_axis ? group : kTokenAxisBlock; }
  // Range grouping as the block kernels take it: 0 = per channel over the block's tokens.
  size_t kernel_group() const { return channel_axis ? 0 : group; }
  size_t meta_count(uint32_t bt) const { return quant::BlockMetaCount(bt, head_dim, kernel_group()); }
  size_t block_bytes(uint32_t bt) const { return quant::BlockBytes(bt, head_dim, kernel_group(), bits); }
  size_t slab_bytes() const {
    size_t total = 0;
    const uint32_t b = block_tokens();
    if (n_quant > 0) total += size_t{n_quant / b} * block_bytes(b) + (n_quant % b ? block_bytes(n_quant % b) : 0);
    return total + size_t{residual} * head_dim * 2;
  }
};

// The error of a block whose group `bad` (its min/max left in s) does not fit fp16 metadata.
Status RangeError(const quant::BlockScratch& s, size_t bad) {
  return Status::InvalidArgument("value range [" + std::to_string(s.mn[bad]) + ", " + std::to_string(s.mx[bad]) +
                                 "] of a group does not fit fp16 quantisation metadata");
}

// The most recent tokens' n values (contiguous, `dt`), kept as fp16.
void ResidualToF16(const uint8_t* src, DType dt, size_t n, uint8_t* dst, quant::BlockScratch& s) {
  if (dt == DType::kF16) {
    std::memcpy(dst, src, n * 2);
    return;
  }
  s.Reserve(n, 0);
  ConvertToF32(dt, src, s.x.data(), n);
  ConvertFromF32(DType::kF16, s.x.data(), dst, n);
}

Status EncodeSlab(RowBlocks& in, DType dt, const PartLayout& p, uint8_t* dst, quant::BlockScratch& s) {
  const size_t D = p.head_dim;
  const uint32_t n_token = p.n_quant + p.residual;
  for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
    const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
    const size_t m = p.meta_count(bt);
    // A paged slab's block is gathered into an L1-sized buffer, the next block's rows prefetched
    // (reading the rows where they lie inside the kernel measured no faster).
    const uint8_t* src = in.Read(t0, bt, std::min(p.block_tokens(), n_token - t0 - bt));
    const size_t bad = quant::EncodeBlock(src, dt, bt, D, p.kernel_group(), p.bits, dst, s);
    if (bad < m) return RangeError(s, bad);
    dst += p.block_bytes(bt);
  }
  const size_t nr = size_t{p.residual} * D;
  if (nr > 0) ResidualToF16(in.Read(p.n_quant, p.residual, 0), dt, nr, dst, s);
  return Status::Ok();
}

void DecodeSlab(const uint8_t* src, const PartLayout& p, DType dt, RowBlocks& out, quant::BlockScratch& s) {
  const size_t D = p.head_dim;
  for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
    const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
    // A paged slab's rows are written where they lie.
    if (uint8_t* const* rows = out.RowsFrom(t0)) quant::DecodeBlockToRows(src, bt, D, p.kernel_group(), p.bits, dt, rows, s);
    else quant::DecodeBlock(src, bt, D, p.kernel_group(), p.bits, dt, out.Write(t0, bt), s);
    src += p.block_bytes(bt);
  }
  quant::StreamFence();
  const size_t nr = size_t{p.residual} * D;
  if (nr > 0) {
    uint8_t* r = out.Write(p.n_quant, p.residual);
    if (dt == DType::kF16) {
      std::memcpy(r, src, nr * 2);
    } else {
      s.Reserve(nr, 0);
      ConvertToF32(DType::kF16, src, s.x.data(), nr);
      ConvertFromF32(dt, s.x.data(), r, nr);
    }
    out.Wrote(p.n_quant, p.residual);
  }
}

// The n_head_kv slabs of one (layer, K/V) part of a paged cache, which share one layout, encoded
// a block of tokens at a time, head after head (PagedPartRows). The fused kernel reads each head's
// rows where they lie and, while it codes, asks for a share of the next block's page rows, so
// they are in cache when read (paged/dense encode 0.6 -> 0.8, docs/results/paged.md); the float
// path elsewhere converts each row where it lies and asks the same. dst[h]: head h's slab output;
// errors[h]: its status.
void EncodePagedPart(PagedPartRows& in, DType dt, const PartLayout& p, uint8_t* const* dst, Status* errors,
                     quant::BlockScratch& s) {
  thread_local std::vector<const uint8_t*> head_rows;
  const size_t D = p.head_dim;
  const uint32_t H = in.n_head(), n_token = p.n_quant + p.residual;
  size_t done = 0;  // bytes of each slab written so far
  for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
    const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
    const size_t m = p.meta_count(bt);
    if (t0 == 0) in.Ask(0, bt);
    const uint32_t next_t0 = t0 + bt, next_n = std::min(p.block_tokens(), n_token - next_t0);
    for (uint32_t h = 0; h < H; ++h) {
      const uint32_t a = next_n * h / H, b = next_n * (h + 1) / H;
      const quant::NextRows next{in.PageRows(next_t0 + a), b - a, in.page_row_bytes()};
      in.HeadRows(h, t0, bt, &head_rows);
      const size_t bad =
          quant::EncodeBlockFromRows(head_rows.data(), dt, bt, D, p.kernel_group(), p.bits, dst[h] + done, s, &next);
      if (bad < m && errors[h].ok()) errors[h] = RangeError(s, bad);
    }
    done += p.block_bytes(bt);
  }
  const size_t nr = size_t{p.residual} * D;
  for (uint32_t h = 0; h < H && nr > 0; ++h) ResidualToF16(in.ReadHead(h, p.n_quant, p.residual), dt, nr, dst[h] + done, s);
}

class QuantStage final : public Stage {
 public:
  QuantStage(int kbits, int vbits, bool k_channel, bool v_channel, uint32_t group, uint32_t residual,
             uint32_t boost_layers, int boost_bits)
      : kbits_(kbits), vbits_(vbits), k_channel_(k_channel), v_channel_(v_channel), group_(group), residual_(residual),
        boost_layers_(boost_layers), boost_bits_(boost_bits) {}

  // Layout of one slab's part; the first boost_layers layers get boost_bits more (CacheGen gives
  // shallow layers more bits: their errors propagate through every later layer).
  PartLayout Layout(KvPart part, const KvShape& shape, uint32_t layer) const {
    PartLayout p;
    const bool k = part == KvPart::kKey;
    p.bits = std::min(8, (k ? kbits_ : vbits_) + (layer < boost_layers_ ? boost_bits_ : 0));
    p.channel_axis = k ? k_channel_ : v_channel_;
    p.head_dim = shape.head_dim;
    p.residual = std::min(residual_, shape.n_token);
    p.n_quant = shape.n_token - p.residual;
    p.group = p.channel_axis ? std::max<uint32_t>(1, std::min(group_, p.n_quant)) : std::min(group_, shape.head_dim);
    return p;
  }
  PartLayout SlabLayout(uint64_t i, const KvShape& shape) const {
    return Layout((i / shape.n_head_kv) % 2 ? KvPart::kValue : KvPart::kKey, shape, uint32_t(i / (2 * shape.n_head_kv)));
  }

  // Byte offset of every slab (after the payload header), slabs ordered [layer][K|V][head]; the
  // last entry is the total.
  std::vector<size_t> SlabOffsets(const KvShape& shape) const {
    std::vector<size_t> off(shape.n_slab() + 1, 0);
    for (uint64_t i = 0; i < shape.n_slab(); ++i) off[i + 1] = off[i] + SlabLayout(i, shape).slab_bytes();
    return off;
  }

  uint16_t EffectiveBoostLayers(const KvShape& shape) const {
    return uint16_t(boost_bits_ ? std::min<uint32_t>(boost_layers_, shape.n_layer) : 0);
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& shape = t.shape();
    const PartLayout kl = Layout(KvPart::kKey, shape, 0), vl = Layout(KvPart::kValue, shape, 0);
    const std::vector<size_t> off = SlabOffsets(shape);
    const size_t start = out.bytes->size();
    out.bytes->resize(start + kPayloadHeader + off.back());
    uint8_t* hdr = out.bytes->data() + start;
    hdr[0] = 1;
    hdr[1] = static_cast<uint8_t>(kbits_);
    hdr[2] = static_cast<uint8_t>(vbits_);
    hdr[3] = k_channel_ ? 0 : 1;
    hdr[4] = v_channel_ ? 0 : 1;
    hdr[5] = static_cast<uint8_t>(boost_bits_);
    const uint16_t boost = EffectiveBoostLayers(shape);
    std::memcpy(hdr + 6, &boost, 2);
    std::memcpy(hdr + 8, &kl.group, 4);
    std::memcpy(hdr + 12, &vl.group, 4);
    std::memcpy(hdr + 16, &kl.residual, 4);
    std::memcpy(hdr + 20, &shape.n_token, 4);
    uint8_t* body = hdr + kPayloadHeader;
    std::vector<Status> errors(shape.n_slab());
    const uint64_t H = shape.n_head_kv;
    if (t.is_paged()) {  // a (layer, K/V) part at a time: all its heads' page rows together
      ParallelFor(ctx.pool, shape.n_slab() / H, [&](uint64_t part) {
        thread_local quant::BlockScratch scratch;
        thread_local std::vector<uint8_t*> rows, dst;
        thread_local ByteBuffer buf;
        PagedPartRows in(t, part, rows, buf);
        dst.resize(H);
        for (uint64_t h = 0; h < H; ++h) dst[h] = body + off[part * H + h];
        EncodePagedPart(in, t.dtype(), SlabLayout(part * H, shape), dst.data(), errors.data() + part * H, scratch);
      });
    } else {
      ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t i) {
        thread_local quant::BlockScratch scratch;
        thread_local std::vector<uint8_t*> rows;
        thread_local ByteBuffer buf;
        RowBlocks in(t, i, rows, buf);
        errors[i] = EncodeSlab(in, t.dtype(), SlabLayout(i, shape), body + off[i], scratch);
      });
    }
    for (uint64_t i = 0; i < errors.size(); ++i) {
      if (!errors[i].ok()) {
        const uint64_t h = shape.n_head_kv;
        return errors[i].WithContext("layer " + std::to_string(i / (2 * h)) + ((i / h) % 2 ? " V" : " K") + " head " +
                                     std::to_string(i % h));
      }
    }
    return Status::Ok();
  }

  std::vector<CodeSection> CodeSections(const KvShape& shape) const override {
    const std::vector<size_t> offs = SlabOffsets(shape);
    std::vector<CodeSection> out;
    for (uint64_t i = 0; i < shape.n_slab(); ++i) {
      const uint64_t part = (i / shape.n_head_kv) % 2, layer = i / (2 * shape.n_head_kv);
      const PartLayout p = SlabLayout(i, shape);
      uint64_t off = kPayloadHeader + offs[i];
      for (uint32_t t0 = 0; t0 < p.n_quant; t0 += p.block_tokens()) {
        const uint32_t bt = std::min(p.block_tokens(), p.n_quant - t0);
        const size_t n8 = (size_t{bt} * p.head_dim + 7) & ~size_t{7};
        const uint32_t m = uint32_t(p.meta_count(bt)), ctx = uint32_t(layer * 2 + part);
        // Minima, then steps, then the codes: each kind of value gets its own statistics.
        out.push_back({off, m, 16, 1, ctx * 2, CodeSection::Kind::kHalf});
        out.push_back({off + m * 2, m, 16, 1, ctx * 2 + 1, CodeSection::Kind::kHalf});
        out.push_back({off + m * 4, uint32_t(n8), uint8_t(p.bits), p.head_dim, ctx});
        off += p.block_bytes(bt);
      }
    }
    return out;
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const KvShape& shape = t.shape();
    const PartLayout kl = Layout(KvPart::kKey, shape, 0), vl = Layout(KvPart::kValue, shape, 0);
    const std::vector<size_t> off = SlabOffsets(shape);
    const size_t want = kPayloadHeader + off.back();
    if (in.bytes.size() != want) {
      return Status::Corrupt("quant payload is " + std::to_string(in.bytes.size()) + " bytes, shape " +
                             shape.ToString() + " needs " + std::to_string(want));
    }
    const uint8_t* hdr = in.bytes.data();
    uint32_t kg, vg, res, nt;
    uint16_t boost;
    std::memcpy(&boost, hdr + 6, 2);
    std::memcpy(&kg, hdr + 8, 4);
    std::memcpy(&vg, hdr + 12, 4);
    std::memcpy(&res, hdr + 16, 4);
    std::memcpy(&nt, hdr + 20, 4);
    if (hdr[0] != 1 || hdr[1] != kbits_ || hdr[2] != vbits_ || hdr[3] != (k_channel_ ? 0 : 1) ||
        hdr[4] != (v_channel_ ? 0 : 1) || hdr[5] != boost_bits_ || boost != EffectiveBoostLayers(shape) ||
        kg != kl.group || vg != vl.group || res != kl.residual || nt != shape.n_token) {
      return Status::Corrupt("quant payload header does not match the frame's strategy and shape");
    }
    const uint8_t* body = hdr + kPayloadHeader;
    ParallelFor(ctx.pool, shape.n_slab(), [&](uint64_t i) {
      thread_local quant::BlockScratch scratch;
      thread_local std::vector<uint8_t*> rows;
      thread_local ByteBuffer buf;
      RowBlocks out(t, i, rows, buf);
      DecodeSlab(body + off[i], SlabLayout(i, shape), t.dtype(), out, scratch);
      out.Fence();
    });
    return Status::Ok();
  }

 private:
  int kbits_, vbits_;
  bool k_channel_, v_channel_;
  uint32_t group_, residual_;
  uint32_t boost_layers_;
  int boost_bits_;
};

Result<std::unique_ptr<Stage>> MakeQuant(const StageSpec& spec, const CodecEnv&) {
  return std::unique_ptr<Stage>(new QuantStage(
      static_cast<int>(spec.GetInt("kbits")), static_cast<int>(spec.GetInt("vbits")), spec.Get("kaxis") == "channel",
      spec.Get("vaxis") == "channel", static_cast<uint32_t>(spec.GetInt("group")),
      static_cast<uint32_t>(spec.GetInt("residual")), static_cast<uint32_t>(spec.GetInt("boost_layers")),
      static_cast<int>(spec.GetInt("boost_bits"))));
}

}  // namespace

StageRegistration QuantStageRegistration() {
  StageInfo info;
  info.name = "quant";
  info.summary = "asymmetric min-max quantisation, K and V separately, bit-packed (KIVI-style axes)";
  info.input = DataKind::kTensor;
  info.output = DataKind::kSymbols;
  using T = ParamSpec::Type;
  info.params = {
      {"kbits", T::kInt, 1, 8, {}, "4", "bits per K value", ParamSpec::Scale::kStep},
      {"vbits", T::kInt, 1, 8, {}, "4", "bits per V value", ParamSpec::Scale::kStep},
      {"kaxis", T::kEnum, 0, 0, {"channel", "token"}, "channel",
       "K ranges per channel (over a group of tokens) or per token (over a group of channels)"},
      {"vaxis", T::kEnum, 0, 0, {"channel", "token"}, "token", "V ranges, as kaxis"},
      {"group", T::kInt, 1, 65536, {}, "32", "values sharing one range along the grouped axis (clamped to it)", ParamSpec::Scale::kLog},
      {"residual", T::kInt, 0, 1 << 20, {}, "0", "most recent tokens kept in fp16", ParamSpec::Scale::kLog1p},
      {"boost_layers", T::kInt, 0, 4096, {}, "0", "first layers that get boost_bits more (CacheGen-style)"},
      {"boost_bits", T::kInt, 0, 7, {}, "1", "extra bits of the boosted layers (capped at 8)"},
  };
  return {info, &MakeQuant,
          [](const StageSpec& spec, const KvShape&, uint32_t layer_begin, uint32_t n_layers) -> Result<StageSpec> {
            StageSpec out = spec;
            const int64_t boosted = spec.GetInt("boost_layers") - int64_t(layer_begin);
            out.Set("boost_layers", std::to_string(std::clamp<int64_t>(boosted, 0, n_layers)));
            return out;
          }};
}

}  // namespace kvserve

