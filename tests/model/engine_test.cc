// The llama engine: golden greedy outputs of both shipped models, every op against a naive
// reference, the whole forward pass against a naive llama2.c-style one, and the KV it keeps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string_view>
#include <unordered_map>

#include "model/ops.h"
#include "model_test_util.h"

namespace kvserve {
namespace {

using testing::Baby;
using testing::Stories;

std::vector<int> GoldenIds(const std::string& name, std::string* text) {
  std::ifstream f(ModelsDir() + "/" + name + ".greedy.txt");
  std::string line;
  std::getline(f, line);
  std::vector<int> ids;
  std::stringstream ss(line);
  for (int v; ss >> v;) ids.push_back(v);
  std::getline(f, *text);
  for (size_t at; (at = text->find("\\n")) != std::string::npos;) text->replace(at, 2, "\n");
  return ids;
}

TEST(Engine, GreedyReproducesGoldenIdsAndText) {
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    std::string text;
    const std::vector<int> golden = GoldenIds(m->name, &text);
    ASSERT_EQ(golden.size(), 64u);
    LlamaEngine engine(*m);
    const std::vector<int> ids = engine.Generate({Tokenizer::kBos}, 64).value();
    EXPECT_EQ(ids, golden) << m->name;
    // The reference text line may carry trailing whitespace that no id produces.
    while (!text.empty() && text.back() == ' ') text.pop_back();
    EXPECT_EQ(m->tokenizer.DecodeAll(ids), text) << m->name;
  }
}

TEST(Engine, GgufAndLlama2cLoadIdenticalWeights) {
  LlamaModel g = LoadModel(ModelsDir() + "/tinyllamas-stories-260k-f32.gguf").value();
  const LlamaModel& b = Stories();
  EXPECT_EQ(g.config.dim, b.config.dim);
  EXPECT_EQ(g.config.n_head_kv, b.config.n_head_kv);
  EXPECT_EQ(g.config.seq_len, b.config.seq_len);
  // The GGUF stores the classifier as its own tensor (a copy); the .bin shares the embedding.
  const LlamaConfig& c = b.config;
  const size_t L = c.n_layer, d = c.dim, kv = c.kv_dim(), h = c.hidden_dim, v = c.vocab_size;
  auto same = [](const float* x, const float* y, size_t n) { return std::equal(x, x + n, y); };
  EXPECT_TRUE(same(g.weights.token_embedding, b.weights.token_embedding, v * d));
  EXPECT_TRUE(same(g.weights.rms_att, b.weights.rms_att, L * d));
  EXPECT_TRUE(same(g.weights.wq, b.weights.wq, L * d * d));
  EXPECT_TRUE(same(g.weights.wk, b.weights.wk, L * kv * d));
  EXPECT_TRUE(same(g.weights.wv, b.weights.wv, L * kv * d));
  EXPECT_TRUE(same(g.weights.wo, b.weights.wo, L * d * d));
  EXPECT_TRUE(same(g.weights.rms_ffn, b.weights.rms_ffn, L * d));
  EXPECT_TRUE(same(g.weights.w1, b.weights.w1, L * h * d));
  EXPECT_TRUE(same(g.weights.w2, b.weights.w2, L * d * h));
  EXPECT_TRUE(same(g.weights.w3, b.weights.w3, L * h * d));
  EXPECT_TRUE(same(g.weights.rms_final, b.weights.rms_final, d));
  EXPECT_TRUE(same(g.weights.wcls, b.weights.wcls, v * d));
  ASSERT_EQ(g.tokenizer.vocab_size(), b.tokenizer.vocab_size());
  for (uint32_t i = 3; i < b.tokenizer.vocab_size(); ++i) EXPECT_EQ(g.tokenizer.piece(i), b.tokenizer.piece(i)) << i;
  EXPECT_EQ(b.sha256, "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696");
}

TEST(Ops, MatMulMatchesNaive) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const uint32_t n = 5, i = 37, o = 11;
  std::vector<float> x(n * i), w(o * i), y(n * o);
  for (auto& v : x) v = nd(rng);
  for (auto& v : w) v = nd(rng);
  ops::MatMul(x.data(), n, i, w.data(), o, y.data());
  for (uint32_t r = 0; r < n; ++r)
    for (uint32_t c = 0; c < o; ++c) {
      double ref = 0;
      for (uint32_t k = 0; k < i; ++k) ref += double(x[r * i + k]) * w[c * i + k];
      EXPECT_NEAR(y[r * o + c], ref, 1e-4);
    }
}

