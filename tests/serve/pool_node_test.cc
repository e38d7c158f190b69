// Pool node (KV disaggregation) with the shipped models: a hit of the uncompressed pool gives
// the tokens of local generation; the adaptive node fetches a copy within the floor or
// recomputes when that is faster; every fault — a corrupted value, a chunk evicted between
// lookup and fetch, Redis stopped (and back), a cluster node killed — ends in right tokens.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <thread>

#include "kvserve/frame.h"
#include "kvserve/profile.h"
#include "kvserve/serve.h"
#include "model/model_test_util.h"
#include "transfer/redis_test_util.h"
#include "test_paths.h"

namespace kvserve {
namespace {

using testing::Baby;
using testing::Stories;

constexpr uint32_t kChunk = 16;

ServeRequest Req(const LlamaModel& m, const std::string& text, uint32_t n, uint64_t id = 1) {
  ServeRequest r;
  r.id = id;
  r.prompt = m.tokenizer.Encode(text, true);
  r.max_new_tokens = n;
  return r;
}

const char* kStory = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
                     "with her big red ball. One day, she saw a dog";

std::vector<int> Local(const LlamaModel& m, const ServeRequest& r) {
  LlamaEngine engine(m);
  return engine.Generate(r.prompt, r.max_new_tokens).value();
}

// The key of chunk `c` of a stories260K request's uncompressed copy, as the node stores it.
std::string UncompressedChunkKey(const ServeRequest& r, size_t c) {
  PoolKeyOptions ko{Stories().sha256, kChunk};
  return PoolChunkKey(ko, PrefixChainHashes(ko, std::span(r.prompt.data(), r.prompt.size() - 1)), c, "none");
}

std::unique_ptr<PoolNode> Node(const LlamaModel& m, KvPool* pool, const std::string& policy, const Profile* profile = nullptr,
                               double gbps = 10, double prefill_tps = 0) {
  PoolNodeOptions o;
  o.model = &m;
  o.pool = pool;
  o.chunk_tokens = kChunk;
  o.policy = policy;
  o.profile = profile;
  o.assume_gbps = gbps;  // these tests set the pool's speed by what the node assumes: no probe
  o.probe = false;
  o.prefill_tokens_per_second = prefill_tps;  // 0: measured as prompts run
  auto n = PoolNode::Create(o);
  EXPECT_TRUE(n.ok()) << n.status().ToString();
  return std::move(n).value();
}

TEST(PoolNode, UncompressedHitGivesLocalTokensForBothModels) {
  for (const LlamaModel* m : {&Stories(), &Baby()}) {
    auto pool = MakeEmbeddedPool();
    auto node = Node(*m, pool.get(), "none");
    const ServeRequest req = Req(*m, kStory, 24);
    ASSERT_GT(req.prompt.size(), 2 * kChunk) << m->name;
    const std::vector<int> local = Local(*m, req);
    auto miss = node->Serve(req);
    ASSERT_TRUE(miss.ok()) << miss.status().ToString();
    EXPECT_EQ(miss->pool_action, "miss");
    EXPECT_EQ(miss->tokens, local) << m->name;
    EXPECT_GT(miss->stored_bytes, 0u);
    auto hit = node->Serve(req);
    ASSERT_TRUE(hit.ok()) << hit.status().ToString();
    EXPECT_EQ(hit->pool_action, "fetch");
    EXPECT_EQ(hit->cached_tokens, (req.prompt.size() - 1) / kChunk * kChunk);
    EXPECT_EQ(hit->tokens, local) << m->name;
    EXPECT_EQ(hit->stored_bytes, 0u);  // nothing new to store
    // A prompt sharing only the first chunk fetches that chunk and computes the rest.
    ServeRequest other = req;
    other.prompt[kChunk + 3] = other.prompt[kChunk + 3] == 5 ? 6 : 5;
    auto part = node->Serve(other);
    ASSERT_TRUE(part.ok());
    EXPECT_EQ(part->cached_tokens, kChunk);
    EXPECT_EQ(part->tokens, Local(*m, other)) << m->name;
    EXPECT_EQ(node->metrics().pool_hits.load(), 2u);
  }
}

TEST(PoolNode, RecomputePolicyNeverTouchesThePool) {
  auto pool = MakeEmbeddedPool();
  auto node = Node(Stories(), pool.get(), "recompute");
  const ServeRequest req = Req(Stories(), kStory, 8);
  for (int i = 0; i < 2; ++i) {
    auto r = node->Serve(req);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->cached_tokens, 0u);
    EXPECT_EQ(r->tokens, Local(Stories(), req));
  }
  EXPECT_EQ(pool->Stats().value().entries, 0u);
}

TEST(PoolNode, TokenSelectingPoolStrategiesAreRefused) {
  auto pool = MakeEmbeddedPool();
  PoolNodeOptions o;
  o.model = &Stories();
  o.pool = pool.get();
  o.policy = "prune(keep=0.5)|quant";
  auto n = PoolNode::Create(o);
  ASSERT_FALSE(n.ok());
  EXPECT_NE(n.status().message().find("selects tokens"), std::string::npos);
}

TEST(PoolNode, AdaptiveFetchesACopyWithinTheFloorOrRecomputesWhenThatIsFaster) {
  const Profile profile = LoadProfile(SourceDir() + "/bench/profiles/default.json").value();
  auto pool = MakeEmbeddedPool();
  // A slow pool link: the compressed copy is fetched. (The prefill rate is fixed so that the
  // decisions do not hang on how fast this machine ran the first prompt: recomputing the story's
  // prefix takes tens of ms at 2000 tokens/s, fetching its ~30 KB copy at 0.05 Gbit/s a few.)
  auto slow = Node(Baby(), pool.get(), "adaptive", &profile, 0.05, 2000);
  ServeRequest req = Req(Baby(), kStory, 8);
  req.floor = 0.99;
  auto stored = slow->Serve(req);  // miss: stores
  ASSERT_TRUE(stored.ok());
  EXPECT_GT(stored->stored_bytes, 0u) << stored->explanation;
  auto hit = slow->Serve(req);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(hit->pool_action, "fetch");
  EXPECT_NE(hit->strategy, "none");
  double q = 0;
  for (const StrategyCost& s : slow->strategies()) if (s.spec == hit->strategy) q = s.quality;
  EXPECT_GE(q, 0.99) << hit->strategy;
  EXPECT_NE(hit->explanation.find("fetch"), std::string::npos) << hit->explanation;
  // A stricter request still finds a copy it may use (the safe copy), or recomputes; never below.
  ServeRequest strict = req;
  strict.floor = 0.999;
  auto s = slow->Serve(strict);
  ASSERT_TRUE(s.ok());
  if (s->pool_action == "fetch") {
    for (const StrategyCost& c : slow->strategies()) if (c.spec == s->strategy) EXPECT_GE(c.quality, 0.999);
  } else {
    EXPECT_EQ(s->pool_action, "recompute") << s->explanation;
    EXPECT_EQ(s->tokens, Local(Baby(), strict));
  }
  // A retrieval request with a low floor of its own still gets its label's 0.99.
  ServeRequest retrieval = req;
  retrieval.floor = 0.5;
  retrieval.label = "retrieval";
  auto rr = slow->Serve(retrieval);
  ASSERT_TRUE(rr.ok());
  for (const StrategyCost& c : slow->strategies()) if (c.spec == rr->strategy) EXPECT_GE(c.quality, 0.99) << c.spec;
  // A pool link so slow that fetching loses to computing the prompt: recompute, said so.
  auto crawl = Node(Baby(), pool.get(), "adaptive", &profile, 1e-6, 2000);
  auto r = crawl->Serve(req);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->pool_action, "recompute") << r->explanation;
  EXPECT_EQ(r->tokens, Local(Baby(), req));
  EXPECT_NE(r->explanation.find("recompute"), std::string::npos);
}

