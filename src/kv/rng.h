// Internal: deterministic pseudo-random numbers (splitmix64 seeding xoshiro256**, Box-Muller
// normals), written from the algorithms' public definitions. Used wherever a seed must give the
// same result on every run: synthetic KV, the evaluation set, the profiler.
#pragma once

#include <cmath>
#include <cstdint>

namespace kvserve {

// splitmix64 seeds xoshiro256**; both are public-domain algorithms written from their definitions.
inline uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& v : s_) v = SplitMix(seed);
  }
  uint64_t Next() {
    const uint64_t r = Rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
    s_[2] ^= s_[0], s_[3] ^= s_[1], s_[1] ^= s_[2], s_[0] ^= s_[3], s_[2] ^= t, s_[3] = Rotl(s_[3], 45);
    return r;
  }
  double Uniform() { return double(Next() >> 11) * 0x1.0p-53; }  // [0, 1)
  // Standard normals in pairs (Box-Muller).
  float Normal() {
    if (has_spare_) { has_spare_ = false; return spare_; }
    const double u1 = 1.0 - Uniform(), u2 = Uniform();
    const double r = std::sqrt(-2.0 * std::log(u1)), a = 6.283185307179586 * u2;
    spare_ = float(r * std::sin(a));
    has_spare_ = true;
    return float(r * std::cos(a));
  }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
  float spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace kvserve
