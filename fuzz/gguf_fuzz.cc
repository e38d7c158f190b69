// libFuzzer target: arbitrary bytes as a GGUF model file (seeded with the header and metadata of
// the shipped one). Loading must fail with a message or give a model whose configuration
// validates; never crash, read out of bounds or allocate what the bytes cannot back.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvserve/model.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = kvserve::ParseGgufModel(std::span<const uint8_t>(data, size), "fuzz.gguf");
  if (m.ok() && !m->config.Validate().ok()) __builtin_trap();
  return 0;
}
