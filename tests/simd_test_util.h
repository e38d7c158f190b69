// Shared by the SIMD tests: which path a test compares against its scalar reference, printed
// and recorded in the test's XML, so a run on a CPU (or build) without the vector path says so
// instead of passing on a comparison of the scalar code with itself.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace kvserve::testing {

// Returns `simd`; prints "[ simd     ] what: path".
inline bool ReportSimdPath(const std::string& what, bool simd, const char* simd_name, const char* fallback_name) {
  const char* path = simd ? simd_name : fallback_name;
  ::testing::Test::RecordProperty(what + " path", path);
  std::printf("[ simd     ] %s: %s\n", what.c_str(), path);
  return simd;
}

}  // namespace kvserve::testing
