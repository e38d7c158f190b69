// Internal to serve: what every node kind does with a model — greedy generation after a prompt
// whose KV is in a cache, the synthetic stand-in's timed compute, and its synthetic prompt KV.
#pragma once

#include <memory>
#include <vector>

#include "kvserve/model.h"
#include "kvserve/serve.h"
#include "kvserve/thread_pool.h"

namespace kvserve::serve_internal {

// A prompt `model` can run: it fits the context and every id is in the vocabulary; errors name
// the length or the id.
Status CheckPrompt(const LlamaConfig& cfg, const std::vector<int>& prompt);

// Greedy tokens from `first_token` on, exactly as LlamaEngine::Generate continues after its
// prompt, over the prompt KV in `cache` (first_token is out[0]).
Result<std::vector<int>> GreedyContinue(const LlamaModel& model, KvCache* cache, int first_token, uint32_t max_new);

// The synthetic model's generation: time at its decode rate (the first token came from prefill).
std::vector<int> SyntheticTokens(const SyntheticModel& m, int first_token, uint32_t max_new);

// The synthetic KV (fp16) of an n_token prompt: made once per shape, shared process-wide, so
// that synthesis is done before timing (Prepare) and never counts as serving time.
Result<std::shared_ptr<const KvBlock>> SyntheticPromptKv(const SyntheticModel& m, uint32_t n_token, ThreadPool* pool);

}  // namespace kvserve::serve_internal
