// KV pool: compressed prefix KV stored in chunks of a prompt's tokens, found again by a hash
// chain over the model and the tokens, so a request with a shared prefix fetches instead of
// recomputing. Backends: embedded (in process, LRU), Redis, Redis Cluster (hiredis).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"

namespace kvserve {

// ---- Keys ---------------------------------------------------------------------------------------
// Chunk c covers tokens [c * chunk_tokens, (c + 1) * chunk_tokens). Its chain hash is
// H(chain[c-1], tokens of chunk c), with chain[-1] = H(model id, chunk_tokens): two prompts
// share chunk c's key exactly when they share the model and every token up to its end. The
// key adds the strategy (each stored copy is its own value) and a Redis Cluster hash tag.
enum class KeyPlacement : uint8_t {
  kPrefix = 0,  // tag = chain[0]: every chunk of a prefix in one slot (one node, one round trip)
  kSpread = 1,  // tag = chain[c]: chunks spread over the cluster's slots
};
struct PoolKeyOptions {
  std::string model_id;  // the weights' checksum (LlamaModel::sha256) or a synthetic shape's name
  uint32_t chunk_tokens = kDefaultChunkTokens;
  KeyPlacement placement = KeyPlacement::kPrefix;
};
// Chain hashes (32 hex digits each) of the full chunks of `tokens`.
std::vector<std::string> PrefixChainHashes(const PoolKeyOptions& o, std::span<const int> tokens);
// "kvs:{TAG}:CHAIN:STRATEGYHASH" for chunk `chunk` of `chain` stored with canonical `strategy`.
std::string PoolChunkKey(const PoolKeyOptions& o, const std::vector<std::string>& chain, size_t chunk,
                         const std::string& strategy);
// What a value stored under `key` carries in its frame's request id (XXH3-64 of the key): the
// fetch checks it, so a valid frame copied or moved under another key is a miss, never KV of
// other tokens.
uint64_t PoolValueTag(const std::string& key);

// ---- Backends -----------------------------------------------------------------------------------
struct PoolStats {
  uint64_t puts = 0, gets = 0, hits = 0, misses = 0, deletes = 0;
  uint64_t evictions = 0;      // values dropped for capacity (Redis: the server's evicted_keys)
  uint64_t bytes = 0, entries = 0;  // held now (Redis: used_memory and dbsize)
  uint64_t errors = 0;         // backend failures (connection lost, timeouts)
  uint64_t reconnects = 0;
};

// Values are opaque bytes (kvserve frames, checksummed, in the serving path). A miss is an empty
// optional; an error is a backend that could not answer (down, timed out) — callers treat it as
// a miss and go on. Thread-safe: every backend may be called from any number of threads.
class KvPool {
 public:
  virtual ~KvPool() = default;
  virtual std::string name() const = 0;
  virtual Status Put(const std::string& key, std::span<const uint8_t> value) = 0;
  // Pipelined: one round trip per backend node for the whole batch where the backend allows.
  // A value longer than max_value_bytes (the largest a caller's values can be), or whose stored
  // header claims so, is kCorrupt naming its key — found before anything is allocated or
  // fetched for it, so a forged value cannot make a reader allocate what it claims.
  virtual Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys,
                                                                  uint64_t max_value_bytes) = 0;
  Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys) {
    return GetMany(keys, kAnyValueBytes);
  }
  virtual Result<std::vector<bool>> ExistsMany(const std::vector<std::string>& keys) = 0;
  virtual Status Delete(const std::string& key) = 0;
  virtual Result<PoolStats> Stats() = 0;
  // Drops every value (tests and benchmarks start from an empty pool).
  virtual Status Clear() = 0;

  Result<std::optional<ByteBuffer>> Get(const std::string& key, uint64_t max_value_bytes = kAnyValueBytes);

  static constexpr uint64_t kAnyValueBytes = uint64_t{1} << 40;
};

struct EmbeddedPoolOptions {
  uint64_t capacity_bytes = uint64_t{8} << 30;  // least recently used values go first beyond it
};
std::unique_ptr<KvPool> MakeEmbeddedPool(EmbeddedPoolOptions o = {});

struct RedisPoolOptions {
  // "host:port" of the server (Redis) or of any node (Redis Cluster, which learns the others).
  std::string address = "127.0.0.1:6379";
  bool cluster = false;
  double timeout_s = 2;                        // connect and per-command
  uint64_t part_bytes = uint64_t{4} << 20;     // values above are split into parts of this size
  uint32_t connections = 4;                    // per node; concurrent callers beyond wait
  double reconnect_backoff_s = 0.5;            // after a failure, calls fail fast for this long
};
Result<std::unique_ptr<KvPool>> MakeRedisPool(RedisPoolOptions o);

// "embedded", "redis://host:port" or "redis-cluster://host:port"; errors name the text.
Result<std::unique_ptr<KvPool>> MakePool(const std::string& uri, uint64_t embedded_capacity_bytes = uint64_t{8} << 30);

}  // namespace kvserve
