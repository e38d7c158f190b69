// Shared by the model tests: the shipped models, loaded once per test binary.
#pragma once

#include "kvserve/model.h"
#include "test_paths.h"

namespace kvserve::testing {

inline const LlamaModel& Stories() {
  static const LlamaModel m = LoadModel("stories260K", "", ModelsDir()).value();
  return m;
}
inline const LlamaModel& Baby() {
  static const LlamaModel m = LoadModel("babyllama105", "", ModelsDir()).value();
  return m;
}

}  // namespace kvserve::testing
