// Pool node (KV disaggregation): finds a prompt's longest cached prefix in the pool, fetches it
// (decoding each chunk while the next is on the wire) or recomputes when that is faster,
// computes the suffix and generates; then stores the chunks the pool lacked.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "kvserve/codec.h"
#include "kvserve/serve.h"
#include "serve/compute.h"
#include "serve/wire.h"

namespace kvserve {

using serve_internal::Seconds;

namespace {

// Token selection works on a whole prompt with its prefill attention; per pool chunk it would
// keep each chunk's first and last tokens, which is not what any profile measured.
bool SelectsTokens(const std::string& spec) {
  auto parsed = ParseStrategy(spec);
  if (!parsed.ok()) return false;
  for (const StageSpec& st : parsed->stages) {
    const StageInfo* info = FindStageInfo(st.name);
    if (info && info->selects_tokens) return true;
  }
  return false;
}
}  // namespace

// One job's entry in the node's work in flight (work_): registered when the job starts — a
// fetch under the lock of the decision that chose it, so a concurrent decision sees it — its
// remaining link bytes and codec seconds lowered as its chunks move, removed when it ends.
class PoolNode::WorkScope {
 public:
  // Adopts entry `id` of node->work_, made (under the node's lock) with `initial`.
  WorkScope(PoolNode* node, uint64_t id, Work initial) : node_(node), id_(id), initial_(initial) {}
  WorkScope(const WorkScope&) = delete;
  WorkScope& operator=(const WorkScope&) = delete;
  ~WorkScope() {
    std::lock_guard<std::mutex> lock(node_->mu_);
    node_->work_.erase(id_);
  }
  const Work& initial() const { return initial_; }
  // Whether another job was in flight beside this one at some time: its timings then include
  // sharing, which the decision adds itself, so they do not teach the live speeds.
  bool shared() const {
    std::lock_guard<std::mutex> lock(node_->mu_);
    auto it = node_->work_.find(id_);
    return it != node_->work_.end() && it->second.shared;
  }
  void Moved(double link_bytes, double codec_s) {
    std::lock_guard<std::mutex> lock(node_->mu_);
    auto it = node_->work_.find(id_);
    if (it == node_->work_.end()) return;
    it->second.link_bytes = std::max(0.0, it->second.link_bytes - link_bytes);
    it->second.codec_s = std::max(0.0, it->second.codec_s - codec_s);
  }