// A backend slower than the link the node assumes: every GET waits `delay_s` first.
class SlowGetPool : public KvPool {
 public:
  SlowGetPool(KvPool* inner, double delay_s) : inner_(inner), delay_s_(delay_s) {}
  std::string name() const override { return "slow"; }
  Status Put(const std::string& k, std::span<const uint8_t> v) override { return inner_->Put(k, v); }
  using KvPool::GetMany;
  Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys, uint64_t max_value_bytes) override {
    ::usleep(useconds_t(delay_s_ * 1e6));
    return inner_->GetMany(keys, max_value_bytes);
  }
  Result<std::vector<bool>> ExistsMany(const std::vector<std::string>& k) override { return inner_->ExistsMany(k); }
  Status Delete(const std::string& k) override { return inner_->Delete(k); }
  Result<PoolStats> Stats() override { return inner_->Stats(); }
  Status Clear() override { return inner_->Clear(); }

 private:
  KvPool* inner_;
  double delay_s_;
};

// An adaptive node's setting: synthetic llama3-8b KV (128 KiB a token; recomputing 129 tokens
// takes 0.13 s), an embedded pool whose GETs each take get_delay_s, planned at assume_gbps
// until the node measures (no probe).
struct SlowPoolSetup {
  Profile profile = LoadProfile(SourceDir() + "/bench/profiles/default.json").value();
  SyntheticModel sm;
  std::unique_ptr<KvPool> inner = MakeEmbeddedPool();
  SlowGetPool pool;
  PoolNodeOptions options;
  SlowPoolSetup(double get_delay_s, double assume_gbps) : pool(inner.get(), get_delay_s) {
    sm.prefill_tokens_per_second = 1000;
    options.synthetic = &sm;
    options.pool = &pool;
    options.chunk_tokens = kChunk;
    options.profile = &profile;
    options.assume_gbps = assume_gbps;
    options.probe = false;
  }
};

