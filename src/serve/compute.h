// Internal to serve: what a node computes with, behind one interface — the llama engine over a
// real model, or the synthetic stand-in of a production shape on a GPU preset (synthetic KV,
// modelled GPU time). The nodes ask it for the KV's shape, prefill, a request's KV and
// generation; none of them branches on which one it has.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvserve/model.h"
#include "kvserve/serve.h"
#include "kvserve/thread_pool.h"
#include "kv/rng.h"

namespace kvserve::serve_internal {

// What the nodes need to know of the KV and the model before computing anything.
struct ComputeShape {
  uint32_t n_layer = 0, n_head_kv = 0, head_dim = 0;
  uint32_t max_prompt = 0;  // the longest prompt it takes
  uint32_t max_new = 0;     // the most tokens one request may generate
  uint32_t vocab = 0;       // token ids below this
  DType kv_dtype = DType::kF16;  // the KV it makes and takes
  // Raw KV bytes per fp16 byte (profiles measure against fp16: a real model's f32 KV is twice).
  double per_fp16 = 1;
  std::string identity;  // what pool keys are made under: the model's sha256, or the shape's name
  double modelled_prefill_tps = 0;  // the stand-in's prefill rate; 0: measured as it runs
  uint64_t kv_bytes_per_token() const { return uint64_t{2} * n_layer * n_head_kv * head_dim * DTypeSize(kv_dtype); }
};

// A prompt's prefill: its KV, per-token attention scores (what token-selecting strategies rank
// by; zeros where not captured), the first generated token, and where the time went.
struct Prefilled {
  std::shared_ptr<const KvBlock> kv;
  std::vector<float> scores;
  int first_token = 0;
  double queue_s = 0, prefill_s = 0;
};

// Picks tokens as LlamaEngine::Generate does: one uniform draw per token when sampling, from
// Rng(SplitMix(seed)). `skip` draws are made first (the decode node continues after prefill's).
class TokenPicker {
 public:
  explicit TokenPicker(const Sampling& s, uint32_t skip = 0);
  int Pick(const float* logits, uint32_t n_vocab);

 private:
  static Rng Seeded(uint64_t seed) { return Rng(SplitMix(seed)); }
  Sampling s_;
  Rng rng_;
};

// One request's KV on a node that generates (decode, pool): the engine's cache, or nothing the
// stand-in needs. One thread at a time.
class ComputeSession {
 public:
  virtual ~ComputeSession() = default;
  // Decode node: the transferred prompt KV (`kv`, maybe fewer tokens than the prompt's
  // `n_prompt` when a strategy kept some) as the cache's prefix.
  virtual Status LoadPrefix(const KvBlock& kv, uint32_t n_prompt) = 0;
  // Pool node: a fetched chunk's KV into cache slots [at, at + its tokens); false when it does
  // not fit (or cannot be converted), and then nothing was written.
  virtual bool PlaceChunk(const KvBlock& chunk, uint32_t at) = 0;
  // Pool node: computes prompt tokens [cached, n) over the cache's first `cached` slots; returns
  // the first generated token.
  virtual Result<int> ComputeSuffix(const std::vector<int>& prompt, uint32_t cached, const Sampling& sampling = {}) = 0;
  // Pool node, storing: KeepPrefix before generation (which extends the cache) marks the first
  // n_token tokens' exact KV; Kept after gives them (at least n_token tokens, maybe the whole
  // prompt's n_prompt).
  virtual Status KeepPrefix(uint32_t n_token) = 0;
  virtual Result<std::shared_ptr<const KvBlock>> Kept(uint32_t n_prompt) = 0;
  // Tokens from first_token on (first_token is out[0], picked by `sampling`'s first draw; the
  // rest continue its draws). `on_token` (may be null) has each token as it is made; false from
  // it ends generation there.
  virtual Result<std::vector<int>> Generate(int first_token, uint32_t max_new, const Sampling& sampling = {},
                                            const TokenSink& on_token = nullptr) = 0;
};

class Compute {
 public:
  virtual ~Compute() = default;
  const ComputeShape& shape() const { return shape_; }
  // A prompt it can run (ids in the vocabulary, within the context); errors name the length or id.
  virtual Status CheckPrompt(const std::vector<int>& prompt) const = 0;
  // Work done before serving so a first request does not pay it (the stand-in's synthetic KV).
  virtual Status Prepare(uint32_t n_token) = 0;
  // Prefill node: the prompt's KV and first token. The stand-in runs one prompt at a time, as
  // one GPU would: the wait is queue_s.
  virtual Result<Prefilled> Prefill(const std::vector<int>& prompt, const Sampling& sampling = {}) = 0;
  virtual Result<std::unique_ptr<ComputeSession>> NewSession() const = 0;

 protected:
  ComputeShape shape_;
};

// The compute of a node's options: exactly one of `model` and `synthetic` (an error says so).
// `pool` runs the stand-in's KV synthesis (null: the calling thread).
Result<std::unique_ptr<Compute>> MakeCompute(const LlamaModel* model, const SyntheticModel* synthetic, ThreadPool* pool,
                                             const char* node);

}  // namespace kvserve::serve_internal
