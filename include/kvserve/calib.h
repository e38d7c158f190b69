// Calibration artefacts: data a strategy needs on both sides but must not resend per request.
// Now: the low-rank bases of `lowrank` — per (layer, K/V, head), the mean and the principal
// directions of the KV vectors, fitted offline (PCA) and identified by a checksum-derived id.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvserve/kv.h"
#include "kvserve/status.h"

namespace kvserve {

struct LowRankBasis {
  uint32_t n_layer = 0, n_head_kv = 0, head_dim = 0;
  std::vector<float> mean;   // [slab][head_dim]
  std::vector<float> basis;  // [slab][head_dim][head_dim]: row d, column j = direction j's coordinate d;
                             // columns by decreasing variance, orthonormal
  uint64_t id = 0;           // 52 bits of the XXH3-64 of the serialized basis (fits a spec integer)
  uint64_t n_slab() const { return uint64_t(n_layer) * 2 * n_head_kv; }
};

// PCA of every slab's token vectors over the given blocks (all of one shape but n_token).
Result<LowRankBasis> FitLowRankBasis(const std::vector<const KvBlock*>& samples);
// Writes dir/lowrank-<id>.bin (atomically, creating dir) and returns its path.
Result<std::string> SaveLowRankBasis(const LowRankBasis& b, const std::string& dir);
// Loads dir/lowrank-<id>.bin, verifying its size and its id.
Result<std::shared_ptr<const LowRankBasis>> LoadLowRankBasis(uint64_t id, const std::string& dir);

// The calibration artefacts of one directory, loaded on first use and kept for the store's
// life. The caller creates it (the CLI from --calib-dir) and passes it to pipelines through
// CodecEnv. Thread-safe: pipelines on many threads may share one store.
class CalibrationStore {
 public:
  explicit CalibrationStore(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }
  Result<std::shared_ptr<const LowRankBasis>> LowRank(uint64_t id);

 private:
  std::string dir_;
  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<const LowRankBasis>> lowrank_;
};

}  // namespace kvserve
