// The evaluator: per context, encode+decode the prompt KV with a strategy, teacher-force the rest
// of the context and greedy-decode a continuation on top of it, and compare with the exact run.
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "kv/parallel.h"
#include "kvserve/codec.h"
#include "kvserve/eval.h"
#include "kvserve/file.h"

namespace kvserve {

namespace {

// log-softmax in place; returns nothing, rows of `vocab`.
void LogSoftmax(float* x, uint32_t n) {
  float mx = x[0];
  for (uint32_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0;
  for (uint32_t i = 0; i < n; ++i) sum += std::exp(double(x[i] - mx));
  const float lse = mx + float(std::log(sum));
  for (uint32_t i = 0; i < n; ++i) x[i] -= lse;
}

// The exact run of one context, as cached.
struct ExactContext {
  std::vector<float> logprobs;  // [n_cont][vocab], predictions of ctx[P+1 ..]
  std::vector<int> greedy;      // greedy continuation after the prompt, greedy_tokens long
};

constexpr char kCacheMagic[8] = {'K', 'V', 'E', 'X', 'A', 'C', 'T', '1'};

// Per-context sums, reduced in context order so results do not depend on threads.
struct Partial {
  uint64_t positions = 0;
  double correct = 0, exact_correct = 0, agree = 0, kl = 0, nll = 0, exact_nll = 0;
  double diff_sq = 0, diff = 0;  // paired (compressed - exact) correctness, for the standard error
  double greedy = 0;
  uint64_t fp16_bytes = 0, frame_bytes = 0;
};

}  // namespace

struct Evaluator::Impl {
  const LlamaModel* model = nullptr;
  EvalOptions opts;
  uint32_t prompt_len = 0, n_cont = 0;
  EvalSet set;
  std::vector<ExactContext> exact;
  std::vector<KvBlock> prompt_kv;  // fp16
  std::vector<std::vector<float>> prompt_last_logits;
  // Per prompt token: attention received from the prompt's last 32 positions, summed over layers
  // and heads (SnapKV's observation window), for token selection.
  std::vector<std::vector<float>> token_scores;
  std::unique_ptr<ThreadPool> own_pool;

  std::string CachePath() const {
    return opts.cache_dir + "/exact-" + model->sha256.substr(0, 16) + "-s" + std::to_string(opts.seed) + "-n" +
           std::to_string(set.contexts.empty() ? opts.n_contexts : set.contexts.size()) + "-p" +
           std::to_string(prompt_len) + "-g" + std::to_string(opts.greedy_tokens) + ".bin";
  }

  // Cache layout: magic, sha256 (64 chars), then u32 n_ctx, u32 seq_len, contexts, then per
  // context its logprobs and greedy tokens; XXH3-64 of everything before it at the end.
  bool LoadCache() {
    auto data = ReadFile(CachePath());
    if (!data.ok() || data->size() < 8 + 64 + 8 + 8) return false;
    const ByteBuffer& d = data.value();
    if (std::memcmp(d.data(), kCacheMagic, 8) != 0 || std::memcmp(d.data() + 8, model->sha256.data(), 64) != 0) return false;
    uint64_t sum;
    std::memcpy(&sum, d.data() + d.size() - 8, 8);
    if (XXH3_64bits(d.data(), d.size() - 8) != sum) return false;
    const uint32_t V = model->config.vocab_size, N = model->config.seq_len, G = opts.greedy_tokens;
    uint32_t n_ctx, seq;
    std::memcpy(&n_ctx, d.data() + 72, 4);
    std::memcpy(&seq, d.data() + 76, 4);
    const size_t want = 80 + size_t(n_ctx) * (N * 4 + size_t(n_cont) * V * 4 + G * 4) + 8;
    if (n_ctx != opts.n_contexts || seq != N || d.size() != want) return false;
    const uint8_t* p = d.data() + 80;
    set.contexts.assign(n_ctx, std::vector<int>(N));
    for (auto& c : set.contexts) std::memcpy(c.data(), p, N * 4), p += N * 4;
    exact.assign(n_ctx, {});
    for (auto& e : exact) {
      e.logprobs.resize(size_t(n_cont) * V);
      std::memcpy(e.logprobs.data(), p, e.logprobs.size() * 4);
      p += e.logprobs.size() * 4;
      e.greedy.resize(G);
      std::memcpy(e.greedy.data(), p, G * 4);
      p += G * 4;
    }
    set.seed = opts.seed;
    return true;
  }

