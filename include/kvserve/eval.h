// Quality of a codec strategy on a real model: the evaluation set (self-generated contexts),
// the cached exact run, and the metrics every quality floor in kvserve refers to.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/codec.h"
#include "kvserve/model.h"
#include "kvserve/thread_pool.h"

namespace kvserve {

struct EvalOptions {
  uint32_t n_contexts = 0;     // 0: enough for >= 8000 scored positions, rounded up to 16
  uint32_t prompt_len = 0;     // 0: 3/4 of the context window
  uint64_t seed = 1;           // of the evaluation set
  uint32_t greedy_tokens = 64;
  int threads = 1;             // contexts in parallel; results do not depend on it
  // Runs the contexts (null: the evaluator starts a pool of `threads` once, for its lifetime).
  ThreadPool* pool = nullptr;
  std::string cache_dir;       // exact-run cache folder; empty: no disk cache
  CodecEnv codec_env;          // for the strategies it evaluates (lowrank bases)
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

// Not thread-safe: one Evaluate at a time (it already runs its contexts on the pool); the
// const accessors may be read from several threads.
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

}  // namespace kvserve
