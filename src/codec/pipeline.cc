// Pipeline: composes registered stages into a strategy, and wraps their output in a frame.
// Encode runs stages first to last; decode runs them last to first.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "codec/stage.h"
#include "kvserve/codec.h"
#include "kvserve/frame.h"

namespace kvserve {

namespace {
// Shape of the tensor entering each stage, and (last entry) of what the pipeline decodes to.
std::vector<KvShape> LevelShapes(const std::vector<Stage*>& stages, const KvShape& input) {
  std::vector<KvShape> s = {input};
  for (const Stage* st : stages) s.push_back(st->OutputShape(s.back()));
  return s;
}

// Upper bound on any byte level of a frame of `shape` through `n_stages` stages (see DecodeView).
uint64_t MaxByteLevelSize(const KvShape& shape, size_t n_stages) {
  return 16 * shape.numel() + (uint64_t{1} << 20) * n_stages;
}

// A pipeline call's intermediate results: tensor and byte levels, two of each, alternating.
struct Intermediates {
  KvBlock tensors[2];
  ByteBuffer bufs[2];
};

// Intermediates are kept between calls, pages and all: fresh memory costs page faults
// comparable to the codec work itself (a first touch is ~50x a warm write on a VM). They are
// lent from one small process-wide pool rather than kept per thread, because serving runs each
// request's encode and decode on a thread of its own (the prefill node's encoder, the decode
// node's connection), which would otherwise fault its intermediates in anew every request.
class IntermediatesLease {
 public:
  IntermediatesLease() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      held_ = std::move(free_.back());
      free_.pop_back();
    }
    if (held_ == nullptr) held_ = std::make_unique<Intermediates>();
  }
  ~IntermediatesLease() {
    std::lock_guard<std::mutex> lock(mu_);
    // As many as calls run at once (a thread pool's worth, or a busy node's transfers); more
    // would only hold memory.
    static const size_t kept = std::max<size_t>(4, std::thread::hardware_concurrency());
    if (free_.size() < kept) free_.push_back(std::move(held_));
  }
  IntermediatesLease(const IntermediatesLease&) = delete;
  IntermediatesLease& operator=(const IntermediatesLease&) = delete;
  Intermediates* operator->() { return held_.get(); }

 private:
  static inline std::mutex mu_;
  static inline std::vector<std::unique_ptr<Intermediates>> free_;
  std::unique_ptr<Intermediates> held_;
};
}  // namespace

Pipeline::Pipeline() = default;
Pipeline::Pipeline(Pipeline&& o) noexcept
    : env_(o.env_), canonical_(std::move(o.canonical_)), stages_(std::move(o.stages_)), infos_(std::move(o.infos_)) {
  o.stages_.clear();
}
Pipeline& Pipeline::operator=(Pipeline&& o) noexcept {
  if (this != &o) {
    for (Stage* s : stages_) delete s;
    env_ = o.env_;
    canonical_ = std::move(o.canonical_);
    stages_ = std::move(o.stages_);
    infos_ = std::move(o.infos_);
    o.stages_.clear();
  }
  return *this;
}
Pipeline::~Pipeline() {
  for (Stage* s : stages_) delete s;
}

Result<Pipeline> Pipeline::Create(std::string_view text, const CodecEnv& env) {
  KV_ASSIGN_OR_RETURN(StrategySpec spec, ParseStrategy(text));
  Pipeline p;
  p.env_ = env;
  p.canonical_ = spec.Canonical();
  // Refused here, not when a frame is read back: the frame header stores the spec.
  if (p.canonical_.size() > kFrameMaxSpec) {
    return Status::InvalidArgument("strategy is " + std::to_string(p.canonical_.size()) +
                                   " bytes in canonical form, above the frame limit of " + std::to_string(kFrameMaxSpec));
  }
  for (const auto& st : spec.stages) {
    KV_ASSIGN_OR_RETURN(std::unique_ptr<Stage> stage, MakeStage(st, env));
    p.stages_.push_back(stage.release());
    p.infos_.push_back(FindStageInfo(st.name));
  }
  return p;
}


