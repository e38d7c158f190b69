// KV pool: key chaining, one conformance suite every backend passes (embedded, Redis, Redis
// Cluster — the Redis servers started here on free loopback ports and stopped after), and the
// backends' failure cases (server down and back, evictions, torn and concurrent writes).
#include <gtest/gtest.h>

#include <future>
#include <random>
#include <set>

#include "kvserve/pool.h"
#include "transfer/redis_test_util.h"

namespace kvserve {
namespace {

using testing::HaveRedis;
using testing::RedisCluster;
using testing::RedisServer;

std::vector<int> Tokens(size_t n, int seed) {
  std::vector<int> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = int((i * 7919 + seed * 104729) % 32000);
  return t;
}

ByteBuffer Bytes(size_t n, uint8_t seed) {
  ByteBuffer b(n);
  for (size_t i = 0; i < n; ++i) b[i] = uint8_t(i * 31 + seed + (i >> 11));
  return b;
}

TEST(PoolKeys, SamePrefixSameKeysOneChangedTokenChangesKeysFromItsChunkOn) {
  PoolKeyOptions o{"model-a", 256};
  const std::vector<int> a = Tokens(1000, 1);
  std::vector<int> b = a;
  b[600] += 1;  // in chunk 2
  const auto ka = PrefixChainHashes(o, a), kb = PrefixChainHashes(o, b);
  ASSERT_EQ(ka.size(), 3u);  // full chunks only: 1000 / 256
  EXPECT_EQ(PrefixChainHashes(o, a), ka);
  EXPECT_EQ(ka[0], kb[0]);
  EXPECT_EQ(ka[1], kb[1]);
  EXPECT_NE(ka[2], kb[2]);
  // A longer prompt with the same start has the same keys for the shared chunks.
  std::vector<int> longer = a;
  longer.resize(1300, 5);
  const auto kl = PrefixChainHashes(o, longer);
  ASSERT_EQ(kl.size(), 5u);
  for (size_t c = 0; c < 3; ++c) EXPECT_EQ(kl[c], ka[c]);
  // Another model or chunk size shares nothing.
  EXPECT_NE(PrefixChainHashes({"model-b", 256}, a)[0], ka[0]);
  EXPECT_NE(PrefixChainHashes({"model-a", 128}, a)[0], ka[0]);
  // The same chunk's tokens after a different first chunk: a different key (it is a chain).
  std::vector<int> c = a;
  c[0] += 1;
  EXPECT_NE(PrefixChainHashes(o, c)[1], ka[1]);
}

TEST(PoolKeys, StrategyAndPlacementShapeTheKey) {
  PoolKeyOptions o{"m", 4};
  const auto chain = PrefixChainHashes(o, Tokens(12, 3));
  EXPECT_NE(PoolChunkKey(o, chain, 1, "none"), PoolChunkKey(o, chain, 1, "quant(k=per_channel,v=per_token,bits=4)"));
  // Prefix placement: every chunk of the prefix carries the first chunk's hash tag.
  const std::string k0 = PoolChunkKey(o, chain, 0, "none"), k2 = PoolChunkKey(o, chain, 2, "none");
  EXPECT_EQ(k0.substr(0, k0.find('}')), k2.substr(0, k2.find('}')));
  o.placement = KeyPlacement::kSpread;
  const std::string s0 = PoolChunkKey(o, chain, 0, "none"), s2 = PoolChunkKey(o, chain, 2, "none");
  EXPECT_NE(s0.substr(0, s0.find('}')), s2.substr(0, s2.find('}')));
}

TEST(PoolUri, UnknownSchemesAreNamed) {
  auto p = MakePool("memcached://x:1");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("memcached://x:1"), std::string::npos);
  auto down = MakePool("redis://127.0.0.1:" + std::to_string(testing::FreePort()));
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(MakePool("embedded").ok());
}

// ---- Conformance: every backend --------------------------------------------------------------
struct Backend {
  std::unique_ptr<RedisServer> redis;
  std::unique_ptr<RedisCluster> cluster;
  std::unique_ptr<KvPool> pool;
};

Backend MakeBackend(const std::string& kind, uint64_t part_bytes = 64 << 10) {
  Backend b;
  if (kind == "embedded") {
    b.pool = MakeEmbeddedPool();
    return b;
  }
  if (!HaveRedis()) return b;
  RedisPoolOptions o;
  if (kind == "redis") {
    b.redis = std::make_unique<RedisServer>();
    o = testing::TestPoolOptions(b.redis->address());
  } else {
    b.cluster = std::make_unique<RedisCluster>(3);
    if (!b.cluster->ok()) return b;
    o = testing::TestPoolOptions(b.cluster->node(0).address(), true);
  }
  o.part_bytes = part_bytes;
  b.pool = MakeRedisPool(o).value();
  return b;
}

class PoolConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    b_ = MakeBackend(GetParam());
    ASSERT_TRUE(b_.pool) << GetParam() << ": no pool — redis-server or redis-cli missing (scripts/setup.sh installs them), "
                            "or the cluster did not form";
  }
  KvPool& pool() { return *b_.pool; }
  Backend b_;
};

