// Production model shapes and GPU presets for the synthetic stand-in (SyntheticModel): the KV a
// real model of that shape would hold, and the compute it would take on that GPU, derived from
// the model's weights and the GPU's datasheet by one rule (docs/SERVING.md, "Compute model").
#include <cmath>

#include "kvserve/serve.h"

namespace kvserve {
namespace {

struct ShapeSpec {
  const char* name;
  uint32_t n_layer, n_head_kv, head_dim;
  double params;  // weights, for the compute model
};
// Published configurations: n_layer, num_key_value_heads, head_dim; parameter counts of the
// released checkpoints.
constexpr ShapeSpec kShapes[] = {
    {"llama3-8b", 32, 8, 128, 8.03e9},     // Llama-3.1-8B
    {"qwen2.5-32b", 64, 8, 128, 32.76e9},  // Qwen2.5-32B
    {"llama3-70b", 80, 8, 128, 70.55e9},   // Llama-3.1-70B
};

struct GpuSpec {
  const char* name;
  double bf16_flops;     // dense BF16 tensor throughput, FLOP/s
  double memory_bps;     // memory bandwidth, bytes/s
  double memory_bytes;
};
constexpr GpuSpec kGpus[] = {
    {"h100", 989.4e12, 3.35e12, 80e9},   // H100 SXM5 80 GB
    {"a100", 312e12, 2.039e12, 80e9},    // A100 SXM4 80 GB
    {"l40s", 362.05e12, 0.864e12, 48e9}, // L40S 48 GB
};

// Two significant figures: the model is a rule of thumb, not a measurement.
double Round2(double v) {
  const double scale = std::pow(10.0, std::floor(std::log10(v)) - 1);
  return std::round(v / scale) * scale;
}

constexpr double kPrefillMfu = 0.40;       // share of peak a compute-bound prefill reaches
constexpr uint32_t kReferenceContext = 4096;  // the KV a decode step reads besides the weights

}  // namespace

std::vector<std::string> SyntheticShapeNames() {
  std::vector<std::string> out;
  for (const ShapeSpec& s : kShapes) out.push_back(s.name);
  return out;
}

std::vector<std::string> GpuPresetNames() {
  std::vector<std::string> out;
  for (const GpuSpec& g : kGpus) out.push_back(g.name);
  return out;
}

Result<SyntheticModel> SyntheticModelByName(const std::string& name, const std::string& gpu) {
  auto list = [](const std::vector<std::string>& names) {
    std::string s;
    for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
    return s;
  };
  const ShapeSpec* shape = nullptr;
  for (const ShapeSpec& s : kShapes)
    if (name == s.name) shape = &s;
  if (shape == nullptr) return Status::InvalidArgument("kv shape '" + name + "' is not known (known: " + list(SyntheticShapeNames()) + ")");
  const GpuSpec* g = nullptr;
  for (const GpuSpec& x : kGpus)
    if (gpu == x.name) g = &x;
  if (g == nullptr) return Status::InvalidArgument("gpu '" + gpu + "' is not known (known: " + list(GpuPresetNames()) + ")");
  SyntheticModel m;
  m.name = shape->name;
  m.n_layer = shape->n_layer;
  m.n_head_kv = shape->n_head_kv;
  m.head_dim = shape->head_dim;
  m.gpu = g->name;
  // Tensor parallel over the fewest GPUs (a power of two) whose memory holds the bf16 weights
  // with a tenth to spare for the KV cache and activations.
  const double weight_bytes = 2 * shape->params;
  m.tensor_parallel = 1;
  while (weight_bytes > 0.9 * g->memory_bytes * m.tensor_parallel) m.tensor_parallel *= 2;
  // Prefill is compute-bound: 2 FLOP per weight per token at kPrefillMfu of peak. Decode is
  // memory-bound: each step reads the weights and a reference context's KV.
  m.prefill_tokens_per_second = Round2(kPrefillMfu * g->bf16_flops * m.tensor_parallel / (2 * shape->params));
  m.decode_tokens_per_second =
      Round2(g->memory_bps * m.tensor_parallel / (weight_bytes + double(m.kv_bytes_per_token()) * kReferenceContext));
  return m;
}

}  // namespace kvserve