// Item 5 of the service-aware controller: the fetch decision plans with what this node's
// backend and decoder delivered, not with the link it was told about and the profile's speeds.
// The node assumes 2 Gbit/s and fetches; its GETs take 30 ms a chunk (a backend far slower than
// that); the next request recomputes, and says at what GET throughput it planned.
TEST(PoolNode, AdaptivePlansWithTheMeasuredGetThroughputAndCodecSpeeds) {
  SlowPoolSetup setup(0.03, 2);  // learned from the fetches alone (the probe is below)
  PoolNodeOptions& o = setup.options;
  KvPool* inner = setup.inner.get();
  auto made = PoolNode::Create(o);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  PoolNode& node = *made.value();
  EXPECT_EQ(node.pool_backend(), "slow");
  ServeRequest req;
  req.prompt.assign(129, 7);  // 8 chunks of 16 tokens (16 MiB of KV) and the last token
  req.max_new_tokens = 1;
  ASSERT_TRUE(node.Prepare(129).ok());
  auto miss = node.Serve(req);  // stores a compressed copy, its encode timed
  ASSERT_TRUE(miss.ok()) << miss.status().ToString();
  EXPECT_EQ(miss->pool_action, "miss");
  EXPECT_GT(miss->stored_bytes, 0u);
  EXPECT_NE(node.codec_speed_factors()[0], 1.0);  // measured
  EXPECT_EQ(node.codec_speed_factors()[1], 1.0);  // nothing decoded yet
  auto hit = node.Serve(req);  // planned at 2 Gbit/s: fetching wins
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  ASSERT_EQ(hit->pool_action, "fetch") << hit->explanation;
  EXPECT_NE(hit->explanation.find("pool GETs at 2.00 Gbit/s"), std::string::npos) << hit->explanation;
  EXPECT_NE(node.codec_speed_factors()[1], 1.0);
  // 8 GETs of 30 ms each for a few MiB: well under 1 Gbit/s.
  EXPECT_LT(node.bandwidth_estimate_gbps(), 1.0);
  auto next = node.Serve(req);
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_EQ(next->pool_action, "recompute") << next->explanation;
  EXPECT_NE(next->explanation.find("pool GETs at 0."), std::string::npos) << next->explanation;
  // With the probe (one value the size of a chunk's frame at ratio 4, here 512 KiB, stored,
  // fetched and deleted at creation), a node that assumes 20 Gbit/s plans its first request at
  // what the backend delivered (512 KiB in 30 ms and more): recompute from the start.
  const uint64_t entries_before = inner->Stats()->entries;
  o.assume_gbps = 20;
  o.probe = true;
  auto probed = PoolNode::Create(o);
  ASSERT_TRUE(probed.ok()) << probed.status().ToString();
  EXPECT_EQ(inner->Stats()->entries, entries_before);  // the probe's value is gone
  EXPECT_LT(probed.value()->bandwidth_estimate_gbps(), 0.15);
  auto first = probed.value()->Serve(req);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->pool_action, "recompute") << first->explanation;
}