TEST(Ops, RmsNormSoftmaxAndExpMatchNaive) {
  std::vector<float> x = {1, -2, 3, 0.5f}, w = {1, 2, 0.5f, -1}, out(4);
  ops::RmsNorm(out.data(), x.data(), w.data(), 4, 1e-5f);
  const double rms = std::sqrt((1 + 4 + 9 + 0.25) / 4.0 + 1e-5);
  for (int j = 0; j < 4; ++j) EXPECT_NEAR(out[j], w[j] * x[j] / rms, 1e-6);
  std::vector<float> s = {0.1f, 3.0f, -2.0f, 3.0f, -100.0f};
  std::vector<double> ref(s.begin(), s.end());
  double mx = 3, sum = 0;
  for (double& v : ref) sum += (v = std::exp(v - mx));
  ops::Softmax(s.data(), 5);
  for (int j = 0; j < 5; ++j) EXPECT_NEAR(s[j], ref[j] / sum, 1e-7);
  for (float v = -87.0f; v <= 0.0f; v += 0.37f) {
    const double e = std::exp(double(v));
    // x * log2(e) is rounded to float, so the error grows with |x|: ulp(|x| log2 e) * ln 2.
    EXPECT_NEAR(ops::ExpNonPositive(v), e, (2e-7 + 6e-8 * std::fabs(v)) * e) << v;
  }
  // Below -87 the result is clamped to exp(-87): negligible next to the softmax maximum, exp(0).
  EXPECT_LT(ops::ExpNonPositive(-1000.0f), 2e-38f);
}

