// CLI: `generate`, `kv capture`, `eval`, `model info|heads` — the reference model and the
// quality evaluator.
#include <cstdio>
#include <random>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.h"
#include "kvserve/calib.h"
#include "kvserve/codec.h"
#include "kvserve/codec_bench.h"
#include "model_flags.h"
#include "table.h"
#include "kvserve/eval.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/model.h"
#include "model/studies.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

Result<std::vector<int>> ParseIds(const std::string& s) {
  std::vector<int> ids;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, tok.find(',') != std::string::npos ? ',' : ' ')) {
    if (tok.empty()) continue;
    char* end = nullptr;
    long v = std::strtol(tok.c_str(), &end, 10);
    if (*end != '\0' || v < 0) return Status::InvalidArgument("--tokens: '" + tok + "' is not a token id");
    ids.push_back(int(v));
  }
  return ids;
}

json MetricsJson(const EvalMetrics& m) {
  return {{"strategy", m.strategy},
          {"relative_accuracy", m.relative_accuracy},
          {"relative_accuracy_se", m.relative_accuracy_se},
          {"top1_agreement", m.top1_agreement},
          {"kl", m.kl},
          {"ppl_ratio", m.ppl_ratio},
          {"greedy_match", m.greedy_match},
          {"ratio", m.ratio},
          {"accuracy", m.accuracy},
          {"exact_accuracy", m.exact_accuracy},
          {"contexts", m.contexts},
          {"positions", m.positions},
          {"seconds", m.seconds}};
}

// The MixHQ solver's weights, measured with a progress line: KL increase of each slab at limit
// kSolverProbe while the others are near exact (limit 63).
constexpr int kSolverProbe = 3;
Result<std::vector<double>> MeasureSlabSensitivities(Evaluator& ev) {
  const LlamaConfig& c = ev.model().config;
  Progress p("slab sensitivity", size_t(c.n_layer) * 2 * c.n_head_kv);
  KV_ASSIGN_OR_RETURN(std::vector<double> w,
                      SlabSensitivities(ev, kSolverProbe, 63, "|rans", [&](uint64_t d, uint64_t) { p.Update(d); }));
  p.Done();
  return w;
}

