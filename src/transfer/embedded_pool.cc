// Embedded pool: values in this process's memory, least recently used evicted beyond capacity.
// The default backend — the README's main job and tests need no server.
#include <list>
#include <mutex>
#include <unordered_map>

#include "kvserve/pool.h"

namespace kvserve {
namespace {

class EmbeddedPool final : public KvPool {
 public:
  explicit EmbeddedPool(EmbeddedPoolOptions o) : o_(o) {}
  std::string name() const override { return "embedded"; }

  Status Put(const std::string& key, std::span<const uint8_t> value) override {
    if (value.size() > o_.capacity_bytes) {
      return Status::OutOfRange("value of " + std::to_string(value.size()) + " bytes for '" + key +
                                "' exceeds the pool capacity of " + std::to_string(o_.capacity_bytes));
    }
    // The copy is made outside the lock; a concurrent writer of the same key replaces it whole.
    auto v = std::make_shared<const ByteBuffer>(CopyBytes(value.data(), value.size()));
    std::lock_guard<std::mutex> lock(mu_);
    stats_.puts++;
    Erase(key);
    lru_.push_front(key);
    map_[key] = {std::move(v), lru_.begin()};
    bytes_ += value.size();
    while (bytes_ > o_.capacity_bytes && !lru_.empty()) {
      Erase(lru_.back());
      stats_.evictions++;
    }
    return Status::Ok();
  }

  using KvPool::GetMany;
  Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys,
                                                          uint64_t max_value_bytes) override {
    std::vector<std::shared_ptr<const ByteBuffer>> found(keys.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        stats_.gets++;
        auto it = map_.find(keys[i]);
        if (it == map_.end()) {
          stats_.misses++;
          continue;
        }
        if (it->second.value->size() > max_value_bytes) {
          return Status::Corrupt("pool value '" + keys[i] + "' holds " + std::to_string(it->second.value->size()) +
                                 " bytes, above the " + std::to_string(max_value_bytes) + " a value here may have");
        }
        stats_.hits++;
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        found[i] = it->second.value;
      }
    }
    // Copies outside the lock: values are immutable once stored, and shared until copied.
    std::vector<std::optional<ByteBuffer>> out(keys.size());
    for (size_t i = 0; i < keys.size(); ++i)
      if (found[i]) out[i] = CopyBytes(found[i]->data(), found[i]->size());
    return out;
  }

  Result<std::vector<bool>> ExistsMany(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<bool> out;
    for (const std::string& k : keys) out.push_back(map_.count(k) > 0);
    return out;
  }

  Status Delete(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.deletes++;
    Erase(key);
    return Status::Ok();
  }

  Result<PoolStats> Stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    PoolStats s = stats_;
    s.bytes = bytes_;
    s.entries = map_.size();
    return s;
  }

  Status Clear() override {
    std::lock_guard<std::mutex> lock(mu_);
    map_.clear();
    lru_.clear();
    bytes_ = 0;
    return Status::Ok();
  }

 private:
  struct Entry {
    std::shared_ptr<const ByteBuffer> value;
    std::list<std::string>::iterator lru;
  };
  void Erase(const std::string& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return;
    bytes_ -= it->second.value->size();
    lru_.erase(it->second.lru);
    map_.erase(it);
  }
  EmbeddedPoolOptions o_;
  std::mutex mu_;
  std::list<std::string> lru_;  // most recently used first
  std::unordered_map<std::string, Entry> map_;
  uint64_t bytes_ = 0;
  PoolStats stats_;
};

}  // namespace

std::unique_ptr<KvPool> MakeEmbeddedPool(EmbeddedPoolOptions o) { return std::make_unique<EmbeddedPool>(o); }

}  // namespace kvserve