// A naive single-token forward pass in the shape of llama2.c's run.c: every op written out.
std::vector<float> NaiveForward(const LlamaModel& m, const std::vector<int>& tokens,
                                std::vector<std::vector<float>>* kcache) {
  const LlamaConfig& c = m.config;
  const LlamaWeights& w = m.weights;
  const int dim = c.dim, hs = c.head_dim(), kvd = c.kv_dim(), hid = c.hidden_dim, L = c.n_layer;
  kcache->assign(L, std::vector<float>(size_t(c.seq_len) * kvd));
  std::vector<std::vector<float>> vcache(L, std::vector<float>(size_t(c.seq_len) * kvd));
  std::vector<float> logits(c.vocab_size);
  auto matvec = [](const float* W, const std::vector<float>& x, int rows, int cols) {
    std::vector<float> y(rows);
    for (int r = 0; r < rows; ++r) {
      double s = 0;
      for (int k = 0; k < cols; ++k) s += double(W[size_t(r) * cols + k]) * x[k];
      y[r] = float(s);
    }
    return y;
  };
  auto rms = [&](const std::vector<float>& x, const float* g) {
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + c.norm_eps);
    std::vector<float> y(x.size());
    for (size_t j = 0; j < x.size(); ++j) y[j] = float(g[j] * x[j] * inv);
    return y;
  };
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    std::vector<float> x(w.token_embedding + size_t(tokens[pos]) * dim, w.token_embedding + size_t(tokens[pos] + 1) * dim);
    for (int l = 0; l < L; ++l) {
      auto xb = rms(x, w.rms_att + size_t(l) * dim);
      auto q = matvec(w.wq + size_t(l) * dim * dim, xb, dim, dim);
      auto k = matvec(w.wk + size_t(l) * kvd * dim, xb, kvd, dim);
      auto v = matvec(w.wv + size_t(l) * kvd * dim, xb, kvd, dim);
      for (int i = 0; i < dim; i += 2) {
        const double freq = 1.0 / std::pow(10000.0, double(i % hs) / hs), a = pos * freq;
        auto rot = [&](std::vector<float>& t) {
          const double x0 = t[i], x1 = t[i + 1];
          t[i] = float(x0 * std::cos(a) - x1 * std::sin(a));
          t[i + 1] = float(x0 * std::sin(a) + x1 * std::cos(a));
        };
        rot(q);
        if (i < kvd) rot(k);
      }
      std::copy(k.begin(), k.end(), (*kcache)[l].begin() + pos * kvd);
      std::copy(v.begin(), v.end(), vcache[l].begin() + pos * kvd);
      std::vector<float> att(dim, 0.0f);
      for (uint32_t h = 0; h < c.n_head; ++h) {
        const int kh = h / (c.n_head / c.n_head_kv);
        std::vector<double> sc(pos + 1);
        double mx = -1e30;
        for (size_t t = 0; t <= pos; ++t) {
          double s = 0;
          for (int d = 0; d < hs; ++d) s += double(q[h * hs + d]) * (*kcache)[l][t * kvd + kh * hs + d];
          sc[t] = s / std::sqrt(double(hs));
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (double& s : sc) sum += (s = std::exp(s - mx));
        for (size_t t = 0; t <= pos; ++t)
          for (int d = 0; d < hs; ++d) att[h * hs + d] += float(sc[t] / sum * vcache[l][t * kvd + kh * hs + d]);
      }
      auto o = matvec(w.wo + size_t(l) * dim * dim, att, dim, dim);
      for (int j = 0; j < dim; ++j) x[j] += o[j];
      xb = rms(x, w.rms_ffn + size_t(l) * dim);
      auto h1 = matvec(w.w1 + size_t(l) * hid * dim, xb, hid, dim);
      auto h3 = matvec(w.w3 + size_t(l) * hid * dim, xb, hid, dim);
      for (int j = 0; j < hid; ++j) h1[j] = float(h1[j] / (1 + std::exp(-double(h1[j]))) * h3[j]);
      auto f = matvec(w.w2 + size_t(l) * dim * hid, h1, dim, hid);
      for (int j = 0; j < dim; ++j) x[j] += f[j];
    }
    auto xf = rms(x, w.rms_final);
    logits = matvec(w.wcls, xf, c.vocab_size, dim);
  }
  return logits;
}

TEST(Engine, ForwardMatchesNaiveReferenceAndKeepsItsKv) {
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    const std::vector<int> tokens = m->tokenizer.Encode("Once upon a time, a cat sat on a mat.", true);
    std::vector<std::vector<float>> naive_k;
    const std::vector<float> ref = NaiveForward(*m, tokens, &naive_k);
    LlamaEngine engine(*m);
    KvCache cache = KvCache::Create(m->config).value();
    std::vector<float> logits(m->config.vocab_size);
    ASSERT_TRUE(engine.Forward(tokens.data(), uint32_t(tokens.size()), &cache, logits.data(), true).ok());
    for (uint32_t v = 0; v < m->config.vocab_size; ++v) ASSERT_NEAR(logits[v], ref[v], 2e-3) << m->name << " " << v;
    // The engine's cache holds exactly the keys the naive pass attended over, in kvserve's layout.
    const uint32_t hs = m->config.head_dim(), kvd = m->config.kv_dim();
    for (uint32_t l = 0; l < m->config.n_layer; ++l)
      for (uint32_t h = 0; h < m->config.n_head_kv; ++h)
        for (uint32_t t = 0; t < tokens.size(); ++t)
          for (uint32_t d = 0; d < hs; ++d)
            ASSERT_NEAR(cache.block.Get(l, KvPart::kKey, h, t, d), naive_k[l][t * kvd + h * hs + d], 1e-4);
  }
}

