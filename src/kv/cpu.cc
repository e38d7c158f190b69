// CPU tier detection (CPUID, XGETBV) and the cap the CLI, the Python module and tests put on it.
#include "kvserve/cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <atomic>
#include <string>

namespace kvserve::cpu {
namespace internal {
std::atomic<int> active_tier{-1};
}  // namespace internal

namespace {
std::atomic<int> cap_tier{static_cast<int>(Tier::kAvx512)};

// CPUID and XGETBV directly (as compilers' own __builtin_cpu_supports do, but with every bit we
// need on every compiler): a feature counts only when the OS saves its registers.
Tier DetectOnce() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Tier::kBaseline;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29), avx = c & (1u << 28);
  if (!osxsave || !avx) return Tier::kBaseline;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool ymm_state = (xcr0_lo & 0x6) == 0x6, zmm_state = (xcr0_lo & 0xe6) == 0xe6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Tier::kBaseline;
  const bool avx2 = ymm_state && fma && f16c && (b & (1u << 5)) && (b & (1u << 8));  // AVX2, BMI2
  const unsigned avx512_bits = (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);  // F DQ CD BW VL
  const bool avx512 = avx2 && zmm_state && (b & avx512_bits) == avx512_bits;
#if defined(KVSERVE_HAVE_AVX512_REGION)
  if (avx512) return Tier::kAvx512;
#endif
#if defined(KVSERVE_HAVE_AVX2_REGION)
  if (avx2) return Tier::kAvx2;
#endif
#endif
  return Tier::kBaseline;
}
}  // namespace

const char* TierName(Tier tier) {
  switch (tier) {
    case Tier::kBaseline:
      return "baseline";
    case Tier::kAvx2:
      return "avx2";
    case Tier::kAvx512:
      return "avx512";
  }
  return "baseline";
}

Result<Tier> ParseTier(std::string_view name) {
  for (Tier t : {Tier::kBaseline, Tier::kAvx2, Tier::kAvx512}) {
    if (name == TierName(t)) return t;
  }
  return Status::InvalidArgument("simd tier '" + std::string(name) + "' unknown (baseline, avx2, avx512)");
}

Tier Detected() {
  static const Tier detected = DetectOnce();
  return detected;
}

int internal::Resolve() {
  const int cap = cap_tier.load(std::memory_order_relaxed);
  const int detected = static_cast<int>(Detected());
  const int active = cap < detected ? cap : detected;
  internal::active_tier.store(active, std::memory_order_relaxed);
  return active;
}

Tier Active() {
  const int t = internal::active_tier.load(std::memory_order_relaxed);
  return static_cast<Tier>(t < 0 ? internal::Resolve() : t);
}

Tier SetCap(Tier cap) {
  cap_tier.store(static_cast<int>(cap));
  return static_cast<Tier>(internal::Resolve());
}

}  // namespace kvserve::cpu
