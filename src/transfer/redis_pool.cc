// Redis and Redis Cluster pools over hiredis: pipelined batches, values split into parts below
// a size, a pool of connections per node with timeouts and reconnect after a back-off, and
// cluster routing by key slot (CRC16 of the hash tag) with the slot map refreshed on MOVED.
#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "kvserve/pool.h"
#include "kvserve/transport.h"

namespace kvserve {
namespace {

// A value's first part starts with this header; parts 1.. (key "#i") start with the put id, so
// a reader that meets parts of two different writes knows and retries.
constexpr char kPartMagic[4] = {'K', 'V', 'S', 'P'};
constexpr uint32_t kPartVersion = 1;
constexpr size_t kHeadBytes = 32;  // magic, version, n_parts, reserved, total bytes, put id
constexpr size_t kPartIdBytes = 8;
constexpr uint64_t kMinPartBytes = 1024;
// A head whose header claims more parts is not read for its part names on Delete: its parts
// beyond are left to the server's eviction rather than spending a command on a million names.
constexpr uint32_t kMaxDeleteParts = 1 << 16;

void PutU32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
void PutU64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint32_t GetU32(const char* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }
uint64_t GetU64(const char* p) { uint64_t v; std::memcpy(&v, p, 8); return v; }

// CRC16-CCITT (XMODEM), the key-slot hash of the Redis Cluster specification.
uint16_t Crc16(const char* p, size_t n) {
  uint16_t crc = 0;
  for (size_t i = 0; i < n; ++i) {
    crc ^= uint16_t(uint8_t(p[i])) << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? uint16_t((crc << 1) ^ 0x1021) : uint16_t(crc << 1);
  }
  return crc;
}

uint16_t KeySlot(const std::string& key) {
  const size_t open = key.find('{');
  if (open != std::string::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string::npos && close > open + 1) return Crc16(key.data() + open + 1, close - open - 1) & 16383;
  }
  return Crc16(key.data(), key.size()) & 16383;
}

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

// One command: its arguments (views into caller memory that outlives the call).
struct Command {
  std::vector<const char*> argv;
  std::vector<size_t> len;
  Command& Arg(std::string_view s) {
    argv.push_back(s.data());
    len.push_back(s.size());
    return *this;
  }
};

timeval Tv(double s) {
  timeval tv;
  tv.tv_sec = long(s);
  tv.tv_usec = long((s - double(tv.tv_sec)) * 1e6);
  return tv;
}

// Connections to one server, reused across calls; a failed connection is dropped, and after a
// failure the node refuses calls for the back-off instead of making every caller wait for a
// timeout on a server that is down.
class Node {
 public:
  Node(std::string host, int port, const RedisPoolOptions& o) : host_(std::move(host)), port_(port), o_(o) {}
  ~Node() {
    for (redisContext* c : idle_) redisFree(c);
  }
  std::string address() const { return host_ + ":" + std::to_string(port_); }

  // Sends `cmds` pipelined and collects one reply per command.
  Status Run(const std::vector<Command>& cmds, std::vector<Reply>* replies) {
    replies->clear();
    KV_ASSIGN_OR_RETURN(redisContext * c, Acquire());
    for (const Command& cmd : cmds) redisAppendCommandArgv(c, int(cmd.argv.size()), const_cast<const char**>(cmd.argv.data()), cmd.len.data());
    for (size_t i = 0; i < cmds.size(); ++i) {
      void* r = nullptr;
      if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) {
        const std::string why = c->errstr[0] ? c->errstr : "no reply";
        Release(c, false);
        return Status::Unavailable("redis " + address() + ": " + why);
      }
      replies->emplace_back(static_cast<redisReply*>(r));
    }
    Release(c, true);
    return Status::Ok();
  }
  uint64_t reconnects() const { return reconnects_; }