TEST(Engine, BatchedAndTokenByTokenAgreeAndPrefixReloads) {
  const LlamaModel& m = Stories();
  LlamaEngine engine(m);
  const std::vector<int> t = m.tokenizer.Encode("The dog ran to the park and saw a big red ball", true);
  const uint32_t V = m.config.vocab_size, n = uint32_t(t.size());
  KvCache a = KvCache::Create(m.config).value(), b = KvCache::Create(m.config).value();
  std::vector<float> batched(size_t(n) * V), step(V);
  ASSERT_TRUE(engine.Forward(t.data(), n, &a, batched.data()).ok());
  for (uint32_t i = 0; i < n; ++i) {
    ASSERT_TRUE(engine.Forward(&t[i], 1, &b, step.data()).ok());
    for (uint32_t v = 0; v < V; ++v) ASSERT_NEAR(step[v], batched[size_t(i) * V + v], 1e-3);
  }
  // A prompt's KV taken out and loaded into a fresh cache continues identically.
  KvBlock prefix = a.Prefix(n - 3).value();
  KvCache c = KvCache::Create(m.config).value();
  ASSERT_TRUE(c.LoadPrefix(prefix).ok());
  EXPECT_EQ(c.n_pos, n - 3);
  std::vector<float> tail(3 * V);
  ASSERT_TRUE(engine.Forward(&t[n - 3], 3, &c, tail.data()).ok());
  for (size_t i = 0; i < tail.size(); ++i) ASSERT_EQ(tail[i], batched[size_t(n - 3) * V + i]) << i;
}

TEST(Engine, PrunedPrefixKeepsRopePositions) {
  // Drop tokens 2..5 of a 12-token prompt's KV: the next token must still sit at position 12,
  // so its layer-0 key (which depends only on the token and its position) equals the full run's.
  const LlamaModel& m = Stories();
  LlamaEngine engine(m);
  const std::vector<int> t = m.tokenizer.Encode("The cat sat on the mat and looked at the dog", true);
  ASSERT_GE(t.size(), 13u);
  KvCache full = KvCache::Create(m.config).value();
  ASSERT_TRUE(engine.Forward(t.data(), 13, &full, nullptr).ok());
  KvCache part = KvCache::Create(m.config).value();
  ASSERT_TRUE(engine.Forward(t.data(), 12, &part, nullptr).ok());
  KvBlock prefix = part.Prefix(12).value();
  std::vector<uint32_t> keep = {0, 1, 6, 7, 8, 9, 10, 11};
  KvShape s = prefix.shape();
  s.n_token = uint32_t(keep.size());
  KvBlock pruned = KvBlock::Create(s, DType::kF32).value();
  for (uint64_t sl = 0; sl < s.n_slab(); ++sl)
    for (size_t j = 0; j < keep.size(); ++j)
      std::memcpy(pruned.slab_at(sl) + j * s.head_dim * 4, prefix.slab_at(sl) + keep[j] * s.head_dim * 4, s.head_dim * 4);
  pruned.set_positions(keep);
  KvCache c = KvCache::Create(m.config).value();
  ASSERT_TRUE(c.LoadPrefix(pruned).ok());
  EXPECT_EQ(c.n_pos, 8u);
  EXPECT_EQ(c.next_pos, 12u);
  ASSERT_TRUE(engine.Forward(&t[12], 1, &c, nullptr).ok());
  for (uint32_t h = 0; h < m.config.n_head_kv; ++h)
    for (uint32_t d = 0; d < m.config.head_dim(); ++d)
      EXPECT_NEAR(c.block.Get(0, KvPart::kKey, h, 8, d), full.block.Get(0, KvPart::kKey, h, 12, d), 1e-5);
}