// A fetch shares the node's pool link and cores with the fetches and stores in flight, and the
// decision says what it saw: a request that decides while another's fetch is still on its slow
// GETs counts that fetch's link bytes and decode; once every job has ended nothing is counted,
// and only a fetch that ran alone teaches the node its GET throughput.
TEST(PoolNode, AdaptiveDecisionsSeeTheWorkInFlightAtTheNode) {
  SlowPoolSetup setup(0.1, 20);  // a fetch of 8 chunks: 0.8 s
  auto made = PoolNode::Create(setup.options);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  PoolNode& node = *made.value();
  ServeRequest req;
  req.prompt.assign(129, 7);
  req.max_new_tokens = 1;
  ASSERT_TRUE(node.Prepare(129).ok());
  auto miss = node.Serve(req);  // stores a compressed copy
  ASSERT_TRUE(miss.ok()) << miss.status().ToString();
  ASSERT_GT(miss->stored_bytes, 0u);
  EXPECT_EQ(miss->explanation.find("in flight here"), std::string::npos) << miss->explanation;
  Result<ServeResponse> first = Status::Internal("not run");
  std::thread t([&] { first = node.Serve(req); });
  ::usleep(300000);  // the first fetch is on its GETs
  auto second = node.Serve(req);
  t.join();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  ASSERT_EQ(first->pool_action, "fetch") << first->explanation;
  EXPECT_EQ(first->explanation.find("in flight here"), std::string::npos) << first->explanation;
  EXPECT_NE(second->explanation.find("in flight here: link "), std::string::npos) << second->explanation;
  EXPECT_NE(second->explanation.find(" (1), codec "), std::string::npos) << second->explanation;
  // Fetches that ran beside each other do not teach the GET throughput (the decision adds the
  // sharing itself); one alone does: 8 GETs of 0.1 s for a few MiB, well under 1 Gbit/s.
  EXPECT_EQ(node.bandwidth_estimate_gbps(), 20.0);
  auto third = node.Serve(req);
  ASSERT_TRUE(third.ok()) << third.status().ToString();
  EXPECT_EQ(third->pool_action, "fetch") << third->explanation;
  EXPECT_EQ(third->explanation.find("in flight here"), std::string::npos) << third->explanation;
  EXPECT_LT(node.bandwidth_estimate_gbps(), 1.0);
}

// Deletes each key just before it is fetched, once armed: eviction between lookup and fetch.
class EvictingPool : public KvPool {
 public:
  explicit EvictingPool(KvPool* inner) : inner_(inner) {}
  std::string name() const override { return "evicting"; }
  Status Put(const std::string& k, std::span<const uint8_t> v) override { return inner_->Put(k, v); }
  using KvPool::GetMany;
  Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys, uint64_t max_value_bytes) override {
    if (armed) for (const std::string& k : keys) (void)inner_->Delete(k);
    return inner_->GetMany(keys, max_value_bytes);
  }
  Result<std::vector<bool>> ExistsMany(const std::vector<std::string>& k) override { return inner_->ExistsMany(k); }
  Status Delete(const std::string& k) override { return inner_->Delete(k); }
  Result<PoolStats> Stats() override { return inner_->Stats(); }
  Status Clear() override { return inner_->Clear(); }
  bool armed = false;

 private:
  KvPool* inner_;
};

