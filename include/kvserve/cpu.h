// Runtime CPU dispatch: which SIMD tier the codec kernels run (baseline x86-64, AVX2+F16C+FMA,
// AVX-512), detected once from the CPU and optionally capped, so one portable binary uses the
// widest kernels a machine has and still runs on a baseline x86-64 CPU.
#pragma once

#include <atomic>
#include <string_view>

#include "kvserve/status.h"

namespace kvserve::cpu {

enum class Tier : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

const char* TierName(Tier tier);                    // "baseline", "avx2", "avx512"
Result<Tier> ParseTier(std::string_view name);      // the names above
// The widest tier this CPU (and the OS's saved register state) supports, and that this build
// has kernels for.
Tier Detected();
// The tier the kernels use: Detected(), capped by the last SetCap(). Never above Detected().
Tier Active();
// Caps the active tier and returns the tier now active. The library reads no environment: the
// CLI, the Python module and the test binary apply the variable KVSERVE_SIMD (a tier name) with
// it at start-up; tests also use it to run every path.
Tier SetCap(Tier cap);

namespace internal {
extern std::atomic<int> active_tier;  // -1 until first use
int Resolve();
}  // namespace internal

// Whether the active tier reaches `tier`: the kernels' branch.
inline bool Use(Tier tier) {
  int t = internal::active_tier.load(std::memory_order_relaxed);
  if (t < 0) t = internal::Resolve();
  return t >= static_cast<int>(tier);
}

}  // namespace kvserve::cpu

// Function regions compiled for a tier inside an otherwise baseline file (GCC: target
// pragmas, guarded at run time by cpu::Use). Under a compiler without them (clang, used for
// the fuzz build) a region exists only when the build's own flags already enable the tier.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVSERVE_TIER_PRAGMAS 1
#define KVSERVE_BEGIN_AVX2 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c,bmi,bmi2,popcnt,lzcnt,movbe\")")
#define KVSERVE_BEGIN_AVX512                                                                           \
  _Pragma("GCC push_options")                                                                          \
      _Pragma("GCC target(\"avx2,fma,f16c,bmi,bmi2,popcnt,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd\")")
#define KVSERVE_END_TIER _Pragma("GCC pop_options")
#define KVSERVE_HAVE_AVX2_REGION 1
#define KVSERVE_HAVE_AVX512_REGION 1
#else
#define KVSERVE_BEGIN_AVX2
#define KVSERVE_BEGIN_AVX512
#define KVSERVE_END_TIER
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define KVSERVE_HAVE_AVX2_REGION 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512CD__) && defined(__F16C__)
#define KVSERVE_HAVE_AVX512_REGION 1
#endif
#endif