  void SaveCache() const {
    ByteBuffer d;
    auto put = [&](const void* src, size_t n) {
      const uint8_t* b = static_cast<const uint8_t*>(src);
      d.insert(d.end(), b, b + n);
    };
    put(kCacheMagic, 8);
    put(model->sha256.data(), 64);
    const uint32_t n_ctx = uint32_t(set.contexts.size()), seq = model->config.seq_len;
    put(&n_ctx, 4);
    put(&seq, 4);
    for (const auto& c : set.contexts) put(c.data(), c.size() * 4);
    for (const auto& e : exact) {
      put(e.logprobs.data(), e.logprobs.size() * 4);
      put(e.greedy.data(), e.greedy.size() * 4);
    }
    const uint64_t sum = XXH3_64bits(d.data(), d.size());
    put(&sum, 8);
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(CachePath()).parent_path(), ec);
    (void)WriteFileAtomic(CachePath(), d);  // a cache that cannot be written only costs time
  }

  // Broken weights (a NaN in a norm, an inf in a matrix) give NaN logits, which every metric
  // below would silently count as wrong, agreeing or zero-KL: refuse them instead.
  Status CheckFinite(const float* logits, size_t n, uint32_t context, const char* where) const {
    for (size_t j = 0; j < n; ++j) {
      if (!std::isfinite(logits[j])) {
        return Status::InvalidArgument("model '" + model->name + "' produced a non-finite logit (" +
                                       std::to_string(logits[j]) + ") in the " + where + " of evaluation context " +
                                       std::to_string(context) + ": its weights hold NaN or inf, or overflow");
      }
    }
    return Status::Ok();
  }

  // Prefill of context i's prompt (exact, f32), keeping its fp16 KV and last logits.
  Status Prefill(LlamaEngine& engine, KvCache& cache, uint32_t i) {
    cache.Rewind(0, 0);
    prompt_last_logits[i].resize(model->config.vocab_size);
    AttentionCapture cap;
    cap.window = 32;
    KV_RETURN_IF_ERROR(
        engine.Forward(set.contexts[i].data(), prompt_len, &cache, prompt_last_logits[i].data(), true, &cap));
    KV_RETURN_IF_ERROR(CheckFinite(prompt_last_logits[i].data(), prompt_last_logits[i].size(), i, "prefill"));
    std::vector<float>& ts = token_scores[i];
    ts.assign(prompt_len, 0.0f);
    for (size_t row = 0; row < cap.probs.size() / cap.n_prompt; ++row)
      for (uint32_t j = 0; j < prompt_len; ++j) ts[j] += cap.probs[row * cap.n_prompt + j];
    KV_ASSIGN_OR_RETURN(prompt_kv[i], cache.Prefix(prompt_len, DType::kF16));
    return Status::Ok();
  }

  // Teacher-forced logprobs of the continuation over whatever prompt KV the cache holds in its
  // first `prefix_slots` slots (fewer than prompt_len when tokens were pruned).
  Status Continuation(LlamaEngine& engine, KvCache& cache, uint32_t i, uint32_t prefix_slots,
                      std::vector<float>* logprobs) {
    const uint32_t V = model->config.vocab_size;
    cache.Rewind(prefix_slots, prompt_len);
    logprobs->resize(size_t(n_cont) * V);
    KV_RETURN_IF_ERROR(engine.Forward(set.contexts[i].data() + prompt_len, n_cont, &cache, logprobs->data()));
    KV_RETURN_IF_ERROR(CheckFinite(logprobs->data(), logprobs->size(), i, "continuation"));
    for (uint32_t t = 0; t < n_cont; ++t) LogSoftmax(logprobs->data() + size_t(t) * V, V);
    return Status::Ok();
  }

  // Runs fn(engine, cache, i) for every context on opts.threads workers, each with its own engine
  // and cache; workers take contexts round-robin. Results must be stored per context.
  Status ForEachContext(const std::function<Status(LlamaEngine&, KvCache&, uint32_t)>& fn, const ProgressFn& progress) {
    const uint32_t n = uint32_t(set.contexts.size());
    ThreadPool& workers_pool = opts.pool ? *opts.pool : *own_pool;
    const int workers = std::max(1, std::min<int>(workers_pool.size(), int(n)));
    std::vector<Status> errors(n);
    std::mutex mu;
    uint64_t done = 0;
    workers_pool.ParallelFor(uint64_t(workers), [&](uint64_t w) {
      LlamaEngine engine(*model);
      auto cache = KvCache::Create(model->config);
      for (uint32_t i = uint32_t(w); i < n; i += uint32_t(workers)) {
        errors[i] = cache.ok() ? fn(engine, cache.value(), i) : cache.status();
        std::lock_guard<std::mutex> lock(mu);
        if (progress) progress(++done, n);
      }
    });
    for (const Status& st : errors) KV_RETURN_IF_ERROR(st);
    return Status::Ok();
  }

