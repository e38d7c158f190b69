// The two computes a node may have (compute.h): the llama engine over a real model, and the
// synthetic stand-in of a production shape with modelled GPU time.
#include "serve/compute.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "kvserve/synth.h"

namespace kvserve::serve_internal {

// LlamaEngine::Generate's generator: Rng(SplitMix(seed)), one draw per token when sampling.
TokenPicker::TokenPicker(const Sampling& s, uint32_t skip) : s_(s), rng_(Seeded(s.seed)) {
  for (uint32_t i = 0; s.temperature > 0 && i < skip; ++i) rng_.Uniform();
}

int TokenPicker::Pick(const float* logits, uint32_t n_vocab) {
  if (s_.temperature <= 0) return int(Argmax(logits, n_vocab));
  return int(SampleTopP(logits, n_vocab, s_.temperature, s_.top_p, rng_.Uniform()));
}

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A prompt `model` can run: it fits the context and every id is in the vocabulary.
Status PromptFits(const LlamaConfig& cfg, const std::vector<int>& prompt) {
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

// Tokens from `first_token` on, exactly as LlamaEngine::Generate continues after its prompt
// with the same sampling, over the prompt KV in `cache` (first_token is out[0]).
Result<std::vector<int>> GreedyContinue(const LlamaModel& model, KvCache* cache, int first_token, uint32_t max_new,
                                        const Sampling& sampling, const TokenSink& on_token) {
  const LlamaConfig& cfg = model.config;
  LlamaEngine engine(model);
  TokenPicker picker(sampling, 1);  // the first token was prefill's draw
  std::vector<float> logits(cfg.vocab_size);
  std::vector<int> out = {first_token};
  if (on_token && !on_token(first_token)) return out;
  int tok = first_token;
  while (out.size() < max_new && cache->next_pos < cfg.seq_len) {
    KV_RETURN_IF_ERROR(engine.Forward(&tok, 1, cache, logits.data(), true));
    if (cache->next_pos >= cfg.seq_len) break;
    tok = picker.Pick(logits.data(), cfg.vocab_size);
    out.push_back(tok);
    if (on_token && !on_token(tok)) break;
  }
  return out;
}

// The stand-in's generation: time at its decode rate (the first token came from prefill).
// Streamed, a token at each step's time.
std::vector<int> SyntheticTokens(const SyntheticModel& m, int first_token, uint32_t max_new, const TokenSink& on_token) {
  std::vector<int> out(max_new, 0);
  out[0] = first_token;
  if (!on_token) {
    std::this_thread::sleep_for(std::chrono::duration<double>((max_new - 1) / m.decode_tokens_per_second));
    return out;
  }
  const Clock::time_point t0 = Clock::now();
  for (uint32_t i = 0; i < max_new; ++i) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(i / m.decode_tokens_per_second)));
    if (!on_token(out[i])) {
      out.resize(i + 1);
      break;
    }
  }
  return out;
}

// The synthetic KV (fp16) of an n_token prompt: made once per shape, shared process-wide, so
// that synthesis is done before timing (Prepare) and never counts as serving time.
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


// ---- The llama engine ------------------------------------------------------------------------------

class EngineSession final : public ComputeSession {
 public:
  EngineSession(const LlamaModel& model, KvCache cache) : model_(model), cache_(std::move(cache)) {}

  Status LoadPrefix(const KvBlock& kv, uint32_t n_prompt) override { return cache_.LoadPrefix(kv, n_prompt); }

  bool PlaceChunk(const KvBlock& chunk, uint32_t at) override {
    const KvShape& s = chunk.shape();
    const uint32_t head_dim = model_.config.head_dim();
    if (at + s.n_token > cache_.block.shape().n_token || s.n_slab() != cache_.block.shape().n_slab() || s.head_dim != head_dim) {
      return false;
    }
    KvBlock f32;
    const KvBlock* src = &chunk;
    if (chunk.dtype() != DType::kF32) {
      auto conv = chunk.ConvertTo(DType::kF32);
      if (!conv.ok()) return false;
      f32 = std::move(conv).value();
      src = &f32;
    }
    for (uint64_t slab = 0; slab < s.n_slab(); ++slab) {
      std::memcpy(cache_.block.slab_at(slab) + size_t(at) * head_dim * sizeof(float), src->slab_at(slab),
                  size_t(s.n_token) * head_dim * sizeof(float));
    }
    return true;
  }

