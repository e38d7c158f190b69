// cast(dtype=f16|bf16|e4m3|e5m2): stores the tensor in a 16- or 8-bit float type, unscaled (FP8
// saturates: `fp8` is the scaled form). Lossless from that type.
#include <cstring>

#include "codec/stage.h"

namespace kvserve {
namespace {

class CastStage final : public Stage {
 public:
  explicit CastStage(DType dtype) : dtype_(dtype) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const size_t es = DTypeSize(dtype_);
    const size_t start = out.bytes->size();
    out.bytes->resize(start + t.shape().numel() * es);
    uint8_t* dst = out.bytes->data() + start;
    const size_t n = t.shape().slab_numel();
    ParallelFor(ctx.pool, t.shape().n_slab(), [&](uint64_t s) {
      thread_local ByteBuffer scratch;
      const uint8_t* src = t.ReadSlab(s, scratch);
      if (t.dtype() == dtype_) {
        std::memcpy(dst + s * n * es, src, n * es);
        return;
      }
      thread_local std::vector<float> buf;
      buf.resize(n);
      ConvertToF32(t.dtype(), src, buf.data(), n);
      ConvertFromF32(dtype_, buf.data(), dst + s * n * es, n);
    });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    KvBlock& t = *out.tensor;
    const size_t es = DTypeSize(dtype_);
    const size_t n = t.shape().slab_numel();
    if (in.bytes.size() != t.shape().numel() * es) {
      return Status::Corrupt("cast payload is " + std::to_string(in.bytes.size()) + " bytes, expected " +
                             std::to_string(t.shape().numel() * es));
    }
    const uint8_t* src = in.bytes.data();
    ParallelFor(ctx.pool, t.shape().n_slab(), [&](uint64_t s) {
      thread_local ByteBuffer scratch;
      uint8_t* dst = t.SlabToWrite(s, scratch);
      if (t.dtype() == dtype_) {
        std::memcpy(dst, src + s * n * es, n * es);
      } else {
        thread_local std::vector<float> buf;
        buf.resize(n);
        ConvertToF32(dtype_, src + s * n * es, buf.data(), n);
        ConvertFromF32(t.dtype(), buf.data(), dst, n);
      }
      t.WroteSlab(s, dst);
    });
    return Status::Ok();
  }

 private:
  DType dtype_;
};

Result<std::unique_ptr<Stage>> MakeCast(const StageSpec& spec, const CodecEnv&) {
  KV_ASSIGN_OR_RETURN(DType dt, ParseDType(spec.Get("dtype")));
  return std::unique_ptr<Stage>(new CastStage(dt));
}

}  // namespace

StageRegistration CastStageRegistration() {
  StageInfo info;
  info.name = "cast";
  info.summary = "store K and V as 16- or 8-bit floats, unscaled (lossless for data already in that type)";
  info.input = DataKind::kTensor;
  info.output = DataKind::kBytes;
  info.params = {{"dtype", ParamSpec::Type::kEnum, 0, 0, {"f16", "bf16", "e4m3", "e5m2"}, "f16", "storage type"}};
  return {info, &MakeCast};
}

}  // namespace kvserve
