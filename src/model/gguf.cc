// GGUF loader (versions 1-3; F32/F16 tensors; llama architecture; vocabulary from the file).
// Version 1 stores counts and string lengths as u32, later versions as u64.
#include <cstring>
#include <filesystem>
#include <map>
#include <variant>

#include "kvserve/file.h"
#include "kvserve/model.h"

namespace kvserve {
namespace {

class Reader {
 public:
  Reader(std::span<const uint8_t> d, std::string path) : d_(d), path_(std::move(path)) {}
  size_t pos() const { return off_; }
  Status Need(size_t n) const {
    if (d_.size() - off_ < n) {
      return Status::Corrupt("GGUF '" + path_ + "' is truncated at byte " + std::to_string(off_));
    }
    return Status::Ok();
  }
  template <typename T>
  Result<T> Get() {
    KV_RETURN_IF_ERROR(Need(sizeof(T)));
    T v;
    std::memcpy(&v, d_.data() + off_, sizeof(T));
    off_ += sizeof(T);
    return v;
  }
  Result<uint64_t> Count(bool v1) {
    if (v1) {
      KV_ASSIGN_OR_RETURN(uint32_t c, Get<uint32_t>());
      return uint64_t(c);
    }
    return Get<uint64_t>();
  }
  Result<std::string> String(bool v1) {
    KV_ASSIGN_OR_RETURN(uint64_t n, Count(v1));
    KV_RETURN_IF_ERROR(Need(n));
    std::string s(reinterpret_cast<const char*>(d_.data() + off_), n);
    off_ += n;
    return s;
  }
  void Seek(size_t off) { off_ = off; }

 private:
  std::span<const uint8_t> d_;
  std::string path_;
  size_t off_ = 0;
};

using Scalar = std::variant<uint64_t, int64_t, double, bool, std::string>;
struct Value {
  Scalar scalar;
  std::vector<Scalar> array;
};

enum GgufType : uint32_t { U8 = 0, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 };

Result<Scalar> ReadScalar(Reader& r, uint32_t type, bool v1) {
  switch (type) {
    case U8: { KV_ASSIGN_OR_RETURN(uint8_t v, r.Get<uint8_t>()); return Scalar(uint64_t(v)); }
    case I8: { KV_ASSIGN_OR_RETURN(int8_t v, r.Get<int8_t>()); return Scalar(int64_t(v)); }
    case U16: { KV_ASSIGN_OR_RETURN(uint16_t v, r.Get<uint16_t>()); return Scalar(uint64_t(v)); }
    case I16: { KV_ASSIGN_OR_RETURN(int16_t v, r.Get<int16_t>()); return Scalar(int64_t(v)); }
    case U32: { KV_ASSIGN_OR_RETURN(uint32_t v, r.Get<uint32_t>()); return Scalar(uint64_t(v)); }
    case I32: { KV_ASSIGN_OR_RETURN(int32_t v, r.Get<int32_t>()); return Scalar(int64_t(v)); }
    case F32: { KV_ASSIGN_OR_RETURN(float v, r.Get<float>()); return Scalar(double(v)); }
    case BOOL: { KV_ASSIGN_OR_RETURN(uint8_t v, r.Get<uint8_t>()); return Scalar(v != 0); }
    case STRING: { KV_ASSIGN_OR_RETURN(std::string v, r.String(v1)); return Scalar(std::move(v)); }
    case U64: { KV_ASSIGN_OR_RETURN(uint64_t v, r.Get<uint64_t>()); return Scalar(v); }
    case I64: { KV_ASSIGN_OR_RETURN(int64_t v, r.Get<int64_t>()); return Scalar(v); }
    case F64: { KV_ASSIGN_OR_RETURN(double v, r.Get<double>()); return Scalar(v); }
  }
  return Status::Corrupt("GGUF metadata value type " + std::to_string(type) + " is unknown");
}

double AsNumber(const Scalar& s) {
  if (auto* u = std::get_if<uint64_t>(&s)) return double(*u);
  if (auto* i = std::get_if<int64_t>(&s)) return double(*i);
  if (auto* d = std::get_if<double>(&s)) return *d;
  if (auto* b = std::get_if<bool>(&s)) return *b;
  return 0;
}

struct TensorInfo {
  std::vector<uint64_t> dims;
  uint32_t type = 0;
  uint64_t offset = 0;
};

}  // namespace

Result<LlamaModel> LoadGgufModel(const std::string& path, const std::string& tokenizer_path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer data, ReadFile(path));
  KV_ASSIGN_OR_RETURN(LlamaModel m, ParseGgufModel(data, path));
  if (!tokenizer_path.empty()) {
    auto t = Tokenizer::LoadLlama2c(tokenizer_path, m.config.vocab_size);
    if (!t.ok()) return t.status().WithContext("--tokenizer for GGUF model '" + path + "'");
    m.tokenizer = std::move(t).value();
    m.notes.push_back("tokenizer '" + tokenizer_path + "' replaces the vocabulary embedded in '" + path + "'");
  }
  return m;
}