TEST_P(PoolConformance, PutGetExistsDeleteRoundTrip) {
  const ByteBuffer small = Bytes(100, 1), big = Bytes(300 << 10, 2), empty;  // big: several parts
  ASSERT_TRUE(pool().Put("kvs:{a}:1", small).ok());
  ASSERT_TRUE(pool().Put("kvs:{a}:2", big).ok());
  ASSERT_TRUE(pool().Put("kvs:{b}:3", empty).ok());
  auto got = pool().GetMany({"kvs:{a}:1", "kvs:{nope}:9", "kvs:{a}:2", "kvs:{b}:3"});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 4u);
  ASSERT_TRUE((*got)[0] && (*got)[2] && (*got)[3]);
  EXPECT_EQ(*(*got)[0], small);
  EXPECT_FALSE((*got)[1]);
  EXPECT_EQ(*(*got)[2], big);
  EXPECT_TRUE((*got)[3]->empty());
  auto ex = pool().ExistsMany({"kvs:{a}:1", "kvs:{nope}:9", "kvs:{a}:2"});
  ASSERT_TRUE(ex.ok());
  EXPECT_EQ(*ex, (std::vector<bool>{true, false, true}));
  // Overwrite with a smaller value, then delete.
  ASSERT_TRUE(pool().Put("kvs:{a}:2", small).ok());
  EXPECT_EQ(*pool().Get("kvs:{a}:2").value(), small);
  ASSERT_TRUE(pool().Delete("kvs:{a}:2").ok());
  EXPECT_FALSE(pool().Get("kvs:{a}:2").value());
  EXPECT_TRUE(pool().Delete("kvs:{never}:0").ok());  // deleting nothing is not an error
  auto st = pool().Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_GE(st->puts, 4u);
  EXPECT_GE(st->hits, 4u);
  EXPECT_GE(st->misses, 2u);
  ASSERT_TRUE(pool().Clear().ok());
  EXPECT_FALSE(pool().Get("kvs:{a}:1").value());
}

TEST_P(PoolConformance, ConcurrentWritersOfOneKeyLeaveOneWholeValueAndNoTornReads) {
  // Writers alternate two values of several parts; every read is one of them whole, or a miss.
  const ByteBuffer v1 = Bytes(200 << 10, 7), v2 = Bytes(200 << 10, 99);
  const std::string key = "kvs:{race}:k";
  std::atomic<bool> stop{false};
  std::atomic<int> torn{0}, reads{0};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < 40 && !stop; ++i) EXPECT_TRUE(pool().Put(key, (i + w) % 2 ? v1 : v2).ok());
    });
  }
  std::thread reader([&] {
    for (int i = 0; i < 80; ++i) {
      auto g = pool().Get(key);
      ASSERT_TRUE(g.ok());
      if (!g.value()) continue;
      reads++;
      if (*g.value() != v1 && *g.value() != v2) torn++;
    }
  });
  for (auto& t : writers) t.join();
  stop = true;
  reader.join();
  EXPECT_EQ(torn.load(), 0);
  auto last = pool().Get(key);
  ASSERT_TRUE(last.ok() && last.value());
  EXPECT_TRUE(*last.value() == v1 || *last.value() == v2);
}

TEST_P(PoolConformance, ManyKeysInOneBatchComeBackInOrder) {
  std::vector<std::string> keys;
  for (int i = 0; i < 64; ++i) {
    keys.push_back("kvs:{k" + std::to_string(i % 7) + "}:" + std::to_string(i));
    ASSERT_TRUE(pool().Put(keys.back(), Bytes(1000 + i, uint8_t(i))).ok());
  }
  auto got = pool().GetMany(keys);
  ASSERT_TRUE(got.ok());
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE((*got)[i]) << i;
    EXPECT_EQ(*(*got)[i], Bytes(1000 + i, uint8_t(i))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PoolConformance, ::testing::Values("embedded", "redis", "redis_cluster"),
                         [](const auto& info) { return info.param; });

// ---- Backend-specific failure cases ----------------------------------------------------------
TEST(EmbeddedPool, EvictsLeastRecentlyUsedBeyondCapacityAndCountsIt) {
  auto pool = MakeEmbeddedPool({.capacity_bytes = 3000});
  ASSERT_TRUE(pool->Put("a", Bytes(1000, 1)).ok());
  ASSERT_TRUE(pool->Put("b", Bytes(1000, 2)).ok());
  ASSERT_TRUE(pool->Put("c", Bytes(1000, 3)).ok());
  ASSERT_TRUE(pool->Get("a").value());  // a is now the most recent
  ASSERT_TRUE(pool->Put("d", Bytes(1000, 4)).ok());
  EXPECT_TRUE(pool->Get("a").value());
  EXPECT_FALSE(pool->Get("b").value());  // the least recently used went
  EXPECT_TRUE(pool->Get("d").value());
  const PoolStats s = pool->Stats().value();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.entries, 3u);
  EXPECT_EQ(s.bytes, 3000u);
  auto huge = pool->Put("e", Bytes(5000, 5));
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.message().find("capacity"), std::string::npos);
}

