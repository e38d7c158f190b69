// Internal to transfer: the 16-byte header every transport frames a message with — magic "KVSM",
// the kind, three zero bytes, the body's length (little-endian u64) — written and checked in one
// place, so TCP and UCX refuse the same things with the same words.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "kvserve/transport.h"

namespace kvserve::transfer_internal {

inline constexpr char kMagic[4] = {'K', 'V', 'S', 'M'};
inline constexpr size_t kHeaderBytes = 16;

inline void WriteHeader(MessageKind kind, uint64_t len, uint8_t* header) {
  std::memset(header, 0, kHeaderBytes);
  std::memcpy(header, kMagic, 4);
  header[4] = uint8_t(kind);
  std::memcpy(header + 8, &len, 8);
}

// The kind and length of a header from `peer`: kCorrupt for bytes that are no kvserve header or
// an unknown kind, kOutOfRange for a length above `limit` (refused before any body is read).
inline Status ReadHeader(const uint8_t* header, const std::string& peer, uint64_t limit, MessageKind* kind, uint64_t* len) {
  if (std::memcmp(header, kMagic, 4) != 0 || header[5] || header[6] || header[7]) {
    return Status::Corrupt("message from " + peer + " does not start with a kvserve message header");
  }
  std::memcpy(len, header + 8, 8);
  if (header[4] < uint8_t(MessageKind::kRequest) || header[4] > uint8_t(MessageKind::kTokens)) {
    return Status::Corrupt("message from " + peer + " has unknown kind " + std::to_string(header[4]));
  }
  if (*len > limit) {
    return Status::OutOfRange("message from " + peer + " announces " + std::to_string(*len) + " bytes, above the limit of " +
                              std::to_string(limit));
  }
  *kind = MessageKind(header[4]);
  return Status::Ok();
}

}  // namespace kvserve::transfer_internal
