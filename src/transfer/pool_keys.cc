// Pool keys: the hash chain over (model, chunk size, tokens) that lets a request find its longest
// cached prefix chunk by chunk, and the key of one stored copy of a chunk.
#include <xxhash.h>

#include <cstdio>
#include <memory>

#include "kvserve/pool.h"

namespace kvserve {
namespace {
std::string Hex128(XXH128_hash_t h) {
  char b[33];
  std::snprintf(b, sizeof b, "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return b;
}
}  // namespace

std::vector<std::string> PrefixChainHashes(const PoolKeyOptions& o, std::span<const int> tokens) {
  std::vector<std::string> chain;
  if (o.chunk_tokens == 0) return chain;
  // Heap state: the struct is opaque without XXH_INLINE_ALL, whose inlined SIMD paths trip
  // gcc's uninitialised-use warnings for the streaming API.
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owned(XXH3_createState(), &XXH3_freeState);
  XXH3_state_t& state = *owned;
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, o.model_id.data(), o.model_id.size());
  XXH3_128bits_update(&state, &o.chunk_tokens, sizeof o.chunk_tokens);
  std::string prev = Hex128(XXH3_128bits_digest(&state));
  for (size_t c = 0; (c + 1) * o.chunk_tokens <= tokens.size(); ++c) {
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, prev.data(), prev.size());
    // Token ids as fixed-width little-endian int32, so the hash does not depend on the platform.
    for (size_t i = c * o.chunk_tokens; i < (c + 1) * o.chunk_tokens; ++i) {
      const uint32_t t = static_cast<uint32_t>(tokens[i]);
      const uint8_t le[4] = {uint8_t(t), uint8_t(t >> 8), uint8_t(t >> 16), uint8_t(t >> 24)};
      XXH3_128bits_update(&state, le, 4);
    }
    prev = Hex128(XXH3_128bits_digest(&state));
    chain.push_back(prev);
  }
  return chain;
}

std::string PoolChunkKey(const PoolKeyOptions& o, const std::vector<std::string>& chain, size_t chunk,
                         const std::string& strategy) {
  const std::string& tag = o.placement == KeyPlacement::kPrefix ? chain.front() : chain[chunk];
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(XXH3_64bits(strategy.data(), strategy.size())));
  return "kvs:{" + tag.substr(0, 16) + "}:" + chain[chunk] + ":" + s;
}

uint64_t PoolValueTag(const std::string& key) { return XXH3_64bits(key.data(), key.size()); }

Result<std::optional<ByteBuffer>> KvPool::Get(const std::string& key, uint64_t max_value_bytes) {
  KV_ASSIGN_OR_RETURN(std::vector<std::optional<ByteBuffer>> v, GetMany({key}, max_value_bytes));
  return std::move(v.front());
}

}  // namespace kvserve