 private:
  PoolNode* node_;
  uint64_t id_;
  Work initial_;
};

uint64_t PoolNode::AddWorkLocked(Work w) {
  if (!work_.empty()) {
    w.shared = true;
    for (auto& [id, other] : work_) other.shared = true;
  }
  work_[++next_work_] = w;
  return next_work_;
}

struct PoolNode::Fetch {
  size_t chunks = 0;      // leading chunks fetched and decoded intact
  uint32_t slots = 0;     // cache slots they filled (fewer than their tokens after token selection)
  uint64_t bytes = 0;     // values fetched
  double wire_s = 0, decode_s = 0;
};

Result<std::unique_ptr<PoolNode>> PoolNode::Create(PoolNodeOptions opts) {
  KV_ASSIGN_OR_RETURN(std::unique_ptr<serve_internal::Compute> compute,
                      serve_internal::MakeCompute(opts.model, opts.synthetic, opts.threads, "pool"));
  if (opts.pool == nullptr && opts.policy != "recompute") return Status::InvalidArgument("pool node needs a pool");
  if (opts.chunk_tokens == 0) return Status::InvalidArgument("pool chunk_tokens must be positive");
  if (!(opts.assume_gbps > 0)) return Status::InvalidArgument("assume_gbps must be positive");
  std::unique_ptr<PoolNode> n(new PoolNode(std::move(opts)));
  n->compute_ = std::move(compute);
  PoolNodeOptions& o = n->opts_;
  n->bytes_per_token_ = double(n->compute_->shape().kv_bytes_per_token());
  n->s_.push_back({"none", "none", 1.0, 1.0, 0, 0});
  if (o.policy == "adaptive") {
    if (o.profile == nullptr) return Status::InvalidArgument("pool policy adaptive needs a profile");
    // Profiles count ratio and speed against fp16; a real model's pool holds f32 KV.
    const double per_fp16 = n->compute_->shape().per_fp16;
    for (StrategyCost c : StrategiesFromProfile(*o.profile)) {
      if (c.none() || SelectsTokens(c.spec) || !Pipeline::Create(c.spec, o.env).ok()) continue;
      c.ratio *= per_fp16, c.encode_Bps *= per_fp16, c.decode_Bps *= per_fp16;
      n->s_.push_back(c);
    }
    for (size_t i = 0; i < n->s_.size(); ++i) n->candidates_.push_back(i);
    if (o.probe) (void)n->ProbeBackend();  // a backend that is down now: assume_gbps until the first fetch
  } else if (o.policy != "recompute") {
    KV_ASSIGN_OR_RETURN(std::string spec, CanonicalStrategy(o.policy));
    KV_RETURN_IF_ERROR(Pipeline::Create(spec, o.env).status());
    if (SelectsTokens(spec)) {
      return Status::InvalidArgument("pool strategy '" + spec + "' selects tokens; pool chunks keep every token");
    }
    o.policy = spec;
    if (spec != "none") n->s_.push_back({spec, ShortSpec(spec), 1.0, 1.0, 1, 1});
    n->candidates_.push_back(n->s_.size() - 1);
  }
  return n;
}

// One value stored, fetched (timed and paced as a fetch is) and deleted, so the
// first requests are planned at what this backend delivers rather than at assume_gbps: a Redis
// that serves GETs at a fifth of the link's rate would otherwise cost the first hits of every
// node a fetch slower than recomputing (docs/POOL.md).
Status PoolNode::ProbeBackend() {
  // A value of the size the fetches will GET: per-GET costs weigh as they will then.
  const double chunk_frame = bytes_per_token_ * opts_.chunk_tokens / 4;
  std::vector<uint8_t> value(size_t(std::clamp(chunk_frame, 256.0 * 1024, 64.0 * 1024 * 1024)));
  uint64_t x = uint64_t(::getpid()) * 0x9E3779B97F4A7C15ull ^ uint64_t(Clock::now().time_since_epoch().count());
  for (size_t i = 0; i < value.size(); i += 8) {  // incompressible, as frames nearly are
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    std::memcpy(value.data() + i, &x, std::min<size_t>(8, value.size() - i));
  }
  const std::string key = "kvserve:probe:" + std::to_string(x);
  KV_RETURN_IF_ERROR(opts_.pool->Put(key, value));
  const Clock::time_point w0 = Clock::now();
  auto got = opts_.pool->Get(key, value.size());
  if (got.ok() && got.value() && opts_.pool_link) opts_.pool_link->Take(got.value()->size(), w0);
  const double seconds = Seconds(w0, Clock::now());
  (void)opts_.pool->Delete(key);
  KV_RETURN_IF_ERROR(got.status());
  if (!got.value() || got.value()->size() != value.size()) return Status::Unavailable("pool probe value was not read back");
  std::lock_guard<std::mutex> lock(mu_);
  estimator_.AddSample(double(value.size()), seconds, serve_internal::NowSeconds());
  last_get_sample_s_ = serve_internal::NowSeconds();
  return Status::Ok();
}

// Modelled, configured, or measured as prompts run (1e4 until the first).
double PoolNode::PrefillTokensPerSecond() const {
  const double modelled = compute_->shape().modelled_prefill_tps;
  if (modelled > 0) return modelled;
  if (opts_.prefill_tokens_per_second > 0) return opts_.prefill_tokens_per_second;
  std::lock_guard<std::mutex> lock(mu_);
  return measured_tps_ > 0 ? measured_tps_ : 1e4;
}

double PoolNode::bandwidth_estimate_gbps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return estimator_.has_estimate() ? estimator_.estimate() * 8 / 1e9 : opts_.assume_gbps;
}

double PoolNode::link_latency_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return estimator_.latency_seconds();
}

std::array<double, 2> PoolNode::codec_speed_factors() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {speeds_.encode(), speeds_.decode()};
}

void PoolNode::WorkAheadLocked(double bw, std::vector<double>* link_s, std::vector<double>* codec_s) const {
  for (const auto& [id, job] : work_) {
    if (job.link_bytes > 0) link_s->push_back(job.link_bytes / bw);
    if (job.codec_s > 0) codec_s->push_back(job.codec_s);
  }
}