Status Pipeline::Encode(const KvBlock& block, ByteBuffer* frame, const CodecOptions& opts) const {
  return EncodeTagged(block, 0, block.shape().n_layer, frame, opts);
}

Status Pipeline::EncodeLayers(const KvBlock& block, uint32_t layer_begin, uint32_t n_layers, ByteBuffer* frame,
                              const CodecOptions& opts) const {
  KV_ASSIGN_OR_RETURN(KvBlock layers, block.LayerView(layer_begin, n_layers));
  return EncodeLayerSlice(layers, layer_begin, block.shape().n_layer, frame, opts);
}

Status Pipeline::EncodeLayerSlice(const KvBlock& layers, uint32_t layer_begin, uint32_t n_layer_total,
                                  ByteBuffer* frame, const CodecOptions& opts) const {
  if (uint64_t{layer_begin} + layers.shape().n_layer > n_layer_total) {
    return Status::InvalidArgument("layers " + std::to_string(layer_begin) + ".." +
                                   std::to_string(uint64_t{layer_begin} + layers.shape().n_layer) +
                                   " exceed the request's n_layer " + std::to_string(n_layer_total));
  }
  KvShape whole = layers.shape();
  whole.n_layer = n_layer_total;
  const std::vector<KvShape> shapes = LevelShapes(stages_, whole);
  if (shapes.back().n_token != whole.n_token && opts.token_scores == nullptr) {
    return Status::InvalidArgument("per-layer frames of '" + canonical_ +
                                   "' need token scores (CodecOptions::token_scores), so that every layer keeps the same tokens");
  }
  // Stages that name absolute layers get their parameters rewritten for this range.
  KV_ASSIGN_OR_RETURN(StrategySpec spec, ParseStrategy(canonical_));
  bool sliced = false;
  for (StageSpec& st : spec.stages) {
    for (const StageRegistration& r : StageRegistry()) {
      if (r.info.name != st.name || r.slice_layers == nullptr) continue;
      KV_ASSIGN_OR_RETURN(StageSpec cut, r.slice_layers(st, whole, layer_begin, layers.shape().n_layer));
      sliced = sliced || cut.Canonical() != st.Canonical();
      st = std::move(cut);
    }
  }
  if (!sliced) return EncodeTagged(layers, layer_begin, n_layer_total, frame, opts);
  KV_ASSIGN_OR_RETURN(Pipeline cut, Pipeline::Create(spec.Canonical(), env_));
  return cut.EncodeTagged(layers, layer_begin, n_layer_total, frame, opts);
}

namespace {
// After the stages have written the frame's codes (or values) into `out`: an owning block takes
// the frame's FP8 scales; a view (an engine's cache) keeps its own, so each slab is converted
// from the frame's scale to the view's — FP8 codes re-rounded, other dtypes given the values.
// Nothing is touched where the two agree (the usual case: one model's scales on both sides).
Status ToDestinationScales(const FrameHeader& h, KvBlock* out) {
  if (!out->is_view()) return out->set_fp8_scales(h.fp8_scales);
  if (h.fp8_scales.empty() && out->fp8_scales().empty()) return Status::Ok();
  const KvShape& shape = out->shape();
  std::vector<float> mul(shape.n_slab());
  bool any = false;
  for (uint64_t s = 0; s < shape.n_slab(); ++s) {
    mul[s] = h.fp8_scales.ForSlab(shape, s) / out->fp8_scales().ForSlab(shape, s);
    any |= mul[s] != 1.0f;
  }
  if (any) out->ScaleSlabs(mul);
  return Status::Ok();
}
}  // namespace

