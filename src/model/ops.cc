// The engine's elementary operations, kept apart so each can be tested against a naive reference.
#include "model/ops.h"

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>

namespace kvserve::ops {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// out[n][o] = in[n][i] . W[o][i]^T
void MatMul(const float* in, uint32_t n, uint32_t i, const float* w, uint32_t o, float* out) {
  Eigen::Map<const RowMat> x(in, n, i);
  Eigen::Map<const RowMat> wm(w, o, i);
  Eigen::Map<RowMat> y(out, n, o);
  y.noalias() = x * wm.transpose();
}

void RmsNorm(float* out, const float* x, const float* weight, uint32_t size, float eps) {
  float ss = 0.0f;
  for (uint32_t j = 0; j < size; ++j) ss += x[j] * x[j];
  ss = 1.0f / std::sqrt(ss / float(size) + eps);
  for (uint32_t j = 0; j < size; ++j) out[j] = weight[j] * (ss * x[j]);
}

// exp(x) for x <= 0 (softmax after max subtraction), vectorisable: 2^(x log2 e) split into an
// integer power of two and a degree-6 Taylor polynomial of 2^f on [-0.5, 0.5] (relative
// error ~1e-7, the order of float rounding).
float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float fi = std::nearbyint(t);
  const float f = (t - fi) * 0.693147180559945309f;
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t e = static_cast<int32_t>(fi) + 127;
  return p * std::bit_cast<float>(e << 23);
}

void Softmax(float* x, uint32_t n) {
  float mx = x[0];
  for (uint32_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.0f;
  for (uint32_t i = 0; i < n; ++i) {
    x[i] = ExpNonPositive(x[i] - mx);
    sum += x[i];
  }
  const float inv = 1.0f / sum;
  for (uint32_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace kvserve::ops
