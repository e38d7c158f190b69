// The codec API: strategy specs (text that round-trips), the stage registry that describes the
// strategy space, and Pipeline, which encodes a KvBlock into a frame and back.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"
#include "kvserve/thread_pool.h"

namespace kvserve {

// What flows between stages. The pipeline's input is always a tensor; a pipeline may end on
// any kind (a tensor at the end is stored raw). `symbols` are bytes whose quantisation codes the
// producing stage can locate (code sections), so an entropy coder can model them; any stage
// that takes bytes takes symbols too.
enum class DataKind : uint8_t { kTensor = 0, kBytes = 1, kSymbols = 2 };
const char* DataKindName(DataKind kind);
// Whether a stage consuming `input` accepts what a stage producing `produced` gives it.
bool KindAccepts(DataKind input, DataKind produced);

// One parameter of a stage, as the registry describes it. The profiler reads the search space
// from these descriptions; the parser validates against them.
struct ParamSpec {
  enum class Type : uint8_t { kInt, kFloat, kEnum, kList };  // kList: "auto" or dot-separated integers
  std::string name;
  Type type = Type::kInt;
  double min = 0, max = 0;            // kInt / kFloat: inclusive range
  std::vector<std::string> choices;   // kEnum
  std::string default_value;
  std::string help;
  // How the profiler's GP sees a number (before scaling to [0,1]): quality varies smoothly in
  // the transformed value. kStep: 2^-x (quantisation step of x bits); kInverse: 1/x (step of
  // x levels); kLog / kLog1p: for sizes spanning orders of magnitude.
  enum class Scale : uint8_t { kLinear, kLog, kLog1p, kInverse, kStep };
  Scale scale = Scale::kLinear;
  // kList only: a sequence (order and repeats kept, "auto|i.j.k...") instead of a set (sorted,
  // without repeats, so that every set has one canonical text).
  bool sequence = false;
  std::string RangeText() const;      // "1..8", "channel|token", "0.0..1.0", "auto|i.j.k"
};

struct StageInfo {
  std::string name;
  std::string summary;
  DataKind input = DataKind::kTensor;
  DataKind output = DataKind::kBytes;
  bool lossless = false;
  bool selects_tokens = false;  // keeps a subset of the tokens (their positions go in the frame)
  std::vector<ParamSpec> params;
  const ParamSpec* FindParam(std::string_view key) const;
};

// Every registered stage, in a stable order.
const std::vector<StageInfo>& RegisteredStages();
const StageInfo* FindStageInfo(std::string_view name);

// A parsed stage with every parameter present (defaults filled in), in registry order.
struct StageSpec {
  std::string name;
  std::vector<std::pair<std::string, std::string>> params;
  const std::string& Get(std::string_view key) const;  // key must be one of the stage's params
  void Set(std::string_view key, std::string value);    // likewise; the caller keeps it canonical
  int64_t GetInt(std::string_view key) const;
  double GetFloat(std::string_view key) const;
  std::string Canonical() const;
};

struct StrategySpec {
  std::vector<StageSpec> stages;  // empty = identity ("none")
  std::string Canonical() const;
};

// Grammar: spec := "none" | stage ("|" stage)*; stage := name ["(" [kv ("," kv)*] ")"];
// kv := key "=" value. Whitespace between tokens is ignored. Errors name the character position
// and the bad stage, key or value. Stage order is type-checked against the registry.
Result<StrategySpec> ParseStrategy(std::string_view text);
Result<std::string> CanonicalStrategy(std::string_view text);

struct CodecOptions {
  // Workers for stages that parallelise over slabs (null: the calling thread alone). The output
  // does not depend on it.
  ThreadPool* pool = nullptr;
  // Importance of each token of the block (e.g. attention it received at prefill), for token
  // selection; null when the caller has none (prune then falls back to key norms).
  const std::vector<float>* token_scores = nullptr;
  uint64_t max_decoded_bytes = uint64_t{16} << 30;  // refuse frames that would decode to more
  uint64_t request_id = 0;    // Encode: written into the frame header
  // DecodeKv: the frame's request id must be this (kCorrupt otherwise, before anything is
  // decoded): a value bound to the key it was stored under (PoolValueTag).
  std::optional<uint64_t> require_request_id;
};

class CalibrationStore;  // kvserve/calib.h

// What creating a pipeline may need from outside, always passed in by the caller: nothing is
// read from environment variables, source paths or process-global state.
struct CodecEnv {
  // Calibration artefacts (lowrank bases); null: a strategy that names one fails to create.
  CalibrationStore* calibration = nullptr;
};

class Stage;      // internal: src/codec/stage.h
struct FrameView;  // kvserve/frame.h

// Thread-safety: a Pipeline is immutable after Create; any number of threads may Encode and
// Decode with one Pipeline at once (scratch buffers are per thread).
class Pipeline {
 public:
  static Result<Pipeline> Create(std::string_view spec, const CodecEnv& env = {});
  Pipeline(Pipeline&&) noexcept;
  Pipeline& operator=(Pipeline&&) noexcept;
  ~Pipeline();

