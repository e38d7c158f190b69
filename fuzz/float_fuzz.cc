// libFuzzer target: arbitrary bytes as the values of a KV block — every float pattern, NaN
// payloads, subnormals and infinities included — in each storage type the lossless float coder
// takes. `fpsplit|rans` and `fpsplit|zstd` must give the exact bytes back; `fp8` must encode or
// refuse cleanly and decode to the block's shape.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvserve/codec.h"

namespace {
void Check(const uint8_t* data, size_t size, kvserve::DType dtype) {
  const size_t es = kvserve::DTypeSize(dtype);
  // A shape from the first byte: 1-2 layers, 1-2 heads, head_dim 8 or 16, the tokens that fit.
  if (size < 1) return;
  const uint32_t n_layer = 1 + (data[0] & 1), n_head = 1 + ((data[0] >> 1) & 1), head_dim = (data[0] & 4) ? 16 : 8;
  data += 1;
  size -= 1;
  const size_t row = size_t(n_layer) * 2 * n_head * head_dim * es;
  const uint32_t n_token = uint32_t(std::min<size_t>(size / row, 256));
  kvserve::KvBlock in = kvserve::KvBlock::Create({n_layer, n_head, n_token, head_dim}, dtype).value();
  if (in.bytes() > 0) std::memcpy(in.data(), data, in.bytes());
  const std::string name = kvserve::DTypeName(dtype);
  for (const std::string& spec : {"fpsplit(dtype=" + name + ")|rans", "fpsplit(dtype=" + name + ")|zstd"}) {
    auto frame = kvserve::EncodeKv(in, spec);
    if (!frame.ok()) __builtin_trap();
    kvserve::KvBlock out;
    if (!kvserve::DecodeKv(frame.value(), &out).ok()) __builtin_trap();
    if (out.bytes() != in.bytes()) __builtin_trap();
    if (in.bytes() > 0 && std::memcmp(out.data(), in.data(), in.bytes()) != 0) __builtin_trap();
  }
  auto fp8 = kvserve::EncodeKv(in, "fp8|rans");
  if (fp8.ok()) {
    kvserve::KvBlock out;
    if (!kvserve::DecodeKv(fp8.value(), &out).ok() || !(out.shape() == in.shape())) __builtin_trap();
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (kvserve::DType dt : {kvserve::DType::kF16, kvserve::DType::kBF16, kvserve::DType::kE4M3, kvserve::DType::kE5M2})
    Check(data, size, dt);
  return 0;
}
