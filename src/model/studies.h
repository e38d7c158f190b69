// Internal: the studies the evaluator drives — the named strategy table, lowrank calibration,
// head rankings (retrieval scores, measured sensitivities) and MixHQ's bit-budget solver.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvserve/eval.h"

namespace kvserve {

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
Result<uint64_t> CalibrateLowRank(const LlamaModel& model, const std::string& calib_dir, const std::string& cache_dir = "",
                                  uint32_t n_contexts = 16, uint64_t seed = 1000);

// DuoAttention-style retrieval score per (layer, KV head): the share of attention that the last
// `window` prompt positions put outside the first `sink` tokens and their own last `recent`
// tokens, averaged over the evaluation set's prompts and the query heads of each KV head.
struct HeadScore {
  uint32_t layer = 0, head = 0;
  // What the ranking measures: the retrieval share (RetrievalHeadScores, in [0, 1]) or the KL
  // increase when the head is coarse (SensitivityHeadScores). Higher = keep finer.
  double score = 0;
  uint32_t rank = 0;  // 0 = highest score
};
struct HeadProfileOptions {
  uint32_t window = 32, sink = 4, recent = 64;
};
Result<std::vector<HeadScore>> RetrievalHeadScores(const Evaluator& ev, const HeadProfileOptions& opts = {},
                                                   const ProgressFn& progress = nullptr);

// Measured sensitivity per (layer, KV head): the KL increase over an all-fine `mixhq` when only
// that head is quantised coarsely (in `score`; higher = more sensitive).
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
