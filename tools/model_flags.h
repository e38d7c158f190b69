// Flags shared by the CLI commands that load a model and build an evaluator.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "cli.h"
#include "kvserve/eval.h"
#include "kvserve/model.h"

namespace kvserve::cli {

struct ModelFlags {
  std::string model = "stories260K";
  std::string tokenizer;
  void Add(CLI::App* c) {
    c->add_option("-m,--model", model, "shipped model name (stories260K, babyllama105) or a .bin/.gguf path")
        ->capture_default_str();
    c->add_option("--tokenizer", tokenizer,
                  "llama2.c tokenizer (default: tok<vocab>.bin beside a .bin model, the embedded one of a GGUF)");
  }
  // Loads the model, telling the user on stderr what the loader assumed (LlamaModel::notes).
  Result<LlamaModel> Load() const {
    KV_ASSIGN_OR_RETURN(LlamaModel m, LoadModel(model, tokenizer, ModelsDir()));
    for (const std::string& note : m.notes) std::fprintf(stderr, "kvserve: note: %s\n", note.c_str());
    return m;
  }
};

struct EvalFlags {
  uint32_t contexts = 0, prompt_len = 0;
  uint64_t seed = 1;
  int threads = 1;
  void Add(CLI::App* c) {
    c->add_option("--contexts", contexts, "evaluation contexts (default: enough for >= 8000 scored positions)")->check(InRange(0, 4096));
    c->add_option("--prompt-len", prompt_len, "prompt tokens per context (default: 3/4 of the window)")->check(InRange(0, 1 << 20));
    c->add_option("--seed", seed, "evaluation-set seed")->capture_default_str();
    c->add_option("--threads", threads, "contexts evaluated in parallel")->capture_default_str()->check(InRange(1, 256));
  }
  EvalOptions Options() const {
    EvalOptions o;
    o.n_contexts = contexts, o.prompt_len = prompt_len, o.seed = seed, o.threads = threads;
    o.pool = Pool(threads);
    o.cache_dir = CacheDir();
    o.codec_env = Codec();
    return o;
  }
};

inline Result<std::unique_ptr<Evaluator>> MakeEvaluator(const LlamaModel& m, const EvalFlags& f) {
  Progress p("exact run of " + m.name, 1);
  auto ev = Evaluator::Create(m, f.Options(), [&](uint64_t d, uint64_t t) {
    p = Progress("exact run of " + m.name, t);
    p.Update(d);
  });
  p.Done();
  return ev;
}

}  // namespace kvserve::cli