TEST(Engine, RejectsBadTokensAndOverflow) {
  const LlamaModel& m = Baby();
  LlamaEngine engine(m);
  KvCache cache = KvCache::Create(m.config).value();
  int bad = 105;
  Status st = engine.Forward(&bad, 1, &cache, nullptr);
  EXPECT_NE(st.message().find("token id 105"), std::string::npos);
  cache.Rewind(m.config.seq_len, m.config.seq_len);
  int ok = 1;
  EXPECT_EQ(engine.Forward(&ok, 1, &cache, nullptr).code(), StatusCode::kOutOfRange);
}

TEST(Tokenizer, EncodesAndDecodesBack) {
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    const std::string text = "Lily and Ben went to the park. They saw a big dog!";
    const std::vector<int> ids = m->tokenizer.Encode(text, true);
    EXPECT_EQ(ids[0], Tokenizer::kBos);
    EXPECT_EQ(m->tokenizer.DecodeAll(std::vector<int>(ids.begin() + 1, ids.end())), text) << m->name;
  }
  // stories260K has byte-fallback tokens: a character outside its vocabulary survives.
  // (U+2603, a snowman, is not in its vocabulary; "é" is.)
  const std::vector<int> ids = Stories().tokenizer.Encode("caf\xC3\xA9 \xE2\x98\x83", false);
  EXPECT_EQ(Stories().tokenizer.DecodeAll(ids), "caf\xC3\xA9 \xE2\x98\x83");  // DecodeAll drops the dummy-prefix space
  EXPECT_EQ(std::vector<int>(ids.end() - 3, ids.end()), (std::vector<int>{0xE2 + 3, 0x98 + 3, 0x83 + 3}));
}

// The merge loop as it was (rescan every pair, merge the best, leftmost among equals): the
// reference the heap-based Encode must equal token for token.
std::vector<int> QuadraticEncode(const Tokenizer& tok, std::string_view text, bool bos) {
  std::unordered_map<std::string, int> index;  // the smallest id of each piece, as Lookup finds
  for (uint32_t i = 0; i < tok.vocab_size(); ++i) index.emplace(tok.piece(i), int(i));
  auto lookup = [&](std::string_view s) {
    auto it = index.find(std::string(s));
    return it == index.end() ? -1 : it->second;
  };
  std::vector<int> ids;
  if (bos) ids.push_back(Tokenizer::kBos);
  if (!text.empty() && lookup(" ") >= 0) ids.push_back(lookup(" "));
  const bool byte_fallback = lookup("<0x41>") >= 0;
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    while (i + len < text.size() && len < 4 && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
    const int id = lookup(text.substr(i, len));
    if (id >= 0) {
      ids.push_back(id);
    } else {
      for (size_t b = 0; b < len; ++b) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "<0x%02X>", static_cast<unsigned char>(text[i + b]));
        const int bid = byte_fallback ? lookup(hex) : -1;
        ids.push_back(bid >= 0 ? bid : Tokenizer::kUnk);
      }
    }
    i += len;
  }
  const size_t first = bos ? 1 : 0;
  while (true) {
    float best = -1e30f;
    int best_id = -1;
    size_t best_at = 0;
    for (size_t i = first; i + 1 < ids.size(); ++i) {
      const int id = lookup(tok.piece(uint32_t(ids[i])) + tok.piece(uint32_t(ids[i + 1])));
      if (id >= 0 && tok.score(uint32_t(id)) > best) best = tok.score(uint32_t(id)), best_id = id, best_at = i;
    }
    if (best_id < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + best_at + 1);
  }
  return ids;
}

