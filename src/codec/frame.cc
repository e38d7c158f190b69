// Frame writing and verification, and .kvf files (a frame with the identity strategy).
#include "kvserve/frame.h"

#include <fcntl.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kv/parallel.h"
#include "kvserve/codec.h"
#include "kvserve/file.h"

namespace kvserve {
namespace {

template <typename T>
void Put(ByteBuffer* out, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little-endian hosts only (checked in CMake)
  out->insert(out->end(), b, b + sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

Status CheckPrefix(std::span<const uint8_t> b) {
  if (b.size() < 6) {
    return Status::Corrupt("truncated frame: " + std::to_string(b.size()) + " bytes, the header alone needs " +
                           std::to_string(kFrameFixedHeader));
  }
  if (std::memcmp(b.data(), kFrameMagic, 4) != 0) {
    return Status::Corrupt("not a kvserve frame: bad magic (expected \"KVSF\")");
  }
  const uint16_t version = Get<uint16_t>(b.data() + 4);
  if (version < kFrameOldestVersion || version > kFrameVersion) {
    return Status::Unsupported("frame format version " + std::to_string(version) + " (this build reads versions " +
                               std::to_string(kFrameOldestVersion) + " to " + std::to_string(kFrameVersion) + ")");
  }
  if (b.size() < kFrameFixedHeader) {
    return Status::Corrupt("truncated frame: " + std::to_string(b.size()) + " bytes, the header alone needs " +
                           std::to_string(kFrameFixedHeader));
  }
  return Status::Ok();
}

// The frame checksum of the n bytes at p (everything before the checksum) in the given version's
// form. Version 2: XXH3-64 of the bytes. Version 3: XXH3-64 of the chunk hashes, each the XXH3-64
// of kFrameChecksumChunk bytes (the last chunk shorter), as little-endian u64s; the chunks hash
// independently, so a pool shares the work and encoding or decoding a large frame on two threads
// is not held to one thread's hashing speed.
uint64_t FrameChecksum(const uint8_t* p, size_t n, uint16_t version, ThreadPool* pool) {
  if (version < 3) return XXH3_64bits(p, n);
  const size_t chunks = std::max<size_t>(1, (n + kFrameChecksumChunk - 1) / kFrameChecksumChunk);
  std::vector<uint64_t> hashes(chunks);  // little-endian host (checked in CMake): the u64s are their encoding
  ParallelFor(PoolForBytes(pool, n), chunks, [&](uint64_t i) {
    const size_t begin = i * kFrameChecksumChunk;
    hashes[i] = XXH3_64bits(p + begin, std::min(kFrameChecksumChunk, n - begin));
  });
  return XXH3_64bits(hashes.data(), chunks * sizeof(uint64_t));
}

}  // namespace

void AppendFrameHeader(const FrameHeader& h, ByteBuffer* out) {
  out->insert(out->end(), kFrameMagic, kFrameMagic + 4);
  Put<uint16_t>(out, h.version);
  Put<uint16_t>(out, static_cast<uint16_t>(h.header_len()));
  Put<uint8_t>(out, static_cast<uint8_t>(h.dtype));
  Put<uint8_t>(out, (h.has_positions ? 1 : 0) | (h.fp8_scales.empty() ? 0 : 2));
  Put<uint16_t>(out, 0);
  Put<uint32_t>(out, h.shape.n_layer);
  Put<uint32_t>(out, h.shape.n_head_kv);
  Put<uint32_t>(out, h.shape.n_token);
  Put<uint32_t>(out, h.shape.head_dim);
  Put<uint32_t>(out, h.token_offset);
  Put<uint64_t>(out, h.payload_len);
  Put<uint64_t>(out, h.request_id);
  Put<uint32_t>(out, h.layer_begin);
  Put<uint32_t>(out, h.n_layer_total != 0 ? h.n_layer_total : h.shape.n_layer);
  Put<uint16_t>(out, static_cast<uint16_t>(h.spec.size()));
  out->insert(out->end(), h.spec.begin(), h.spec.end());
  if (h.has_positions) {
    Put<uint32_t>(out, static_cast<uint32_t>(h.positions.size()));
    for (uint32_t p : h.positions) Put<uint32_t>(out, p);
  }
  if (!h.fp8_scales.empty()) {
    Put<uint8_t>(out, static_cast<uint8_t>(h.fp8_scales.granularity));
    Put<uint8_t>(out, 0);
    Put<uint16_t>(out, 0);
    Put<uint32_t>(out, static_cast<uint32_t>(h.fp8_scales.scale.size()));
    for (float f : h.fp8_scales.scale) Put<float>(out, f);
  }
}

Status FinishFrame(ByteBuffer* out, size_t frame_start, ThreadPool* pool) {
  if (out->size() < frame_start + kFrameFixedHeader) return Status::Internal("FinishFrame before header");
  uint8_t* f = out->data() + frame_start;
  const uint64_t header_len = Get<uint16_t>(f + 6);
  const uint64_t payload_len = out->size() - frame_start - header_len;
  std::memcpy(f + 32, &payload_len, 8);
  const uint64_t sum = FrameChecksum(f, out->size() - frame_start, Get<uint16_t>(f + 4), pool);
  Put<uint64_t>(out, sum);
  return Status::Ok();
}

Result<uint64_t> PeekFrameLength(std::span<const uint8_t> prefix) {
  KV_RETURN_IF_ERROR(CheckPrefix(prefix));
  const uint64_t header_len = Get<uint16_t>(prefix.data() + 6);
  const uint64_t payload_len = Get<uint64_t>(prefix.data() + 32);
  if (header_len < kFrameFixedHeader) {
    return Status::Corrupt("frame header_len " + std::to_string(header_len) + " < " + std::to_string(kFrameFixedHeader));
  }
  if (payload_len > (uint64_t{1} << 48)) {
    return Status::Corrupt("frame payload_len " + std::to_string(payload_len) + " is implausible");
  }
  return header_len + payload_len + kFrameChecksumBytes;
}

Result<FrameView> ParseFrame(std::span<const uint8_t> b, ThreadPool* pool) {
  KV_RETURN_IF_ERROR(CheckPrefix(b));
  const uint8_t* p = b.data();
  const uint16_t header_len = Get<uint16_t>(p + 6);
  const uint16_t spec_len = Get<uint16_t>(p + 56);
  const bool has_positions = p[9] & 1;
  uint64_t n_positions = 0;
  if (has_positions) {
    if (b.size() < kFrameFixedHeader + spec_len + 4u) return Status::Corrupt("truncated frame: positions count missing");
    n_positions = Get<uint32_t>(p + kFrameFixedHeader + spec_len);
  }
  const bool has_scales = p[9] & 2;
  const uint64_t scales_at = kFrameFixedHeader + spec_len + (has_positions ? 4 + 4 * n_positions : 0);
  uint64_t n_scales = 0;
  if (has_scales) {
    if (b.size() < scales_at + 8) return Status::Corrupt("truncated frame: FP8 scales count missing");
    n_scales = Get<uint32_t>(p + scales_at + 4);
  }
  if (header_len != scales_at + (has_scales ? 8 + 4 * n_scales : 0)) {
    return Status::Corrupt("frame header_len " + std::to_string(header_len) + " does not match spec_len " +
                           std::to_string(spec_len) + " + " + std::to_string(kFrameFixedHeader) +
                           (has_positions ? " + positions (" + std::to_string(n_positions) + ")" : std::string()) +
                           (has_scales ? " + FP8 scales (" + std::to_string(n_scales) + ")" : std::string()));
  }
  if (spec_len > kFrameMaxSpec) {
    return Status::Corrupt("frame spec_len " + std::to_string(spec_len) + " above the limit of " +
                           std::to_string(kFrameMaxSpec));
  }
  const uint64_t payload_len = Get<uint64_t>(p + 32);
  const uint64_t available = b.size();
  if (available < uint64_t{header_len} + kFrameChecksumBytes ||
      payload_len != available - header_len - kFrameChecksumBytes) {
    const bool short_frame = available < uint64_t{header_len} + kFrameChecksumBytes ||
                             payload_len > available - header_len - kFrameChecksumBytes;
    return Status::Corrupt(std::string(short_frame ? "truncated frame: " : "frame length mismatch: ") +
                           "header says " + std::to_string(header_len) + " + " + std::to_string(payload_len) +
                           " + 8 bytes, buffer holds " + std::to_string(available));
  }
  const uint64_t want = Get<uint64_t>(p + available - kFrameChecksumBytes);
  const uint64_t got = FrameChecksum(p, available - kFrameChecksumBytes, Get<uint16_t>(p + 4), pool);
  if (want != got) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "frame checksum mismatch (stored %016llx, computed %016llx)",
                  static_cast<unsigned long long>(want), static_cast<unsigned long long>(got));
    return Status::Corrupt(buf);
  }
  // The checksum matched, so anything wrong below was written wrong, not damaged in transit.
  if ((p[9] & ~3) != 0 || p[10] != 0 || p[11] != 0) return Status::Corrupt("frame reserved bytes are not zero");
  FrameView v;
  v.header.version = Get<uint16_t>(p + 4);
  const uint8_t dtype = p[8];
  if (dtype > static_cast<uint8_t>(kLastDType)) return Status::Corrupt("frame dtype " + std::to_string(dtype) + " unknown");
  v.header.dtype = static_cast<DType>(dtype);
  v.header.shape = KvShape{Get<uint32_t>(p + 12), Get<uint32_t>(p + 16), Get<uint32_t>(p + 20), Get<uint32_t>(p + 24)};
  KV_RETURN_IF_ERROR(v.header.shape.Validate().WithContext("frame"));
  v.header.token_offset = Get<uint32_t>(p + 28);
  if (uint64_t{v.header.token_offset} + v.header.shape.n_token > (uint64_t{1} << 32)) {
    return Status::Corrupt("frame tokens from " + std::to_string(v.header.token_offset) + " (" +
                           std::to_string(v.header.shape.n_token) + " of them) overflow 32-bit positions");
  }
  v.header.payload_len = payload_len;
  v.header.request_id = Get<uint64_t>(p + 40);
  v.header.layer_begin = Get<uint32_t>(p + 48);
  v.header.n_layer_total = Get<uint32_t>(p + 52);
  if (v.header.n_layer_total > 4096 ||
      uint64_t{v.header.layer_begin} + v.header.shape.n_layer > v.header.n_layer_total) {
    return Status::Corrupt("frame layers [" + std::to_string(v.header.layer_begin) + ", " +
                           std::to_string(uint64_t{v.header.layer_begin} + v.header.shape.n_layer) +
                           ") do not fit its request's n_layer_total=" + std::to_string(v.header.n_layer_total));
  }
  v.header.spec.assign(reinterpret_cast<const char*>(p + kFrameFixedHeader), spec_len);
  v.header.has_positions = has_positions;
  if (has_positions) {
    const KvShape& sh = v.header.shape;
    if (n_positions > sh.n_token) return Status::Corrupt("frame keeps " + std::to_string(n_positions) + " of " + std::to_string(sh.n_token) + " tokens");
    v.header.positions.resize(n_positions);
    if (n_positions > 0) std::memcpy(v.header.positions.data(), p + kFrameFixedHeader + spec_len + 4, 4 * n_positions);
    for (uint64_t i = 0; i < n_positions; ++i) {
      const uint32_t q = v.header.positions[i];
      // Within the block's span for a selecting strategy, which the pipeline checks; a block
      // selected before carries positions from a wider span, still increasing from the offset.
      if (q < v.header.token_offset || (i && q <= v.header.positions[i - 1])) {
        return Status::Corrupt("frame token positions are not increasing from the token offset");
      }
    }
  }
  if (has_scales) {
    const uint8_t* q = p + scales_at;
    if (!IsFp8(v.header.dtype)) {
      return Status::Corrupt(std::string("frame carries FP8 scales for dtype ") + DTypeName(v.header.dtype));
    }
    if (q[0] < 1 || q[0] > 2 || q[1] != 0 || q[2] != 0 || q[3] != 0) {
      return Status::Corrupt("frame FP8 scale granularity " + std::to_string(q[0]) + " is not 1 (tensor) or 2 (head)");
    }
    const auto g = static_cast<Fp8Scales::Granularity>(q[0]);
    if (n_scales != Fp8Scales::Count(g, v.header.shape)) {
      return Status::Corrupt("frame carries " + std::to_string(n_scales) + " FP8 scales per " + Fp8GranularityName(g) +
                             ", its shape " + v.header.shape.ToString() + " needs " +
                             std::to_string(Fp8Scales::Count(g, v.header.shape)));
    }
    v.header.fp8_scales.granularity = g;
    v.header.fp8_scales.scale.resize(n_scales);
    if (n_scales > 0) std::memcpy(v.header.fp8_scales.scale.data(), q + 8, 4 * n_scales);
    for (uint64_t i = 0; i < n_scales; ++i) {
      const float f = v.header.fp8_scales.scale[i];
      if (!std::isfinite(f) || !(f > 0)) {
        return Status::Corrupt("frame FP8 scale " + std::to_string(i) + " = " + std::to_string(f) +
                               " is not finite and positive");
      }
    }
  }
  v.payload = b.subspan(header_len, payload_len);
  return v;
}

Status WriteKvFile(const std::string& path, const KvBlock& block) {
  KV_ASSIGN_OR_RETURN(ByteBuffer frame, EncodeKv(block, "none"));
  return WriteFileAtomic(path, frame);
}

Result<KvBlock> ReadKvFile(const std::string& path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer bytes, ReadFile(path));
  KvBlock block;
  Status st = DecodeKv(bytes, &block);
  if (!st.ok()) return st.WithContext("'" + path + "'");
  return block;
}

}  // namespace kvserve
