// The llama forward pass, top to bottom: embedding, then per layer RMSNorm -> QKV -> RoPE ->
// grouped-query attention over the KV cache -> output projection -> residual, RMSNorm -> SwiGLU
// FFN -> residual; final RMSNorm and classifier. Tokens are processed as a batch (prefill,
// teacher forcing) so the matmuls are matrix-matrix products (Eigen).
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "kv/rng.h"
#include "model/ops.h"
#include "kvserve/model.h"

namespace kvserve {
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

uint32_t Argmax(const float* v, uint32_t n) {
  uint32_t best = 0;
  for (uint32_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

uint32_t SampleTopP(const float* logits, uint32_t n, float temperature, float top_p, double u) {
  std::vector<float> p(logits, logits + n);
  for (float& x : p) x /= temperature;
  ops::Softmax(p.data(), n);
  std::vector<uint32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0u);
  // Stable order (by probability, then id) keeps sampling reproducible.
  std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
  double cum = 0;
  uint32_t last = n - 1;
  for (uint32_t k = 0; k < n; ++k) {
    cum += p[idx[k]];
    if (cum >= top_p) {
      last = k;
      break;
    }
  }
  const double r = u * cum;
  double acc = 0;
  for (uint32_t k = 0; k <= last; ++k) {
    acc += p[idx[k]];
    if (r < acc) return idx[k];
  }
  return idx[last];
}

LlamaEngine::LlamaEngine(const LlamaModel& model) : model_(model) {
  const LlamaConfig& c = model.config;
  const uint32_t hs = c.head_dim();
  rope_cos_.resize(size_t(c.seq_len) * hs / 2);
  rope_sin_.resize(rope_cos_.size());
  for (uint32_t pos = 0; pos < c.seq_len; ++pos) {
    for (uint32_t i = 0; i < hs; i += 2) {
      // As llama2.c computes it, in float, so greedy outputs match the reference exactly.
      const float freq = 1.0f / std::pow(c.rope_theta, float(i) / float(hs));
      const float val = float(pos) * freq;
      rope_cos_[size_t(pos) * hs / 2 + i / 2] = std::cos(val);
      rope_sin_[size_t(pos) * hs / 2 + i / 2] = std::sin(val);
    }
  }
}

Status LlamaEngine::Forward(const int* tokens, uint32_t n, KvCache* cache, float* logits, bool last_logits_only,
                            AttentionCapture* capture) {
  const LlamaConfig& c = model_.config;
  const LlamaWeights& w = model_.weights;
  const uint32_t dim = c.dim, hs = c.head_dim(), kv_dim = c.kv_dim(), hidden = c.hidden_dim;
  // p0: first free cache slot; pos0: sequence position of the first token (they differ after a
  // pruned prefix, whose kept tokens keep their original positions).
  const uint32_t group = c.n_head / c.n_head_kv, p0 = cache->n_pos, pos0 = cache->next_pos;
  const uint32_t capacity = cache->block.shape().n_token;
  if (n == 0) return Status::Ok();
  if (uint64_t(pos0) + n > c.seq_len || uint64_t(p0) + n > capacity) {
    return Status::OutOfRange("positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n - 1) +
                              " exceed the context of " + std::to_string(std::min(capacity, c.seq_len)));
  }
  for (uint32_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || uint32_t(tokens[t]) >= c.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(tokens[t]) + " outside the vocabulary of " +
                                     std::to_string(c.vocab_size));
    }
  }
  x_.resize(size_t(n) * dim), xb_.resize(x_.size()), q_.resize(x_.size()), att_out_.resize(x_.size());
  k_.resize(size_t(n) * kv_dim), v_.resize(k_.size());
  hb_.resize(size_t(n) * hidden), hb2_.resize(hb_.size());
  const uint32_t window = capture ? std::min(capture->window, n) : 0;
  if (capture) {
    capture->window = window;
    capture->n_prompt = p0 + n;
    capture->n_layer = c.n_layer;
    capture->n_head = c.n_head;
    capture->probs.assign(size_t(c.n_layer) * c.n_head * window * (p0 + n), 0.0f);
  }

  for (uint32_t t = 0; t < n; ++t) std::copy_n(w.token_embedding + size_t(tokens[t]) * dim, dim, &x_[size_t(t) * dim]);

