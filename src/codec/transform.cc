// Tensor-to-tensor transforms that reshape value distributions before quantisation:
//   rotate(kind=hadamard, seed, parts) — a randomised Walsh–Hadamard rotation of every head
//     vector (random signs, then the normalised transform), spreading outlier channels;
//   delta(anchor) — CacheGen-style: in each group of `anchor` tokens the first token is kept and
//     the others become differences to it, shrinking ranges where neighbouring tokens are alike.
// Both output f32 tensors of the input's shape; decoding inverts them exactly up to float error.
#include <cmath>
#include <cstring>

#include "codec/hadamard.h"
#include "codec/stage.h"

namespace kvserve {
namespace {

bool PartSelected(const std::string& parts, bool is_v) { return parts == "kv" || (parts == "k") != is_v; }

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
      ConvertToF32(t.dtype(), t.slab_at(i), dst, s.slab_numel());
      if (!PartSelected(parts_, (i / s.n_head_kv) % 2)) return;
      std::vector<float> sign(D);
      Signs(seed_, ctx.first_slab + i, D, sign.data());
      for (uint32_t tok = 0; tok < s.n_token; ++tok) {
        float* row = dst + size_t(tok) * D;
        for (uint32_t d = 0; d < D; ++d) row[d] *= sign[d];
        Hadamard(row, D);
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
      std::vector<float> buf(s.slab_numel()), sign(D);
      ConvertToF32(t.dtype(), t.slab_at(i), buf.data(), buf.size());
      if (PartSelected(parts_, (i / s.n_head_kv) % 2)) {
        Signs(seed_, ctx.first_slab + i, D, sign.data());
        for (uint32_t tok = 0; tok < s.n_token; ++tok) {
          float* row = buf.data() + size_t(tok) * D;
          Hadamard(row, D);
          for (uint32_t d = 0; d < D; ++d) row[d] *= sign[d];
        }
      }
      ConvertFromF32(out.tensor->dtype(), buf.data(), out.tensor->slab_at(i), buf.size());
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
      ConvertToF32(t.dtype(), t.slab_at(i), x, s.slab_numel());
      if (!PartSelected(parts_, (i / s.n_head_kv) % 2)) return;
      for (uint32_t g = 0; g < s.n_token; g += anchor_) {
        const float* a = x + size_t(g) * D;
        for (uint32_t tok = g + 1; tok < std::min(s.n_token, g + anchor_); ++tok) {
          float* row = x + size_t(tok) * D;
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
      std::vector<float> x(s.slab_numel());
      ConvertToF32(t.dtype(), t.slab_at(i), x.data(), x.size());
      if (PartSelected(parts_, (i / s.n_head_kv) % 2)) {
        for (uint32_t g = 0; g < s.n_token; g += anchor_) {
          const float* a = x.data() + size_t(g) * D;
          for (uint32_t tok = g + 1; tok < std::min(s.n_token, g + anchor_); ++tok) {
            float* row = x.data() + size_t(tok) * D;
            for (uint32_t d = 0; d < D; ++d) row[d] += a[d];
          }
        }
      }
      ConvertFromF32(out.tensor->dtype(), x.data(), out.tensor->slab_at(i), x.size());
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
