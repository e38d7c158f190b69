// The strategy table: published KV-compression methods as kvserve compositions, plus
// recompositions, sized to a model's prompt length.
#include <algorithm>

#include "kvserve/calib.h"
#include "kvserve/eval.h"
#include "model/studies.h"

namespace kvserve {

std::vector<NamedStrategy> StrategyTable(const LlamaConfig& config, uint32_t prompt_len, uint64_t lowrank_basis) {
  // KIVI keeps the last 128 tokens in fp16 on multi-thousand-token prompts; here prompts are
  // 192-384 tokens, so the window is scaled to about a sixth of the prompt (multiple of 16).
  const uint32_t residual = std::max<uint32_t>(16, std::min<uint32_t>(128, prompt_len / 6 / 16 * 16));
  const std::string r = std::to_string(residual);
  auto q = [](int kb, int vb, const char* vaxis, int group) {
    return "quant(kbits=" + std::to_string(kb) + ",vbits=" + std::to_string(vb) + ",kaxis=channel,vaxis=" + vaxis +
           ",group=" + std::to_string(group) + ")";
  };
  std::vector<NamedStrategy> t = {
      {"none", "none", "fp16 KV, no compression"},
      {"uniform8", q(8, 8, "token", 32), "min-max, K per channel / V per token, groups of 32"},
      {"uniform4", q(4, 4, "token", 32), ""},
      {"uniform3", q(3, 3, "token", 32), ""},
      {"uniform2", q(2, 2, "token", 32), ""},
      {"uniform4+zstd", q(4, 4, "token", 32) + "|zstd(level=3)", "generic lossless coder on top"},
      {"lossless", "fpsplit|rans", "the lossless float coder: exponents per channel, sign and mantissa stored"},
      {"fp8", "fp8", "FP8 E4M3 with a scale per (layer, K/V, head): what vLLM's --kv-cache-dtype fp8 stores"},
      {"fp8-e5m2", "fp8(format=e5m2)", "FP8 E5M2 (SGLang fp8_e5m2), scale per head"},
      {"fp8+rans", "fp8|rans", "FP8 E4M3 with the entropy coder", true},
      {"kivi4", "quant(kbits=4,vbits=4,kaxis=channel,vaxis=token,group=32,residual=" + r + ")",
       "KIVI: K per channel, V per token, group 32, fp16 window of the last " + r + " tokens"},
      {"kivi2", "quant(kbits=2,vbits=2,kaxis=channel,vaxis=token,group=32,residual=" + r + ")", "KIVI-2, as kivi4"},
      {"cachegen", "delta(anchor=16)|quant(kbits=3,vbits=3,kaxis=channel,vaxis=channel,group=64,boost_layers=" +
                       std::to_string(std::max<uint32_t>(1, config.n_layer / 3)) + ",boost_bits=1)|rans",
       "CacheGen-like: anchor/delta per 16 tokens, quantise with one more bit for the first third of the layers, "
       "arithmetic-code"},
      {"kivi2+rans", "quant(kbits=2,vbits=2,kaxis=channel,vaxis=token,group=32,residual=" + r + ")|rans",
       "KIVI-2 with the entropy coder", true},
      {"uniform4+rans", q(4, 4, "token", 32) + "|rans", "", true},
      {"q4c128+rans", q(4, 4, "channel", 128) + "|rans", "V ranges per channel over 128 tokens", true},
      {"q4k3v+rans", q(4, 3, "channel", 128) + "|rans", "", true},
      {"q3c128+rans", q(3, 3, "channel", 128) + "|rans", "", true},
      {"q3c64+rans", q(3, 3, "channel", 64) + "|rans", "", true},
      {"q3k2v+rans", q(3, 2, "channel", 64) + "|rans", "more bits for K than V", true},
      {"q2c128+rans", q(2, 2, "channel", 128) + "|rans", "", true},
      {"q2c64+rans", q(2, 2, "channel", 64) + "|rans", "", true},
      {"streamingllm", "prune(sink=4,recent=" + std::to_string(prompt_len / 4) + ",keep=0)",
       "StreamingLLM: 4 attention sinks + a recent window of a quarter of the prompt, fp16"},
      {"snapkv", "prune(sink=4,recent=32,keep=0.25,score=attn)",
       "SnapKV/H2O-like: keep the observation window (last 32) and the quarter of the rest that got the most "
       "prefill attention from it (one selection for all heads; SnapKV selects per head)"},
      {"snapkv+q3k2v+rans", "prune(sink=4,recent=32,keep=0.5,score=attn)|" + q(3, 2, "channel", 64) + "|rans",
       "token selection + quantisation + entropy coding", true},
      {"snapkv+q2c64+rans", "prune(sink=4,recent=32,keep=0.5,score=attn)|" + q(2, 2, "channel", 64) + "|rans", "", true},
      {"snapkv40+q2c128+rans", "prune(sink=4,recent=32,keep=0.4,score=attn)|" + q(2, 2, "channel", 128) + "|rans", "", true},
      {"mixhq4", "mixhq(kfine=12,vfine=8,kcoarse=6,vcoarse=4,lo_frac=0.8,group=64)|rans",
       "MixHQ with its published limits (K/V 12/8 fine, 6/4 coarse, 80% coarse); fine heads chosen at random "
       "here (see docs/results/mixhq.md for retrieval and sensitivity rankings)"},
      {"mixhq3", "mixhq(kfine=6,vfine=4,kcoarse=3,vcoarse=2,lo_frac=0.8,group=64)|rans", "MixHQ, halved limits"},
      {"mixhq2", "mixhq(kfine=3,vfine=2,kcoarse=2,vcoarse=1,lo_frac=0.8,group=128)|rans", "MixHQ, minimal limits"},
      {"rotate+q4tok+rans", "rotate|quant(kbits=4,vbits=4,kaxis=token,vaxis=token,group=128)|rans",
       "QuaRot-style: Hadamard, then per-token ranges for both", true},
      {"rotate+q3+rans", "rotate|" + q(3, 3, "channel", 64) + "|rans", "", true},
      {"delta+q3+rans", "delta(anchor=16)|" + q(3, 3, "channel", 64) + "|rans", "", true},
  };
  if (lowrank_basis) {
    const std::string id = std::to_string(lowrank_basis);
    for (uint32_t r : {config.head_dim() / 2, config.head_dim() * 3 / 4}) {
      t.push_back({"lowrank" + std::to_string(r) + "+q4+rans",
                   "lowrank(rank=" + std::to_string(r) + ",basis=" + id + ")|" + q(4, 4, "channel", 64) + "|rans",
                   "PCA basis per head fitted on a separate calibration set (seed 1000, 16 contexts)", true});
    }
  }
  return t;
}

}  // namespace kvserve

namespace kvserve {

Result<uint64_t> CalibrateLowRank(const LlamaModel& model, const std::string& calib_dir, const std::string& cache_dir,
                                  uint32_t n_contexts, uint64_t seed) {
  EvalOptions o;
  o.n_contexts = n_contexts;
  o.seed = seed;
  o.cache_dir = cache_dir;
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, Evaluator::Create(model, o));
  std::vector<const KvBlock*> samples;
  for (uint32_t i = 0; i < ev->eval_set().contexts.size(); ++i) samples.push_back(&ev->prompt_kv(i));
  KV_ASSIGN_OR_RETURN(LowRankBasis b, FitLowRankBasis(samples));
  KV_RETURN_IF_ERROR(SaveLowRankBasis(b, calib_dir).status());
  return b.id;
}

}  // namespace kvserve
