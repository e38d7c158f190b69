// Internal: elementary operations of the llama forward pass (see llama.cc).
#pragma once

#include <cstdint>

namespace kvserve::ops {

// out[n][o] = in[n][i] . W[o][i]^T (W row-major [out][in], as checkpoints store it).
void MatMul(const float* in, uint32_t n, uint32_t i, const float* w, uint32_t o, float* out);
// out = weight * x / sqrt(mean(x^2) + eps)
void RmsNorm(float* out, const float* x, const float* weight, uint32_t size, float eps);
// exp(x) for x <= 0, vectorisable, relative error ~1e-7.
float ExpNonPositive(float x);
// In-place softmax of n values.
void Softmax(float* x, uint32_t n);

}  // namespace kvserve::ops