TEST(PoolNode, CorruptValuesAreDeletedAndRecomputedAndEvictionsMidFetchRecompute) {
  auto inner = MakeEmbeddedPool();
  EvictingPool pool(inner.get());
  auto node = Node(Stories(), &pool, "none");
  const ServeRequest req = Req(Stories(), kStory, 16);
  const std::vector<int> local = Local(Stories(), req);
  ASSERT_TRUE(node->Serve(req).ok());
  // Fault injection: the second chunk's value overwritten with garbage in the pool.
  const std::string key1 = UncompressedChunkKey(req, 1);
  ByteBuffer garbage = inner->Get(key1).value().value();
  garbage[garbage.size() / 2] ^= 0x40;
  ASSERT_TRUE(inner->Put(key1, garbage).ok());
  auto r = node->Serve(req);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->cached_tokens, kChunk);  // chunk 0 only: verified before use
  EXPECT_EQ(r->tokens, local);
  EXPECT_EQ(node->metrics().pool_corrupt.load(), 1u);
  // Deleted, recomputed, and stored again intact.
  const auto restored = inner->Get(key1).value();
  ASSERT_TRUE(restored);
  EXPECT_NE(*restored, garbage);
  EXPECT_TRUE(ParseFrame(*restored).ok());
  // Evicted between lookup and fetch: computed instead, same tokens.
  pool.armed = true;
  auto e = node->Serve(req);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->cached_tokens, 0u);
  EXPECT_EQ(e->tokens, local);
}

// An uncompressed stories260K pool node over a redis-server of its own, and the story request
// with its local tokens, served once (stored).
class PoolNodeOnRedis : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(testing::HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
    server = std::make_unique<testing::RedisServer>();
    pool = MakeRedisPool(testing::TestPoolOptions(server->address())).value();
    node = Node(Stories(), pool.get(), "none");
    req = Req(Stories(), kStory, 16);
    local = Local(Stories(), req);
    ASSERT_TRUE(node->Serve(req).ok());
  }
  std::unique_ptr<testing::RedisServer> server;
  std::unique_ptr<KvPool> pool;
  std::unique_ptr<PoolNode> node;
  ServeRequest req;
  std::vector<int> local;
};

TEST_F(PoolNodeOnRedis, StoppedMidRunFallsBackToRecomputeAndReconnects) {
  ASSERT_EQ(node->Serve(req)->pool_action, "fetch");
  server->Stop();
  auto down = node->Serve(req);
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  EXPECT_EQ(down->cached_tokens, 0u);
  EXPECT_EQ(down->tokens, local);
  EXPECT_GT(node->metrics().pool_errors.load(), 0u);
  ASSERT_TRUE(server->Start());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // past the back-off
  auto again = node->Serve(req);  // empty server: a miss that stores
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tokens, local);
  auto hit = node->Serve(req);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->pool_action, "fetch");
  EXPECT_EQ(hit->tokens, local);
}

TEST(PoolNode, AKilledClusterNodeCostsItsPrefixesNotTheRequests) {
  ASSERT_TRUE(testing::HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
  testing::RedisCluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  auto pool = MakeRedisPool(testing::TestPoolOptions(cluster.node(0).address(), true)).value();
  auto node = Node(Stories(), pool.get(), "none");
  // Prompts differing in their first chunk: their prefixes land on different nodes.
  std::vector<ServeRequest> reqs;
  for (int i = 0; i < 6; ++i) {
    ServeRequest r = Req(Stories(), kStory, 8, i + 1);
    r.prompt[1 + i] = 100 + i;
    reqs.push_back(r);
    ASSERT_TRUE(node->Serve(r).ok());
  }
  cluster.node(2).Stop();
  uint32_t hits = 0;
  for (const ServeRequest& r : reqs) {
    auto out = node->Serve(r);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(out->tokens, Local(Stories(), r));
    hits += out->pool_action == "fetch";
  }
  EXPECT_GT(hits, 0u);
}

// A valid frame of the same model moved under another prompt's key (as `redis-cli eval
// "redis.call('set',KEYS[2],redis.call('get',KEYS[1]))"` would) is refused by the key it was
// fetched under: a miss, deleted and recomputed, never the other prompt's tokens.
TEST(PoolNode, AValueMovedUnderAnotherPromptsKeyIsAMissNeverItsTokens) {
  auto pool = MakeEmbeddedPool();
  auto node = Node(Stories(), pool.get(), "none");
  const ServeRequest a = Req(Stories(), kStory, 16, 1);
  const ServeRequest b = Req(Stories(), "Tom had a big blue truck. He liked to push it around the garden every day and", 16, 2);
  ASSERT_TRUE(node->Serve(a).ok());
  ASSERT_TRUE(node->Serve(b).ok());
  const std::string key_a0 = UncompressedChunkKey(a, 0), key_b0 = UncompressedChunkKey(b, 0);
  ASSERT_NE(key_a0, key_b0);
  const ByteBuffer moved = pool->Get(key_b0).value().value();
  ASSERT_TRUE(ParseFrame(moved).ok());  // a frame that passes every frame check
  ASSERT_TRUE(pool->Put(key_a0, moved).ok());
  auto r = node->Serve(a);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cached_tokens, 0u);
  EXPECT_EQ(r->tokens, Local(Stories(), a));
  EXPECT_EQ(node->metrics().pool_corrupt.load(), 1u);
  // Stored again under its own key: the next request fetches it.
  auto again = node->Serve(a);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->pool_action, "fetch");
  EXPECT_GT(again->cached_tokens, 0u);
  EXPECT_EQ(again->tokens, Local(Stories(), a));
}

