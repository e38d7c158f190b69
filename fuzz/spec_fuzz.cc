// libFuzzer target: arbitrary text as a strategy spec. Parsing must fail cleanly or give a
// canonical form that is a fixed point (canonical(canonical(s)) == canonical(s)) and makes a
// pipeline, unless that form is longer than a frame can store (a documented limit, refused by
// Pipeline::Create with its size: short specs can expand past it, as defaults are spelled out).
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvserve/codec.h"
#include "kvserve/frame.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto c1 = kvserve::CanonicalStrategy(text);
  if (!c1.ok()) return 0;
  auto c2 = kvserve::CanonicalStrategy(c1.value());
  if (!c2.ok() || c2.value() != c1.value()) __builtin_trap();
  if (!kvserve::Pipeline::Create(c1.value()).ok() && c1.value().size() <= kvserve::kFrameMaxSpec) __builtin_trap();
  return 0;
}