 private:
  Result<redisContext*> Acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto now = Clock::now();
    if (now < down_until_) return Status::Unavailable("redis " + address() + " is down (retrying after a back-off)");
    cv_.wait(lock, [&] { return !idle_.empty() || open_ < o_.connections; });
    if (!idle_.empty()) {
      redisContext* c = idle_.back();
      idle_.pop_back();
      return c;
    }
    open_++;
    const bool had_failed = failed_before_;
    lock.unlock();
    redisContext* c = redisConnectWithTimeout(host_.c_str(), port_, Tv(o_.timeout_s));
    if (c == nullptr || c->err) {
      const std::string why = c ? c->errstr : "out of memory";
      if (c) redisFree(c);
      lock.lock();
      open_--;
      failed_before_ = true;
      down_until_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.reconnect_backoff_s));
      cv_.notify_one();
      return Status::Unavailable("cannot connect to redis " + address() + ": " + why);
    }
    redisSetTimeout(c, Tv(o_.timeout_s));
    if (had_failed) {
      // The first connection after a failure is the reconnect; later ones are the pool growing.
      lock.lock();
      if (failed_before_) reconnects_++, failed_before_ = false;
    }
    return c;
  }
  void Release(redisContext* c, bool healthy) {
    std::lock_guard<std::mutex> lock(mu_);
    if (healthy) {
      idle_.push_back(c);
    } else {
      redisFree(c);
      open_--;
      failed_before_ = true;
      down_until_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o_.reconnect_backoff_s));
    }
    cv_.notify_one();
  }
  std::string host_;
  int port_;
  RedisPoolOptions o_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<redisContext*> idle_;
  uint32_t open_ = 0;
  bool failed_before_ = false;
  Clock::time_point down_until_{};
  std::atomic<uint64_t> reconnects_{0};
};

std::string ReplyError(const Reply& r) { return std::string(r->str, r->len); }

class RedisPool final : public KvPool {
 public:
  explicit RedisPool(RedisPoolOptions o) : o_(std::move(o)), rng_(std::random_device{}()) {}

  Status Init() {
    std::string host;
    uint16_t port = 0;
    KV_RETURN_IF_ERROR(ParseHostPort(o_.address, &host, &port));
    seed_ = NodeFor(host, port);
    if (o_.cluster) return RefreshSlots();
    std::vector<Reply> r;
    KV_RETURN_IF_ERROR(seed_->Run({Command().Arg("PING")}, &r));
    if (r[0]->type == REDIS_REPLY_ERROR) return Status::Unavailable("redis " + o_.address + ": " + ReplyError(r[0]));
    return Status::Ok();
  }

  std::string name() const override { return o_.cluster ? "redis-cluster" : "redis"; }