TEST(RedisPool, ServerDownIsAnErrorNotAHangAndThePoolReconnectsWhenItReturns) {
  ASSERT_TRUE(HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
  RedisServer server;
  auto pool = MakeRedisPool(testing::TestPoolOptions(server.address())).value();
  ASSERT_TRUE(pool->Put("kvs:{x}:1", Bytes(5000, 1)).ok());
  server.Stop();
  const auto t0 = std::chrono::steady_clock::now();
  auto g = pool->Get("kvs:{x}:1");
  EXPECT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kUnavailable);
  EXPECT_FALSE(pool->Put("kvs:{x}:2", Bytes(10, 1)).ok());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 3.0);
  ASSERT_TRUE(server.Start());
  bool back = false;
  for (int i = 0; i < 100 && !back; ++i) {
    back = pool->Put("kvs:{x}:3", Bytes(10, 3)).ok();
    if (!back) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(back);
  EXPECT_EQ(*pool->Get("kvs:{x}:3").value(), Bytes(10, 3));
  EXPECT_FALSE(pool->Get("kvs:{x}:1").value());  // a restarted server without persistence is empty
  EXPECT_GE(pool->Stats().value().reconnects, 1u);
}

TEST(RedisPool, AnEvictedPartIsAMissNeverAShortValue) {
  ASSERT_TRUE(HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
  RedisServer server;
  RedisPoolOptions o = testing::TestPoolOptions(server.address());
  o.part_bytes = 16 << 10;
  auto pool = MakeRedisPool(o).value();
  ASSERT_TRUE(pool->Put("kvs:{p}:v", Bytes(100 << 10, 4)).ok());
  server.Cli("DEL 'kvs:{p}:v#3'");  // as if the server evicted one part
  auto g = pool->Get("kvs:{p}:v");
  ASSERT_TRUE(g.ok());
  EXPECT_FALSE(g.value());
}

TEST(RedisPool, ServerSideLruEvictionsAreCounted) {
  ASSERT_TRUE(HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
  RedisServer server({"--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"});
  auto pool = MakeRedisPool(testing::TestPoolOptions(server.address())).value();
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(pool->Put("kvs:{e}:" + std::to_string(i), Bytes(256 << 10, uint8_t(i))).ok());
  const PoolStats s = pool->Stats().value();
  EXPECT_GT(s.evictions, 0u);
  EXPECT_LT(s.entries, 40u);
  // Whatever survived is whole.
  for (int i = 0; i < 40; ++i) {
    auto g = pool->Get("kvs:{e}:" + std::to_string(i)).value();
    if (g) EXPECT_EQ(*g, Bytes(256 << 10, uint8_t(i)));
  }
}

TEST(RedisClusterPool, KeysSpreadOverNodesAndAKilledNodeOnlyLosesItsSlots) {
  ASSERT_TRUE(HaveRedis()) << "redis-server is not installed (scripts/setup.sh installs it)";
  RedisCluster cluster(3);
  ASSERT_TRUE(cluster.ok()) << "redis-cli --cluster create failed";
  auto pool = MakeRedisPool(testing::TestPoolOptions(cluster.node(0).address(), true)).value();
  std::vector<std::string> keys;
  for (int i = 0; i < 60; ++i) {
    keys.push_back("kvs:{t" + std::to_string(i) + "}:x");
    ASSERT_TRUE(pool->Put(keys.back(), Bytes(2000, uint8_t(i))).ok());
  }
  // Every node holds some of them.
  for (size_t n = 0; n < cluster.size(); ++n) EXPECT_NE(cluster.node(n).Cli("DBSIZE"), "0\n") << n;
  EXPECT_EQ(pool->Stats().value().entries, 60u);
  cluster.node(1).Stop();
  size_t found = 0, failed = 0;
  for (int i = 0; i < 60; ++i) {
    auto g = pool->Get(keys[i]);
    if (!g.ok()) {
      failed++;  // the dead node's slots: an error the serving path treats as a miss
      continue;
    }
    ASSERT_TRUE(g.value()) << keys[i];
    EXPECT_EQ(*g.value(), Bytes(2000, uint8_t(i)));
    found++;
  }
  EXPECT_GT(found, 20u);
  EXPECT_GT(failed, 5u);
}

}  // namespace
}  // namespace kvserve