  Result<int> ComputeSuffix(const std::vector<int>& prompt, uint32_t cached, const Sampling& sampling) override {
    const LlamaConfig& cfg = model_.config;
    cache_.Rewind(cached, cached);
    LlamaEngine engine(model_);
    std::vector<float> logits(cfg.vocab_size);
    KV_RETURN_IF_ERROR(engine.Forward(prompt.data() + cached, uint32_t(prompt.size()) - cached, &cache_, logits.data(), true));
    return TokenPicker(sampling).Pick(logits.data(), cfg.vocab_size);
  }

  Status KeepPrefix(uint32_t n_token) override {
    KV_ASSIGN_OR_RETURN(KvBlock prefix, cache_.Prefix(n_token));
    kept_ = std::make_shared<const KvBlock>(std::move(prefix));
    return Status::Ok();
  }

  Result<std::shared_ptr<const KvBlock>> Kept(uint32_t) override {
    if (kept_ == nullptr) return Status::Internal("no prefix kept before generation");
    return kept_;
  }

  Result<std::vector<int>> Generate(int first_token, uint32_t max_new, const Sampling& sampling, const TokenSink& on_token) override {
    return GreedyContinue(model_, &cache_, first_token, max_new, sampling, on_token);
  }

 private:
  const LlamaModel& model_;
  KvCache cache_;
  std::shared_ptr<const KvBlock> kept_;
};

class EngineCompute final : public Compute {
 public:
  explicit EngineCompute(const LlamaModel& model) : model_(model) {
    const LlamaConfig& c = model.config;
    shape_.n_layer = c.n_layer;
    shape_.n_head_kv = c.n_head_kv;
    shape_.head_dim = c.head_dim();
    shape_.max_prompt = c.seq_len - 1;
    shape_.max_new = c.seq_len;
    shape_.vocab = c.vocab_size;
    shape_.kv_dtype = DType::kF32;
    shape_.per_fp16 = 2;
    shape_.identity = model.sha256;
  }

  Status CheckPrompt(const std::vector<int>& prompt) const override { return PromptFits(model_.config, prompt); }
  Status Prepare(uint32_t) override { return Status::Ok(); }

  Result<Prefilled> Prefill(const std::vector<int>& prompt, const Sampling& sampling) override {
    const Clock::time_point t0 = Clock::now();
    const LlamaConfig& cfg = model_.config;
    KV_RETURN_IF_ERROR(CheckPrompt(prompt));
    const uint32_t n = uint32_t(prompt.size());
    // Prefill, capturing the attention token-selecting strategies rank by.
    LlamaEngine engine(model_);
    KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(cfg));
    std::vector<float> logits(cfg.vocab_size);
    AttentionCapture cap;
    cap.window = std::min<uint32_t>(32, n);
    KV_RETURN_IF_ERROR(engine.Forward(prompt.data(), n, &cache, logits.data(), true, &cap));
    Prefilled out;
    out.scores.assign(n, 0.0f);
    for (size_t row = 0; cap.n_prompt && row < cap.probs.size() / cap.n_prompt; ++row)
      for (uint32_t j = 0; j < n; ++j) out.scores[j] += cap.probs[row * cap.n_prompt + j];
    out.first_token = TokenPicker(sampling).Pick(logits.data(), cfg.vocab_size);
    KV_ASSIGN_OR_RETURN(KvBlock prefix, cache.Prefix(n, DType::kF32));
    out.kv = std::make_shared<const KvBlock>(std::move(prefix));
    out.prefill_s = SecondsSince(t0);
    return out;
  }

  Result<std::unique_ptr<ComputeSession>> NewSession() const override {
    KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(model_.config));
    return std::unique_ptr<ComputeSession>(new EngineSession(model_, std::move(cache)));
  }

 private:
  const LlamaModel& model_;
};

