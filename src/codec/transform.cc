// Tensor-to-tensor transforms that reshape value distributions before quantisation:
//   rotate(kind=hadamard, seed, parts) — a randomised Walsh–Hadamard rotation of every head
//     vector (random signs, then the normalised transform), spreading outlier channels;
//   delta(anchor) — CacheGen-style: in each group of `anchor` tokens the first token is kept and
//     the others become differences to it, shrinking ranges where neighbouring tokens are alike.
// Both output f32 tensors of the input's shape; decoding inverts them exactly up to float error.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "codec/hadamard.h"
#include "codec/stage.h"

namespace kvserve {
namespace {

bool PartSelected(const std::string& parts, bool is_v) { return parts == "kv" || (parts == "k") != is_v; }

// Values per chunk of rows that a transform converts, transforms and stores while they are in L1.
constexpr uint32_t kChunkValues = 4096;
uint32_t ChunkRows(uint32_t head_dim) { return std::max<uint32_t>(1, kChunkValues / head_dim); }

// Slab i of `in` as f32 into the same slab of `out` (an f32 tensor), `chunk` rows at a time,
// each chunk then transformed in place by fn(rows, n_rows) while it is in L1.
template <typename Fn>
void ForwardInChunks(const KvBlock& in, KvBlock& out, uint64_t i, uint32_t chunk, Fn fn) {
  const uint32_t D = in.shape().head_dim, n_token = in.shape().n_token;
  const size_t es = DTypeSize(in.dtype());
  float* dst = reinterpret_cast<float*>(out.slab_at(i));
  thread_local ByteBuffer gathered;  // a paged input's slab
  const uint8_t* src = in.ReadSlab(i, gathered);
  for (uint32_t t0 = 0; t0 < n_token; t0 += chunk) {
    const uint32_t rows = std::min(chunk, n_token - t0);
    float* x = dst + size_t(t0) * D;
    ConvertToF32(in.dtype(), src + size_t(t0) * D * es, x, size_t(rows) * D);
    fn(x, rows);
  }
}

// The way back: slab i of `in` into the same slab of `out` in its dtype, `chunk` rows at a time
// through f32 scratch that fn(rows, n_rows) inverts in place.
template <typename Fn>
void InverseInChunks(const KvBlock& in, KvBlock& out, uint64_t i, uint32_t chunk, Fn fn) {
  const uint32_t D = in.shape().head_dim, n_token = in.shape().n_token;
  const size_t in_es = DTypeSize(in.dtype()), out_es = DTypeSize(out.dtype());
  thread_local std::vector<float> buf;
  thread_local ByteBuffer scratch;  // a paged output's slab
  buf.resize(size_t(chunk) * D);
  uint8_t* dst = out.SlabToWrite(i, scratch);
  for (uint32_t t0 = 0; t0 < n_token; t0 += chunk) {
    const uint32_t rows = std::min(chunk, n_token - t0);
    const size_t first = size_t(t0) * D, n = size_t(rows) * D;
    ConvertToF32(in.dtype(), in.slab_at(i) + first * in_es, buf.data(), n);
    fn(buf.data(), rows);
    ConvertFromF32(out.dtype(), buf.data(), dst + first * out_es, n);
  }
  out.WroteSlab(i, dst);
}

class RotateStage final : public Stage {
 public:
  RotateStage(uint64_t seed, std::string parts) : seed_(seed), parts_(std::move(parts)) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = t.shape();
    const uint32_t D = s.head_dim;
    if (D & (D - 1)) return Status::InvalidArgument("rotate needs head_dim a power of two, got " + std::to_string(D));
    KV_RETURN_IF_ERROR(out.tensor->Reset(s, DType::kF32));
    out.tensor->set_token_offset(t.token_offset());
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) { Slab(t, *out.tensor, i, ctx.first_slab + i, false); });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = out.tensor->shape();
    const uint32_t D = s.head_dim;
    if (!(t.shape() == s) || (D & (D - 1))) return Status::Corrupt("rotate input does not match the frame's shape");
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) { Slab(t, *out.tensor, i, ctx.first_slab + i, true); });
    return Status::Ok();
  }

 private:
  // One slab either way; `slab` numbers it in the whole request (the signs' key).
  void Slab(const KvBlock& in, KvBlock& out, uint64_t i, uint64_t slab, bool inverse) const {
    const uint32_t D = in.shape().head_dim;
    const bool selected = PartSelected(parts_, (i / in.shape().n_head_kv) % 2);
    thread_local std::vector<float> sign;
    sign.resize(D);
    if (selected) Signs(seed_, slab, D, sign.data());
    auto rotate = [&](float* x, uint32_t rows) {
      if (selected) RotateRows(x, rows, D, sign.data(), inverse);
    };
    if (inverse) InverseInChunks(in, out, i, ChunkRows(D), rotate);
    else ForwardInChunks(in, out, i, ChunkRows(D), rotate);
  }

  uint64_t seed_;
  std::string parts_;
};

