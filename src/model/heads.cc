// Head profile: how much each KV head's attention reaches beyond the sinks and the recent
// window (DuoAttention's retrieval vs streaming heads), measured on the evaluation set.
#include <algorithm>
#include <cmath>
#include <string>
#include <numeric>

#include "kvserve/eval.h"
#include "model/studies.h"

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
    cache.Rewind(0, 0);
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
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return out[a].score > out[b].score; });
  for (size_t r = 0; r < order.size(); ++r) out[order[r]].rank = uint32_t(r);
  return out;
}

namespace {
std::string HeadList(const std::vector<uint32_t>& ids) {
  if (ids.empty()) return "";
  std::vector<uint32_t> v = ids;
  std::sort(v.begin(), v.end());
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "." : "") + std::to_string(v[i]);
  return s;
}
std::string MixHq(const std::string& heads, double lo_frac, const std::string& params, const std::string& coder) {
  // An empty list means "no fine head": expressed as lo_frac=1 with heads=auto.
  std::string p = heads.empty() ? "heads=auto,lo_frac=1" : "heads=" + heads + ",lo_frac=" + std::to_string(lo_frac);
  if (!params.empty()) p += "," + params;
  return "mixhq(" + p + ")" + coder;
}
}  // namespace

std::string MixHqSpecFromScores(const std::vector<HeadScore>& scores, uint32_t n_head_kv, double lo_frac,
                                const std::string& mixhq_params, const std::string& coder) {
  std::vector<const HeadScore*> order;
  for (const auto& s : scores) order.push_back(&s);
  std::stable_sort(order.begin(), order.end(), [](const HeadScore* a, const HeadScore* b) { return a->score > b->score; });
  const size_t n_fine = size_t(std::lround((1.0 - lo_frac) * double(scores.size())));
  std::vector<uint32_t> ids;
  for (size_t i = 0; i < n_fine && i < order.size(); ++i) ids.push_back(order[i]->layer * n_head_kv + order[i]->head);
  return MixHq(HeadList(ids), lo_frac, mixhq_params, coder);
}

Result<std::vector<HeadScore>> SensitivityHeadScores(Evaluator& ev, const std::string& mixhq_params,
                                                     const std::string& coder, const ProgressFn& progress) {
  const LlamaConfig& c = ev.model().config;
  const uint32_t n = c.n_layer * c.n_head_kv;
  std::vector<uint32_t> all(n);
  std::iota(all.begin(), all.end(), 0u);
  KV_ASSIGN_OR_RETURN(EvalMetrics base, ev.Evaluate(MixHq(HeadList(all), 0.0, mixhq_params, coder)));
  std::vector<HeadScore> out;
  for (uint32_t h = 0; h < n; ++h) {
    std::vector<uint32_t> others;
    for (uint32_t k = 0; k < n; ++k)
      if (k != h) others.push_back(k);
    KV_ASSIGN_OR_RETURN(EvalMetrics m, ev.Evaluate(MixHq(HeadList(others), 0.0, mixhq_params, coder)));
    out.push_back({h / c.n_head_kv, h % c.n_head_kv, m.kl - base.kl, 0});
    if (progress) progress(h + 1, n);
  }
  std::vector<size_t> order(out.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return out[a].score > out[b].score; });
  for (size_t r = 0; r < order.size(); ++r) out[order[r]].rank = uint32_t(r);
  return out;
}

Result<std::vector<double>> SlabSensitivities(Evaluator& ev, int probe_m, int base_m, const std::string& coder,
                                              const ProgressFn& progress) {
  const LlamaConfig& c = ev.model().config;
  const size_t n = size_t(c.n_layer) * 2 * c.n_head_kv;
  std::vector<int> levels(n, base_m);
  KV_ASSIGN_OR_RETURN(EvalMetrics base, ev.Evaluate(MixHqLevelsSpec(levels, coder)));
  std::vector<double> out(n);
  for (size_t s = 0; s < n; ++s) {
    levels[s] = probe_m;
    KV_ASSIGN_OR_RETURN(EvalMetrics m, ev.Evaluate(MixHqLevelsSpec(levels, coder)));
    levels[s] = base_m;
    out[s] = m.kl - base.kl;
    if (progress) progress(s + 1, n);
  }
  return out;
}

std::vector<int> AllocateMixHqLevels(const std::vector<double>& weight, int probe_m, double target_bits, int max_m) {
  const size_t n = weight.size();
  if (n == 0) return {};
  // Measured increases can be noise-level or negative: floor them so every slab still costs
  // something to coarsen, and the solver never starves a slab for free.
  double w_max = 0;
  for (double w : weight) w_max = std::max(w_max, w);
  const double floor = w_max > 0 ? 1e-3 * w_max : 1.0;
  auto bits = [](int m) { return std::log2(2.0 * m + 1.0); };
  auto kl = [&](size_t s, int m) { return std::max(weight[s], floor) * double(probe_m) * probe_m / (double(m) * m); };
  std::vector<int> m(n, 1);
  double total = bits(1) * double(n);
  const double budget = target_bits * double(n);
  using Step = std::pair<double, size_t>;  // KL saved per bit of the slab's next step
  auto gain = [&](size_t s) { return (kl(s, m[s]) - kl(s, m[s] + 1)) / (bits(m[s] + 1) - bits(m[s])); };
  std::vector<Step> heap;
  for (size_t s = 0; s < n; ++s) heap.push_back({gain(s), s});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const size_t s = heap.back().second;
    heap.pop_back();
    const double cost = bits(m[s] + 1) - bits(m[s]);
    // Stop at the first best step that does not fit: taking lesser steps that still do would
    // spend the remainder where it is worth less (and break ties between equal slabs).
    if (total + cost > budget + 1e-9) break;
    total += cost;
    if (++m[s] < max_m) {
      heap.push_back({gain(s), s});
      std::push_heap(heap.begin(), heap.end());
    }
  }
  return m;
}

std::string MixHqLevelsSpec(const std::vector<int>& levels, const std::string& coder) {
  std::string s = "mixhq(levels=";
  for (size_t i = 0; i < levels.size(); ++i) s += (i ? "." : "") + std::to_string(levels[i]);
  return s + ")" + coder;
}

}  // namespace kvserve
