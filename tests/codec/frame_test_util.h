// Test helper: edit a frame behind its checksum, so that only the stage decoders' own checks can
// catch the damage.
#pragma once

#include <gtest/gtest.h>

#include "kvserve/file.h"
#include "kvserve/frame.h"

namespace kvserve::testing {

// Drops the checksum, applies `edit` to the rest, and checksums again.
template <typename Edit>
ByteBuffer Rechecksummed(ByteBuffer f, Edit edit) {
  f.resize(f.size() - kFrameChecksumBytes);
  edit(f);
  EXPECT_TRUE(FinishFrame(&f, 0).ok());
  return f;
}
// The frame without the last `drop` bytes of its payload, checksummed again.
inline ByteBuffer Shortened(ByteBuffer f, size_t drop) {
  return Rechecksummed(std::move(f), [drop](ByteBuffer& b) { b.resize(b.size() - drop); });
}

}  // namespace kvserve::testing
