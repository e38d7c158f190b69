// CPU tier dispatch: names round-trip, the cap never lifts the tier above the CPU's, and every
// cap below it takes effect.
#include "kvserve/cpu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace kvserve {
namespace {

// The test binary applies KVSERVE_SIMD as the CLI does, so CTest can run suites at a capped
// tier (codec_suites_at_baseline_tier); an unknown name fails loudly rather than testing the
// wrong path.
const bool kSimdCapApplied = [] {
  const char* simd = std::getenv("KVSERVE_SIMD");
  if (simd == nullptr || *simd == 0) return false;
  auto tier = cpu::ParseTier(simd);
  if (!tier.ok()) {
    std::fprintf(stderr, "KVSERVE_SIMD: %s\n", tier.status().message().c_str());
    std::exit(2);
  }
  cpu::SetCap(*tier);
  return true;
}();

TEST(CpuTier, NamesRoundTripAndUnknownNamesAreRejected) {
  for (cpu::Tier t : {cpu::Tier::kBaseline, cpu::Tier::kAvx2, cpu::Tier::kAvx512}) {
    auto parsed = cpu::ParseTier(cpu::TierName(t));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t);
  }
  auto bad = cpu::ParseTier("sse9");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'sse9'"), std::string::npos) << bad.status().message();
}

// With KVSERVE_SIMD the run is at that tier (or the CPU's, if lower); without it, at the CPU's.
TEST(CpuTier, EnvironmentCapIsApplied) {
  const cpu::Tier want = kSimdCapApplied ? std::min(*cpu::ParseTier(std::getenv("KVSERVE_SIMD")), cpu::Detected())
                                         : cpu::Detected();
  EXPECT_EQ(cpu::TierName(cpu::Active()), std::string(cpu::TierName(want)));
}

TEST(CpuTier, CapLowersButNeverRaisesTheActiveTier) {
  const cpu::Tier before = cpu::Active();
  EXPECT_LE(static_cast<int>(before), static_cast<int>(cpu::Detected()));
  for (cpu::Tier t : {cpu::Tier::kBaseline, cpu::Tier::kAvx2, cpu::Tier::kAvx512}) {
    const cpu::Tier now = cpu::SetCap(t);
    EXPECT_EQ(now, cpu::Active());
    EXPECT_EQ(static_cast<int>(now), std::min(static_cast<int>(t), static_cast<int>(cpu::Detected())));
    EXPECT_EQ(cpu::Use(cpu::Tier::kAvx512), now == cpu::Tier::kAvx512);
    EXPECT_TRUE(cpu::Use(cpu::Tier::kBaseline));
  }
  cpu::SetCap(before);
  EXPECT_EQ(cpu::Active(), before);
  std::printf("[ simd     ] detected: %s\n", cpu::TierName(cpu::Detected()));
}

}  // namespace
}  // namespace kvserve
