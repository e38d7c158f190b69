// The frame: kvserve's self-describing, checksummed unit of encoded KV, on disk (.kvf) and on
// the wire. Layout (little-endian):
//   0 magic "KVSF" | 4 u16 version (3) | 6 u16 header_len | 8 u8 dtype | 9 u8 flags | 10 u8[2] zero
//  12 u32 n_layer | 16 u32 n_head_kv | 20 u32 n_token | 24 u32 head_dim | 28 u32 token_offset
//  32 u64 payload_len | 40 u64 request_id | 48 u32 layer_begin | 52 u32 n_layer_total
//  56 u16 spec_len | 58 spec bytes (canonical strategy)
//  [flags bit 0: u32 count, count x u32 positions of the tokens a selection stage kept]
//  [flags bit 1 (FP8 frames): u8 granularity (1 per (layer, K/V), 2 per (layer, K/V, head)),
//   u8[3] zero, u32 count, count x f32 scales of the engine's FP8 cache (Fp8Scales)]
//  header_len: payload | u64 checksum of everything before it: XXH3-64 (xxHash) of the XXH3-64s
//  of its 256 KiB chunks (the last one shorter), as little-endian u64s. Version 2 frames, whose
//  checksum is the XXH3-64 of the bytes, are still read; frames are written as version 3.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"
#include "kvserve/thread_pool.h"

namespace kvserve {

inline constexpr char kFrameMagic[4] = {'K', 'V', 'S', 'F'};
inline constexpr uint16_t kFrameVersion = 3;
inline constexpr uint16_t kFrameOldestVersion = 2;  // the oldest version ParseFrame reads
inline constexpr size_t kFrameChecksumChunk = size_t{1} << 18;
inline constexpr size_t kFrameFixedHeader = 58;
inline constexpr size_t kFrameChecksumBytes = 8;
inline constexpr size_t kFrameMaxSpec = 4096;

struct FrameHeader {
  uint16_t version = kFrameVersion;
  DType dtype = DType::kF16;
  KvShape shape;
  uint32_t token_offset = 0;
  uint64_t payload_len = 0;
  // Which request and which layers: a frame holds layers [layer_begin, layer_begin + n_layer)
  // of a request whose KV has n_layer_total layers (a whole block: 0 and n_layer; writing 0
  // writes n_layer). A receiver
  // assembling a request from per-layer frames checks the pieces against each other.
  uint64_t request_id = 0;
  uint32_t layer_begin = 0;
  uint32_t n_layer_total = 0;
  std::string spec;
  // Sequence positions of the kept tokens when the strategy selects tokens (empty otherwise):
  // strictly increasing, within [token_offset, token_offset + n_token).
  std::vector<uint32_t> positions;
  bool has_positions = false;
  // The encoded block's FP8 scales (empty for other dtypes and unscaled FP8 caches).
  Fp8Scales fp8_scales;
  size_t header_len() const {
    return kFrameFixedHeader + spec.size() + (has_positions ? 4 + 4 * positions.size() : 0) +
           (fp8_scales.empty() ? 0 : 8 + 4 * fp8_scales.scale.size());
  }
  size_t frame_len() const { return header_len() + payload_len + kFrameChecksumBytes; }
};

// A frame whose checksum, lengths and header fields were all verified; payload points into the
// caller's buffer.
struct FrameView {
  FrameHeader header;
  std::span<const uint8_t> payload;
};

// Writes the header (payload_len as given) to the end of `out`.
void AppendFrameHeader(const FrameHeader& header, ByteBuffer* out);
// After the payload has been appended: patches payload_len and appends the checksum (in the
// form of the version the header names), its chunks hashed on `pool` when one is given.
// `frame_start` is where AppendFrameHeader began writing.
Status FinishFrame(ByteBuffer* out, size_t frame_start, ThreadPool* pool = nullptr);

// Reads the total frame length from its first kFrameFixedHeader bytes, so a reader of a
// stream knows how much to read. Fails on a bad magic or version.
Result<uint64_t> PeekFrameLength(std::span<const uint8_t> prefix);
// Verifies everything — magic, version, lengths, reserved bytes, checksum, shape — before the
// payload is touched. Each failure has its own message. A pool, when given, shares the checksum.
Result<FrameView> ParseFrame(std::span<const uint8_t> bytes, ThreadPool* pool = nullptr);

// A KV file (.kvf) is a frame with the identity strategy "none".
Status WriteKvFile(const std::string& path, const KvBlock& block);
Result<KvBlock> ReadKvFile(const std::string& path);

}  // namespace kvserve