// MixHQ rankings against uniform precision at equal average bits (docs/results/mixhq.md).
Status RunMixHqStudy(const ModelFlags& mf, const EvalFlags& ef, double lo_frac, bool as_json) {
  KV_ASSIGN_OR_RETURN(LlamaModel m, mf.Load());
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, MakeEvaluator(m, ef));
  const uint32_t hk = m.config.n_head_kv;
  struct Row {
    std::string name, kind;
    EvalMetrics e;
  };
  std::vector<Row> rows;
  auto run = [&](const std::string& name, const std::string& kind, const std::string& spec) -> Status {
    KV_ASSIGN_OR_RETURN(EvalMetrics e, ev->Evaluate(spec));
    rows.push_back({name, kind, e});
    std::fprintf(stderr, "\r\033[K%s done", name.c_str());
    return Status::Ok();
  };
  // The uniform curve: the same quantiser with one limit pair for every head.
  for (auto [k, v] : std::vector<std::pair<int, int>>{{4, 3}, {6, 4}, {8, 5}, {9, 6}, {12, 8}, {16, 11}}) {
    const std::string kv = "kfine=" + std::to_string(k) + ",vfine=" + std::to_string(v) + ",kcoarse=" +
                           std::to_string(k) + ",vcoarse=" + std::to_string(v);
    KV_RETURN_IF_ERROR(run("uniform k" + std::to_string(k) + "/v" + std::to_string(v), "uniform",
                           "mixhq(lo_frac=0," + kv + ")|rans"));
  }
  Progress p("retrieval scores", ev->eval_set().contexts.size());
  KV_ASSIGN_OR_RETURN(std::vector<HeadScore> retrieval, RetrievalHeadScores(*ev, {}, [&](uint64_t d, uint64_t) { p.Update(d); }));
  p.Done();
  Progress ps("sensitivity", m.config.n_layer * hk);
  KV_ASSIGN_OR_RETURN(std::vector<HeadScore> sensitivity, SensitivityHeadScores(*ev, "", "|rans", [&](uint64_t d, uint64_t) { ps.Update(d); }));
  ps.Done();
  for (uint64_t seed : {1, 2, 3}) {
    KV_RETURN_IF_ERROR(run("random (seed " + std::to_string(seed) + ")", "random",
                           "mixhq(lo_frac=" + std::to_string(lo_frac) + ",seed=" + std::to_string(seed) + ")|rans"));
  }
  KV_RETURN_IF_ERROR(run("retrieval", "retrieval", MixHqSpecFromScores(retrieval, hk, lo_frac)));
  KV_RETURN_IF_ERROR(run("sensitivity", "sensitivity", MixHqSpecFromScores(sensitivity, hk, lo_frac)));
  // Inverted sensitivity: the control that should do worst.
  std::vector<HeadScore> inverted = sensitivity;
  for (auto& h : inverted) h.score = -h.score;
  KV_RETURN_IF_ERROR(run("least sensitive fine", "control", MixHqSpecFromScores(inverted, hk, lo_frac)));
  // The bit-budget solver: limits per (layer, K/V, head) from measured slab sensitivities, at
  // several average code widths; controls at 3.5 bits: equal weights, the same weights shuffled
  // across slabs, and the retrieval score as the weight.
  const size_t n_slab = size_t(m.config.n_layer) * 2 * hk;
  KV_ASSIGN_OR_RETURN(std::vector<double> weight, MeasureSlabSensitivities(*ev));
  for (double bits : {3.0, 3.5, 4.0, 4.5}) {
    char name[64];
    std::snprintf(name, sizeof name, "solver %.1f bits", bits);
    KV_RETURN_IF_ERROR(run(name, "solver", MixHqLevelsSpec(AllocateMixHqLevels(weight, kSolverProbe, bits))));
  }
  KV_RETURN_IF_ERROR(run("solver, equal weights", "control",
                         MixHqLevelsSpec(AllocateMixHqLevels(std::vector<double>(n_slab, 1.0), kSolverProbe, 3.5))));
  for (uint64_t seed : {1, 2}) {
    std::vector<double> shuffled = weight;
    std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(seed));
    KV_RETURN_IF_ERROR(run("solver, shuffled (" + std::to_string(seed) + ")", "control",
                           MixHqLevelsSpec(AllocateMixHqLevels(shuffled, kSolverProbe, 3.5))));
  }
  std::vector<double> by_retrieval(n_slab);
  for (size_t s = 0; s < n_slab; ++s) by_retrieval[s] = retrieval[s / (2 * hk) * hk + s % hk].score;
  KV_RETURN_IF_ERROR(run("solver, retrieval weights", "control", MixHqLevelsSpec(AllocateMixHqLevels(by_retrieval, kSolverProbe, 3.5))));
  std::fprintf(stderr, "\r\033[K");
  // Uniform curve at a row's average bits, by linear interpolation between neighbours.
  std::vector<const Row*> uni;
  for (const auto& r : rows)
    if (r.kind == "uniform") uni.push_back(&r);
  std::sort(uni.begin(), uni.end(), [](const Row* a, const Row* b) { return a->e.ratio > b->e.ratio; });
  auto at_bits = [&](double bits, bool kl) {
    auto val = [&](const Row* r) { return kl ? r->e.kl : r->e.relative_accuracy; };
    auto b = [](const Row* r) { return 16.0 / r->e.ratio; };
    if (bits <= b(uni.front())) return val(uni.front());
    for (size_t i = 1; i < uni.size(); ++i) {
      if (bits <= b(uni[i])) {
        const double w = (bits - b(uni[i - 1])) / (b(uni[i]) - b(uni[i - 1]));
        return val(uni[i - 1]) * (1 - w) + val(uni[i]) * w;
      }
    }
    return val(uni.back());
  };
  json j = {{"model", m.name}, {"lo_frac", lo_frac}, {"rows", json::array()}};
  std::printf("%s, MixHQ with %.0f%% coarse heads vs uniform levels, all followed by rans\n", m.name.c_str(), lo_frac * 100);
  std::printf("%-24s %-9s %-8s %-9s %-9s %-12s %-10s\n", "row", "avg bits", "rel_acc", "± se", "kl", "Δacc@bits",
              "Δkl@bits");
  for (const auto& r : rows) {
    const double bits = 16.0 / r.e.ratio;
    const double dacc = r.e.relative_accuracy - at_bits(bits, false), dkl = r.e.kl - at_bits(bits, true);
    char da[32] = "", dk[32] = "";
    if (r.kind != "uniform") {
      std::snprintf(da, sizeof da, "%+.4f", dacc);
      std::snprintf(dk, sizeof dk, "%+.5f", dkl);
    }
    std::printf("%-24s %-9.3f %-8.4f %-9.4f %-9.5f %-12s %-10s\n", r.name.c_str(), bits, r.e.relative_accuracy,
                r.e.relative_accuracy_se, r.e.kl, da, dk);
    j["rows"].push_back({{"name", r.name}, {"kind", r.kind}, {"spec", r.e.strategy}, {"avg_bits", bits},
                         {"relative_accuracy", r.e.relative_accuracy}, {"relative_accuracy_se", r.e.relative_accuracy_se},
                         {"kl", r.e.kl}, {"delta_acc_vs_uniform", dacc}, {"delta_kl_vs_uniform", dkl}});
  }
  auto rank_text = [&](const std::vector<HeadScore>& v) {
    std::vector<HeadScore> sorted = v;
    std::sort(sorted.begin(), sorted.end(), [](const HeadScore& a, const HeadScore& b) { return a.rank < b.rank; });
    std::string s;
    for (const auto& h : sorted) s += (s.empty() ? "" : " ") + std::to_string(h.layer) + "." + std::to_string(h.head);
    return s;
  };
  std::printf("\nhead order by retrieval score (layer.head, most first):   %s\n", rank_text(retrieval).c_str());
  std::printf("head order by measured sensitivity (KL, most first):      %s\n", rank_text(sensitivity).c_str());
  j["retrieval_order"] = rank_text(retrieval);
  j["sensitivity_order"] = rank_text(sensitivity);
  if (as_json) std::printf("%s\n", j.dump(2).c_str());
  return Status::Ok();
}