  Status Put(const std::string& key, std::span<const uint8_t> value) override {
    const uint64_t part = std::max<uint64_t>(kMinPartBytes, o_.part_bytes);
    const uint32_t n_parts = uint32_t(std::max<uint64_t>(1, (value.size() + part - 1) / part));
    uint64_t put_id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      put_id = rng_();
    }
    // Every part's bytes, prefixed, in memory the commands point into.
    std::vector<std::string> keys(n_parts);
    std::vector<ByteBuffer> bodies(n_parts);
    for (uint32_t i = 0; i < n_parts; ++i) {
      const size_t begin = size_t(i) * part, end = std::min<size_t>(value.size(), begin + part);
      const size_t pre = i == 0 ? kHeadBytes : kPartIdBytes;
      bodies[i].resize(pre + (end - begin));
      uint8_t* p = bodies[i].data();
      if (i == 0) {
        std::memcpy(p, kPartMagic, 4);
        PutU32(p + 4, kPartVersion);
        PutU32(p + 8, n_parts);
        PutU32(p + 12, 0);
        PutU64(p + 16, value.size());
        PutU64(p + 24, put_id);
      } else {
        PutU64(p, put_id);
      }
      if (end > begin) std::memcpy(p + pre, value.data() + begin, end - begin);
      keys[i] = i == 0 ? key : key + "#" + std::to_string(i);
    }
    // One transaction: parts first, the head last, so no reader sees a head before its parts.
    std::vector<Command> cmds;
    cmds.push_back(Command().Arg("MULTI"));
    for (uint32_t i = n_parts; i-- > 0;) {
      cmds.push_back(Command().Arg("SET").Arg(keys[i]).Arg({reinterpret_cast<const char*>(bodies[i].data()), bodies[i].size()}));
    }
    cmds.push_back(Command().Arg("EXEC"));
    std::vector<Reply> r;
    KV_RETURN_IF_ERROR(Run(key, cmds, &r));
    const Reply& exec = r.back();
    if (exec->type != REDIS_REPLY_ARRAY) {
      errors_++;
      return Status::Unavailable("redis refused SET of '" + key + "': " +
                                 (exec->type == REDIS_REPLY_ERROR ? ReplyError(exec) : std::string("transaction aborted")));
    }
    for (size_t i = 0; i < exec->elements; ++i) {
      if (exec->element[i]->type == REDIS_REPLY_ERROR) {
        errors_++;
        return Status::Unavailable("redis refused SET of '" + key + "': " + std::string(exec->element[i]->str, exec->element[i]->len));
      }
    }
    puts_++;
    return Status::Ok();
  }

  using KvPool::GetMany;
  Result<std::vector<std::optional<ByteBuffer>>> GetMany(const std::vector<std::string>& keys,
                                                          uint64_t max_value_bytes) override {
    std::vector<std::optional<ByteBuffer>> out(keys.size());
    std::vector<Command> heads;
    for (const std::string& k : keys) heads.push_back(Command().Arg("GET").Arg(k));
    KV_ASSIGN_OR_RETURN(std::vector<Reply> hr, RunGrouped(keys, heads));
    gets_ += keys.size();
    for (size_t i = 0; i < keys.size(); ++i) {
      KV_ASSIGN_OR_RETURN(out[i], Assemble(keys[i], hr[i], max_value_bytes));
      (out[i] ? hits_ : misses_)++;
    }
    return out;
  }

  Result<std::vector<bool>> ExistsMany(const std::vector<std::string>& keys) override {
    std::vector<Command> cmds;
    for (const std::string& k : keys) cmds.push_back(Command().Arg("EXISTS").Arg(k));
    KV_ASSIGN_OR_RETURN(std::vector<Reply> r, RunGrouped(keys, cmds));
    std::vector<bool> out;
    for (const Reply& x : r) out.push_back(x->type == REDIS_REPLY_INTEGER && x->integer > 0);
    return out;
  }

  Status Delete(const std::string& key) override {
    std::vector<Reply> r;
    // Only the head's header says how many parts there are: read those bytes, not the value.
    const std::string last = std::to_string(kHeadBytes - 1);
    KV_RETURN_IF_ERROR(Run(key, {Command().Arg("GETRANGE").Arg(key).Arg("0").Arg(last)}, &r));
    uint32_t n_parts = 1;
    if (r[0]->type == REDIS_REPLY_STRING && r[0]->len >= kHeadBytes && std::memcmp(r[0]->str, kPartMagic, 4) == 0) {
      n_parts = std::min<uint32_t>(GetU32(r[0]->str + 8), kMaxDeleteParts);
    }
    std::vector<std::string> names = {key};
    for (uint32_t i = 1; i < n_parts; ++i) names.push_back(key + "#" + std::to_string(i));
    Command del;
    del.Arg("DEL");
    for (const std::string& n : names) del.Arg(n);
    KV_RETURN_IF_ERROR(Run(key, {del}, &r));
    deletes_++;
    return Status::Ok();
  }

  Result<PoolStats> Stats() override {
    PoolStats s;
    s.puts = puts_, s.gets = gets_, s.hits = hits_, s.misses = misses_, s.deletes = deletes_, s.errors = errors_;
    KV_ASSIGN_OR_RETURN(std::vector<Node*> nodes, Masters());
    for (Node* n : nodes) {
      std::vector<Reply> r;
      KV_RETURN_IF_ERROR(Call(n, {Command().Arg("INFO").Arg("all"), Command().Arg("DBSIZE")}, &r));
      if (r[0]->type == REDIS_REPLY_STRING) {
        const std::string info(r[0]->str, r[0]->len);
        s.evictions += InfoField(info, "evicted_keys");
        s.bytes += InfoField(info, "used_memory");
      }
      if (r[1]->type == REDIS_REPLY_INTEGER) s.entries += uint64_t(r[1]->integer);
      s.reconnects += n->reconnects();
    }
    return s;
  }

  Status Clear() override {
    KV_ASSIGN_OR_RETURN(std::vector<Node*> nodes, Masters());
    for (Node* n : nodes) {
      std::vector<Reply> r;
      KV_RETURN_IF_ERROR(Call(n, {Command().Arg("FLUSHALL")}, &r));
    }
    return Status::Ok();
  }

 private:
  static uint64_t InfoField(const std::string& info, const std::string& field) {
    const size_t at = info.find("\n" + field + ":");
    return at == std::string::npos ? 0 : std::strtoull(info.c_str() + at + field.size() + 2, nullptr, 10);
  }

  // The value behind a head reply, reading its other parts; a missing or torn part is a miss.
  // The head's claims (parts, total) are checked against max_value_bytes and the smallest part
  // a writer makes before any part is fetched or any byte reserved.
  Result<std::optional<ByteBuffer>> Assemble(const std::string& key, const Reply& head, uint64_t max_value_bytes) {
    if (head->type == REDIS_REPLY_NIL) return std::optional<ByteBuffer>();
    if (head->type == REDIS_REPLY_ERROR) return Status::Unavailable("redis GET '" + key + "': " + ReplyError(head));
    if (head->type != REDIS_REPLY_STRING || head->len < kHeadBytes || std::memcmp(head->str, kPartMagic, 4) != 0 ||
        GetU32(head->str + 4) != kPartVersion) {
      return Status::Corrupt("pool value '" + key + "' is not a kvserve value (bad part header)");
    }
    const uint32_t n_parts = GetU32(head->str + 8);
    const uint64_t total = GetU64(head->str + 16), put_id = GetU64(head->str + 24);
    const uint64_t part = head->len - kHeadBytes;
    if (total > max_value_bytes) {
      return Status::Corrupt("pool value '" + key + "' claims " + std::to_string(total) + " bytes, above the " +
                             std::to_string(max_value_bytes) + " a value here may have");
    }
    // Put() cuts parts of at least kMinPartBytes (all but the last of equal size), so a header
    // claiming many tiny parts was not written by it.
    const bool parts_fit = n_parts == 1 ? part == total
                                        : part >= kMinPartBytes && part * (n_parts - 1) < total && total <= part * n_parts;
    if (n_parts == 0 || !parts_fit) {
      return Status::Corrupt("pool value '" + key + "' has an impossible part header (" + std::to_string(n_parts) +
                             " parts, " + std::to_string(total) + " bytes, a first part of " + std::to_string(part) + ")");
    }
    ByteBuffer v;
    v.reserve(total);
    v.insert(v.end(), head->str + kHeadBytes, head->str + head->len);
    if (n_parts > 1) {
      std::vector<std::string> names;
      Command mget;
      mget.Arg("MGET");
      for (uint32_t i = 1; i < n_parts; ++i) names.push_back(key + "#" + std::to_string(i));
      for (const std::string& n : names) mget.Arg(n);
      std::vector<Reply> r;
      KV_RETURN_IF_ERROR(Run(key, {mget}, &r));
      if (r[0]->type != REDIS_REPLY_ARRAY || r[0]->elements != n_parts - 1) {
        return Status::Unavailable("redis MGET of the parts of '" + key + "' failed");
      }
      for (size_t i = 0; i < r[0]->elements; ++i) {
        const redisReply* p = r[0]->element[i];
        // A part evicted, or written by another put since the head was read: not this value.
        if (p->type != REDIS_REPLY_STRING || p->len < kPartIdBytes || GetU64(p->str) != put_id) return std::optional<ByteBuffer>();
        v.insert(v.end(), p->str + kPartIdBytes, p->str + p->len);
      }
    }
    if (v.size() != total) return std::optional<ByteBuffer>();
    return std::optional<ByteBuffer>(std::move(v));
  }

  Node* NodeFor(const std::string& host, int port) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string addr = host + ":" + std::to_string(port);
    auto& n = nodes_[addr];
    if (!n) n = std::make_unique<Node>(host, port, o_);
    return n.get();
  }

  Status Call(Node* n, const std::vector<Command>& cmds, std::vector<Reply>* r) {
    Status st = n->Run(cmds, r);
    if (!st.ok()) errors_++;
    return st;
  }

  // Learns which node serves each slot (CLUSTER SLOTS), from the seed or any known node.
  Status RefreshSlots() {
    std::vector<Node*> tries = {seed_};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [a, n] : nodes_) if (n.get() != seed_) tries.push_back(n.get());
    }
    Status last = Status::Unavailable("no redis cluster node to ask for slots");
    for (Node* n : tries) {
      std::vector<Reply> r;
      last = Call(n, {Command().Arg("CLUSTER").Arg("SLOTS")}, &r);
      if (!last.ok()) continue;
      if (r[0]->type != REDIS_REPLY_ARRAY) {
        last = Status::Unavailable("redis " + n->address() + " is not a cluster node: " +
                                   (r[0]->type == REDIS_REPLY_ERROR ? ReplyError(r[0]) : std::string("bad CLUSTER SLOTS reply")));
        continue;
      }
      std::vector<Node*> slots(16384, nullptr);
      for (size_t i = 0; i < r[0]->elements; ++i) {
        const redisReply* e = r[0]->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[2]->type != REDIS_REPLY_ARRAY ||
            e->element[2]->elements < 2) continue;
        const long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const redisReply* m = e->element[2];
        Node* owner = NodeFor(std::string(m->element[0]->str, m->element[0]->len), int(m->element[1]->integer));
        for (long long s = std::max(0LL, lo); s <= std::min(16383LL, hi); ++s) slots[size_t(s)] = owner;
      }
      std::lock_guard<std::mutex> lock(mu_);
      slots_ = std::move(slots);
      return Status::Ok();
    }
    return last;
  }

  Node* Owner(const std::string& key) {
    if (!o_.cluster) return seed_;
    std::lock_guard<std::mutex> lock(mu_);
    Node* n = slots_.empty() ? nullptr : slots_[KeySlot(key)];
    return n ? n : seed_;
  }

  Result<std::vector<Node*>> Masters() {
    if (!o_.cluster) return std::vector<Node*>{seed_};
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Node*> out;
    for (Node* n : slots_)
      if (n && std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
    if (out.empty()) out.push_back(seed_);
    return out;
  }

  static bool Moved(const std::vector<Reply>& r) {
    for (const Reply& x : r) {
      if (x->type == REDIS_REPLY_ERROR && (std::strncmp(x->str, "MOVED", 5) == 0 || std::strncmp(x->str, "ASK", 3) == 0)) return true;
      if (x->type == REDIS_REPLY_ERROR && std::strncmp(x->str, "EXECABORT", 9) == 0) return true;
    }
    return false;
  }

  // Commands that all touch `key`'s slot, on its node; once more after a slot-map refresh when
  // the cluster says the slot moved.
  Status Run(const std::string& key, const std::vector<Command>& cmds, std::vector<Reply>* r) {
    KV_RETURN_IF_ERROR(Call(Owner(key), cmds, r));
    if (!o_.cluster || !Moved(*r)) return Status::Ok();
    KV_RETURN_IF_ERROR(RefreshSlots());
    return Call(Owner(key), cmds, r);
  }

  // One command per key, pipelined per owning node; replies in the keys' order.
  Result<std::vector<Reply>> RunGrouped(const std::vector<std::string>& keys, const std::vector<Command>& cmds) {
    std::vector<Reply> out(keys.size());
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::map<Node*, std::vector<size_t>> by_node;
      for (size_t i = 0; i < keys.size(); ++i)
        if (!out[i]) by_node[Owner(keys[i])].push_back(i);
      bool moved = false;
      for (auto& [node, idx] : by_node) {
        std::vector<Command> batch;
        for (size_t i : idx) batch.push_back(cmds[i]);
        std::vector<Reply> r;
        KV_RETURN_IF_ERROR(Call(node, batch, &r));
        for (size_t j = 0; j < idx.size(); ++j) {
          const bool m = o_.cluster && r[j]->type == REDIS_REPLY_ERROR &&
                         (std::strncmp(r[j]->str, "MOVED", 5) == 0 || std::strncmp(r[j]->str, "ASK", 3) == 0);
          if (m) {
            moved = true;
          } else {
            out[idx[j]] = std::move(r[j]);
          }
        }
      }
      if (!moved) return out;
      KV_RETURN_IF_ERROR(RefreshSlots());
    }
    for (size_t i = 0; i < keys.size(); ++i)
      if (!out[i]) return Status::Unavailable("redis cluster kept moving the slot of '" + keys[i] + "'");
    return out;
  }

  RedisPoolOptions o_;
  std::mutex mu_;  // nodes_, slots_, rng_
  std::mt19937_64 rng_;
  std::map<std::string, std::unique_ptr<Node>> nodes_;
  std::vector<Node*> slots_;
  Node* seed_ = nullptr;
  std::atomic<uint64_t> puts_{0}, gets_{0}, hits_{0}, misses_{0}, deletes_{0}, errors_{0};
};

}  // namespace

Result<std::unique_ptr<KvPool>> MakeRedisPool(RedisPoolOptions o) {
  if (!(o.timeout_s > 0)) return Status::InvalidArgument("redis timeout_s must be positive");
  if (o.connections == 0) return Status::InvalidArgument("redis connections must be at least 1");
  auto p = std::make_unique<RedisPool>(std::move(o));
  KV_RETURN_IF_ERROR(p->Init());
  return std::unique_ptr<KvPool>(std::move(p));
}

Result<std::unique_ptr<KvPool>> MakePool(const std::string& uri, uint64_t embedded_capacity_bytes) {
  if (uri == "embedded") return MakeEmbeddedPool({.capacity_bytes = embedded_capacity_bytes});
  for (const auto& [scheme, cluster] : {std::pair<std::string, bool>{"redis://", false}, {"redis-cluster://", true}}) {
    if (uri.rfind(scheme, 0) == 0) {
      RedisPoolOptions o;
      o.address = uri.substr(scheme.size());
      o.cluster = cluster;
      return MakeRedisPool(o);
    }
  }
  return Status::InvalidArgument("pool '" + uri + "' is not embedded, redis://HOST:PORT or redis-cluster://HOST:PORT");
}

}  // namespace kvserve