PoolWorkState PoolNode::work_in_flight() const {
  std::vector<double> link, codec;
  {
    std::lock_guard<std::mutex> lock(mu_);
    WorkAheadLocked(serve_internal::PlanningBps(estimator_, opts_.assume_gbps), &link, &codec);
  }
  PoolWorkState w;
  for (double x : link) w.link_s += x;
  for (double x : codec) w.codec_s += x;
  w.link_jobs = uint32_t(link.size()), w.codec_jobs = uint32_t(codec.size());
  return w;
}

PoolNode::PoolNode(PoolNodeOptions opts) : opts_(std::move(opts)) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) codec_cores_ = CPU_COUNT(&set);
}
PoolNode::~PoolNode() = default;

Status PoolNode::Prepare(uint32_t n_token) { return compute_->Prepare(n_token); }

// The copies to store: the strategy fastest to fetch at the expected bandwidth among those at or
// above the floor, plus the fastest at safe_floor when the first is below it (a stricter request
// later still finds a copy it may use).
//
// Adaptive nodes store only copies a request would fetch: one whose fetch of this prefix is
// predicted (at the live GET throughput and decode speed, as DecidePoolFetch predicts it) to take
// more than kStoreMargin times recomputing the prefix is not stored. Such a copy costs an encode
// of the whole prefix and its PUTs for nothing, and on a slow backend those stores (seconds of
// Redis time for 512 MiB prompts) held up the lookups of the requests behind them: recomputing
// every request, the adaptive node's TTFT was 1.19x the recompute policy's (e2e_pool_redis.md).
std::vector<size_t> PoolNode::StoreChoice(double floor, uint32_t prefix_tokens, double tps, std::string* note) const {
  if (opts_.policy == "recompute") return {};
  if (opts_.policy != "adaptive") return {candidates_.front()};
  constexpr double kStoreMargin = 1.5;  // estimates move: keep copies that are nearly worth fetching
  double bw;
  std::vector<StrategyCost> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bw = serve_internal::PlanningBps(estimator_, opts_.assume_gbps);
    live.reserve(s_.size());
    for (const StrategyCost& s : s_) live.push_back(speeds_.Apply(s));
  }
  const double bytes = bytes_per_token_ * prefix_tokens;
  const uint32_t chunks = std::max<uint32_t>(1, prefix_tokens / opts_.chunk_tokens);
  auto fastest = [&](double q) {
    std::pair<size_t, double> best = {0, 1e300};
    for (size_t i = 0; i < live.size(); ++i) {
      if (live[i].quality < q) continue;
      const double t = PoolFetchSeconds(live[i], bytes, bw, chunks);
      if (t < best.second) best = {i, t};
    }
    return best;
  };
  const double recompute = prefix_tokens / std::max(1e-9, tps);
  std::vector<size_t> out;
  const auto first = fastest(floor);
  if (first.second <= kStoreMargin * recompute) out.push_back(first.first);
  if (s_[first.first].quality < opts_.safe_floor) {
    const auto safe = fastest(opts_.safe_floor);
    if (safe.first != first.first && safe.second <= kStoreMargin * recompute) out.push_back(safe.first);
  }
  if (out.empty() && note) {
    char b[160];
    std::snprintf(b, sizeof b, "; stored no copy: fetching the fastest (%.3f s) would lose to recomputing the prefix (%.3f s)",
                  first.second, recompute);
    *note = b;
  }
  return out;
}

