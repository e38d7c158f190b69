// prune(sink, recent, keep, score): token selection. Keeps the first `sink` tokens (attention
// sinks, StreamingLLM), the last `recent`, and the top `keep` share of the tokens between them by
// importance: the attention they received from the prompt's last positions at prefill
// (SnapKV/H2O-style, given by the caller as token scores), or — with score=knorm, or when no
// scores are given — the smallest key norm, which in trained models marks the keys that draw
// the most attention (Devoto et al., 2024). One selection for all layers and heads: the kept
// block stays rectangular and the decode side keeps one position list (recorded in the frame
// header), so RoPE positions stay right. Per-head selection would keep more of what each head
// needs, at the price of ragged blocks; not done.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "codec/stage.h"

namespace kvserve {
namespace {

constexpr uint32_t kScoreTokens = 64;  // tokens per scoring task

// Sum of squares in double, eight running sums (one vector) added pairwise: a fixed order, so
// the same on every thread.
double SquaredNorm(const float* x, uint32_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) acc[k] += double(x[d + k]) * x[d + k];
  for (; d < n; ++d) acc[d % 8] += double(x[d]) * x[d];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

class PruneStage final : public Stage {
 public:
  PruneStage(uint32_t sink, uint32_t recent, double keep, bool attn) : sink_(sink), recent_(recent), keep_(keep), attn_(attn) {}

  KvShape OutputShape(const KvShape& in) const override {
    KvShape out = in;
    const uint32_t s = std::min(sink_, in.n_token), r = std::min(recent_, in.n_token - s);
    const uint32_t mid = in.n_token - s - r;
    out.n_token = s + r + uint32_t(std::lround(keep_ * mid));
    return out;
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& sh = t.shape();
    const uint32_t n = sh.n_token, s = std::min(sink_, n), r = std::min(recent_, n - s), mid = n - s - r;
    const uint32_t k = uint32_t(std::lround(keep_ * mid));
    std::vector<double> score(n, 0.0);
    if (attn_ && ctx.token_scores != nullptr) {
      if (ctx.token_scores->size() != n) {
        return Status::InvalidArgument("prune got " + std::to_string(ctx.token_scores->size()) +
                                       " token scores for a block of " + std::to_string(n) + " tokens");
      }
      for (uint32_t i = 0; i < n; ++i) score[i] = (*ctx.token_scores)[i];
    } else {
      // Negative squared key norm, summed over layers and heads: small keys rank first. Tasks
      // take token ranges and sum each token's slabs in the same order, so the scores do not
      // depend on the threads.
      ParallelFor(ctx.pool, (n + kScoreTokens - 1) / kScoreTokens, [&](uint64_t part) {
        thread_local std::vector<float> row;
        row.resize(sh.head_dim);
        const uint32_t begin = uint32_t(part * kScoreTokens), end = std::min<uint32_t>(n, begin + kScoreTokens);
        for (uint32_t l = 0; l < sh.n_layer; ++l)
          for (uint32_t h = 0; h < sh.n_head_kv; ++h) {
            const uint64_t slab = sh.slab_index(l, KvPart::kKey, h);
            // Keys of an FP8 cache are its codes times their scale: heads compare by value.
            const double scale = t.fp8_scales().ForSlab(sh, slab), scale2 = scale * scale;
            for (uint32_t i = begin; i < end; ++i) {
              ConvertToF32(t.dtype(), t.TokenRow(slab, i), row.data(), sh.head_dim);
              score[i] -= SquaredNorm(row.data(), sh.head_dim) * scale2;
            }
          }
      });
    }
    std::vector<uint32_t> middle(mid);
    std::iota(middle.begin(), middle.end(), s);
    std::stable_sort(middle.begin(), middle.end(), [&](uint32_t a, uint32_t b) { return score[a] > score[b]; });
    std::vector<uint32_t> keep_idx;
    for (uint32_t i = 0; i < s; ++i) keep_idx.push_back(i);
    keep_idx.insert(keep_idx.end(), middle.begin(), middle.begin() + k);
    for (uint32_t i = n - r; i < n; ++i) keep_idx.push_back(i);
    std::sort(keep_idx.begin(), keep_idx.end());
    KvShape os = sh;
    os.n_token = uint32_t(keep_idx.size());
    // The kept rows keep their dtype: selection changes no value, and converting to f32 here
    // would double what the next stage reads.
    KV_RETURN_IF_ERROR(out.tensor->Reset(os, t.dtype()));
    out.tensor->set_token_offset(t.token_offset());
    std::vector<uint32_t> pos;
    for (uint32_t i : keep_idx) pos.push_back(t.position(i));
    const size_t row = size_t(sh.head_dim) * DTypeSize(t.dtype());
    ParallelFor(ctx.pool, sh.n_slab(), [&](uint64_t sl) {
      uint8_t* dst = out.tensor->slab_at(sl);
      for (size_t j = 0; j < keep_idx.size(); ++j) std::memcpy(dst + j * row, t.TokenRow(sl, keep_idx[j]), row);
    });
    out.tensor->set_positions(std::move(pos));
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    // The kept tokens pass through; the pipeline attaches their positions from the frame header.
    const KvBlock& t = *in.tensor;
    if (!(t.shape() == out.tensor->shape())) return Status::Corrupt("prune input does not match the frame's kept tokens");
    const size_t n = t.shape().slab_numel();
    ParallelFor(ctx.pool, t.shape().n_slab(), [&](uint64_t sl) {
      thread_local ByteBuffer scratch;  // a paged destination's slab
      uint8_t* dst = out.tensor->SlabToWrite(sl, scratch);
      if (t.dtype() == out.tensor->dtype()) {
        std::memcpy(dst, t.slab_at(sl), n * DTypeSize(t.dtype()));
      } else {
        thread_local std::vector<float> buf;
        buf.resize(n);
        ConvertToF32(t.dtype(), t.slab_at(sl), buf.data(), n);
        ConvertFromF32(out.tensor->dtype(), buf.data(), dst, n);
      }
      out.tensor->WroteSlab(sl, dst);
    });
    return Status::Ok();
  }

 private:
  uint32_t sink_, recent_;
  double keep_;
  bool attn_;
};

}  // namespace

StageRegistration PruneStageRegistration() {
  StageInfo info;
  info.name = "prune";
  info.summary = "token selection: keep sinks, the recent window, and the most important share of the rest";
  info.input = DataKind::kTensor;
  info.output = DataKind::kTensor;
  info.selects_tokens = true;
  using T = ParamSpec::Type;
  info.params = {
      {"sink", T::kInt, 0, 1 << 20, {}, "4", "first tokens always kept (attention sinks)", ParamSpec::Scale::kLog1p},
      {"recent", T::kInt, 0, 1 << 20, {}, "64", "last tokens always kept", ParamSpec::Scale::kLog1p},
      {"keep", T::kFloat, 0, 1, {}, "0.5", "share of the tokens in between that is kept"},
      {"score", T::kEnum, 0, 0, {"attn", "knorm"}, "attn",
       "importance: prefill attention (falls back to knorm when none is given), or small key norm"},
  };
  return {info, [](const StageSpec& spec, const CodecEnv& env) -> Result<std::unique_ptr<Stage>> {
            return std::unique_ptr<Stage>(new PruneStage(uint32_t(spec.GetInt("sink")), uint32_t(spec.GetInt("recent")),
                                                         spec.GetFloat("keep"), spec.Get("score") == "attn"));
          }};
}

}  // namespace kvserve
