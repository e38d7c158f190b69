// zstd(level=N): lossless compression of the previous stage's bytes with libzstd.
// Payload: u64 raw size, then one zstd frame.
#include <zstd.h>

#include <cstring>
#include <memory>

#include "codec/stage.h"

namespace kvserve {
namespace {

class ZstdStage final : public Stage {
 public:
  explicit ZstdStage(int level) : level_(level) {}

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const uint64_t raw = in.bytes.size();
    const size_t start = out.bytes->size();
    const size_t bound = ZSTD_compressBound(raw);
    out.bytes->resize(start + 8 + bound);
    std::memcpy(out.bytes->data() + start, &raw, 8);
    // One context per thread, reused: creating one per call re-allocates its window every time.
    thread_local std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> cctx(ZSTD_createCCtx(), &ZSTD_freeCCtx);
    if (cctx == nullptr) return Status::Internal("ZSTD_createCCtx failed");
    ZSTD_CCtx_reset(cctx.get(), ZSTD_reset_session_and_parameters);
    ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, level_);
    ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_nbWorkers, ctx.pool && ctx.pool->size() > 1 ? ctx.pool->size() : 0);
    const size_t n = ZSTD_compress2(cctx.get(), out.bytes->data() + start + 8, bound, in.bytes.data(), raw);
    if (ZSTD_isError(n)) return Status::Internal(std::string("zstd compression failed: ") + ZSTD_getErrorName(n));
    out.bytes->resize(start + 8 + n);
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    if (in.bytes.size() < 8) return Status::Corrupt("zstd payload shorter than its 8-byte size field");
    uint64_t raw;
    std::memcpy(&raw, in.bytes.data(), 8);
    if (raw > ctx.max_decoded_bytes) {
      return Status::OutOfRange("zstd payload claims " + std::to_string(raw) + " bytes, above the limit of " +
                                std::to_string(ctx.max_decoded_bytes));
    }
    const unsigned long long content = ZSTD_getFrameContentSize(in.bytes.data() + 8, in.bytes.size() - 8);
    if (content == ZSTD_CONTENTSIZE_ERROR || content != raw) {
      return Status::Corrupt("zstd frame content size does not match the stored size " + std::to_string(raw));
    }
    out.bytes->resize(raw);
    thread_local std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> dctx(ZSTD_createDCtx(), &ZSTD_freeDCtx);
    if (dctx == nullptr) return Status::Internal("ZSTD_createDCtx failed");
    const size_t n = ZSTD_decompressDCtx(dctx.get(), out.bytes->data(), raw, in.bytes.data() + 8, in.bytes.size() - 8);
    if (ZSTD_isError(n)) return Status::Corrupt(std::string("zstd: ") + ZSTD_getErrorName(n));
    if (n != raw) return Status::Corrupt("zstd decoded " + std::to_string(n) + " bytes, expected " + std::to_string(raw));
    return Status::Ok();
  }

 private:
  int level_;
};

Result<std::unique_ptr<Stage>> MakeZstd(const StageSpec& spec, const CodecEnv&) {
  return std::unique_ptr<Stage>(new ZstdStage(static_cast<int>(spec.GetInt("level"))));
}

}  // namespace

StageRegistration ZstdStageRegistration() {
  StageInfo info;
  info.name = "zstd";
  info.summary = "lossless zstd over the packed bytes";
  info.input = DataKind::kBytes;
  info.output = DataKind::kBytes;
  info.lossless = true;
  info.params = {{"level", ParamSpec::Type::kInt, 1, 19, {}, "3", "zstd compression level"}};
  return {info, &MakeZstd};
}

}  // namespace kvserve
