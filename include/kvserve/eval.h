// Quality of a codec strategy on a real model: the evaluation set (self-generated contexts),
// the cached exact run, and the metrics every quality floor in kvserve refers to.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/model.h"

namespace kvserve {

struct EvalOptions {
  uint32_t n_contexts = 0;     // 0: enough for >= 8000 scored positions, rounded up to 16
  uint32_t prompt_len = 0;     // 0: 3/4 of the context window
  uint64_t seed = 1;           // of the evaluation set
  uint32_t greedy_tokens = 64;
  int threads = 1;             // contexts in parallel; results do not depend on it
  std::string cache_dir;       // exact-run cache; empty: $KVSERVE_CACHE or <source>/.kvserve-cache
  bool disk_cache = true;
};

// Deterministic contexts, each as long as the model's window: the first few continue fixed
// prompts, the rest start from BOS; all sampled at temperature 1, top-p 0.9, from the seed.
struct EvalSet {
  uint64_t seed = 0;
  std::vector<std::vector<int>> contexts;
};
Result<EvalSet> BuildEvalSet(const LlamaModel& model, uint32_t n_contexts, uint64_t seed);
uint32_t DefaultEvalContexts(const LlamaConfig& c, uint32_t prompt_len);

struct EvalMetrics {
  std::string strategy;
  double relative_accuracy = 0;     // accuracy(compressed) / accuracy(exact)
  double relative_accuracy_se = 0;  // paired standard error over positions
  double top1_agreement = 0;
  double kl = 0;                    // mean KL(p_exact || p_compressed) per position
  double ppl_ratio = 0;
  double greedy_match = 0;          // mean common prefix of greedy tokens, in [1, greedy_tokens]
  double ratio = 0;                 // fp16 bytes of the prompt KV / frame bytes
  double accuracy = 0, exact_accuracy = 0;
  uint32_t contexts = 0;
  uint64_t positions = 0;
  double seconds = 0;
};

using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

class Evaluator {
 public:
  // Builds (or loads from the cache) the evaluation set and the exact run, and prefills every
  // context's prompt. The exact reference keeps the prompt KV in fp16, as a prefill node ships it.
  static Result<std::unique_ptr<Evaluator>> Create(const LlamaModel& model, const EvalOptions& opts,
                                                   const ProgressFn& progress = nullptr);
  ~Evaluator();

  Result<EvalMetrics> Evaluate(std::string_view strategy, const ProgressFn& progress = nullptr);

  const LlamaModel& model() const;
  const EvalSet& eval_set() const;
  uint32_t prompt_len() const;
  // The fp16 prompt KV of context i (what the strategies encode).
  const KvBlock& prompt_kv(uint32_t i) const;

 private:
  struct Impl;
  explicit Evaluator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The named strategies of `kvserve eval --table`: published methods re-created as compositions
// (sized to the model's prompt) and recompositions of the stage space.
struct NamedStrategy {
  std::string name;
  std::string spec;
  std::string note;            // how it relates to the published method, where it differs
  bool recomposition = false;  // a new combination, not a baseline or a published method
};
// `lowrank_basis`: id of a fitted basis for this model (0 leaves the lowrank rows out).
std::vector<NamedStrategy> StrategyTable(const LlamaConfig& config, uint32_t prompt_len, uint64_t lowrank_basis = 0);

// Fits `lowrank` bases on the prompt KV of a calibration set (its own seed, so that the
// evaluation set is not the training set) and saves them in CalibrationDir(). Returns the id.
Result<uint64_t> CalibrateLowRank(const LlamaModel& model, uint32_t n_contexts = 16, uint64_t seed = 1000);

// DuoAttention-style retrieval score per (layer, KV head): the share of attention that the last
// `window` prompt positions put outside the first `sink` tokens and their own last `recent`
// tokens, averaged over the evaluation set's prompts and the query heads of each KV head.
struct HeadScore {
  uint32_t layer = 0, head = 0;
  double retrieval = 0;
  uint32_t rank = 0;  // 0 = most retrieval-like
};
struct HeadProfileOptions {
  uint32_t window = 32, sink = 4, recent = 64;
};
Result<std::vector<HeadScore>> RetrievalHeadScores(const Evaluator& ev, const HeadProfileOptions& opts = {},
                                                   const ProgressFn& progress = nullptr);

// Measured sensitivity per (layer, KV head): the KL increase over an all-fine `mixhq` when only
// that head is quantised coarsely (the `retrieval` field holds it; higher = more sensitive).
// `mixhq_params` are extra mixhq parameters ("kfine=12,vfine=8,..."), `coder` follows ("|rans").
Result<std::vector<HeadScore>> SensitivityHeadScores(Evaluator& ev, const std::string& mixhq_params = "",
                                                     const std::string& coder = "|rans",
                                                     const ProgressFn& progress = nullptr);

// Measured sensitivity per slab ([layer][K|V][KV head], the order of mixhq's `levels`): the KL
// increase over a near-exact mixhq (every limit `base_m`) when only that slab is quantised
// with limit `probe_m`. One evaluation per slab, plus the baseline.
Result<std::vector<double>> SlabSensitivities(Evaluator& ev, int probe_m = 3, int base_m = 63,
                                              const std::string& coder = "|rans", const ProgressFn& progress = nullptr);

// The bit-budget solver: a level limit per slab holding `target_bits` (average log2(2m + 1), the
// code width before entropy coding) that minimises the modelled KL sum_s w_s (probe_m / m_s)^2 —
// quantisation noise power falls as 1/m^2 and KL grows linearly in it for small noise. Greedy
// on the marginal KL saved per bit spent; each slab's saving per bit decreases as m grows, so
// this is optimal up to the last step that no longer fits the budget. Equal weights give
// uniform limits (within one level).
std::vector<int> AllocateMixHqLevels(const std::vector<double>& weight, int probe_m, double target_bits, int max_m = 127);
std::string MixHqLevelsSpec(const std::vector<int>& levels, const std::string& coder = "|rans");

// A mixhq spec whose fine heads are the (1 - lo_frac) share of heads with the highest scores.
std::string MixHqSpecFromScores(const std::vector<HeadScore>& scores, uint32_t n_head_kv, double lo_frac,
                                const std::string& mixhq_params = "", const std::string& coder = "|rans");

}  // namespace kvserve
