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
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) {
      float* dst = reinterpret_cast<float*>(out.tensor->slab_at(i));
      const bool selected = PartSelected(parts_, (i / s.n_head_kv) % 2);
      thread_local std::vector<float> sign;
      sign.resize(D);
      if (selected) Signs(seed_, ctx.first_slab + i, D, sign.data());
      // Rows in chunks that stay in L1 between the conversion and the rotation.
      const uint32_t chunk = std::max<uint32_t>(1, kChunkValues / D);
      const size_t es = DTypeSize(t.dtype());
      for (uint32_t t0 = 0; t0 < s.n_token; t0 += chunk) {
        const uint32_t rows = std::min(chunk, s.n_token - t0);
        const size_t first = size_t(t0) * D;
        ConvertToF32(t.dtype(), t.slab_at(i) + first * es, dst + first, size_t(rows) * D);
        if (selected) RotateRows(dst + first, rows, D, sign.data(), false);
      }
    });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = out.tensor->shape();
    const uint32_t D = s.head_dim;
    if (!(t.shape() == s) || (D & (D - 1))) return Status::Corrupt("rotate input does not match the frame's shape");
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) {
      const bool selected = PartSelected(parts_, (i / s.n_head_kv) % 2);
      thread_local std::vector<float> buf, sign;
      sign.resize(D);
      if (selected) Signs(seed_, ctx.first_slab + i, D, sign.data());
      const uint32_t chunk = std::max<uint32_t>(1, kChunkValues / D);
      buf.resize(size_t(chunk) * D);
      const size_t in_es = DTypeSize(t.dtype()), out_es = DTypeSize(out.tensor->dtype());
      for (uint32_t t0 = 0; t0 < s.n_token; t0 += chunk) {
        const uint32_t rows = std::min(chunk, s.n_token - t0);
        const size_t first = size_t(t0) * D, n = size_t(rows) * D;
        ConvertToF32(t.dtype(), t.slab_at(i) + first * in_es, buf.data(), n);
        if (selected) RotateRows(buf.data(), rows, D, sign.data(), true);
        ConvertFromF32(out.tensor->dtype(), buf.data(), out.tensor->slab_at(i) + first * out_es, n);
      }
    });
    return Status::Ok();
  }

 private:
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
    const uint32_t D = s.head_dim;
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) {
      float* x = reinterpret_cast<float*>(out.tensor->slab_at(i));
      const size_t es = DTypeSize(t.dtype());
      if (!PartSelected(parts_, (i / s.n_head_kv) % 2)) {
        ConvertToF32(t.dtype(), t.slab_at(i), x, s.slab_numel());
        return;
      }
      // Group by group, so the rows are still in L1 when their anchor is subtracted.
      for (uint32_t g = 0; g < s.n_token; g += anchor_) {
        const uint32_t rows = std::min(anchor_, s.n_token - g);
        float* a = x + size_t(g) * D;
        ConvertToF32(t.dtype(), t.slab_at(i) + size_t(g) * D * es, a, size_t(rows) * D);
        for (uint32_t r = 1; r < rows; ++r) {
          float* row = a + size_t(r) * D;
          for (uint32_t d = 0; d < D; ++d) row[d] -= a[d];
        }
      }
    });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = out.tensor->shape();
    if (!(t.shape() == s)) return Status::Corrupt("delta input does not match the frame's shape");
    const uint32_t D = s.head_dim;
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t i) {
      const bool selected = PartSelected(parts_, (i / s.n_head_kv) % 2);
      // One anchor group at a time (or L1-sized chunks when nothing is restored).
      const uint32_t chunk = selected ? anchor_ : std::max<uint32_t>(1, kChunkValues / D);
      thread_local std::vector<float> x;
      x.resize(size_t(chunk) * D);
      const size_t in_es = DTypeSize(t.dtype()), out_es = DTypeSize(out.tensor->dtype());
      for (uint32_t g = 0; g < s.n_token; g += chunk) {
        const uint32_t rows = std::min(chunk, s.n_token - g);
        const size_t first = size_t(g) * D, n = size_t(rows) * D;
        ConvertToF32(t.dtype(), t.slab_at(i) + first * in_es, x.data(), n);
        if (selected) {
          for (uint32_t r = 1; r < rows; ++r) {
            float* row = x.data() + size_t(r) * D;
            for (uint32_t d = 0; d < D; ++d) row[d] += x[d];
          }
        }
        ConvertFromF32(out.tensor->dtype(), x.data(), out.tensor->slab_at(i) + first * out_es, n);
      }
    });
    return Status::Ok();
  }

 private:
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
