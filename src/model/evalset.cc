// The evaluation set: contexts the model writes itself, from a seed. Self-generated text is a
// fair corpus for *relative* quality: every strategy is scored against the same model's own
// predictions on text that model finds natural, so the score measures what compression changes,
// not how well the model fits some external corpus (see docs/EVALUATION.md).
#include <cmath>

#include "kv/rng.h"
#include "kvserve/eval.h"

namespace kvserve {

namespace {
const char* const kFixedPrompts[] = {"Once upon a time", "Tom and Lily were playing", "The little dog",
                                     "One day, a girl named Sue"};
}

uint32_t DefaultEvalContexts(const LlamaConfig& c, uint32_t prompt_len) {
  const uint32_t scored = c.seq_len > prompt_len + 1 ? c.seq_len - prompt_len - 1 : 1;
  const uint32_t n = (8000 + scored - 1) / scored;
  return (n + 15) / 16 * 16;
}

Result<EvalSet> BuildEvalSet(const LlamaModel& model, uint32_t n_contexts, uint64_t seed) {
  const LlamaConfig& c = model.config;
  LlamaEngine engine(model);
  KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(c));
  std::vector<float> logits(c.vocab_size);
  EvalSet set;
  set.seed = seed;
  for (uint32_t i = 0; i < n_contexts; ++i) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + i;
    Rng rng(SplitMix(s));
    std::vector<int> ctx = {Tokenizer::kBos};
    if (i < std::size(kFixedPrompts)) {
      ctx = model.tokenizer.Encode(kFixedPrompts[i], true);
      ctx.resize(std::min<size_t>(ctx.size(), c.seq_len / 2));
    }
    cache.Rewind(0, 0);
    KV_RETURN_IF_ERROR(engine.Forward(ctx.data(), uint32_t(ctx.size()), &cache, logits.data(), true));
    // Sampling runs straight through story boundaries (BOS), as in the training data.
    while (ctx.size() < c.seq_len) {
      const int next = int(SampleTopP(logits.data(), c.vocab_size, 1.0f, 0.9f, rng.Uniform()));
      ctx.push_back(next);
      if (ctx.size() == c.seq_len) break;
      KV_RETURN_IF_ERROR(engine.Forward(&next, 1, &cache, logits.data(), true));
    }
    set.contexts.push_back(std::move(ctx));
  }
  return set;
}

}  // namespace kvserve
