// Model loading: llama2.c checkpoints, name resolution to the shipped models, and the weights'
// SHA-256 that keys every cache and profile.
#include <nettle/sha2.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "kvserve/file.h"
#include "kvserve/model.h"

namespace kvserve {

Status LlamaConfig::Validate() const {
  auto bad = [](const char* f, uint32_t v) {
    return Status::Corrupt(std::string("model header ") + f + "=" + std::to_string(v) + " is not valid");
  };
  if (dim == 0 || dim > 65536) return bad("dim", dim);
  if (hidden_dim == 0 || hidden_dim > 262144) return bad("hidden_dim", hidden_dim);
  if (n_layer == 0 || n_layer > 1024) return bad("n_layers", n_layer);
  if (n_head == 0 || dim % n_head != 0 || head_dim() % 2 != 0) return bad("n_heads", n_head);
  if (n_head_kv == 0 || n_head % n_head_kv != 0) return bad("n_kv_heads", n_head_kv);
  if (vocab_size == 0 || vocab_size > (1u << 22)) return bad("vocab_size", vocab_size);
  if (seq_len == 0 || seq_len > (1u << 20)) return bad("seq_len", seq_len);
  return Status::Ok();
}

size_t LlamaWeights::FloatCount(const LlamaConfig& c) {
  const size_t L = c.n_layer, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  return v * d + L * d + L * d * d + 2 * L * kv * d + L * d * d + L * d + 3 * L * h * d + d +
         (c.shared_classifier ? 0 : v * d);
}

void LlamaWeights::Bind(const LlamaConfig& c) {
  const size_t L = c.n_layer, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  const float* p = storage.data();
  auto take = [&](size_t n) {
    const float* r = p;
    p += n;
    return r;
  };
  token_embedding = take(v * d);
  rms_att = take(L * d);
  wq = take(L * d * d);
  wk = take(L * kv * d);
  wv = take(L * kv * d);
  wo = take(L * d * d);
  rms_ffn = take(L * d);
  w1 = take(L * h * d);
  w2 = take(L * d * h);
  w3 = take(L * h * d);
  rms_final = take(d);
  wcls = c.shared_classifier ? token_embedding : take(v * d);
}

std::string Sha256Hex(const void* data, size_t n) {
  sha256_ctx ctx;
  sha256_init(&ctx);
  sha256_update(&ctx, n, static_cast<const uint8_t*>(data));
  uint8_t digest[SHA256_DIGEST_SIZE];
  sha256_digest(&ctx, sizeof digest, digest);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (uint8_t b : digest) s += hex[b >> 4], s += hex[b & 15];
  return s;
}

Result<LlamaModel> LoadLlama2cModel(const std::string& path, const std::string& tokenizer_path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer data, ReadFile(path));
  if (data.size() < 28) {
    return Status::Corrupt("model '" + path + "' is " + std::to_string(data.size()) +
                           " bytes, shorter than the 28-byte llama2.c header");
  }
  int32_t h[7];
  std::memcpy(h, data.data(), 28);
  for (int i = 0; i < 7; ++i) {
    if (h[i] == 0 || (i != 5 && h[i] < 0)) {
      static const char* names[] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"};
      return Status::Corrupt("model '" + path + "' header field " + names[i] + "=" + std::to_string(h[i]) +
                             " is not a llama2.c checkpoint");
    }
  }
  LlamaModel m;
  LlamaConfig& c = m.config;
  c.dim = uint32_t(h[0]), c.hidden_dim = uint32_t(h[1]), c.n_layer = uint32_t(h[2]), c.n_head = uint32_t(h[3]);
  c.n_head_kv = uint32_t(h[4]), c.shared_classifier = h[5] > 0, c.vocab_size = uint32_t(std::abs(h[5]));
  c.seq_len = uint32_t(h[6]);
  KV_RETURN_IF_ERROR(c.Validate().WithContext("'" + path + "'"));
  const size_t n_weights = LlamaWeights::FloatCount(c);
  const size_t n_cls = c.shared_classifier ? 0 : size_t(c.vocab_size) * c.dim;
  const size_t freq_cis = size_t(c.seq_len) * c.head_dim();  // legacy cos+sin block, skipped
  const size_t want = 28 + 4 * (n_weights + freq_cis);
  if (data.size() != want) {
    return Status::Corrupt("model '" + path + "' is " + std::to_string(data.size()) + " bytes, but its header (dim=" +
                           std::to_string(c.dim) + ", n_layers=" + std::to_string(c.n_layer) + ", vocab_size=" +
                           std::to_string(h[5]) + ", seq_len=" + std::to_string(c.seq_len) + ") implies " +
                           std::to_string(want));
  }
  m.weights.storage.resize(n_weights);
  const uint8_t* p = data.data() + 28;
  const size_t main_part = n_weights - n_cls;
  std::memcpy(m.weights.storage.data(), p, main_part * 4);
  if (n_cls) std::memcpy(m.weights.storage.data() + main_part, p + (main_part + freq_cis) * 4, n_cls * 4);
  m.weights.Bind(c);
  m.path = path;
  m.name = std::filesystem::path(path).stem().string();
  m.sha256 = Sha256Hex(data.data(), data.size());
  std::string tok = tokenizer_path;
  if (tok.empty()) {
    // The shipped pairing by vocabulary size; other models must name their tokenizer.
    const std::string dir = std::filesystem::path(path).parent_path().string();
    tok = (dir.empty() ? "." : dir) + "/tok" + std::to_string(c.vocab_size) + ".bin";
  }
  auto t = Tokenizer::LoadLlama2c(tok, c.vocab_size);
  if (!t.ok()) return t.status().WithContext("tokenizer for model '" + path + "' (use --tokenizer)");
  m.tokenizer = std::move(t).value();
  return m;
}

