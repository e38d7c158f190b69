// The reference model: a llama-architecture CPU engine (llama2.c checkpoints and GGUF), its
// tokenizer, and a KV cache held in kvserve's own block layout so prompts' KV can be encoded
// with any strategy and attended over after decoding.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"

namespace kvserve {

struct LlamaConfig {
  uint32_t dim = 0, hidden_dim = 0, n_layer = 0, n_head = 0, n_head_kv = 0, vocab_size = 0, seq_len = 0;
  bool shared_classifier = true;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  uint32_t head_dim() const { return dim / n_head; }
  uint32_t kv_dim() const { return head_dim() * n_head_kv; }
  Status Validate() const;
};

// All weights in one contiguous float buffer, row-major [out][in], in llama2.c order.
struct LlamaWeights {
  std::vector<float> storage;
  const float* token_embedding = nullptr;  // [vocab][dim]
  const float* rms_att = nullptr;          // [L][dim]
  const float* wq = nullptr;               // [L][dim][dim]
  const float* wk = nullptr;               // [L][kv_dim][dim]
  const float* wv = nullptr;               // [L][kv_dim][dim]
  const float* wo = nullptr;               // [L][dim][dim]
  const float* rms_ffn = nullptr;          // [L][dim]
  const float* w1 = nullptr;               // [L][hidden][dim]
  const float* w2 = nullptr;               // [L][dim][hidden]
  const float* w3 = nullptr;               // [L][hidden][dim]
  const float* rms_final = nullptr;        // [dim]
  const float* wcls = nullptr;             // [vocab][dim] (== token_embedding when shared)
  // Number of floats each part holds, given the config (llama2.c order).
  static size_t FloatCount(const LlamaConfig& c);
  void Bind(const LlamaConfig& c);  // points the arrays into storage
};

class Tokenizer {
 public:
  // llama2.c tokenizer.bin: int32 max_token_length, then per token: f32 score, i32 len, bytes.
  static Result<Tokenizer> LoadLlama2c(const std::string& path, uint32_t vocab_size);
  static Tokenizer FromVocab(std::vector<std::string> pieces, std::vector<float> scores);

  uint32_t vocab_size() const { return static_cast<uint32_t>(pieces_.size()); }
  const std::string& piece(uint32_t id) const { return pieces_[id]; }
  float score(uint32_t id) const { return scores_[id]; }
  // SentencePiece-style BPE: optional BOS, a leading space, characters (byte fallback where
  // the vocabulary has <0xXX> tokens, else <unk>), then merges by best score.
  // O(n log n) in the text's length.
  std::vector<int> Encode(std::string_view text, bool bos) const;
  // The longest piece in bytes: a text of more than max_prompt * max_piece_bytes() bytes
  // cannot encode to max_prompt tokens, so servers refuse it before encoding.
  size_t max_piece_bytes() const;
  // Text of `id` following `prev` (the space after BOS is dropped, <0xXX> become bytes).
  std::string Decode(int prev, int id) const;
  std::string DecodeAll(const std::vector<int>& ids) const;
  static constexpr int kUnk = 0, kBos = 1, kEos = 2;

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<int> sorted_;  // ids sorted by piece, for lookup
  bool byte_fallback_ = false;
  int Lookup(std::string_view s) const;
  void Index();
};

struct LlamaModel {
  std::string name;     // "stories260K", or the file name
  std::string path;
  std::string sha256;   // of the weights file: the key for caches and profiles
  LlamaConfig config;
  LlamaWeights weights;
  Tokenizer tokenizer;
  // What the loader assumed or replaced that the file did not say outright (a classifier tied
  // to the embedding because the file has none, a tokenizer given instead of the embedded one):
  // callers show these to the user.
  std::vector<std::string> notes;
};

// Loads a model by path to a llama2.c .bin or a GGUF file, or by name (stories260K,
// babyllama105: `<models_dir>/<name>.bin|.gguf`, when models_dir is given). `tokenizer_path`
// names a llama2.c tokenizer: for a .bin the one to use instead of tok<vocab>.bin beside it,
// for a GGUF one that replaces the embedded vocabulary (its size must match).
Result<LlamaModel> LoadModel(const std::string& name_or_path, const std::string& tokenizer_path = "",
                             const std::string& models_dir = "");
Result<LlamaModel> LoadLlama2cModel(const std::string& path, const std::string& tokenizer_path);
Result<LlamaModel> LoadGgufModel(const std::string& path, const std::string& tokenizer_path = "");
// The GGUF loader on bytes in memory; `origin` names them in errors.
Result<LlamaModel> ParseGgufModel(std::span<const uint8_t> data, const std::string& origin);
std::string Sha256Hex(const void* data, size_t n);

// The running KV cache: a f32 KvBlock of n_token = capacity; slots [0, n_pos) are valid. Slots
// and sequence positions coincide unless a pruned prefix was loaded: then `next_pos` (the RoPE
// position of the next token) runs ahead of the slot count.
struct KvCache {
  KvBlock block;
  uint32_t n_pos = 0;
  uint32_t next_pos = 0;
  void Rewind(uint32_t slots, uint32_t position) { n_pos = slots, next_pos = position; }
  static Result<KvCache> Create(const LlamaConfig& c, uint32_t capacity = 0);  // 0 = seq_len
  // Copy of positions [0, n) as a block (the prompt KV a prefill node ships), in `dtype`.
  Result<KvBlock> Prefix(uint32_t n, DType dtype = DType::kF32) const;
  // Overwrites slots [0, kv.n_token) from `kv` (any dtype); n_pos becomes kv.n_token and
  // next_pos `next_position` (0: one past kv's last token position).
  Status LoadPrefix(const KvBlock& kv, uint32_t next_position = 0);
};

// Attention probabilities of the last `window` prompt positions over all prompt positions,
// per layer and query head: probs[((layer * n_head + head) * window + w) * n_prompt + p].
struct AttentionCapture {
  uint32_t window = 32;
  uint32_t n_prompt = 0;  // set by the forward pass that fills it
  uint32_t n_layer = 0, n_head = 0;
  std::vector<float> probs;
};

class LlamaEngine {
 public:
  explicit LlamaEngine(const LlamaModel& model);
  const LlamaModel& model() const { return model_; }

  // Runs tokens[0, n) at positions cache->next_pos, ... attending over every cached slot; writes
  // their K/V into the cache and advances n_pos. `logits` ([n][vocab]) may be null; with
  // `last_logits_only` only the last row is computed (written to logits[0..vocab)).
  // `capture` (may be null) records attention of the last capture->window of these positions.
  Status Forward(const int* tokens, uint32_t n, KvCache* cache, float* logits, bool last_logits_only = false,
                 AttentionCapture* capture = nullptr);

  // Greedy (temperature 0) or seeded sampling (temperature, top-p) after `prompt`.
  Result<std::vector<int>> Generate(const std::vector<int>& prompt, uint32_t n, float temperature = 0.0f,
                                    float top_p = 0.9f, uint64_t seed = 1);

 private:
  const LlamaModel& model_;
  std::vector<float> rope_cos_, rope_sin_;  // [seq_len][head_dim/2]
  // Scratch, sized for the largest batch seen.
  std::vector<float> x_, xb_, q_, k_, v_, att_out_, hb_, hb2_, scores_;
};

// Index of the largest value (first on ties).
uint32_t Argmax(const float* v, uint32_t n);
// Samples from softmax(logits / temperature) restricted to the top-p nucleus; u in [0, 1).
uint32_t SampleTopP(const float* logits, uint32_t n, float temperature, float top_p, double u);

}  // namespace kvserve