// Values whose part header lies — 2^20 parts of a 2^40-byte value after 1 MiB, or 2,000,000
// parts in 33 bytes — are refused before anything is allocated or fetched for them, deleted, and
// the request recomputes: the node neither aborts nor balloons, and is right after each.
TEST_F(PoolNodeOnRedis, ForgedPartHeadersAreDeletedNotAllocated) {
  const std::string key0 = UncompressedChunkKey(req, 0);
  auto header = [](uint32_t n_parts, uint64_t total) {
    std::string h = "KVSP";
    auto put = [&](const void* p, size_t n) { h.append(static_cast<const char*>(p), n); };
    const uint32_t version = 1, reserved = 0;
    const uint64_t put_id = 7;
    put(&version, 4), put(&n_parts, 4), put(&reserved, 4), put(&total, 8), put(&put_id, 8);
    return h;
  };
  const std::string bombs[] = {header(1u << 20, uint64_t{1} << 40) + std::string(1 << 20, '\0'),
                               header(2000000, 2000000) + "x"};
  const std::string path = ::testing::TempDir() + "/kvserve-bomb-" + std::to_string(::getpid());
  uint64_t corrupt = 0;
  for (const std::string& bomb : bombs) {
    FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(bomb.data(), 1, bomb.size(), f);
    std::fclose(f);
    ASSERT_NE(server->Cli("-x SET '" + key0 + "' < " + path).find("OK"), std::string::npos);
    auto r = node->Serve(req);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->cached_tokens, 0u);
    EXPECT_EQ(r->tokens, local);
    EXPECT_EQ(node->metrics().pool_corrupt.load(), ++corrupt);
    // Deleted, then stored again intact by the recompute: the next request fetches it.
    auto hit = node->Serve(req);
    ASSERT_TRUE(hit.ok()) << hit.status().ToString();
    EXPECT_EQ(hit->pool_action, "fetch");
    EXPECT_EQ(hit->tokens, local);
  }
  std::remove(path.c_str());
}

// A request may name one of the copies this node stores (fetched and stored alone); a strategy
// it cannot code here (lowrank without a calibration store) or one it does not store is a 400,
// as at the prefill node — never silently ignored.
TEST(PoolNode, ARequestsStrategyIsHonouredOrRefused) {
  auto pool = MakeEmbeddedPool();
  auto node = Node(Stories(), pool.get(), "none");
  ServeRequest req = Req(Stories(), kStory, 8);
  req.strategy = "lowrank(rank=4,basis=12)";
  auto low = node->Serve(req);
  ASSERT_FALSE(low.ok());
  EXPECT_EQ(low.status().code(), StatusCode::kInvalidArgument) << low.status().ToString();
  req.strategy = CanonicalStrategy("quant(kbits=4,vbits=4)").value();
  auto other = node->Serve(req);
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.status().message().find("not a copy this pool node stores"), std::string::npos) << other.status().ToString();
  req.strategy = "none";
  ASSERT_TRUE(node->Serve(req).ok());
  auto hit = node->Serve(req);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->pool_action, "fetch");
  EXPECT_EQ(hit->tokens, Local(Stories(), req));
}

}  // namespace
}  // namespace kvserve