  // Greedy tokens after the prompt; with `reference`, stops at the first disagreement and
  // returns the common prefix length.
  Result<uint32_t> Greedy(LlamaEngine& engine, KvCache& cache, uint32_t i, uint32_t prefix_slots,
                          std::vector<int>* out, const std::vector<int>* reference) {
    const uint32_t V = model->config.vocab_size, G = opts.greedy_tokens;
    std::vector<float> logits(V);
    cache.Rewind(prefix_slots, prompt_len);
    int tok = int(Argmax(prompt_last_logits[i].data(), V));  // the prefill node's own first token
    out->assign(1, tok);
    while (out->size() < G) {
      if (reference && (*reference)[out->size() - 1] != tok) break;
      KV_RETURN_IF_ERROR(engine.Forward(&tok, 1, &cache, logits.data(), true));
      tok = int(Argmax(logits.data(), V));
      out->push_back(tok);
    }
    if (!reference) return uint32_t(out->size());
    uint32_t m = 0;
    while (m < out->size() && (*out)[m] == (*reference)[m]) ++m;
    return m;
  }
};

Evaluator::Evaluator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Evaluator::~Evaluator() = default;
const LlamaModel& Evaluator::model() const { return *impl_->model; }
const EvalSet& Evaluator::eval_set() const { return impl_->set; }
uint32_t Evaluator::prompt_len() const { return impl_->prompt_len; }
const KvBlock& Evaluator::prompt_kv(uint32_t i) const { return impl_->prompt_kv[i]; }

Result<std::unique_ptr<Evaluator>> Evaluator::Create(const LlamaModel& model, const EvalOptions& opts,
                                                     const ProgressFn& progress) {
  auto impl = std::make_unique<Impl>();
  impl->model = &model;
  impl->opts = opts;
  const LlamaConfig& c = model.config;
  impl->prompt_len = opts.prompt_len ? opts.prompt_len : c.seq_len * 3 / 4;
  if (impl->prompt_len < 1 || impl->prompt_len + 2 > c.seq_len) {
    return Status::InvalidArgument("prompt_len=" + std::to_string(impl->prompt_len) + " must leave room in the context of " +
                                   std::to_string(c.seq_len));
  }
  if (impl->prompt_len + opts.greedy_tokens > c.seq_len || opts.greedy_tokens < 1) {
    return Status::InvalidArgument("greedy_tokens=" + std::to_string(opts.greedy_tokens) + " after a prompt of " +
                                   std::to_string(impl->prompt_len) + " exceeds the context of " + std::to_string(c.seq_len));
  }
  impl->n_cont = c.seq_len - impl->prompt_len - 1;
  if (impl->opts.n_contexts == 0) impl->opts.n_contexts = DefaultEvalContexts(c, impl->prompt_len);
  const uint32_t n_ctx = impl->opts.n_contexts;
  if (opts.pool == nullptr) impl->own_pool = std::make_unique<ThreadPool>(std::max(1, opts.threads));
  const bool use_cache = !impl->opts.cache_dir.empty();
  const bool cached = use_cache && impl->LoadCache();
  if (!cached) {
    KV_ASSIGN_OR_RETURN(impl->set, BuildEvalSet(model, n_ctx, opts.seed));
    impl->exact.assign(n_ctx, {});
  }
  impl->prompt_kv.resize(n_ctx);
  impl->prompt_last_logits.resize(n_ctx);
  impl->token_scores.resize(n_ctx);
  Impl& im = *impl;
  KV_RETURN_IF_ERROR(im.ForEachContext(
      [&](LlamaEngine& engine, KvCache& cache, uint32_t i) -> Status {
        KV_RETURN_IF_ERROR(im.Prefill(engine, cache, i));
        if (cached) return Status::Ok();
        // The exact reference attends over the fp16 prompt KV, exactly what strategy `none` gives.
        KV_RETURN_IF_ERROR(cache.LoadPrefix(im.prompt_kv[i], im.prompt_len));
        KV_RETURN_IF_ERROR(im.Continuation(engine, cache, i, im.prompt_len, &im.exact[i].logprobs));
        return im.Greedy(engine, cache, i, im.prompt_len, &im.exact[i].greedy, nullptr).status();
      },
      progress));
  if (!cached && use_cache) impl->SaveCache();
  return std::unique_ptr<Evaluator>(new Evaluator(std::move(impl)));
}

Result<EvalMetrics> Evaluator::Evaluate(std::string_view strategy, const ProgressFn& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& im = *impl_;
  KV_ASSIGN_OR_RETURN(Pipeline pipeline, Pipeline::Create(strategy, impl_->opts.codec_env));
  const LlamaModel& model = *im.model;
  const uint32_t V = model.config.vocab_size, n_ctx = uint32_t(im.set.contexts.size());
  std::vector<Partial> parts(n_ctx);
  KV_RETURN_IF_ERROR(im.ForEachContext(
      [&](LlamaEngine& engine, KvCache& cache, uint32_t i) -> Status {
        Partial& pt = parts[i];
        ByteBuffer frame;
        KvBlock decoded;
        std::vector<float> lp;
        std::vector<int> greedy;
        const KvBlock& kv = im.prompt_kv[i];
        CodecOptions co;
        co.token_scores = &im.token_scores[i];
        KV_RETURN_IF_ERROR(pipeline.Encode(kv, &frame, co));
        KV_RETURN_IF_ERROR(pipeline.Decode(frame, &decoded));
        pt.fp16_bytes = kv.shape().numel() * 2;
        pt.frame_bytes = frame.size();
        KV_RETURN_IF_ERROR(cache.LoadPrefix(decoded, im.prompt_len));
        const uint32_t slots = decoded.shape().n_token;
        KV_RETURN_IF_ERROR(im.Continuation(engine, cache, i, slots, &lp));
        const std::vector<int>& ctx = im.set.contexts[i];
        const std::vector<float>& ex = im.exact[i].logprobs;
        for (uint32_t t = 0; t < im.n_cont; ++t) {
          const float* pc = lp.data() + size_t(t) * V;
          const float* pe = ex.data() + size_t(t) * V;
          const int y = ctx[im.prompt_len + 1 + t];
          const uint32_t ac = Argmax(pc, V), ae = Argmax(pe, V);
          const double c = ac == uint32_t(y), e = ae == uint32_t(y);
          pt.correct += c;
          pt.exact_correct += e;
          pt.diff += c - e;
          pt.diff_sq += (c - e) * (c - e);
          pt.agree += ac == ae;
          double kl = 0;
          for (uint32_t v = 0; v < V; ++v) kl += std::exp(double(pe[v])) * (double(pe[v]) - double(pc[v]));
          pt.kl += std::max(0.0, kl);
          pt.nll -= pc[y];
          pt.exact_nll -= pe[y];
        }
        pt.positions = im.n_cont;
        KV_ASSIGN_OR_RETURN(uint32_t m, im.Greedy(engine, cache, i, slots, &greedy, &im.exact[i].greedy));
        pt.greedy = m;
        return Status::Ok();
      },
      progress));
  Partial s;
  for (const Partial& p : parts) {
    s.positions += p.positions, s.correct += p.correct, s.exact_correct += p.exact_correct, s.agree += p.agree;
    s.kl += p.kl, s.nll += p.nll, s.exact_nll += p.exact_nll, s.diff += p.diff, s.diff_sq += p.diff_sq;
    s.greedy += p.greedy, s.fp16_bytes += p.fp16_bytes, s.frame_bytes += p.frame_bytes;
  }
  EvalMetrics m;
  m.strategy = pipeline.spec();
  const double n = double(s.positions);
  m.accuracy = s.correct / n;
  m.exact_accuracy = s.exact_correct / n;
  m.relative_accuracy = m.exact_accuracy > 0 ? m.accuracy / m.exact_accuracy : 0;
  const double mean_d = s.diff / n, var_d = std::max(0.0, s.diff_sq / n - mean_d * mean_d);
  m.relative_accuracy_se = m.exact_accuracy > 0 ? std::sqrt(var_d / n) / m.exact_accuracy : 0;
  m.top1_agreement = s.agree / n;
  m.kl = s.kl / n;
  m.ppl_ratio = std::exp((s.nll - s.exact_nll) / n);
  m.greedy_match = s.greedy / n_ctx;
  m.ratio = double(s.fp16_bytes) / double(s.frame_bytes);
  m.contexts = n_ctx;
  m.positions = s.positions;
  m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return m;
}

}  // namespace kvserve
