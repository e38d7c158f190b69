// Head profile: how much each KV head's attention reaches beyond the sinks and the recent
// window (DuoAttention's retrieval vs streaming heads), measured on the evaluation set.
#include <algorithm>
#include <numeric>

#include "kvserve/eval.h"

namespace kvserve {

Result<std::vector<HeadScore>> RetrievalHeadScores(const Evaluator& ev, const HeadProfileOptions& opts,
                                                   const ProgressFn& progress) {
  const LlamaModel& model = ev.model();
  const LlamaConfig& c = model.config;
  const uint32_t P = ev.prompt_len(), group = c.n_head / c.n_head_kv;
  LlamaEngine engine(model);
  KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(c));
  std::vector<double> mass(size_t(c.n_layer) * c.n_head_kv, 0.0);
  uint64_t samples = 0;
  const auto& contexts = ev.eval_set().contexts;
  for (size_t i = 0; i < contexts.size(); ++i) {
    AttentionCapture cap;
    cap.window = opts.window;
    cache.n_pos = 0;
    KV_RETURN_IF_ERROR(engine.Forward(contexts[i].data(), P, &cache, nullptr, false, &cap));
    for (uint32_t l = 0; l < c.n_layer; ++l) {
      for (uint32_t h = 0; h < c.n_head; ++h) {
        for (uint32_t w = 0; w < cap.window; ++w) {
          const uint32_t q = P - cap.window + w;  // query position
          const float* a = &cap.probs[((size_t(l) * c.n_head + h) * cap.window + w) * cap.n_prompt];
          // Keys in [sink, q + 1 - recent): neither a sink nor in the query's recent window.
          const uint32_t end = q + 1 > opts.recent ? q + 1 - opts.recent : 0;
          double m = 0;
          for (uint32_t j = opts.sink; j < end; ++j) m += a[j];
          mass[size_t(l) * c.n_head_kv + h / group] += m;
        }
      }
    }
    samples += uint64_t(cap.window) * group;
    if (progress) progress(i + 1, contexts.size());
  }
  std::vector<HeadScore> out;
  for (uint32_t l = 0; l < c.n_layer; ++l)
    for (uint32_t h = 0; h < c.n_head_kv; ++h)
      out.push_back({l, h, samples ? mass[size_t(l) * c.n_head_kv + h] / double(samples) : 0.0, 0});
  std::vector<size_t> order(out.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return out[a].retrieval > out[b].retrieval; });
  for (size_t r = 0; r < order.size(); ++r) out[order[r]].rank = uint32_t(r);
  return out;
}

}  // namespace kvserve