// Per-slab mixhq limits are sized to the model; on the (larger) speed block they repeat
// cyclically, which keeps the mix of code widths that sets the speed.
std::string TileLevels(const std::string& spec, uint64_t n_slab) {
  const size_t at = spec.find("levels=");
  if (at == std::string::npos) return spec;
  const size_t begin = at + 7, end = spec.find_first_of(",)", begin);
  std::vector<std::string> items;
  for (size_t i = begin; i < end;) {
    const size_t j = std::min(spec.find('.', i), end);
    items.push_back(spec.substr(i, j - i));
    i = j + 1;
  }
  std::string tiled;
  for (uint64_t s = 0; s < n_slab; ++s) tiled += (s ? "." : "") + items[s % items.size()];
  return spec.substr(0, begin) + tiled + spec.substr(end);
}

Status RunTable(const ModelFlags& mf, const EvalFlags& ef, bool as_json, const std::string& md_path,
                const std::string& svg_path, uint32_t bench_tokens) {
  KV_ASSIGN_OR_RETURN(LlamaModel m, mf.Load());
  KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, MakeEvaluator(m, ef));
  KV_ASSIGN_OR_RETURN(uint64_t basis, CalibrateLowRank(m, CalibDir(), CacheDir()));
  std::vector<NamedStrategy> list = StrategyTable(m.config, ev->prompt_len(), basis);
  // MixHQ with the bit-budget solver needs this model's slab sensitivities (one evaluation per
  // slab), so its rows are added here rather than in the static table.
  KV_ASSIGN_OR_RETURN(std::vector<double> w, MeasureSlabSensitivities(*ev));
  for (int bits : {4, 3, 2}) {
    list.push_back({"mixhq-solver" + std::to_string(bits), MixHqLevelsSpec(AllocateMixHqLevels(w, kSolverProbe, bits)),
                    "MixHQ limits per (layer, K/V, head) from the bit-budget solver on measured slab sensitivities, " +
                        std::to_string(bits) + "-bit average code width (docs/results/mixhq.md)",
                    true});
  }
  KV_ASSIGN_OR_RETURN(KvBlock block, BenchBlock(bench_tokens, Pool(2)));
  // Codec speed is measured on the synthetic llama3-8b block, which needs a basis of its own shape.
  KV_ASSIGN_OR_RETURN(LowRankBasis bench_basis, FitLowRankBasis({&block}));
  KV_RETURN_IF_ERROR(SaveLowRankBasis(bench_basis, CalibDir()).status());
  const std::string model_id = "basis=" + std::to_string(basis), bench_id = "basis=" + std::to_string(bench_basis.id);
  BenchOptions bo;
  bo.runs = 3;
  bo.env = Codec();
  std::vector<TableRow> rows;
  Progress p("strategy table", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    KV_ASSIGN_OR_RETURN(EvalMetrics e, ev->Evaluate(list[i].spec));
    std::string bench_spec = list[i].spec;
    if (size_t at = bench_spec.find(model_id); at != std::string::npos) bench_spec.replace(at, model_id.size(), bench_id);
    bench_spec = TileLevels(bench_spec, block.shape().n_slab());
    KV_ASSIGN_OR_RETURN(CodecMeasurement c, MeasureCodec(block, bench_spec, bo));
    rows.push_back({list[i], e, c});
    p.Update(i + 1, list[i].name);
  }
  p.Done();
  if (!md_path.empty()) KV_RETURN_IF_ERROR(WriteTextAtomic(md_path, TableMarkdown(m, *ev, rows, bench_tokens)));
  if (!svg_path.empty()) KV_RETURN_IF_ERROR(WriteTextAtomic(svg_path, TableSvg(m, rows)));
  if (as_json) {
    json j = {{"model", m.name}, {"model_sha256", m.sha256}, {"rows", json::array()}};
    for (const auto& r : rows) {
      j["rows"].push_back({{"name", r.named.name},
                           {"spec", r.eval.strategy},
                           {"avg_bits", 16.0 / r.eval.ratio},
                           {"ratio", r.eval.ratio},
                           {"relative_accuracy", r.eval.relative_accuracy},
                           {"relative_accuracy_se", r.eval.relative_accuracy_se},
                           {"top1_agreement", r.eval.top1_agreement},
                           {"kl", r.eval.kl},
                           {"greedy_match", r.eval.greedy_match},
                           {"encode_gbps", r.codec.encode_gbps},
                           {"decode_gbps", r.codec.decode_gbps}});
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s", TableMarkdown(m, *ev, rows, bench_tokens).c_str());
  }
  return Status::Ok();
}

}  // namespace

