// Model helpers shared by the prefill, decode and pool nodes (engine_util.h).
#include "serve/engine_util.h"

#include <mutex>
#include <thread>

#include "kvserve/synth.h"

namespace kvserve::serve_internal {

Status CheckPrompt(const LlamaConfig& cfg, const std::vector<int>& prompt) {
  if (prompt.size() >= cfg.seq_len) {
    return Status::OutOfRange("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                              std::to_string(cfg.seq_len));
  }
  for (int t : prompt) {
    if (t < 0 || uint32_t(t) >= cfg.vocab_size) {
      return Status::InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary of " +
                                     std::to_string(cfg.vocab_size));
    }
  }
  return Status::Ok();
}

Result<std::vector<int>> GreedyContinue(const LlamaModel& model, KvCache* cache, int first_token, uint32_t max_new) {
  const LlamaConfig& cfg = model.config;
  LlamaEngine engine(model);
  std::vector<float> logits(cfg.vocab_size);
  std::vector<int> out = {first_token};
  int tok = first_token;
  while (out.size() < max_new && cache->next_pos < cfg.seq_len) {
    KV_RETURN_IF_ERROR(engine.Forward(&tok, 1, cache, logits.data(), true));
    if (cache->next_pos >= cfg.seq_len) break;
    tok = int(Argmax(logits.data(), cfg.vocab_size));
    out.push_back(tok);
  }
  return out;
}

std::vector<int> SyntheticTokens(const SyntheticModel& m, int first_token, uint32_t max_new) {
  std::this_thread::sleep_for(std::chrono::duration<double>((max_new - 1) / m.decode_tokens_per_second));
  std::vector<int> out(max_new, 0);
  out[0] = first_token;
  return out;
}

Result<std::shared_ptr<const KvBlock>> SyntheticPromptKv(const SyntheticModel& m, uint32_t n_token, ThreadPool* pool) {
  static std::mutex mu;
  static std::vector<std::pair<KvShape, std::shared_ptr<const KvBlock>>> cache;
  const KvShape shape{m.n_layer, m.n_head_kv, n_token, m.head_dim};
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [s, kv] : cache)
    if (s == shape) return kv;
  KV_ASSIGN_OR_RETURN(KvBlock kv, SynthesizeKv(shape, SynthOptions{.seed = n_token, .dtype = DType::kF16, .pool = pool}));
  if (cache.size() >= 8) cache.erase(cache.begin());  // a few prompt lengths at a time
  cache.push_back({shape, std::make_shared<const KvBlock>(std::move(kv))});
  return cache.back().second;
}

}  // namespace kvserve::serve_internal
