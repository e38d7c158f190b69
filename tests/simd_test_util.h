// Shared by the SIMD tests: which path a test compares against its scalar reference, printed
// and recorded in the test's XML, so a run on a CPU (or build) without the vector path says so
// instead of passing on a comparison of the scalar code with itself.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "kvserve/cpu.h"

namespace kvserve::testing {

// Returns `simd`; prints "[ simd     ] what: path".
inline bool ReportSimdPath(const std::string& what, bool simd, const char* simd_name, const char* fallback_name) {
  const char* path = simd ? simd_name : fallback_name;
  ::testing::Test::RecordProperty(what + " path", path);
  std::printf("[ simd     ] %s: %s\n", what.c_str(), path);
  return simd;
}

// Fixture of the kernel tests that run once per CPU tier (kvserve/cpu.h): each instance caps the
// dispatch at its tier, so the baseline, AVX2 and AVX-512 paths of one binary are all compared
// with the reference; a tier the CPU lacks is skipped with a message.
class SimdTier : public ::testing::TestWithParam<cpu::Tier> {
 protected:
  void SetUp() override {
    if (static_cast<int>(GetParam()) > static_cast<int>(cpu::Detected())) {
      GTEST_SKIP() << "this CPU has no " << cpu::TierName(GetParam()) << " (detected "
                   << cpu::TierName(cpu::Detected()) << ")";
    }
    previous_ = cpu::Active();
    capped_ = true;
    cpu::SetCap(GetParam());
    std::printf("[ simd     ] tier: %s\n", cpu::TierName(cpu::Active()));
  }
  void TearDown() override {
    if (capped_) cpu::SetCap(previous_);
  }

 private:
  cpu::Tier previous_ = cpu::Tier::kBaseline;
  bool capped_ = false;
};

inline auto AllTiers() { return ::testing::Values(cpu::Tier::kBaseline, cpu::Tier::kAvx2, cpu::Tier::kAvx512); }
inline std::string TierParamName(const ::testing::TestParamInfo<cpu::Tier>& info) { return cpu::TierName(info.param); }

}  // namespace kvserve::testing