Result<LlamaModel> ParseGgufModel(std::span<const uint8_t> data, const std::string& path) {
  Reader r(data, path);
  KV_ASSIGN_OR_RETURN(uint32_t magic, r.Get<uint32_t>());
  if (std::memcmp(&magic, "GGUF", 4) != 0) return Status::Corrupt("'" + path + "' is not a GGUF file (bad magic)");
  KV_ASSIGN_OR_RETURN(uint32_t version, r.Get<uint32_t>());
  if (version < 1 || version > 3) {
    return Status::Unsupported("GGUF '" + path + "' version " + std::to_string(version) + " (this build reads 1-3)");
  }
  const bool v1 = version == 1;
  KV_ASSIGN_OR_RETURN(uint64_t n_tensors, r.Count(v1));
  KV_ASSIGN_OR_RETURN(uint64_t n_kv, r.Count(v1));
  if (n_tensors > 1 << 20 || n_kv > 1 << 20) return Status::Corrupt("GGUF '" + path + "' has implausible counts");
  std::map<std::string, Value> kv;
  for (uint64_t i = 0; i < n_kv; ++i) {
    KV_ASSIGN_OR_RETURN(std::string key, r.String(v1));
    KV_ASSIGN_OR_RETURN(uint32_t type, r.Get<uint32_t>());
    Value v;
    if (type == ARRAY) {
      KV_ASSIGN_OR_RETURN(uint32_t et, r.Get<uint32_t>());
      KV_ASSIGN_OR_RETURN(uint64_t n, r.Count(v1));
      KV_RETURN_IF_ERROR(r.Need(n));  // every element is at least one byte
      v.array.reserve(n);
      for (uint64_t j = 0; j < n; ++j) {
        KV_ASSIGN_OR_RETURN(Scalar s, ReadScalar(r, et, v1));
        v.array.push_back(std::move(s));
      }
    } else {
      KV_ASSIGN_OR_RETURN(v.scalar, ReadScalar(r, type, v1));
    }
    kv[key] = std::move(v);
  }
  // Every number is checked before it is used: a size becomes a uint32 and an allocation.
  auto num = [&](const std::string& k, double def, bool required, double lo, double hi) -> Result<double> {
    auto it = kv.find(k);
    if (it == kv.end()) {
      if (required) return Status::Corrupt("GGUF '" + path + "' lacks metadata key " + k);
      return def;
    }
    const double v = AsNumber(it->second.scalar);
    if (!(v >= lo && v <= hi)) {
      return Status::Corrupt("GGUF '" + path + "' metadata " + k + "=" + std::to_string(v) + " is outside [" +
                             std::to_string(lo) + ", " + std::to_string(hi) + "]");
    }
    return v;
  };
  constexpr double kMaxSize = double(1 << 30);
  auto arch = kv.find("general.architecture");
  if (arch == kv.end() || !std::holds_alternative<std::string>(arch->second.scalar) ||
      std::get<std::string>(arch->second.scalar) != "llama") {
    return Status::Unsupported("GGUF '" + path + "' is not a llama-architecture model");
  }
  LlamaModel m;
  LlamaConfig& c = m.config;
  KV_ASSIGN_OR_RETURN(double ctx, num("llama.context_length", 0, true, 1, kMaxSize));
  KV_ASSIGN_OR_RETURN(double dim, num("llama.embedding_length", 0, true, 1, kMaxSize));
  KV_ASSIGN_OR_RETURN(double layers, num("llama.block_count", 0, true, 1, 4096));
  KV_ASSIGN_OR_RETURN(double ff, num("llama.feed_forward_length", 0, true, 1, kMaxSize));
  KV_ASSIGN_OR_RETURN(double heads, num("llama.attention.head_count", 0, true, 1, 4096));
  KV_ASSIGN_OR_RETURN(double heads_kv, num("llama.attention.head_count_kv", heads, false, 1, 4096));
  KV_ASSIGN_OR_RETURN(double eps, num("llama.attention.layer_norm_rms_epsilon", 1e-5, false, 1e-12, 0.1));
  KV_ASSIGN_OR_RETURN(double theta, num("llama.rope.freq_base", 10000, false, 1, 1e9));
  KV_ASSIGN_OR_RETURN(double align, num("general.alignment", 32, false, 1, 1 << 20));
  c.seq_len = uint32_t(ctx), c.dim = uint32_t(dim), c.n_layer = uint32_t(layers), c.hidden_dim = uint32_t(ff);
  c.n_head = uint32_t(heads), c.n_head_kv = uint32_t(heads_kv), c.norm_eps = float(eps), c.rope_theta = float(theta);
  auto toks = kv.find("tokenizer.ggml.tokens");
  auto scores = kv.find("tokenizer.ggml.scores");
  if (toks == kv.end() || toks->second.array.empty()) {
    return Status::Corrupt("GGUF '" + path + "' has no tokenizer.ggml.tokens vocabulary");
  }
  c.vocab_size = uint32_t(toks->second.array.size());

  std::map<std::string, TensorInfo> tensors;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    KV_ASSIGN_OR_RETURN(std::string name, r.String(v1));
    KV_ASSIGN_OR_RETURN(uint32_t n_dims, r.Get<uint32_t>());
    if (n_dims == 0 || n_dims > 4) return Status::Corrupt("GGUF tensor '" + name + "' has " + std::to_string(n_dims) + " dims");
    TensorInfo t;
    for (uint32_t d = 0; d < n_dims; ++d) {
      KV_ASSIGN_OR_RETURN(uint64_t v, r.Count(v1));
      t.dims.push_back(v);
    }
    KV_ASSIGN_OR_RETURN(t.type, r.Get<uint32_t>());
    KV_ASSIGN_OR_RETURN(t.offset, r.Get<uint64_t>());
    tensors[name] = t;
  }
  c.shared_classifier = tensors.find("output.weight") == tensors.end();
  if (c.shared_classifier) {
    // As llama.cpp does for models with tied embeddings; said aloud, since a file that lost the
    // tensor would otherwise run with another classifier without a word.
    m.notes.push_back("'" + path + "' has no output.weight tensor: the classifier is tied to token_embd.weight");
  }
  KV_RETURN_IF_ERROR(c.Validate().WithContext("'" + path + "'"));
  const uint64_t a = uint64_t(align);
  const uint64_t data_start = (r.pos() + a - 1) / a * a;
  // Weights are at least 2 bytes each (F16): a file smaller than that cannot hold them, so the
  // metadata lies, and nothing is allocated for it.
  const uint64_t n_weights = LlamaWeights::FloatCount(c);
  if (data_start > data.size() || n_weights > (data.size() - data_start) / 2) {
    return Status::Corrupt("GGUF '" + path + "' metadata describes " + std::to_string(n_weights) +
                           " weights, more than its " + std::to_string(data.size()) + " bytes can hold");
  }
  m.weights.storage.resize(n_weights);
  float* out = m.weights.storage.data();
  auto copy = [&](const std::string& name, std::vector<uint64_t> want) -> Status {
    auto it = tensors.find(name);
    if (it == tensors.end()) return Status::Corrupt("GGUF '" + path + "' lacks tensor " + name);
    const TensorInfo& t = it->second;
    if (t.dims != want) return Status::Corrupt("GGUF tensor " + name + " has the wrong shape for this model's metadata");
    uint64_t n = 1;
    for (uint64_t d : want) n *= d;
    if (t.type != 0 && t.type != 1) {
      return Status::Unsupported("GGUF tensor " + name + " has type " + std::to_string(t.type) + " (F32 and F16 only)");
    }
    const uint64_t bytes = n * (t.type == 0 ? 4 : 2);
    // Compared without adding to the offset, which a hostile file sets near 2^64.
    if (t.offset > data.size() - data_start || data.size() - data_start - t.offset < bytes) {
      return Status::Corrupt("GGUF tensor " + name + " lies beyond the end of '" + path + "'");
    }
    ConvertToF32(t.type == 0 ? DType::kF32 : DType::kF16, data.data() + data_start + t.offset, out, n);
    out += n;
    return Status::Ok();
  };
  const uint64_t d = c.dim, kvd = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  // llama2.c order, so Bind() finds every array where it expects it. GGUF dims are innermost first.
  KV_RETURN_IF_ERROR(copy("token_embd.weight", {d, v}));
  const char* per_layer[] = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                             "ffn_norm", "ffn_gate", "ffn_down", "ffn_up"};
  const std::vector<std::vector<uint64_t>> shapes = {{d}, {d, d}, {d, kvd}, {d, kvd}, {d, d}, {d}, {d, h}, {h, d}, {d, h}};
  for (size_t part = 0; part < 9; ++part) {
    for (uint32_t l = 0; l < c.n_layer; ++l) {
      KV_RETURN_IF_ERROR(copy("blk." + std::to_string(l) + "." + per_layer[part] + ".weight", shapes[part]));
    }
  }
  KV_RETURN_IF_ERROR(copy("output_norm.weight", {d}));
  if (!c.shared_classifier) KV_RETURN_IF_ERROR(copy("output.weight", {d, v}));
  m.weights.Bind(c);

  std::vector<std::string> pieces;
  std::vector<float> sc;
  for (size_t i = 0; i < toks->second.array.size(); ++i) {
    std::string p = std::holds_alternative<std::string>(toks->second.array[i]) ? std::get<std::string>(toks->second.array[i]) : "";
    // SentencePiece marks spaces with U+2581; llama2.c vocabularies store a plain space.
    for (size_t at; (at = p.find("\xE2\x96\x81")) != std::string::npos;) p.replace(at, 3, " ");
    pieces.push_back(std::move(p));
    sc.push_back(scores != kv.end() && i < scores->second.array.size() ? float(AsNumber(scores->second.array[i])) : 0.f);
  }
  m.tokenizer = Tokenizer::FromVocab(std::move(pieces), std::move(sc));
  m.path = path;
  m.name = std::filesystem::path(path).stem().string();
  m.sha256 = Sha256Hex(data.data(), data.size());
  return m;
}

}  // namespace kvserve