Status Pipeline::EncodeTagged(const KvBlock& block, uint32_t layer_begin, uint32_t n_layer_total, ByteBuffer* frame,
                              const CodecOptions& opts) const {
  KV_RETURN_IF_ERROR(block.shape().Validate());
  const std::vector<KvShape> shapes = LevelShapes(stages_, block.shape());
  const bool selects = shapes.back().n_token != block.shape().n_token;
  if (selects && !block.positions().empty()) {
    return Status::InvalidArgument("strategy '" + canonical_ +
                                   "' selects tokens of a block whose tokens were already selected; select once");
  }
  if (uint64_t{block.token_offset()} + block.shape().n_token > (uint64_t{1} << 32)) {
    return Status::OutOfRange("tokens from " + std::to_string(block.token_offset()) + " to " +
                              std::to_string(uint64_t{block.token_offset()} + block.shape().n_token) +
                              " do not fit 32-bit positions");
  }
  frame->clear();
  FrameHeader h;
  h.dtype = block.dtype();
  h.shape = block.shape();
  h.token_offset = block.token_offset();
  h.request_id = opts.request_id;
  h.layer_begin = layer_begin;
  h.n_layer_total = n_layer_total;
  h.spec = canonical_;
  // A selecting stage's kept positions go in the header; they are patched in once known. A block
  // selected earlier (decoded from such a frame) carries its positions through as they are.
  h.has_positions = selects || !block.positions().empty();
  if (selects) h.positions.assign(shapes.back().n_token, 0);
  else h.positions = block.positions();
  // Stages code an FP8 cache's codes; its scales ride in the header for the decoder.
  h.fp8_scales = block.fp8_scales();
  if (h.header_len() > UINT16_MAX) {
    return Status::OutOfRange("frame header of " + std::to_string(h.header_len()) + " bytes (" +
                              std::to_string(h.positions.size()) + " token positions, " +
                              std::to_string(h.fp8_scales.scale.size()) + " FP8 scales) is above 65535: split the block");
  }
  AppendFrameHeader(h, frame);
  // Room for a payload as large as the block and the checksum: without it the checksum's append
  // reallocates an exactly sized payload, copying the frame and holding it twice. Pages never
  // written are never resident, so the reserve costs address space only (capped at 1 GiB, so a
  // huge block does not ask for a second block's worth of it at once).
  frame->reserve(frame->size() + std::min<size_t>(block.bytes(), size_t{1} << 30) + 64);
  if (stages_.empty()) {
    const size_t slab_bytes = block.shape().slab_numel() * DTypeSize(block.dtype());
    ByteBuffer gathered;  // a paged block's slab
    for (uint64_t s = 0; s < block.shape().n_slab(); ++s) {
      const uint8_t* src = block.ReadSlab(s, gathered);
      frame->insert(frame->end(), src, src + slab_bytes);
    }
    return FinishFrame(frame, 0, opts.pool);
  }
  const std::vector<const StageInfo*>& infos = infos_;
  StageContext ctx;
  ctx.pool = opts.pool;
  ctx.max_decoded_bytes = opts.max_decoded_bytes;
  ctx.token_scores = opts.token_scores;
  ctx.first_slab = uint64_t{layer_begin} * 2 * block.shape().n_head_kv;
  StageInput in;
  in.tensor = &block;
  std::vector<uint32_t> kept;  // positions a selecting stage kept; later transforms need not carry them
  IntermediatesLease lease;
  KvBlock* const tensors = lease->tensors;
  ByteBuffer* const bufs = lease->bufs;
  std::vector<CodeSection> sections;
  for (size_t i = 0; i < stages_.size(); ++i) {
    const bool last = i + 1 == stages_.size();
    if (infos[i]->input == DataKind::kSymbols) {
      sections = stages_[i - 1]->CodeSections(shapes[i - 1]);
      ctx.sections = &sections;
    }
    StageOutput out;
    if (infos[i]->output == DataKind::kTensor) {
      out.tensor = &tensors[i % 2];
    } else {
      out.bytes = last ? frame : &bufs[i % 2];
      if (!last) out.bytes->clear();
    }
    KV_RETURN_IF_ERROR(stages_[i]->Encode(in, out, ctx).WithContext("encoding stage '" + infos[i]->name + "'"));
    in = StageInput{};
    if (out.tensor) {
      in.tensor = out.tensor;
      if (!out.tensor->positions().empty()) kept = out.tensor->positions();
      if (!(out.tensor->shape() == shapes[i + 1])) {
        return Status::Internal("stage '" + infos[i]->name + "' produced " + out.tensor->shape().ToString() +
                                ", announced " + shapes[i + 1].ToString());
      }
    } else {
      in.bytes = *out.bytes;
    }
  }
  if (selects) {
    if (kept.size() != h.positions.size()) return Status::Internal("selected positions missing");
    std::memcpy(frame->data() + kFrameFixedHeader + canonical_.size() + 4, kept.data(), 4 * kept.size());
  }
  if (infos.back()->output == DataKind::kTensor) {
    // A chain of transforms with no packing stage: store the tensor raw, dtype first, in the
    // input's dtype (transforms compute in f32; storing that would double an fp16 block).
    const KvBlock* t = in.tensor;
    KvBlock converted;
    if (t->dtype() != block.dtype()) {
      KV_ASSIGN_OR_RETURN(converted, t->ConvertTo(block.dtype()));
      t = &converted;
    }
    frame->push_back(static_cast<uint8_t>(t->dtype()));
    frame->insert(frame->end(), t->data(), t->data() + t->bytes());
  }
  return FinishFrame(frame, 0, opts.pool);
}