TEST(Tokenizer, HeapMergesEqualTheQuadraticLoopTokenForToken) {
  // A vocabulary with many equal scores, so the leftmost-among-equals rule is exercised.
  const Tokenizer ties = Tokenizer::FromVocab({"<unk>", "<s>", "</s>", " ", "a", "b", "aa", "ab", "ba", "bb", "aaa", " a", "aab", "<0x41>"},
                                              {0, 0, 0, 0, 0, 0, -1, -1, -1, -1, -2, -1, -2, 0});
  std::mt19937 rng(11);
  const std::vector<std::string> alphabet = {"a", "b", " ", "e", "t", "h", "the", " was", ".", ",", "\xC3\xA9", "\xE2\x98\x83", "\xFF"};
  for (const Tokenizer* tok : {&Stories().tokenizer, &Baby().tokenizer, &ties}) {
    for (int trial = 0; trial < 120; ++trial) {
      std::string text;
      const int n = int(rng() % 120);
      for (int i = 0; i < n; ++i) text += alphabet[rng() % (tok == &ties ? 3 : alphabet.size())];
      const bool bos = trial % 2 == 0;
      ASSERT_EQ(tok->Encode(text, bos), QuadraticEncode(*tok, text, bos)) << "text '" << text << "'";
    }
  }
}

TEST(Tokenizer, LongTextEncodesAndServersKnowWhatCannotFit) {
  // 64 KB of text: the heap-based merge is O(n log n) (the quadratic loop took seconds on a
  // fifth of this). The longest piece bounds the text a prompt of n tokens can hold.
  std::string text;
  while (text.size() < (64 << 10)) text += "Lily and Ben went to the park. They saw a big dog and ran home! ";
  const std::vector<int> ids = Stories().tokenizer.Encode(text, false);
  EXPECT_EQ(Stories().tokenizer.DecodeAll(ids), text);
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    size_t longest = 0;
    for (uint32_t i = 0; i < m->tokenizer.vocab_size(); ++i) longest = std::max(longest, m->tokenizer.piece(i).size());
    EXPECT_EQ(m->tokenizer.max_piece_bytes(), longest) << m->name;
    EXPECT_LE(text.size(), m->tokenizer.Encode(text, false).size() * longest) << m->name;
  }
}

class BadFiles : public ::testing::Test {
 protected:
  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string p = ::testing::TempDir() + "/" + name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }
  static std::string Slurp(const std::string& p, size_t n = SIZE_MAX) {
    std::ifstream f(p, std::ios::binary);
    std::string s((std::istreambuf_iterator<char>(f)), {});
    return s.substr(0, std::min(n, s.size()));
  }
};

TEST_F(BadFiles, ModelAndTokenizerErrorsAreClear) {
  const std::string bin = Slurp(ModelsDir() + "/stories260K.bin");
  const std::string tok = ModelsDir() + "/tok512.bin";
  auto r = LoadLlama2cModel(Write("trunc.bin", bin.substr(0, bin.size() - 100)), tok);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("is 1056440 bytes, but its header"), std::string::npos) << r.status().message();
  r = LoadLlama2cModel(Write("tiny.bin", bin.substr(0, 10)), tok);
  EXPECT_NE(r.status().message().find("shorter than the 28-byte"), std::string::npos);
  std::string zero = bin;
  std::memset(zero.data() + 4, 0, 4);  // hidden_dim = 0
  r = LoadLlama2cModel(Write("zero.bin", zero), tok);
  EXPECT_NE(r.status().message().find("hidden_dim=0"), std::string::npos) << r.status().message();
  // The other model's tokenizer.
  r = LoadLlama2cModel(ModelsDir() + "/stories260K.bin", ModelsDir() + "/tok105.bin");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("tokenizer"), std::string::npos) << r.status().message();
  r = LoadLlama2cModel(ModelsDir() + "/babyllama105.bin", tok);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("another model"), std::string::npos) << r.status().message();
  // A truncated GGUF.
  const std::string gguf = Slurp(ModelsDir() + "/tinyllamas-stories-260k-f32.gguf");
  auto g = LoadModel(Write("t.gguf", gguf.substr(0, 5000)));
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("truncated"), std::string::npos) << g.status().message();
  g = LoadModel(Write("t2.gguf", gguf.substr(0, gguf.size() - 1000)));
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("beyond the end"), std::string::npos) << g.status().message();
  EXPECT_EQ(LoadModel("no-such-model", "", ModelsDir()).status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvserve
