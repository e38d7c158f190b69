// Internal stage interface. A stage is one step of a strategy; its Encode consumes the previous
// stage's output kind and produces its own, and Decode inverts it. Stages see only KV types and
// bytes: never the model, the network or the profiler.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kvserve/codec.h"
#include "kv/parallel.h"
#include "kvserve/kv.h"

namespace kvserve {

struct StageContext {
  int threads = 1;
  uint64_t max_decoded_bytes = uint64_t{16} << 30;
};

// Exactly one of tensor / bytes is set, by the kind the stage declares.
struct StageInput {
  const KvBlock* tensor = nullptr;
  std::span<const uint8_t> bytes;
};
struct StageOutput {
  KvBlock* tensor = nullptr;            // Decode to a tensor: shape and dtype are preset by the caller
  ByteBuffer* bytes = nullptr;  // Encode to bytes: append (the vector may hold a frame header)
};

class Stage {
 public:
  virtual ~Stage() = default;
  virtual Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const = 0;
  // For a stage that outputs a tensor when encoding, the decoder receives the tensor and writes
  // `out.tensor`; for bytes output it receives bytes. `out.tensor`'s shape/dtype say what to produce.
  virtual Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const = 0;
};

using StageFactory = Result<std::unique_ptr<Stage>> (*)(const StageSpec& spec);

struct StageRegistration {
  StageInfo info;
  StageFactory factory;
};

// Each stage file defines one of these; registry.cc lists them.
StageRegistration CastStageRegistration();
StageRegistration QuantStageRegistration();
StageRegistration ZstdStageRegistration();

const std::vector<StageRegistration>& StageRegistry();
Result<std::unique_ptr<Stage>> MakeStage(const StageSpec& spec);

}  // namespace kvserve