Status Pipeline::DecodeView(const FrameView& v, KvBlock* out, const CodecOptions& opts) const {
  const std::vector<Stage*>& stages = stages_;
  const std::vector<const StageInfo*>& infos = infos_;
  // Decoding inverts every stage except token selection: level k decodes to the shape that
  // entered stage k, with the kept token count.
  std::vector<KvShape> shapes = LevelShapes(stages, v.header.shape);
  const uint32_t kept_tokens = shapes.back().n_token;
  const KvShape stored = shapes.back();
  for (KvShape& sh : shapes) sh.n_token = kept_tokens;
  const KvShape& shape = shapes.front();
  // A selecting strategy stores the kept tokens' positions, within the block's span; any other
  // may carry the positions of a block selected before, one per token.
  const bool selects = kept_tokens != v.header.shape.n_token;
  const std::vector<uint32_t>& pos = v.header.positions;
  if ((selects && !v.header.has_positions) || (v.header.has_positions && pos.size() != kept_tokens) ||
      (selects && !pos.empty() && uint64_t{pos.back()} - v.header.token_offset >= v.header.shape.n_token)) {
    return Status::Corrupt("frame keeps " + std::to_string(pos.size()) + " token positions, strategy '" +
                           v.header.spec + "' keeps " + std::to_string(kept_tokens) + " of " +
                           std::to_string(v.header.shape.n_token) + " tokens from " +
                           std::to_string(v.header.token_offset));
  }
  const uint64_t out_bytes = shape.numel() * DTypeSize(v.header.dtype);
  if (out_bytes > opts.max_decoded_bytes) {
    return Status::OutOfRange("frame would decode to " + std::to_string(out_bytes) + " bytes, above the limit of " +
                              std::to_string(opts.max_decoded_bytes));
  }
  // A view is written in its own dtype; an owning block takes the frame's.
  const DType out_dtype = out->is_view() ? out->dtype() : v.header.dtype;
  if (out->is_view() && !(out->shape() == shape)) {
    return Status::InvalidArgument("frame decodes to " + shape.ToString() + ", the destination view is " +
                                   out->shape().ToString());
  }
  if (stages.empty()) {
    if (v.payload.size() != out_bytes) {
      return Status::Corrupt("identity frame payload is " + std::to_string(v.payload.size()) + " bytes, shape " +
                             shape.ToString() + " " + DTypeName(v.header.dtype) + " needs " + std::to_string(out_bytes));
    }
    KV_RETURN_IF_ERROR(out->Reset(shape, out_dtype));
    out->set_token_offset(v.header.token_offset);
    out->set_positions(v.header.positions);
    const size_t n = shape.slab_numel(), in_slab = n * DTypeSize(v.header.dtype);
    std::vector<float> tmp(out_dtype == v.header.dtype ? 0 : n);
    ByteBuffer scratch;  // a paged destination's slab
    for (uint64_t s = 0; s < shape.n_slab(); ++s) {
      const uint8_t* src = v.payload.data() + s * in_slab;
      uint8_t* dst = out->SlabToWrite(s, scratch);
      if (out_dtype == v.header.dtype) {
        std::memcpy(dst, src, in_slab);
      } else {
        ConvertToF32(v.header.dtype, src, tmp.data(), n);
        ConvertFromF32(out_dtype, tmp.data(), dst, n);
      }
      out->WroteSlab(s, dst);
    }
    return ToDestinationScales(v.header, out);
  }
  StageContext ctx;
  ctx.pool = opts.pool;
  // A byte level decodes to what its encoder was given, which no stage makes larger than 16
  // bytes per element of the tensor plus bounded tables: a payload claiming more is a
  // decompression bomb, refused before its buffer is allocated.
  ctx.max_decoded_bytes = std::min<uint64_t>(opts.max_decoded_bytes, MaxByteLevelSize(shape, stages.size()));
  ctx.first_slab = uint64_t{v.header.layer_begin} * 2 * v.header.shape.n_head_kv;
  StageInput in;
  IntermediatesLease lease;
  KvBlock* const tensors = lease->tensors;
  ByteBuffer* const bufs = lease->bufs;
  if (infos.back()->output == DataKind::kTensor) {
    if (v.payload.empty() || v.payload[0] > static_cast<uint8_t>(kLastDType)) {
      return Status::Corrupt("raw tensor payload has no valid dtype byte");
    }
    const DType dt = static_cast<DType>(v.payload[0]);
    if (v.payload.size() != 1 + stored.numel() * DTypeSize(dt)) {
      return Status::Corrupt("raw tensor payload is " + std::to_string(v.payload.size() - 1) + " bytes, expected " +
                             std::to_string(stored.numel() * DTypeSize(dt)));
    }
    KV_RETURN_IF_ERROR(tensors[1].Reset(stored, dt));
    std::memcpy(tensors[1].data(), v.payload.data() + 1, tensors[1].bytes());
    in.tensor = &tensors[1];
  } else {
    in.bytes = v.payload;
  }
  std::vector<CodeSection> sections;
  // A token-selecting first stage decodes as the identity (the kept tokens pass through): the
  // stage after it writes straight into the destination instead of through a copy.
  const bool skip_first = stages.size() > 1 && infos[0]->selects_tokens && infos[1]->input == DataKind::kTensor &&
                          shapes[0] == shapes[1];
  for (size_t k = stages.size(); k-- > (skip_first ? 1 : 0);) {
    if (infos[k]->input == DataKind::kSymbols) {
      sections = stages[k - 1]->CodeSections(shapes[k - 1]);
      ctx.sections = &sections;
    }
    StageOutput o;
    if (infos[k]->input == DataKind::kTensor) {
      // A selecting stage does not restore dropped tokens: every tensor level decodes to the kept ones.
      const bool into_out = k == 0 || (skip_first && k == 1);
      o.tensor = into_out ? out : &tensors[k % 2];
      KV_RETURN_IF_ERROR(o.tensor->Reset(shapes[k], into_out ? out_dtype : DType::kF32));
    } else {
      o.bytes = &bufs[k % 2];
      o.bytes->clear();
    }
    KV_RETURN_IF_ERROR(stages[k]->Decode(in, o, ctx).WithContext("decoding stage '" + infos[k]->name + "'"));
    in = StageInput{};
    if (o.tensor) in.tensor = o.tensor;
    else in.bytes = *o.bytes;
  }
  out->set_token_offset(v.header.token_offset);
  out->set_positions(v.header.positions);
  return ToDestinationScales(v.header, out);
}

