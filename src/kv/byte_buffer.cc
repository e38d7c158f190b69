// Byte buffers: large ones on transparent huge pages, each its own 2 MiB-aligned mapping (see kv.h
// for why), and copies made with one memcpy.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <new>

#include "kvserve/kv.h"

namespace kvserve {
namespace {
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

size_t PageRounded(size_t bytes) {
  static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}
}  // namespace

// Maps bytes + 2 MiB, keeps the 2 MiB-aligned part and returns the rest: the buffer's whole
// huge pages can then be backed by huge pages (its tail, if partial, by small ones).
void* AllocateLarge(size_t bytes) {
  const size_t len = PageRounded(bytes);
  if (len < bytes || len > SIZE_MAX - kHugePage) throw std::bad_alloc();
  void* raw = ::mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t begin = uintptr_t(raw), aligned = (begin + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > begin) ::munmap(raw, aligned - begin);
  const uintptr_t end = begin + len + kHugePage;
  if (end > aligned + len) ::munmap(reinterpret_cast<void*>(aligned + len), end - (aligned + len));
  // Advice only: where THP is off the buffer works on small pages, as before.
  (void)::madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}

void FreeLarge(void* p, size_t bytes) noexcept {
  if (p != nullptr) ::munmap(p, PageRounded(bytes));
}

ByteBuffer CopyBytes(const uint8_t* data, size_t size) {
  ByteBuffer out(size);
  if (size > 0) std::memcpy(out.data(), data, size);
  return out;
}

}  // namespace kvserve
