// Consumer of the installed kvserve: encodes a synthetic llama-shaped KV block with a strategy,
// decodes it, and prints the ratio and the error; non-zero exit on any failure.
#include <cstdio>

#include "kvserve/codec.h"
#include "kvserve/cpu.h"
#include "kvserve/synth.h"

int main() {
  auto shape = kvserve::ShapePreset("stories260k", 128);
  if (!shape.ok()) return std::fprintf(stderr, "%s\n", shape.status().message().c_str()), 1;
  auto kv = kvserve::SynthesizeKv(*shape, {.seed = 3});
  if (!kv.ok()) return std::fprintf(stderr, "%s\n", kv.status().message().c_str()), 1;
  auto frame = kvserve::EncodeKv(*kv, "quant(kbits=4,vbits=4)|rans");
  if (!frame.ok()) return std::fprintf(stderr, "%s\n", frame.status().message().c_str()), 1;
  kvserve::KvBlock back;
  kvserve::Status st = kvserve::DecodeKv(*frame, &back);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message().c_str()), 1;
  const kvserve::KvErrorStats e = kvserve::CompareKv(*kv, back).value().k;
  std::printf("consumer ok: ratio %.2f, key snr %.1f dB, simd %s\n", double(kv->bytes()) / double(frame->size()),
              e.snr_db, kvserve::cpu::TierName(kvserve::cpu::Active()));
  return 0;
}
