// libFuzzer target: arbitrary bytes as a frame. Decoding must fail cleanly or succeed; never
// crash, overflow, or allocate without bound. The input is tried twice: as given, and with its
// checksum recomputed, so that mutations reach the stage decoders behind the checksum. When the
// bytes do decode, re-encoding the block with the frame's own strategy must decode too.
#include <cstddef>
#include <cstdint>

#include "kvserve/codec.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"

namespace {
void Check(const uint8_t* data, size_t size) {
  kvserve::CodecOptions opts;
  opts.max_decoded_bytes = 64 << 20;
  kvserve::KvBlock out;
  kvserve::Status st = kvserve::DecodeKv(std::span<const uint8_t>(data, size), &out, opts);
  if (st.ok()) {
    auto view = kvserve::ParseFrame(std::span<const uint8_t>(data, size));
    auto again = kvserve::EncodeKv(out, view->header.spec);
    if (again.ok()) {
      kvserve::KvBlock back;
      if (!kvserve::DecodeKv(again.value(), &back).ok()) __builtin_trap();
    }
  }
  (void)kvserve::PeekFrameLength(std::span<const uint8_t>(data, size));
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Check(data, size);
  if (size > kvserve::kFrameFixedHeader + kvserve::kFrameChecksumBytes) {
    kvserve::ByteBuffer fixed(data, data + size - kvserve::kFrameChecksumBytes);
    if (kvserve::FinishFrame(&fixed, 0).ok()) Check(fixed.data(), fixed.size());
  }
  return 0;
}