  for (uint32_t l = 0; l < c.n_layer; ++l) {
    // Attention block.
    for (uint32_t t = 0; t < n; ++t) ops::RmsNorm(&xb_[size_t(t) * dim], &x_[size_t(t) * dim], w.rms_att + size_t(l) * dim, dim, c.norm_eps);
    ops::MatMul(xb_.data(), n, dim, w.wq + size_t(l) * dim * dim, dim, q_.data());
    ops::MatMul(xb_.data(), n, dim, w.wk + size_t(l) * kv_dim * dim, kv_dim, k_.data());
    ops::MatMul(xb_.data(), n, dim, w.wv + size_t(l) * kv_dim * dim, kv_dim, v_.data());
    // RoPE: rotate adjacent pairs (2i, 2i+1) within each head by pos * theta^(-2i/head_dim).
    for (uint32_t t = 0; t < n; ++t) {
      const float* cs = &rope_cos_[size_t(pos0 + t) * hs / 2];
      const float* sn = &rope_sin_[size_t(pos0 + t) * hs / 2];
      for (uint32_t j = 0; j < dim; j += 2) {
        const uint32_t f = (j % hs) / 2;
        float* qv = &q_[size_t(t) * dim + j];
        const float a = qv[0], b = qv[1];
        qv[0] = a * cs[f] - b * sn[f];
        qv[1] = a * sn[f] + b * cs[f];
        if (j < kv_dim) {
          float* kv = &k_[size_t(t) * kv_dim + j];
          const float ka = kv[0], kb = kv[1];
          kv[0] = ka * cs[f] - kb * sn[f];
          kv[1] = ka * sn[f] + kb * cs[f];
        }
      }
    }
    // The new tokens' K and V go into the cache, in kvserve's [layer][K|V][head][token][dim] layout.
    for (uint32_t h = 0; h < c.n_head_kv; ++h) {
      float* kc = reinterpret_cast<float*>(cache->block.slab(l, KvPart::kKey, h));
      float* vc = reinterpret_cast<float*>(cache->block.slab(l, KvPart::kValue, h));
      for (uint32_t t = 0; t < n; ++t) {
        std::copy_n(&k_[size_t(t) * kv_dim + h * hs], hs, kc + size_t(p0 + t) * hs);
        std::copy_n(&v_[size_t(t) * kv_dim + h * hs], hs, vc + size_t(p0 + t) * hs);
      }
    }
    // Grouped-query attention: query head h reads KV head h / group, positions [0, p0 + t].
    // Per head, S = Q K^T / sqrt(hs) over all cached positions, causal mask, row softmax, O = S V.
    const float scale = 1.0f / std::sqrt(float(hs));
    const uint32_t len = p0 + n;
    scores_.resize(size_t(n) * len);
    using Strided = Eigen::Map<const RowMat, 0, Eigen::OuterStride<>>;
    using StridedOut = Eigen::Map<RowMat, 0, Eigen::OuterStride<>>;
    Eigen::Map<RowMat> s(scores_.data(), n, len);
    for (uint32_t h = 0; h < c.n_head; ++h) {
      Eigen::Map<const RowMat> kc(reinterpret_cast<const float*>(cache->block.slab(l, KvPart::kKey, h / group)), len, hs);
      Eigen::Map<const RowMat> vc(reinterpret_cast<const float*>(cache->block.slab(l, KvPart::kValue, h / group)), len, hs);
      Strided q(&q_[h * hs], n, hs, Eigen::OuterStride<>(dim));
      s.noalias() = (q * kc.transpose()) * scale;
      for (uint32_t t = 0; t < n; ++t) {
        float* row = &scores_[size_t(t) * len];
        const uint32_t valid = p0 + t + 1;
        ops::Softmax(row, valid);
        std::fill(row + valid, row + len, 0.0f);
        if (t + window >= n && window > 0) {
          std::copy_n(row, len, &capture->probs[((size_t(l) * c.n_head + h) * window + (t + window - n)) * capture->n_prompt]);
        }
      }
      StridedOut out(&att_out_[h * hs], n, hs, Eigen::OuterStride<>(dim));
      out.noalias() = s * vc;
    }
    ops::MatMul(att_out_.data(), n, dim, w.wo + size_t(l) * dim * dim, dim, xb_.data());
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += xb_[i];

    // Feed-forward block: w2(silu(w1 x) * w3 x).
    for (uint32_t t = 0; t < n; ++t) ops::RmsNorm(&xb_[size_t(t) * dim], &x_[size_t(t) * dim], w.rms_ffn + size_t(l) * dim, dim, c.norm_eps);
    ops::MatMul(xb_.data(), n, dim, w.w1 + size_t(l) * hidden * dim, hidden, hb_.data());
    ops::MatMul(xb_.data(), n, dim, w.w3 + size_t(l) * hidden * dim, hidden, hb2_.data());
    for (size_t i = 0; i < hb_.size(); ++i) {
      const float g = hb_[i];
      hb_[i] = g * (1.0f / (1.0f + std::exp(-g))) * hb2_[i];
    }
    ops::MatMul(hb_.data(), n, hidden, w.w2 + size_t(l) * dim * hidden, dim, xb_.data());
    for (size_t i = 0; i < x_.size(); ++i) x_[i] += xb_[i];
  }
  cache->n_pos = p0 + n;
  cache->next_pos = pos0 + n;

  if (logits != nullptr) {
    const uint32_t first = last_logits_only ? n - 1 : 0, rows = n - first;
    for (uint32_t t = first; t < n; ++t) ops::RmsNorm(&xb_[size_t(t) * dim], &x_[size_t(t) * dim], w.rms_final, dim, c.norm_eps);
    ops::MatMul(&xb_[size_t(first) * dim], rows, dim, w.wcls, c.vocab_size, logits);
  }
  return Status::Ok();
}

Result<std::vector<int>> LlamaEngine::Generate(const std::vector<int>& prompt, uint32_t n, float temperature,
                                               float top_p, uint64_t seed) {
  if (prompt.empty()) return Status::InvalidArgument("generation needs at least one prompt token (BOS)");
  const LlamaConfig& c = model_.config;
  KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(c));
  std::vector<float> logits(c.vocab_size);
  KV_RETURN_IF_ERROR(Forward(prompt.data(), uint32_t(prompt.size()), &cache, logits.data(), true));
  uint64_t s = seed;
  Rng rng(SplitMix(s));
  std::vector<int> out;
  while (out.size() < n && cache.next_pos < c.seq_len) {
    const int next = temperature <= 0 ? int(Argmax(logits.data(), c.vocab_size))
                                      : int(SampleTopP(logits.data(), c.vocab_size, temperature, top_p, rng.Uniform()));
    out.push_back(next);
    if (out.size() == n || cache.next_pos >= c.seq_len) break;
    KV_RETURN_IF_ERROR(Forward(&next, 1, &cache, logits.data(), true));
  }
  return out;
}

}  // namespace kvserve