Result<LlamaModel> LoadModel(const std::string& name_or_path, const std::string& tokenizer_path,
                             const std::string& models_dir) {
  std::string path = name_or_path;
  if (!std::filesystem::exists(path) && !models_dir.empty()) {
    for (const char* ext : {".bin", ".gguf"}) {
      const std::string cand = models_dir + "/" + name_or_path + ext;
      if (std::filesystem::exists(cand)) {
        path = cand;
        break;
      }
    }
  }
  if (!std::filesystem::exists(path)) {
    return Status::NotFound("model '" + name_or_path + "' is neither a file nor a model in " +
                            (models_dir.empty() ? std::string("(no models folder given)") : models_dir) +
                            " (shipped: stories260K, babyllama105)");
  }
  char magic[4] = {0};
  if (FILE* f = std::fopen(path.c_str(), "rb")) {
    (void)!std::fread(magic, 1, 4, f);
    std::fclose(f);
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) return LoadGgufModel(path, tokenizer_path);
  return LoadLlama2cModel(path, tokenizer_path);
}

Result<KvCache> KvCache::Create(const LlamaConfig& c, uint32_t capacity) {
  KvCache cache;
  KV_ASSIGN_OR_RETURN(cache.block,
                      KvBlock::Create(KvShape{c.n_layer, c.n_head_kv, capacity ? capacity : c.seq_len, c.head_dim()},
                                      DType::kF32));
  return cache;
}

Result<KvBlock> KvCache::Prefix(uint32_t n, DType dtype) const {
  if (n > n_pos) return Status::InvalidArgument("prefix of " + std::to_string(n) + " > " + std::to_string(n_pos) + " cached positions");
  KV_ASSIGN_OR_RETURN(KvBlock b, block.SliceTokens(0, n));
  if (dtype == DType::kF32) return b;
  return b.ConvertTo(dtype);
}

Status KvCache::LoadPrefix(const KvBlock& kv, uint32_t next_position) {
  const KvShape& s = kv.shape();
  const KvShape& c = block.shape();
  if (s.n_layer != c.n_layer || s.n_head_kv != c.n_head_kv || s.head_dim != c.head_dim || s.n_token > c.n_token) {
    return Status::InvalidArgument("KV of shape " + s.ToString() + " does not fit a cache of shape " + c.ToString());
  }
  const size_t row = size_t(s.n_token) * s.head_dim;
  for (uint64_t i = 0; i < s.n_slab(); ++i) {
    ConvertToF32(kv.dtype(), kv.slab_at(i), reinterpret_cast<float*>(block.slab_at(i)), row);
  }
  n_pos = s.n_token;
  next_pos = next_position ? next_position : (s.n_token ? kv.position(s.n_token - 1) + 1 : 0);
  return Status::Ok();
}

}  // namespace kvserve