// Fetches chunks [0, n_chunks) of `keys` in order, one thread fetching while this one decodes;
// stops at the first chunk missing (evicted since the lookup) or failing verification (deleted).
// The chunks' KV fills the session's slots from 0.
Status PoolNode::FetchPrefix(const std::vector<std::string>& keys, size_t n_chunks, serve_internal::ComputeSession* session,
                             WorkScope* work, Fetch* out) {
  struct Item {
    size_t chunk;
    ByteBuffer value;
    bool corrupt = false;  // the pool refused the value (a forged part header, too long)
  };
  const serve_internal::ComputeShape& shape = compute_->shape();
  const uint32_t n_layer = shape.n_layer, n_head_kv = shape.n_head_kv, head_dim = shape.head_dim;
  // The largest value a chunk of this model can have (longer ones are refused unread).
  const uint64_t chunk_values = uint64_t{2} * n_layer * n_head_kv * opts_.chunk_tokens * head_dim;
  const uint64_t max_value_bytes = serve_internal::MaxFrameBytes(chunk_values, opts_.chunk_tokens);
  serve_internal::BoundedQueue<Item> queue(2);
  Status fetch_status;
  double wire_s = 0;
  std::thread fetcher([&] {
    fetch_status = serve_internal::Guarded("fetching from the pool", [&]() -> Status {
      for (size_t c = 0; c < n_chunks; ++c) {
        const Clock::time_point w0 = Clock::now();
        auto v = opts_.pool->Get(keys[c], max_value_bytes);
        if (!v.ok() && v.status().code() == StatusCode::kCorrupt) {
          (void)queue.Push({c, {}, true});
          return Status::Ok();
        }
        KV_RETURN_IF_ERROR(v.status());
        if (!v.value()) break;  // evicted between lookup and fetch: recompute from here
        if (opts_.pool_link) opts_.pool_link->Take(v.value()->size(), w0);  // the copy out of the pool overlaps the wire
        wire_s += Seconds(w0, Clock::now());
        if (work) work->Moved(double(v.value()->size()), 0);
        if (!queue.Push({c, std::move(*v.value())})) break;
      }
      return Status::Ok();
    });
    queue.Finish();
  });
  KvBlock chunk;
  // The codec seconds the fetch's entry counts for each chunk.
  const double decode_per_chunk = work && n_chunks ? work->initial().codec_s / double(n_chunks) : 0;
  CodecOptions co;
  co.pool = opts_.threads;
  // A value claiming more than one chunk of f32 KV is refused before anything is allocated.
  co.max_decoded_bytes = chunk_values * sizeof(float);
  // Under a catch: an exception here, with the fetcher still running, would end the process.
  const Status decode_status = serve_internal::Guarded("decoding pool values", [&]() -> Status {
    while (auto item = queue.Pop()) {
      const Clock::time_point d0 = Clock::now();
      out->bytes += item->value.size();
      // Verified before use: the decode checks the checksum and that the frame was stored under
      // this key (a valid frame moved from another key is refused); then it must be this chunk of
      // this model's KV.
      co.require_request_id = PoolValueTag(keys[item->chunk]);
      bool fits = !item->corrupt && DecodeKv(item->value, &chunk, co, opts_.env).ok();
      if (fits) {
        const KvShape& h = chunk.shape();
        fits = h.n_layer == n_layer && h.n_head_kv == n_head_kv && h.head_dim == head_dim && h.n_token == opts_.chunk_tokens &&
               chunk.positions().empty() && chunk.token_offset() == item->chunk * opts_.chunk_tokens;
      }
      fits = fits && session->PlaceChunk(chunk, uint32_t(out->slots));
      out->decode_s += Seconds(d0, Clock::now());
      if (work) work->Moved(0, decode_per_chunk);
      if (!fits) {
        // Never used: deleted so the next request recomputes and stores it again.
        metrics_.pool_corrupt++;
        (void)opts_.pool->Delete(keys[item->chunk]);
        queue.Close();
        break;
      }
      out->chunks++;
      out->slots += chunk.shape().n_token;
    }
    return Status::Ok();
  });
  queue.Close();
  fetcher.join();
  out->wire_s = wire_s;
  KV_RETURN_IF_ERROR(decode_status);
  return fetch_status;
}