void AddModelCommands(CLI::App& app) {
  {
    auto* c = app.add_subcommand("generate", "Generate text with a shipped (or any llama2.c/GGUF) model");
    auto mf = std::make_shared<ModelFlags>();
    auto prompt = std::make_shared<std::string>();
    auto tokens = std::make_shared<std::string>();
    auto n = std::make_shared<uint32_t>(128);
    auto temperature = std::make_shared<float>(0.0f);
    auto top_p = std::make_shared<float>(0.9f);
    auto seed = std::make_shared<uint64_t>(1);
    auto ids_out = std::make_shared<bool>(false);
    mf->Add(c);
    auto* po = c->add_option("-p,--prompt", *prompt, "prompt text");
    c->add_option("--tokens", *tokens, "prompt as token ids (BOS=1 is not added)")->excludes(po);
    c->add_option("-n,--steps", *n, "tokens to generate")->capture_default_str()->check(InRange(0, 1 << 20));
    c->add_option("-t,--temperature", *temperature, "0 = greedy")->capture_default_str()->check(InRange(0, 100));
    c->add_option("--top-p", *top_p, "nucleus for sampling")->capture_default_str()->check(InRange(1e-6, 1));
    c->add_option("--seed", *seed, "sampling seed")->capture_default_str();
    c->add_flag("--ids", *ids_out, "print token ids instead of text");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
      std::vector<int> in;
      if (!tokens->empty()) {
        KV_ASSIGN_OR_RETURN(in, ParseIds(*tokens));
      } else {
        in = m.tokenizer.Encode(*prompt, true);
      }
      LlamaEngine engine(m);
      const double t0 = NowSeconds();
      KV_ASSIGN_OR_RETURN(std::vector<int> out, engine.Generate(in, *n, *temperature, *top_p, *seed));
      const double dt = NowSeconds() - t0;
      if (*ids_out) {
        for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? " " : "", out[i]);
        std::printf("\n");
      } else {
        std::vector<int> all(in.begin() + (in.size() && in[0] == Tokenizer::kBos ? 1 : 0), in.end());
        all.insert(all.end(), out.begin(), out.end());
        std::printf("%s\n", m.tokenizer.DecodeAll(all).c_str());
      }
      std::fprintf(stderr, "[%s: %zu tokens in %.3f s, %.0f tok/s]\n", m.name.c_str(), out.size(), dt, out.size() / dt);
      return Status::Ok();
    });
  }
  {
    CLI::App* kv = app.get_subcommand("kv");
    auto* c = kv->add_subcommand("capture", "Prefill a prompt with a model and write its KV cache as a frame");
    auto mf = std::make_shared<ModelFlags>();
    auto ef = std::make_shared<EvalFlags>();
    auto prompt = std::make_shared<std::string>();
    auto context = std::make_shared<int>(-1);
    auto dtype = std::make_shared<std::string>("f16");
    auto out = std::make_shared<std::string>();
    mf->Add(c);
    auto* po = c->add_option("-p,--prompt", *prompt, "prompt text");
    c->add_option("--context", *context, "use the prompt of evaluation-set context K")->excludes(po);
    c->add_option("--seed", ef->seed, "evaluation-set seed (with --context)")->capture_default_str();
    c->add_option("--prompt-len", ef->prompt_len, "prompt tokens of the context (with --context)");
    c->add_option("--dtype", *dtype, "f16 | bf16 | f32 | e4m3 | e5m2")->capture_default_str();
    auto fp8_scale = std::make_shared<std::string>("none");
    c->add_option("--fp8-scale", *fp8_scale,
                  "with e4m3/e5m2: none | tensor (one scale per layer and K/V, vLLM's k_scale/v_scale) | head")
        ->capture_default_str();
    c->add_option("-o,--output", *out, "output .kvf")->required()->check(OutputPath());
    SetAction(c, [=]() -> Status {
      if (prompt->empty() && *context < 0) return Status::InvalidArgument("give --prompt TEXT or --context K");
      KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
      KV_ASSIGN_OR_RETURN(DType dt, ParseDType(*dtype));
      KV_ASSIGN_OR_RETURN(Fp8Scales::Granularity granularity, ParseFp8Granularity(*fp8_scale));
      if (granularity != Fp8Scales::Granularity::kNone && !IsFp8(dt)) {
        return Status::InvalidArgument("--fp8-scale " + *fp8_scale + " needs --dtype e4m3 or e5m2, not " + *dtype);
      }
      // Captured in f32; an FP8 cache is then made as an engine makes it (scaled, or not).
      const DType capture_dt = IsFp8(dt) ? DType::kF32 : dt;
      KvBlock kv;
      if (*context >= 0) {
        EvalFlags f = *ef;
        f.contexts = 0;
        KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, MakeEvaluator(m, f));
        if (size_t(*context) >= ev->eval_set().contexts.size()) {
          return Status::InvalidArgument("--context " + std::to_string(*context) + " is beyond the " +
                                         std::to_string(ev->eval_set().contexts.size()) + " evaluation contexts");
        }
        KV_ASSIGN_OR_RETURN(kv, ev->prompt_kv(uint32_t(*context)).ConvertTo(capture_dt));
      } else {
        std::vector<int> ids = m.tokenizer.Encode(*prompt, true);
        LlamaEngine engine(m);
        KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(m.config));
        KV_RETURN_IF_ERROR(engine.Forward(ids.data(), uint32_t(ids.size()), &cache, nullptr));
        KV_ASSIGN_OR_RETURN(kv, cache.Prefix(uint32_t(ids.size()), capture_dt));
      }
      if (IsFp8(dt)) {
        KV_ASSIGN_OR_RETURN(kv, ToScaledFp8(kv, dt, granularity));
      }
      KV_RETURN_IF_ERROR(WriteKvFile(*out, kv));
      std::printf("wrote %s: %s KV of %s, %s %s%s\n", out->c_str(), m.name.c_str(),
                  *context >= 0 ? ("context " + std::to_string(*context)).c_str() : "the prompt",
                  kv.shape().ToString().c_str(), DTypeName(kv.dtype()),
                  kv.fp8_scales().empty() ? "" : (std::string(" scaled per ") + *fp8_scale).c_str());
      return Status::Ok();
    });
  }
  {
    auto* c = app.add_subcommand("eval", "Quality of codec strategies on a real model (relative accuracy and more)");
    auto mf = std::make_shared<ModelFlags>();
    auto ef = std::make_shared<EvalFlags>();
    auto specs = std::make_shared<std::vector<std::string>>();
    auto as_json = std::make_shared<bool>(false);
    mf->Add(c);
    ef->Add(c);
    auto table = std::make_shared<bool>(false);
    auto md_out = std::make_shared<std::string>();
    auto svg_out = std::make_shared<std::string>();
    auto bench_tokens = std::make_shared<uint32_t>(256);
    auto* so = c->add_option("-s,--strategy", *specs, "strategy spec (repeatable)");
    c->add_flag("--table", *table, "run the named strategy table (published methods and recompositions), "
                                   "with codec speed on a synthetic llama3-8b block")->excludes(so);
    c->add_option("--markdown", *md_out, "with --table: also write a Markdown table here")->check(OutputPath());
    c->add_option("--svg", *svg_out, "with --table: also write a quality-vs-ratio plot here")->check(OutputPath());
    c->add_option("--bench-tokens", *bench_tokens, "with --table: tokens of the llama3-8b block for codec speed")
        ->capture_default_str()->check(InRange(1, 65536));
    auto mixhq_study = std::make_shared<bool>(false);
    auto lo_frac = std::make_shared<double>(0.8);
    c->add_flag("--mixhq-study", *mixhq_study,
                "MixHQ against uniform levels at equal average bits: head rankings (random, retrieval score, "
                "measured sensitivity) and the bit-budget solver on measured slab sensitivities")->excludes(so);
    c->add_option("--lo-frac", *lo_frac, "with --mixhq-study: share of coarse heads")->capture_default_str()->check(InRange(0, 1));
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() -> Status {
      if (*table) return RunTable(*mf, *ef, *as_json, *md_out, *svg_out, *bench_tokens);
      if (*mixhq_study) return RunMixHqStudy(*mf, *ef, *lo_frac, *as_json);
      if (specs->empty()) return Status::InvalidArgument("give --strategy SPEC (repeatable) or --table");
      for (const auto& s : *specs) KV_RETURN_IF_ERROR(CanonicalStrategy(s).status());
      KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
      KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, MakeEvaluator(m, *ef));
      std::vector<EvalMetrics> rows;
      for (const auto& s : *specs) {
        Progress p("eval " + s, ev->eval_set().contexts.size());
        KV_ASSIGN_OR_RETURN(EvalMetrics r, ev->Evaluate(s, [&](uint64_t d, uint64_t) { p.Update(d); }));
        p.Done();
        rows.push_back(r);
      }
      if (*as_json) {
        if (rows.size() == 1) {
          std::printf("%s\n", MetricsJson(rows[0]).dump(2).c_str());
        } else {
          json j = {{"model", m.name}, {"results", json::array()}};
          for (const auto& r : rows) j["results"].push_back(MetricsJson(r));
          std::printf("%s\n", j.dump(2).c_str());
        }
        return Status::Ok();
      }
      std::printf("model %s (sha256 %.12s…), %u contexts x %llu scored positions, prompt %u tokens, exact accuracy %.4f\n",
                  m.name.c_str(), m.sha256.c_str(), rows[0].contexts,
                  static_cast<unsigned long long>(rows[0].positions / std::max(1u, rows[0].contexts)), ev->prompt_len(),
                  rows[0].exact_accuracy);
      std::printf("%-9s %-8s %-7s %-8s %-8s %-8s %-7s %-6s  %s\n", "rel_acc", "± se", "top1", "kl", "ppl_x", "greedy",
                  "ratio", "sec", "strategy");
      for (const auto& r : rows) {
        std::printf("%-9.4f %-8.4f %-7.4f %-8.5f %-8.4f %-8.2f %-7.2f %-6.2f  %s\n", r.relative_accuracy,
                    r.relative_accuracy_se, r.top1_agreement, r.kl, r.ppl_ratio, r.greedy_match, r.ratio, r.seconds,
                    r.strategy.c_str());
      }
      return Status::Ok();
    });
  }
  {
    auto* calib = app.add_subcommand("calib", "Fit calibration artefacts that strategies reference (lowrank bases)");
    calib->require_subcommand(1);
    auto* c = calib->add_subcommand("lowrank", "Fit per-head PCA bases on a calibration set's prompt KV");
    auto mf = std::make_shared<ModelFlags>();
    auto contexts = std::make_shared<uint32_t>(16);
    auto seed = std::make_shared<uint64_t>(1000);
    mf->Add(c);
    c->add_option("--contexts", *contexts, "calibration contexts")->capture_default_str()->check(InRange(1, 4096));
    c->add_option("--seed", *seed, "calibration-set seed (keep it apart from the evaluation seed)")->capture_default_str();
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
      KV_ASSIGN_OR_RETURN(uint64_t id, CalibrateLowRank(m, CalibDir(), CacheDir(), *contexts, *seed));
      std::printf("lowrank basis %llu for %s saved in %s\nuse it as: lowrank(rank=%u,basis=%llu)|quant|rans\n",
                  static_cast<unsigned long long>(id), m.name.c_str(), CalibDir().c_str(), m.config.head_dim() / 2,
                  static_cast<unsigned long long>(id));
      return Status::Ok();
    });
  }
  {
    auto* model = app.add_subcommand("model", "Inspect a model: configuration, engine speed, head profile");
    model->require_subcommand(1);
    {
      auto* c = model->add_subcommand("info", "Configuration and checksum of a model");
      auto mf = std::make_shared<ModelFlags>();
      mf->Add(c);
      SetAction(c, [=]() -> Status {
        KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
        const LlamaConfig& k = m.config;
        std::printf("%s  %s\nsha256 %s\ndim %u, hidden %u, layers %u, heads %u, kv heads %u, head_dim %u, vocab %u, context %u, "
                    "%s classifier\n",
                    m.name.c_str(), m.path.c_str(), m.sha256.c_str(), k.dim, k.hidden_dim, k.n_layer, k.n_head,
                    k.n_head_kv, k.head_dim(), k.vocab_size, k.seq_len, k.shared_classifier ? "shared" : "separate");
        return Status::Ok();
      });
    }
    {
      auto* c = model->add_subcommand("bench", "Engine throughput: batched prefill and token-by-token decode");
      auto mf = std::make_shared<ModelFlags>();
      auto runs = std::make_shared<int>(5);
      auto as_json = std::make_shared<bool>(false);
      mf->Add(c);
      c->add_option("--runs", *runs, "runs (median)")->capture_default_str()->check(InRange(1, 1000));
      c->add_flag("--json", *as_json, "machine-readable output");
      SetAction(c, [=]() -> Status {
        KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
        LlamaEngine engine(m);
        KV_ASSIGN_OR_RETURN(KvCache cache, KvCache::Create(m.config));
        const uint32_t prompt = m.config.seq_len * 3 / 4, steps = m.config.seq_len - prompt;
        std::vector<int> tokens(m.config.seq_len);
        for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int(1 + (i * 7919) % (m.config.vocab_size - 1));
        std::vector<float> logits(m.config.vocab_size);
        std::vector<double> prefill, decode;
        for (int r = 0; r < std::max(1, *runs); ++r) {
          cache.Rewind(0, 0);
          double t0 = NowSeconds();
          KV_RETURN_IF_ERROR(engine.Forward(tokens.data(), prompt, &cache, logits.data(), true));
          double t1 = NowSeconds();
          for (uint32_t i = 0; i < steps; ++i) KV_RETURN_IF_ERROR(engine.Forward(&tokens[prompt + i], 1, &cache, logits.data()));
          double t2 = NowSeconds();
          prefill.push_back(prompt / (t1 - t0));
          decode.push_back(steps / (t2 - t1));
        }
        const double p = Median(prefill), d = Median(decode);
        if (*as_json) {
          std::printf("%s\n", json{{"model", m.name}, {"prompt_tokens", prompt}, {"decode_tokens", steps},
                                   {"prefill_tok_s", p}, {"decode_tok_s", d}}.dump(2).c_str());
        } else {
          std::printf("%s: prefill %u tokens at %.0f tok/s, decode %u tokens (positions %u..%u) at %.0f tok/s (1 thread)\n",
                      m.name.c_str(), prompt, p, steps, prompt, m.config.seq_len - 1, d);
        }
        return Status::Ok();
      });
    }
    {
      auto* c = model->add_subcommand("heads", "Retrieval score of every (layer, KV head), DuoAttention-style");
      auto mf = std::make_shared<ModelFlags>();
      auto ef = std::make_shared<EvalFlags>();
      auto as_json = std::make_shared<bool>(false);
      auto ho = std::make_shared<HeadProfileOptions>();
      mf->Add(c);
      ef->Add(c);
      c->add_option("--window", ho->window, "observed query positions at the end of each prompt")->capture_default_str();
      c->add_option("--sink", ho->sink, "attention-sink tokens at the start")->capture_default_str();
      c->add_option("--recent", ho->recent, "recent-window tokens before each query")->capture_default_str();
      c->add_flag("--json", *as_json, "machine-readable output");
      SetAction(c, [=]() -> Status {
        KV_ASSIGN_OR_RETURN(LlamaModel m, mf->Load());
        KV_ASSIGN_OR_RETURN(std::unique_ptr<Evaluator> ev, MakeEvaluator(m, *ef));
        Progress p("head profile", ev->eval_set().contexts.size());
        KV_ASSIGN_OR_RETURN(std::vector<HeadScore> scores,
                            RetrievalHeadScores(*ev, *ho, [&](uint64_t d, uint64_t) { p.Update(d); }));
        p.Done();
        std::vector<HeadScore> ranked = scores;
        std::sort(ranked.begin(), ranked.end(), [](const HeadScore& a, const HeadScore& b) { return a.rank < b.rank; });
        if (*as_json) {
          json j = {{"model", m.name}, {"model_sha256", m.sha256}, {"window", ho->window}, {"sink", ho->sink},
                    {"recent", ho->recent}, {"heads", json::array()}};
          for (const auto& h : scores) {
            j["heads"].push_back({{"layer", h.layer}, {"head", h.head}, {"retrieval", h.score}, {"rank", h.rank}});
          }
          std::printf("%s\n", j.dump(2).c_str());
          return Status::Ok();
        }
        std::printf("%s: retrieval score = attention share beyond the first %u and the last %u tokens\n", m.name.c_str(),
                    ho->sink, ho->recent);
        std::printf("%-5s %-6s %-5s %s\n", "rank", "layer", "head", "retrieval");
        for (const auto& h : ranked) {
          std::printf("%-5u %-6u %-5u %.4f  %s\n", h.rank, h.layer, h.head, h.score,
                      std::string(size_t(h.score * 50 + 0.5), '#').c_str());
        }
        return Status::Ok();
      });
    }
  }
}

}  // namespace kvserve::cli