Status Pipeline::Decode(std::span<const uint8_t> frame, KvBlock* out, const CodecOptions& opts) const {
  KV_ASSIGN_OR_RETURN(FrameView v, ParseFrame(frame, opts.pool));
  if (v.header.spec != canonical_) {
    return Status::InvalidArgument("frame was encoded with '" + v.header.spec + "', this pipeline is '" + canonical_ + "'");
  }
  return DecodeView(v, out, opts);
}

Result<ByteBuffer> EncodeKv(const KvBlock& block, std::string_view spec, const CodecOptions& opts, const CodecEnv& env) {
  KV_ASSIGN_OR_RETURN(Pipeline p, Pipeline::Create(spec, env));
  ByteBuffer frame;
  KV_RETURN_IF_ERROR(p.Encode(block, &frame, opts));
  return frame;
}

namespace {
Result<Pipeline> PipelineForFrame(const FrameView& v, const CodecEnv& env) {
  auto p = Pipeline::Create(v.header.spec, env);
  if (!p.ok() && p.status().code() == StatusCode::kInvalidArgument && ParseStrategy(v.header.spec).ok()) {
    return p.status();  // a valid spec this caller cannot run (a lowrank basis it lacks)
  }
  if (!p.ok()) return Status::Corrupt("frame strategy '" + v.header.spec + "' is invalid: " + p.status().message());
  return p;
}
}  // namespace