  const std::string& spec() const { return canonical_; }

  // Encodes `block` into one self-describing frame (see frame.h); `frame` is overwritten.
  Status Encode(const KvBlock& block, ByteBuffer* frame, const CodecOptions& opts = {}) const;
  // Encodes layers [layer_begin, layer_begin + n_layers) of `block` into a frame of their own
  // (no copy of the block), tagged with opts.request_id and the layer range, so a transfer can
  // stream a request layer by layer.
  Status EncodeLayers(const KvBlock& block, uint32_t layer_begin, uint32_t n_layers, ByteBuffer* frame,
                      const CodecOptions& opts = {}) const;
  // The same frame from `layers` alone: they hold layers [layer_begin, layer_begin +
  // layers.n_layer) of a request whose KV has n_layer_total layers, as an engine's connector is
  // handed one layer at a time. Byte for byte what EncodeLayers gives from the whole block.
  Status EncodeLayerSlice(const KvBlock& layers, uint32_t layer_begin, uint32_t n_layer_total, ByteBuffer* frame,
                          const CodecOptions& opts = {}) const;
  // Decodes a frame produced with this pipeline's spec. `out` is reshaped as needed and its
  // storage reused when large enough; when `out` is a view (KvBlock::View) the frame must
  // decode to exactly its shape and is written into the caller's memory, in the view's dtype.
  Status Decode(std::span<const uint8_t> frame, KvBlock* out, const CodecOptions& opts = {}) const;

 private:
  friend Status DecodeKv(std::span<const uint8_t> frame, KvBlock* out, const CodecOptions& opts, const CodecEnv& env);
  friend class LayerAssembler;
  // Decodes a frame already verified by ParseFrame.
  Status DecodeView(const FrameView& v, KvBlock* out, const CodecOptions& opts) const;
  Status EncodeTagged(const KvBlock& block, uint32_t layer_begin, uint32_t n_layer_total, ByteBuffer* frame,
                      const CodecOptions& opts) const;
  Pipeline();
  CodecEnv env_;
  std::string canonical_;
  std::vector<Stage*> stages_;
  std::vector<const StageInfo*> infos_;  // registry entries of stages_, same order
};

// Convenience: encode with a spec; decode any frame (its spec is read from the frame).
Result<ByteBuffer> EncodeKv(const KvBlock& block, std::string_view spec, const CodecOptions& opts = {},
                            const CodecEnv& env = {});
Status DecodeKv(std::span<const uint8_t> frame, KvBlock* out, const CodecOptions& opts = {}, const CodecEnv& env = {});

// Assembles one request's KV from its per-layer frames (EncodeLayers), decoding each straight
// into `dest` — an owning block or a view of the caller's cache, shaped as the whole request
// (all layers, the kept token count) — as it arrives, in any order. Checks that every piece
// belongs: same request id, layer count, shape, dtype-independent token range and kept
// positions; each layer exactly once. Pipelines are created once per strategy and reused.
// Not thread-safe: one assembler per request, fed by one thread.
class LayerAssembler {
 public:
  LayerAssembler(uint64_t request_id, KvBlock* dest, const CodecEnv& env = {});
  Status Add(std::span<const uint8_t> frame, const CodecOptions& opts = {});
  bool complete() const { return layers_done_ == dest_->shape().n_layer; }
  uint32_t layers_done() const { return layers_done_; }
  bool has_layer(uint32_t layer) const { return layer < have_.size() && have_[layer]; }
  // Token positions of the decoded KV (empty: contiguous from token_offset()), as set on dest.
  const std::vector<uint32_t>& positions() const { return dest_->positions(); }
  uint32_t token_offset() const { return dest_->token_offset(); }

 private:
  uint64_t request_id_;
  KvBlock* dest_;
  CodecEnv env_;
  std::vector<bool> have_;
  uint32_t layers_done_ = 0;
  bool first_ = true;
  std::vector<std::pair<std::string, Pipeline>> pipelines_;
};

}  // namespace kvserve
