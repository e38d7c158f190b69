// lowrank(rank, basis): projects every K and V vector of a head onto the first `rank` principal
// directions of that (layer, K/V, head), fitted offline on calibration KV (PCA, Eigen) and
// stored as an artefact that both sides hold, named in the spec by its id. The output tensor has
// head_dim = rank; decoding maps back (x = mean + c B_r^T). With rank = head_dim it is lossless
// up to float error.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <Eigen/Dense>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>

#include "codec/stage.h"
#include "kvserve/calib.h"
#include "kvserve/file.h"

namespace kvserve {

namespace {
// 16 floats as one value (GCC/Clang vector extension): one AVX-512 register, or several
// narrower ones on a baseline build.
typedef float Lanes16 __attribute__((vector_size(64)));

constexpr char kMagic[8] = {'K', 'V', 'L', 'R', 'B', 'A', 'S', '1'};

ByteBuffer Serialize(const LowRankBasis& b) {
  ByteBuffer out(kMagic, kMagic + 8);
  auto put = [&](const void* p, size_t n) { out.insert(out.end(), (const uint8_t*)p, (const uint8_t*)p + n); };
  put(&b.n_layer, 4), put(&b.n_head_kv, 4), put(&b.head_dim, 4);
  put(b.mean.data(), b.mean.size() * 4);
  put(b.basis.data(), b.basis.size() * 4);
  return out;
}
}  // namespace

Result<LowRankBasis> FitLowRankBasis(const std::vector<const KvBlock*>& samples) {
  if (samples.empty()) return Status::InvalidArgument("lowrank calibration needs at least one KV block");
  const KvShape& s0 = samples[0]->shape();
  LowRankBasis b;
  b.n_layer = s0.n_layer, b.n_head_kv = s0.n_head_kv, b.head_dim = s0.head_dim;
  const uint32_t D = s0.head_dim;
  b.mean.assign(b.n_slab() * D, 0.0f);
  b.basis.assign(b.n_slab() * D * D, 0.0f);
  for (const KvBlock* k : samples) {
    if (k->shape().n_layer != s0.n_layer || k->shape().n_head_kv != s0.n_head_kv || k->shape().head_dim != D) {
      return Status::InvalidArgument("calibration blocks differ in shape: " + k->shape().ToString() + " vs " + s0.ToString());
    }
  }
  std::vector<float> row(D);
  ByteBuffer gathered;
  for (uint64_t sl = 0; sl < b.n_slab(); ++sl) {
    Eigen::VectorXd sum = Eigen::VectorXd::Zero(D);
    Eigen::MatrixXd outer = Eigen::MatrixXd::Zero(D, D);
    double n = 0;
    for (const KvBlock* k : samples) {
      for (uint32_t t = 0; t < k->shape().n_token; ++t) {
        ConvertToF32(k->dtype(), k->ReadSlab(sl, gathered) + size_t(t) * D * DTypeSize(k->dtype()), row.data(), D);
        Eigen::VectorXd x = Eigen::Map<Eigen::VectorXf>(row.data(), D).cast<double>();
        sum += x;
        outer.noalias() += x * x.transpose();
        n += 1;
      }
    }
    if (n < 2) return Status::InvalidArgument("lowrank calibration needs at least two tokens");
    const Eigen::VectorXd mean = sum / n;
    const Eigen::MatrixXd cov = outer / n - mean * mean.transpose();
    Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(cov);
    for (uint32_t d = 0; d < D; ++d) {
      b.mean[sl * D + d] = float(mean[d]);
      for (uint32_t j = 0; j < D; ++j) {
        b.basis[(sl * D + d) * D + j] = float(es.eigenvectors()(d, D - 1 - j));  // decreasing variance
      }
    }
  }
  const ByteBuffer bytes = Serialize(b);
  b.id = XXH3_64bits(bytes.data(), bytes.size()) & ((uint64_t{1} << 52) - 1);
  return b;
}

Result<std::string> SaveLowRankBasis(const LowRankBasis& b, const std::string& dir) {
  const std::string path = dir + "/lowrank-" + std::to_string(b.id) + ".bin";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IoError("cannot create '" + dir + "': " + ec.message());
  const ByteBuffer bytes = Serialize(b);
  KV_RETURN_IF_ERROR(WriteFileAtomic(path, bytes));
  return path;
}

Result<std::shared_ptr<const LowRankBasis>> CalibrationStore::LowRank(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = lowrank_.find(id);
  if (it != lowrank_.end()) return it->second;
  KV_ASSIGN_OR_RETURN(std::shared_ptr<const LowRankBasis> b, LoadLowRankBasis(id, dir_));
  lowrank_[id] = b;
  return b;
}

Result<std::shared_ptr<const LowRankBasis>> LoadLowRankBasis(uint64_t id, const std::string& dir) {
  const std::string path = dir + "/lowrank-" + std::to_string(id) + ".bin";
  auto data = ReadFile(path);
  if (!data.ok()) {
    return Status::NotFound("lowrank basis " + std::to_string(id) + " is not in " + dir +
                            " (fit it with `kvserve calib lowrank`, or name the folder with --calib-dir)");
  }
  const ByteBuffer& d = data.value();
  auto b = std::make_shared<LowRankBasis>();
  if (d.size() < 20 || std::memcmp(d.data(), kMagic, 8) != 0) return Status::Corrupt("'" + path + "' is not a lowrank basis");
  std::memcpy(&b->n_layer, d.data() + 8, 4);
  std::memcpy(&b->n_head_kv, d.data() + 12, 4);
  std::memcpy(&b->head_dim, d.data() + 16, 4);
  const uint64_t D = b->head_dim, want = 20 + 4 * (b->n_slab() * D + b->n_slab() * D * D);
  if (D == 0 || D > 65536 || b->n_layer > 4096 || b->n_head_kv > 4096 || d.size() != want) {
    return Status::Corrupt("'" + path + "' has the wrong size for its shape");
  }
  b->mean.resize(b->n_slab() * D);
  b->basis.resize(b->n_slab() * D * D);
  std::memcpy(b->mean.data(), d.data() + 20, b->mean.size() * 4);
  std::memcpy(b->basis.data(), d.data() + 20 + b->mean.size() * 4, b->basis.size() * 4);
  if ((XXH3_64bits(d.data(), d.size()) & ((uint64_t{1} << 52) - 1)) != id) {
    return Status::Corrupt("'" + path + "' does not match its id (checksum mismatch)");
  }
  b->id = id;
  return std::shared_ptr<const LowRankBasis>(b);
}

namespace {

class LowRankStage final : public Stage {
 public:
  LowRankStage(uint32_t rank, uint64_t id, bool has_id, CalibrationStore* store)
      : rank_(rank), id_(id), has_id_(has_id), store_(store) {}