class DeltaStage final : public Stage {
 public:
  DeltaStage(uint32_t anchor, std::string parts) : anchor_(anchor), parts_(std::move(parts)) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = t.shape();
    KV_RETURN_IF_ERROR(out.tensor->Reset(s, DType::kF32));
    out.tensor->set_token_offset(t.token_offset());
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) { Slab(t, *out.tensor, i, false); });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = out.tensor->shape();
    if (!(t.shape() == s)) return Status::Corrupt("delta input does not match the frame's shape");
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) { Slab(t, *out.tensor, i, true); });
    return Status::Ok();
  }

 private:
  // One slab either way, one anchor group per chunk (L1-sized chunks where nothing changes): the
  // rows after a group's first lose (encode) or regain (decode) it.
  void Slab(const KvBlock& in, KvBlock& out, uint64_t i, bool inverse) const {
    const uint32_t D = in.shape().head_dim;
    const bool selected = PartSelected(parts_, (i / in.shape().n_head_kv) % 2);
    auto delta = [&](float* x, uint32_t rows) {
      if (!selected) return;
      for (uint32_t r = 1; r < rows; ++r) {
        float* row = x + size_t(r) * D;
        if (inverse)
          for (uint32_t d = 0; d < D; ++d) row[d] += x[d];
        else
          for (uint32_t d = 0; d < D; ++d) row[d] -= x[d];
      }
    };
    const uint32_t chunk = selected ? anchor_ : ChunkRows(D);
    if (inverse) InverseInChunks(in, out, i, chunk, delta);
    else ForwardInChunks(in, out, i, chunk, delta);
  }

  uint32_t anchor_;
  std::string parts_;
};

const ParamSpec kPartsParam{"parts", ParamSpec::Type::kEnum, 0, 0, {"kv", "k", "v"}, "kv", "which of K and V"};

}  // namespace

StageRegistration RotateStageRegistration() {
  StageInfo info;
  info.name = "rotate";
  info.summary = "randomised Walsh-Hadamard rotation of each head vector (spreads outlier channels)";
  info.input = DataKind::kTensor;
  info.output = DataKind::kTensor;
  info.params = {{"kind", ParamSpec::Type::kEnum, 0, 0, {"hadamard"}, "hadamard", "rotation family"},
                 {"seed", ParamSpec::Type::kInt, 0, 1e9, {}, "1", "seed of the random signs"},
                 kPartsParam};
  return {info, [](const StageSpec& spec, const CodecEnv& env) -> Result<std::unique_ptr<Stage>> {
            return std::unique_ptr<Stage>(new RotateStage(uint64_t(spec.GetInt("seed")), spec.Get("parts")));
          }};
}

StageRegistration DeltaStageRegistration() {
  StageInfo info;
  info.name = "delta";
  info.summary = "CacheGen-style anchor/delta: tokens become differences to their group's first token";
  info.input = DataKind::kTensor;
  info.output = DataKind::kTensor;
  info.params = {{"anchor", ParamSpec::Type::kInt, 2, 4096, {}, "16", "tokens per anchor group", ParamSpec::Scale::kLog}, kPartsParam};
  return {info, [](const StageSpec& spec, const CodecEnv& env) -> Result<std::unique_ptr<Stage>> {
            return std::unique_ptr<Stage>(new DeltaStage(uint32_t(spec.GetInt("anchor")), spec.Get("parts")));
          }};
}

}  // namespace kvserve
