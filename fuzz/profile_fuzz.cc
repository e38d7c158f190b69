// libFuzzer target: arbitrary text as a profile file and as a search-space file. Loading must
// fail with a message or give a profile whose fields passed validation; never crash, recurse
// without bound or accept a pareto entry that the controller could not use.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvserve/codec.h"
#include "kvserve/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto p = kvserve::ProfileFromJson(text, "fuzz");
  if (p.ok()) {
    for (const kvserve::ProfileEntry& e : p->pareto) {
      if (!kvserve::CanonicalStrategy(e.spec).ok() || !(e.ratio >= 1) || !(e.encode_gbps > 0) || !std::isfinite(e.quality))
        __builtin_trap();
    }
    (void)kvserve::ProfileToJson(p.value());
  }
  auto s = kvserve::SearchSpace::Parse(text, "fuzz");
  if (s.ok()) {
    for (const kvserve::SpaceCandidate& c : s->candidates())
      if (!kvserve::CanonicalStrategy(c.spec).ok()) __builtin_trap();
  }
  return 0;
}
