// Byte buffers: large ones mapped on their own (huge-page aligned), small ones from operator new,
// both aligned for SIMD; growth across the threshold keeps the bytes; freed mappings are reused;
// CopyBytes copies exactly.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>

#include "kvserve/kv.h"

namespace kvserve {
namespace {

TEST(ByteBuffer, SmallAndLargeBuffersAreAlignedAndHoldTheirBytes) {
  ByteBuffer small(1000);
  EXPECT_EQ(uintptr_t(small.data()) % 64, 0u);
  ByteBuffer large(kHugePageAllocBytes + 12345);
  const uintptr_t want = kLargeAllocsMapped ? (uintptr_t{2} << 20) : 64;
  EXPECT_EQ(uintptr_t(large.data()) % want, 0u);
  for (size_t i = 0; i < large.size(); ++i) large[i] = uint8_t(i * 7);
  for (size_t i = 0; i < large.size(); i += 4093) ASSERT_EQ(large[i], uint8_t(i * 7)) << i;
  EXPECT_EQ(large.back(), uint8_t((large.size() - 1) * 7));  // the partial last page is mapped
}

TEST(ByteBuffer, GrowingAcrossTheThresholdKeepsTheBytes) {
  ByteBuffer b;
  for (size_t i = 0; i < 3 * kHugePageAllocBytes; ++i) b.push_back(uint8_t(i % 251));
  for (size_t i = 0; i < b.size(); i += 997) ASSERT_EQ(b[i], uint8_t(i % 251)) << i;
  b.resize(100);
  b.shrink_to_fit();  // back below the threshold: freed as mapped, reallocated by operator new
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(b[i], uint8_t(i % 251));
}

TEST(ByteBuffer, AFreedLargeBufferIsReusedByTheNextOfAboutItsSize) {
  const size_t bytes = kHugePageAllocBytes + 7 * 4096;
  if (!kLargeAllocsMapped) {  // under AddressSanitizer: operator new and delete, nothing kept idle
    { ByteBuffer a(bytes); a.back() = 9; }
    EXPECT_EQ(ReleaseIdleBuffers(), 0u);
    return;
  }
  const uint8_t* first;
  {
    ByteBuffer a(bytes);
    a.back() = 9;
    first = a.data();
  }
  ByteBuffer again(bytes - 100);  // within an eighth: the same mapping
  EXPECT_EQ(again.data(), first);
  again.back() = 1;  // all of it is writable
  ByteBuffer bigger(2 * bytes);  // far larger: a mapping of its own
  EXPECT_NE(bigger.data(), first);
  bigger.back() = 2;
  again = ByteBuffer();  // idle again, then unmapped on request
  EXPECT_GE(ReleaseIdleBuffers(), bytes);
  EXPECT_EQ(ReleaseIdleBuffers(), 0u);
}

TEST(ByteBuffer, CopyBytesCopiesExactly) {
  ByteBuffer src(kHugePageAllocBytes + 3);
  std::iota(src.begin(), src.end(), uint8_t{5});
  const ByteBuffer copy = CopyBytes(src.data(), src.size());
  EXPECT_EQ(copy, src);
  EXPECT_NE(copy.data(), src.data());
  EXPECT_TRUE(CopyBytes(nullptr, 0).empty());
}

}  // namespace
}  // namespace kvserve