  KvShape OutputShape(const KvShape& in) const override {
    KvShape out = in;
    out.head_dim = std::min(rank_, in.head_dim);
    return out;
  }

  Result<std::shared_ptr<const LowRankBasis>> Basis(const KvShape& s) const {
    if (!has_id_) return Status::InvalidArgument("lowrank needs basis=<id> of one calibrated basis (kvserve calib lowrank)");
    if (store_ == nullptr) {
      return Status::InvalidArgument("lowrank basis " + std::to_string(id_) +
                                     " needs calibration data, and none was given (CodecEnv::calibration; the CLI's --calib-dir)");
    }
    KV_ASSIGN_OR_RETURN(std::shared_ptr<const LowRankBasis> b, store_->LowRank(id_));
    if (b->n_layer != s.n_layer || b->n_head_kv != s.n_head_kv || b->head_dim != s.head_dim) {
      return Status::InvalidArgument("lowrank basis " + std::to_string(id_) + " is for " + std::to_string(b->n_layer) +
                                     " layers x " + std::to_string(b->n_head_kv) + " heads x " +
                                     std::to_string(b->head_dim) + " dims, not " + s.ToString());
    }
    return b;
  }

  Status Encode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = t.shape();
    if (rank_ > s.head_dim) {
      return Status::InvalidArgument("lowrank rank=" + std::to_string(rank_) + " exceeds head_dim " + std::to_string(s.head_dim));
    }
    KV_ASSIGN_OR_RETURN(std::shared_ptr<const LowRankBasis> b, Basis(s));
    KV_RETURN_IF_ERROR(out.tensor->Reset(OutputShape(s), DType::kF32));
    out.tensor->set_token_offset(t.token_offset());
    out.tensor->set_positions(t.positions());
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t sl) {
      // Locals, not captures: the loop bounds stay in registers and the loops vectorise.
      const uint32_t D = s.head_dim, r = rank_;
      // Centred rows of a tile of kTile tokens; every coefficient sums over d in order, as the
      // plain loop does, but a tile's kTile x 16 sums stay in registers across d.
      constexpr uint32_t kTile = 4, kLanes = 16;
      thread_local std::vector<float> x;
      x.resize(size_t(kTile) * D);
      const float* mean = &b->mean[sl * D];
      const float* B = &b->basis[sl * D * D];
      float* c = reinterpret_cast<float*>(out.tensor->slab_at(sl));
      const size_t es = DTypeSize(t.dtype());
      thread_local ByteBuffer gathered;  // a paged input's slab
      const uint8_t* src = t.ReadSlab(sl, gathered);
      for (uint32_t tok = 0; tok < s.n_token; tok += kTile) {
        const uint32_t nt = std::min(kTile, s.n_token - tok);
        float* xt = x.data();
        ConvertToF32(t.dtype(), src + size_t(tok) * D * es, xt, size_t(nt) * D);
        for (uint32_t k = 0; k < nt; ++k)
          for (uint32_t d = 0; d < D; ++d) xt[k * D + d] -= mean[d];
        uint32_t j0 = 0;
        if (nt == kTile) {
          for (; j0 + kLanes <= r; j0 += kLanes) {
            Lanes16 acc[kTile] = {};
            for (uint32_t d = 0; d < D; ++d) {
              Lanes16 bd;
              std::memcpy(&bd, B + size_t(d) * D + j0, sizeof bd);
              for (uint32_t k = 0; k < kTile; ++k) acc[k] += xt[k * D + d] * bd;
            }
            for (uint32_t k = 0; k < kTile; ++k) std::memcpy(c + size_t(tok + k) * r + j0, &acc[k], sizeof acc[k]);
          }
        }
        for (uint32_t k = 0; k < nt && j0 < r; ++k) {  // columns past the tiles, and a last partial tile
          float* cr = c + size_t(tok + k) * r;
          const float* xr = xt + k * D;
          for (uint32_t j = j0; j < r; ++j) cr[j] = 0.0f;
          for (uint32_t d = 0; d < D; ++d) {
            const float v = xr[d];
            const float* Bd = B + size_t(d) * D;
            for (uint32_t j = j0; j < r; ++j) cr[j] += v * Bd[j];
          }
        }
      }
    });
    return Status::Ok();
  }

  Status Decode(const StageInput& in, const StageOutput& out, const StageContext& ctx) const override {
    const KvBlock& t = *in.tensor;
    const KvShape& s = out.tensor->shape();
    if (t.shape().head_dim != rank_ || t.shape().n_token != s.n_token) {
      return Status::Corrupt("lowrank input " + t.shape().ToString() + " does not match rank " + std::to_string(rank_));
    }
    KV_ASSIGN_OR_RETURN(std::shared_ptr<const LowRankBasis> b, Basis(s));
    ParallelFor(ctx.pool, s.n_slab(), [&](uint64_t sl) {
      const uint32_t D = s.head_dim, r = rank_;  // locals, as in Encode
      // The used columns transposed (direction j's coordinates contiguous), so each token sums
      // mean + c_0 B_0 + c_1 B_1 + ... over whole rows: vector loops, the plain loop's order
      // per value.
      thread_local std::vector<float> bt, c, x;
      constexpr uint32_t kTile = 4, kLanes = 16;
      bt.resize(size_t(r) * D);
      c.resize(size_t(kTile) * r);
      x.resize(size_t(kTile) * D);
      const float* mean = &b->mean[sl * D];
      const float* B = &b->basis[sl * D * D];
      for (uint32_t d = 0; d < D; ++d)
        for (uint32_t j = 0; j < r; ++j) bt[size_t(j) * D + d] = B[size_t(d) * D + j];
      const size_t in_es = DTypeSize(t.dtype()), out_es = DTypeSize(out.tensor->dtype());
      thread_local ByteBuffer scratch;  // a paged output's slab
      uint8_t* dst = out.tensor->SlabToWrite(sl, scratch);
      for (uint32_t tok = 0; tok < s.n_token; tok += kTile) {
        const uint32_t nt = std::min(kTile, s.n_token - tok);
        float* ct = c.data();
        float* xt = x.data();
        ConvertToF32(t.dtype(), t.slab_at(sl) + size_t(tok) * r * in_es, ct, size_t(nt) * r);
        uint32_t d0 = 0;
        if (nt == kTile) {  // a tile's kTile x 16 values stay in registers across j
          for (; d0 + kLanes <= D; d0 += kLanes) {
            Lanes16 acc[kTile];
            for (uint32_t k = 0; k < kTile; ++k) std::memcpy(&acc[k], mean + d0, sizeof acc[k]);
            for (uint32_t j = 0; j < r; ++j) {
              Lanes16 bj;
              std::memcpy(&bj, bt.data() + size_t(j) * D + d0, sizeof bj);
              for (uint32_t k = 0; k < kTile; ++k) acc[k] += ct[k * r + j] * bj;
            }
            for (uint32_t k = 0; k < kTile; ++k) std::memcpy(xt + k * D + d0, &acc[k], sizeof acc[k]);
          }
        }
        for (uint32_t k = 0; k < nt && d0 < D; ++k) {  // values past the tiles, and a last partial tile
          float* xr = xt + k * D;
          const float* btj = bt.data();
          for (uint32_t d = d0; d < D; ++d) xr[d] = mean[d];
          for (uint32_t j = 0; j < r; ++j, btj += D) {
            const float cj = ct[k * r + j];
            for (uint32_t d = d0; d < D; ++d) xr[d] += cj * btj[d];
          }
        }
        ConvertFromF32(out.tensor->dtype(), xt, dst + size_t(tok) * D * out_es, size_t(nt) * D);
      }
      out.tensor->WroteSlab(sl, dst);
    });
    return Status::Ok();
  }

 private:
  uint32_t rank_;
  uint64_t id_;
  bool has_id_;
  CalibrationStore* store_;
};

}  // namespace