// ---- The synthetic stand-in --------------------------------------------------------------------------

class SyntheticSession final : public ComputeSession {
 public:
  SyntheticSession(const SyntheticModel& m, ThreadPool* pool) : m_(m), pool_(pool) {}
  Status LoadPrefix(const KvBlock&, uint32_t) override { return Status::Ok(); }  // checked, not needed to model time
  bool PlaceChunk(const KvBlock&, uint32_t) override { return true; }
  Result<int> ComputeSuffix(const std::vector<int>& prompt, uint32_t cached, const Sampling&) override {
    std::this_thread::sleep_for(std::chrono::duration<double>((prompt.size() - cached) / m_.prefill_tokens_per_second));
    return 0;
  }
  Status KeepPrefix(uint32_t) override { return Status::Ok(); }
  // The stand-in's exact KV is its synthetic prompt KV (made at Prepare, so no serving time).
  Result<std::shared_ptr<const KvBlock>> Kept(uint32_t n_prompt) override { return SyntheticPromptKv(m_, n_prompt, pool_); }
  Result<std::vector<int>> Generate(int first_token, uint32_t max_new, const Sampling&, const TokenSink& on_token) override {
    return SyntheticTokens(m_, first_token, max_new, on_token);
  }

 private:
  const SyntheticModel& m_;
  ThreadPool* pool_;
};

class SyntheticCompute final : public Compute {
 public:
  SyntheticCompute(const SyntheticModel& m, ThreadPool* pool) : m_(m), pool_(pool) {
    shape_.n_layer = m.n_layer;
    shape_.n_head_kv = m.n_head_kv;
    shape_.head_dim = m.head_dim;
    shape_.max_prompt = m.max_prompt_tokens;
    shape_.max_new = 1u << 20;
    shape_.vocab = 1u << 30;
    shape_.kv_dtype = DType::kF16;
    shape_.per_fp16 = 1;
    shape_.identity = m.name;
    shape_.modelled_prefill_tps = m.prefill_tokens_per_second;
  }

  Status CheckPrompt(const std::vector<int>&) const override { return Status::Ok(); }
  Status Prepare(uint32_t n_token) override { return SyntheticPromptKv(m_, n_token, pool_).status(); }

  Result<Prefilled> Prefill(const std::vector<int>& prompt, const Sampling&) override {
    const Clock::time_point t0 = Clock::now();
    const uint32_t n = uint32_t(prompt.size());
    Prefilled out;
    KV_ASSIGN_OR_RETURN(out.kv, SyntheticPromptKv(m_, n, pool_));
    out.scores.assign(n, 0.0f);
    // One prompt at a time, as on one GPU: the wait is the request's queueing.
    std::unique_lock<std::mutex> gpu(gpu_mu_);
    const Clock::time_point started = Clock::now();
    out.queue_s = std::chrono::duration<double>(started - t0).count();
    std::this_thread::sleep_for(std::chrono::duration<double>(n / m_.prefill_tokens_per_second));
    out.prefill_s = SecondsSince(started);
    return out;
  }

  Result<std::unique_ptr<ComputeSession>> NewSession() const override {
    return std::unique_ptr<ComputeSession>(new SyntheticSession(m_, pool_));
  }

 private:
  const SyntheticModel& m_;
  ThreadPool* pool_;
  std::mutex gpu_mu_;
};

}  // namespace

Result<std::unique_ptr<Compute>> MakeCompute(const LlamaModel* model, const SyntheticModel* synthetic, ThreadPool* pool,
                                             const char* node) {
  if ((model == nullptr) == (synthetic == nullptr)) {
    return Status::InvalidArgument(std::string(node) + " node needs a model or a synthetic model (one of them)");
  }
  if (model != nullptr) return std::unique_ptr<Compute>(new EngineCompute(*model));
  return std::unique_ptr<Compute>(new SyntheticCompute(*synthetic, pool));
}

}  // namespace kvserve::serve_internal