Status DecodeKv(std::span<const uint8_t> frame, KvBlock* out, const CodecOptions& opts, const CodecEnv& env) {
  KV_ASSIGN_OR_RETURN(FrameView v, ParseFrame(frame, opts.pool));
  if (opts.require_request_id && v.header.request_id != *opts.require_request_id) {
    return Status::Corrupt("frame carries request id " + std::to_string(v.header.request_id) + ", not the " +
                           std::to_string(*opts.require_request_id) + " it was fetched for");
  }
  KV_ASSIGN_OR_RETURN(Pipeline p, PipelineForFrame(v, env));
  return p.DecodeView(v, out, opts);
}

LayerAssembler::LayerAssembler(uint64_t request_id, KvBlock* dest, const CodecEnv& env)
    : request_id_(request_id), dest_(dest), env_(env), have_(dest->shape().n_layer, false) {}

Status LayerAssembler::Add(std::span<const uint8_t> frame, const CodecOptions& opts) {
  KV_ASSIGN_OR_RETURN(FrameView v, ParseFrame(frame, opts.pool));
  const FrameHeader& h = v.header;
  const KvShape& want = dest_->shape();
  if (h.request_id != request_id_) {
    return Status::InvalidArgument("frame belongs to request " + std::to_string(h.request_id) + ", not " +
                                   std::to_string(request_id_));
  }
  if (h.n_layer_total != want.n_layer) {
    return Status::InvalidArgument("frame is part of a " + std::to_string(h.n_layer_total) +
                                   "-layer request, the destination has " + std::to_string(want.n_layer) + " layers");
  }
  for (uint32_t l = h.layer_begin; l < h.layer_begin + h.shape.n_layer; ++l) {
    if (have_[l]) return Status::InvalidArgument("layer " + std::to_string(l) + " of request " + std::to_string(request_id_) + " arrived twice");
  }
  if (!first_ && (h.token_offset != dest_->token_offset() || h.positions != dest_->positions())) {
    return Status::InvalidArgument("frame of layers from " + std::to_string(h.layer_begin) +
                                   " covers other tokens than the request's earlier frames");
  }
  Pipeline* p = nullptr;
  for (auto& [spec, pipe] : pipelines_) {
    if (spec == h.spec) p = &pipe;
  }
  if (p == nullptr) {
    KV_ASSIGN_OR_RETURN(Pipeline made, PipelineForFrame(v, env_));
    pipelines_.emplace_back(h.spec, std::move(made));
    p = &pipelines_.back().second;
  }
  KV_ASSIGN_OR_RETURN(KvBlock layers, dest_->LayerView(h.layer_begin, h.shape.n_layer));
  KV_RETURN_IF_ERROR(p->DecodeView(v, &layers, opts).WithContext("layers from " + std::to_string(h.layer_begin)));
  if (first_) {
    first_ = false;
    dest_->set_token_offset(h.token_offset);
    dest_->set_positions(h.positions);
  }
  for (uint32_t l = h.layer_begin; l < h.layer_begin + h.shape.n_layer; ++l) have_[l] = true;
  layers_done_ += h.shape.n_layer;
  return Status::Ok();
}

}  // namespace kvserve