Result<ServeResponse> PoolNode::Serve(const ServeRequest& req, const TokenSink& on_token) {
  const Clock::time_point t0 = Clock::now();
  if (req.prompt.empty()) return Status::InvalidArgument("empty prompt");
  if (req.max_new_tokens < 1) return Status::InvalidArgument("max_new_tokens must be at least 1");
  const uint32_t n = uint32_t(req.prompt.size());
  KV_RETURN_IF_ERROR(compute_->CheckPrompt(req.prompt));
  // The copies this request may use: the node's, or the one it names (which must be one this
  // node stores, and a strategy this node can code).
  std::vector<size_t> candidates = candidates_;
  if (!req.strategy.empty()) {
    KV_ASSIGN_OR_RETURN(std::string spec, CanonicalStrategy(req.strategy));
    KV_RETURN_IF_ERROR(Pipeline::Create(spec, opts_.env).status().WithContext("'strategy'"));
    std::string stored;
    candidates.clear();
    for (size_t s : candidates_) {
      if (s_[s].spec == spec) candidates.push_back(s);
      stored += (stored.empty() ? "'" : ", '") + s_[s].spec + "'";
    }
    if (candidates.empty()) {
      return Status::InvalidArgument("'strategy' " + spec + " is not a copy this pool node stores (policy " + opts_.policy +
                                     (stored.empty() ? ": none" : ": " + stored) + ")");
    }
  }
  ServeResponse out;
  out.id = req.id;
  out.strategy = "none";
  out.kv_bytes = uint64_t(bytes_per_token_ * n);
  // Chunks wholly before the last token: the last one is always computed, for its logits.
  PoolKeyOptions ko{compute_->shape().identity, opts_.chunk_tokens, opts_.placement};
  const std::vector<std::string> chain = PrefixChainHashes(ko, std::span(req.prompt.data(), n - 1));
  const size_t n_full = chain.size();
  // How many leading chunks the pool holds in each candidate copy (one pipelined lookup).
  std::vector<size_t> present(s_.size(), 0);
  if (n_full > 0 && !candidates.empty()) {
    std::vector<std::string> keys;
    for (size_t s : candidates)
      for (size_t c = 0; c < n_full; ++c) keys.push_back(PoolChunkKey(ko, chain, c, s_[s].spec));
    auto exists = opts_.pool->ExistsMany(keys);
    if (exists.ok()) {
      for (size_t k = 0; k < candidates.size(); ++k) {
        size_t c = 0;
        while (c < n_full && (*exists)[k * n_full + c]) ++c;
        present[candidates[k]] = c;
      }
    } else {
      metrics_.pool_errors++;  // the pool is down: serve as a miss
    }
  }
  // Fetch or recompute.
  double floor = req.floor;
  for (const auto& [label, lf] : opts_.label_floors)
    if (label == req.label) floor = std::max(floor, lf);
  int fetch_strategy = -1;
  size_t fetch_chunks = 0;
  std::optional<WorkScope> fetch_work;  // adaptive: the chosen fetch's entry in work_
  bool any_present = false;
  for (size_t s : candidates) any_present |= present[s] > 0;
  const double tps = PrefillTokensPerSecond();
  if (any_present) {
    if (opts_.policy == "adaptive") {
      std::vector<PoolOption> options;
      for (size_t s : candidates)
        if (present[s]) options.push_back({uint32_t(s), uint32_t(present[s] * opts_.chunk_tokens)});
      PoolFetchRequest r;
      r.prompt_tokens = n;
      r.kv_bytes_per_token = bytes_per_token_;
      r.prefill_tokens_per_second = tps;
      r.gpu_wait_s = double(queued_tokens_.load()) / tps;
      r.floor = floor;
      r.chunk_tokens = opts_.chunk_tokens;
      // Decided and, if a fetch, registered as work in flight under one lock: concurrent
      // decisions each see the others' fetches.
      std::lock_guard<std::mutex> lock(mu_);
      const double bw = serve_internal::PlanningBps(estimator_, opts_.assume_gbps);
      r.decode_speed = speeds_.decode();
      r.codec_cores = codec_cores_;
      WorkAheadLocked(bw, &r.link_ahead_s, &r.codec_ahead_s);
      const PoolFetchDecision d = DecidePoolFetch(s_, options, r, bw);
      out.explanation = d.explanation;
      if (d.option >= 0) {
        fetch_strategy = int(options[size_t(d.option)].strategy), fetch_chunks = present[size_t(fetch_strategy)];
        const StrategyCost& c = s_[size_t(fetch_strategy)];
        const double raw = double(fetch_chunks) * opts_.chunk_tokens * bytes_per_token_;
        const Work w{raw / std::max(1e-9, c.ratio), c.none() ? 0.0 : raw / std::max(1.0, c.decode_Bps * r.decode_speed)};
        fetch_work.emplace(this, AddWorkLocked(w), w);  // removed when it goes, whatever way this request ends
      }
    } else {
      fetch_strategy = int(candidates.front());
      fetch_chunks = present[candidates.front()];
      out.explanation = "fixed pool strategy " + ShortSpec(s_[size_t(fetch_strategy)].spec);
    }
  } else {
    out.explanation = opts_.policy == "recompute" ? "recompute policy" : "no cached prefix";
  }
  KV_ASSIGN_OR_RETURN(std::unique_ptr<serve_internal::ComputeSession> session, compute_->NewSession());
  Fetch fetched;
  if (fetch_strategy >= 0) {
    std::vector<std::string> keys;
    for (size_t c = 0; c < fetch_chunks; ++c) keys.push_back(PoolChunkKey(ko, chain, c, s_[size_t(fetch_strategy)].spec));
    const Clock::time_point f0 = Clock::now();
    const Status st = FetchPrefix(keys, fetch_chunks, session.get(), fetch_work ? &*fetch_work : nullptr, &fetched);
    const bool alone = !fetch_work || !fetch_work->shared();
    fetch_work.reset();
    out.timings.fetch_s = Seconds(f0, Clock::now());
    out.timings.wire_s = fetched.wire_s;
    out.timings.decode_s = fetched.decode_s;
    if (!st.ok()) metrics_.pool_errors++;
    if (fetched.bytes > 0 && fetched.wire_s > 0 && alone) {
      // Live speeds: the GETs' throughput from this backend (round trips and the client's copies
      // included) and what decoding delivered here, for every later decision (DecidePoolFetch).
      // An adaptive node learns them from fetches that ran alone: the decision adds the sharing
      // with the work in flight itself, and speeds measured beside it would count it twice.
      std::lock_guard<std::mutex> lock(mu_);
      estimator_.AddSample(double(fetched.bytes), fetched.wire_s, serve_internal::NowSeconds());
      last_get_sample_s_ = serve_internal::NowSeconds();
      if (opts_.policy == "adaptive") {
        StageTimes t;
        t.decode_s = fetched.decode_s;
        speeds_.Observe(s_[size_t(fetch_strategy)], double(fetched.chunks) * opts_.chunk_tokens * bytes_per_token_, t);
      }
    }
    out.wire_bytes = fetched.bytes;
  }
  // Chunks the lookup saw but the fetch lost (evicted since, or deleted as corrupt) are missing
  // from that copy now: storing below puts them back.
  if (fetch_strategy >= 0) present[size_t(fetch_strategy)] = fetched.chunks;
  const uint32_t cached = uint32_t(fetched.chunks * opts_.chunk_tokens);
  out.cached_tokens = cached;
  out.pool_action = cached > 0 ? "fetch" : any_present ? "recompute" : "miss";
  if (cached > 0) out.strategy = s_[size_t(fetch_strategy)].spec;
  (cached > 0 ? metrics_.pool_hits : any_present ? metrics_.pool_recomputes : metrics_.pool_misses)++;
  // The suffix (or everything), one prompt at a time.
  const uint32_t compute = n - cached;
  int first_token = 0;
  queued_tokens_ += compute;
  {
    std::unique_lock<std::mutex> gpu(compute_mu_);
    const Clock::time_point started = Clock::now();
    out.timings.queue_s = Seconds(t0, started) - out.timings.fetch_s;
    auto first = session->ComputeSuffix(req.prompt, cached, req.sampling);
    if (!first.ok()) {
      queued_tokens_ -= compute;
      metrics_.errors++;
      return first.status().WithContext("request " + std::to_string(req.id));
    }
    first_token = first.value();
    out.timings.prefill_s = Seconds(started, Clock::now());
    queued_tokens_ -= compute;
  }
  out.timings.first_token_s = Seconds(t0, Clock::now());
  if (compute_->shape().modelled_prefill_tps == 0 && compute > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    const double rate = compute / std::max(1e-9, out.timings.prefill_s);
    measured_tps_ = measured_tps_ > 0 ? 0.7 * measured_tps_ + 0.3 * rate : rate;
  }
  // What to store: only exact KV. After a lossy prefix the suffix's KV is computed over it and
  // is not exact either, so only a miss, a recompute or an uncompressed fetch stores. The
  // prompt's KV is taken before generation extends the cache.
  const bool exact = cached == 0 || s_[size_t(fetch_strategy)].none();
  std::string store_note;
  const std::vector<size_t> store =
      !(n_full > 0 && exact) ? std::vector<size_t>{}
      : req.strategy.empty() ? StoreChoice(floor, uint32_t(n_full * opts_.chunk_tokens), PrefillTokensPerSecond(), &store_note)
                             : candidates;
  out.explanation += store_note;
  if (!store.empty()) KV_RETURN_IF_ERROR(session->KeepPrefix(uint32_t(n_full * opts_.chunk_tokens)));
  const Clock::time_point g0 = Clock::now();
  KV_ASSIGN_OR_RETURN(out.tokens, session->Generate(first_token, req.max_new_tokens, req.sampling, on_token));
  out.timings.generate_s = Seconds(g0, Clock::now());
  out.timings.total_s = Seconds(t0, Clock::now());
  metrics_.requests++;
  metrics_.cached_tokens += cached;
  metrics_.computed_tokens += compute;
  metrics_.kv_bytes += out.kv_bytes;
  metrics_.wire_bytes += out.wire_bytes;
  // Store the chunks each chosen copy lacks, from the exact KV (the synthetic stand-in's, or
  // this prompt's computed here). A chunk that came from the pool lossy is not re-stored from it.
  const Clock::time_point s0 = Clock::now();
  std::shared_ptr<const KvBlock> exact_kv;
  if (!store.empty()) {
    KV_ASSIGN_OR_RETURN(exact_kv, session->Kept(n));
  }
  for (size_t s : store) {
    const size_t from = present[s];
    if (from >= n_full || exact_kv->shape().n_token < n_full * opts_.chunk_tokens) continue;
    KV_ASSIGN_OR_RETURN(Pipeline pipeline, Pipeline::Create(s_[s].spec, opts_.env));
    CodecOptions co;
    co.pool = opts_.threads;
    const KvBlock& src = *exact_kv;
    StageTimes encoded;
    size_t n_encoded = 0;
    // Its encodes and PUTs, as work in flight that fetches share (adaptive nodes plan with it).
    std::optional<WorkScope> work;
    const double chunk_raw = double(opts_.chunk_tokens) * bytes_per_token_;
    double encode_per_chunk = 0;
    if (opts_.policy == "adaptive") {
      std::lock_guard<std::mutex> lock(mu_);
      const StrategyCost& cost = s_[s];
      encode_per_chunk = cost.none() ? 0.0 : chunk_raw / std::max(1.0, cost.encode_Bps * speeds_.encode());
      const Work w{double(n_full - from) * chunk_raw / std::max(1e-9, cost.ratio), double(n_full - from) * encode_per_chunk};
      work.emplace(this, AddWorkLocked(w), w);
    }
    for (size_t c = from; c < n_full; ++c) {
      KV_ASSIGN_OR_RETURN(KvBlock chunk, src.SliceTokens(uint32_t(c * opts_.chunk_tokens), opts_.chunk_tokens));
      ByteBuffer frame;
      const std::string key = PoolChunkKey(ko, chain, c, s_[s].spec);
      co.request_id = PoolValueTag(key);  // binds the value to its key: see FetchPrefix
      const Clock::time_point e0 = Clock::now();
      KV_RETURN_IF_ERROR(pipeline.Encode(chunk, &frame, co));
      encoded.encode_s += Seconds(e0, Clock::now());
      n_encoded++;
      if (work) work->Moved(0, encode_per_chunk);
      const Clock::time_point p0 = Clock::now();
      const Status st = opts_.pool->Put(key, frame);
      if (opts_.pool_link) opts_.pool_link->Take(frame.size(), p0);
      if (work) work->Moved(double(frame.size()), 0);
      if (!st.ok()) {
        metrics_.pool_errors++;
        break;  // the pool is down or full: serving goes on without it
      }
      out.stored_bytes += frame.size();
    }
    if (opts_.policy == "adaptive" && n_encoded > 0 && !(work && work->shared())) {  // profiled speeds to compare with
      std::lock_guard<std::mutex> lock(mu_);
      speeds_.Observe(s_[s], double(n_encoded) * opts_.chunk_tokens * bytes_per_token_, encoded);
    }
  }
  out.timings.store_s = Seconds(s0, Clock::now());
  metrics_.stored_bytes += out.stored_bytes;
  // A node that no longer fetches (its backend measured too slow) measures it again now and then,
  // after the answer is complete, so that a backend that recovers is fetched from again.
  if (opts_.policy == "adaptive" && opts_.probe && opts_.pool) {
    bool due;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const double now = serve_internal::NowSeconds();
      due = now - last_get_sample_s_ > kReprobeSeconds;
      if (due) last_get_sample_s_ = now;  // one probe at a time
    }
    if (due) (void)ProbeBackend();
  }
  return out;
}

}  // namespace kvserve