StageRegistration LowRankStageRegistration() {
  StageInfo info;
  info.name = "lowrank";
  info.summary = "project K and V of each head onto its first `rank` principal directions (calibrated basis)";
  info.input = DataKind::kTensor;
  info.output = DataKind::kTensor;
  using T = ParamSpec::Type;
  info.params = {
      {"rank", T::kInt, 1, 4096, {}, "4", "kept dimensions per head vector", ParamSpec::Scale::kLog},
      {"basis", T::kList, 0, double((uint64_t{1} << 52) - 1), {}, "auto", "id of the calibrated basis (kvserve calib lowrank)"},
  };
  return {info, [](const StageSpec& spec, const CodecEnv& env) -> Result<std::unique_ptr<Stage>> {
            // A spec without a usable basis still parses; encoding or decoding with it says why it fails.
            const std::string& id = spec.Get("basis");
            const bool one = id != "auto" && id.find('.') == std::string::npos;
            return std::unique_ptr<Stage>(
                new LowRankStage(uint32_t(spec.GetInt("rank")), one ? std::stoull(id) : 0, one, env.calibration));
          },
          [](const StageSpec&, const KvShape&, uint32_t, uint32_t) -> Result<StageSpec> {
            return Status::Unsupported("lowrank bases cover a whole request; encode a lowrank strategy as one frame");
          }};
}

}  // namespace kvserve
