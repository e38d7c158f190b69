// Calibration artefacts: data a strategy needs on both sides but must not resend per request.
// Now: the low-rank bases of `lowrank` — per (layer, K/V, head), the mean and the principal
// directions of the KV vectors, fitted offline (PCA) and identified by a checksum-derived id.
#pragma once

#include <cstdint>
#include <memory>
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
// $KVSERVE_CALIB, else <source>/.kvserve-cache/calib.
std::string CalibrationDir();
// Writes dir/lowrank-<id>.bin (atomically) and returns its path.
Result<std::string> SaveLowRankBasis(const LowRankBasis& b, const std::string& dir = CalibrationDir());
// Loads (and caches in the process) the basis with this id from dir.
Result<std::shared_ptr<const LowRankBasis>> LoadLowRankBasis(uint64_t id, const std::string& dir = CalibrationDir());

}  // namespace kvserve
