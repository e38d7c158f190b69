// Byte buffers: large ones on transparent huge pages, each its own 2 MiB-aligned mapping kept for
// reuse when freed (see kv.h for why), and copies made with one memcpy.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <unordered_map>

#include "kvserve/kv.h"

namespace kvserve {
namespace {
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Idle mappings kept for reuse, at most this many bytes a process.
constexpr size_t kIdleCapBytes = size_t{512} << 20;

size_t PageRounded(size_t bytes) {
  static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// Freed mappings are kept and handed out again: a fresh mapping's pages are faulted in and
// zeroed by the kernel on first touch — on the VM, huge pages included, the GETs of a pool node
// spent more time there than copying — while a node allocates the same sizes request after
// request (pool values, frames, decoded chunks). A request reuses an idle mapping at least its
// size and at most an eighth larger; beyond kIdleCapBytes idle, freed mappings are unmapped.
struct MappingCache {
  std::mutex mu;
  std::unordered_map<uintptr_t, size_t> live;  // length of each mapping handed out
  std::multimap<size_t, uintptr_t> idle;       // by length
  size_t idle_bytes = 0;
};

MappingCache& Cache() {
  static MappingCache* cache = new MappingCache;  // never destroyed: buffers may outlive statics
  return *cache;
}

// Maps len + 2 MiB, keeps the 2 MiB-aligned part and returns the rest: the buffer's whole
// huge pages can then be backed by huge pages (its tail, if partial, by small ones).
void* MapAligned(size_t len) {
  if (len > SIZE_MAX - kHugePage) throw std::bad_alloc();
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
}  // namespace

void* AllocateLarge(size_t bytes) {
  const size_t len = PageRounded(bytes);
  if (len < bytes) throw std::bad_alloc();
  MappingCache& c = Cache();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.idle.lower_bound(len);
    if (it != c.idle.end() && it->first - len <= len / 8) {
      const auto [mapped, p] = *it;
      c.live.emplace(p, mapped);  // first: if it throws, the mapping stays idle
      c.idle.erase(it);
      c.idle_bytes -= mapped;
      return reinterpret_cast<void*>(p);
    }
  }
  void* p = MapAligned(len);
  try {
    std::lock_guard<std::mutex> lock(c.mu);
    c.live.emplace(uintptr_t(p), len);
  } catch (...) {
    ::munmap(p, len);
    throw;
  }
  return p;
}

void FreeLarge(void* p, size_t bytes) noexcept {
  if (p == nullptr) return;
  MappingCache& c = Cache();
  size_t mapped = PageRounded(bytes);
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auto it = c.live.find(uintptr_t(p));
    if (it != c.live.end()) {
      mapped = it->second;
      c.live.erase(it);
    }
    if (c.idle_bytes + mapped <= kIdleCapBytes) {
      try {
        c.idle.emplace(mapped, uintptr_t(p));
        c.idle_bytes += mapped;
        return;
      } catch (...) {  // no memory for the entry: unmap instead
      }
    }
  }
  ::munmap(p, mapped);
}

size_t ReleaseIdleBuffers() noexcept {
  MappingCache& c = Cache();
  std::multimap<size_t, uintptr_t> idle;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    idle.swap(c.idle);
    c.idle_bytes = 0;
  }
  size_t released = 0;
  for (const auto& [len, p] : idle) {
    ::munmap(reinterpret_cast<void*>(p), len);
    released += len;
  }
  return released;
}

ByteBuffer CopyBytes(const uint8_t* data, size_t size) {
  ByteBuffer out(size);
  if (size > 0) std::memcpy(out.data(), data, size);
  return out;
}

}  // namespace kvserve
