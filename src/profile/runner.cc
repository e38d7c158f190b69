// A profiling run on a real model: cheap objectives (ratio on the model's prompt KV, codec speed
// on the synthetic llama3-8b block) for every candidate, then quality evaluations chosen by the
// Bayesian search (or all of them, for the grid), checkpointed to the profile file after each.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "kvserve/codec.h"
#include "kvserve/codec_bench.h"
#include "kvserve/eval.h"
#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

bool FileExists(const std::string& path) {
  struct stat st;
  return !path.empty() && ::stat(path.c_str(), &st) == 0;
}

Status CheckResumable(const Profile& old, const Profile& now, const std::string& path) {
  auto refuse = [&](const std::string& what) {
    return Status::InvalidArgument("profile " + path + " holds a run with another " + what +
                                   "; remove it or write to another file to start afresh");
  };
  if (old.space_json != now.space_json) return refuse("space");
  if (old.mode != now.mode) return refuse("mode (" + old.mode + ")");
  if (old.seed != now.seed) return refuse("seed (" + std::to_string(old.seed) + ")");
  if (old.floor != now.floor) return refuse("floor (" + std::to_string(old.floor) + ")");
  if (old.eval_seed != now.eval_seed) return refuse("evaluation seed");
  if (old.speed_threads != now.speed_threads)
    return refuse("codec thread count for speeds (" + std::to_string(old.speed_threads) + ")");
  if (old.candidates.size() != now.candidates.size()) return refuse("candidate list");
  for (size_t i = 0; i < old.candidates.size(); ++i)
    if (old.candidates[i].spec != now.candidates[i].spec) return refuse("candidate list");
  return Status::Ok();
}

}  // namespace

Result<Profile> RunProfile(Evaluator& ev, const SearchSpace& space, const ProfileRunOptions& opts,
                           const ProfileProgressFn& progress) {
  Profile p;
  p.model = ev.model().name;
  p.model_sha256 = ev.model().sha256;
  p.eval_seed = ev.eval_set().seed;
  p.machine = MachineDescription();
  p.speed_threads = std::max<uint32_t>(1, opts.speed_threads);
  p.space_json = space.json();
  p.mode = opts.grid ? "grid" : SearchModeName(opts.bo.mode);
  p.budget = opts.grid ? uint32_t(space.candidates().size()) : std::min<uint32_t>(opts.bo.budget, space.candidates().size());
  p.seed = opts.bo.seed;
  p.floor = opts.bo.floor;
  p.reference = ReferencePoint(p.floor);
  for (const SpaceCandidate& sc : space.candidates()) {
    BoCandidate c;
    c.spec = sc.spec;
    c.features = sc.features;
    c.quality_group = sc.quality_group;
    p.candidates.push_back(std::move(c));
  }

  bool measured = false;
  if (FileExists(opts.out)) {
    KV_ASSIGN_OR_RETURN(Profile old, LoadProfile(opts.out, p.model_sha256));
    KV_RETURN_IF_ERROR(CheckResumable(old, p, opts.out));
    for (size_t i = 0; i < p.candidates.size(); ++i) {
      if (old.candidates[i].quality_group != p.candidates[i].quality_group && old.candidates[i].quality_group >= 0)
        return Status::InvalidArgument("profile " + opts.out + " groups its candidates differently (another kvserve?); "
                                       "remove it or write to another file to start afresh");
      p.candidates[i].ratio = old.candidates[i].ratio;
      p.candidates[i].encode_gbps = old.candidates[i].encode_gbps;
      p.candidates[i].decode_gbps = old.candidates[i].decode_gbps;
    }
    p.log = std::move(old.log);
    measured = true;
  }

  if (!measured) {
    // Cheap objectives for every candidate, before any model run. Speeds are measured in rounds,
    // every candidate once per round, and each keeps the median of its rounds: on a shared machine
    // the noise is mostly slow (other tenants, clocks), so candidates measured one after another
    // in a single pass were ranked by when they ran as much as by their kernels (two quantisers
    // that run level measured 10.1 and 12.3 GB/s in such a pass, and the controller took the
    // difference for a reason to choose).
    KV_ASSIGN_OR_RETURN(KvBlock bench, BenchBlock(opts.speed_tokens));
    const uint32_t n_ctx = std::max<uint32_t>(1, std::min<uint32_t>(opts.ratio_contexts, ev.eval_set().contexts.size()));
    BenchOptions bo;
    bo.runs = std::max(1, opts.speed_runs);
    bo.threads = int(p.speed_threads);
    bo.env = opts.codec_env;
    const uint32_t rounds = std::max<uint32_t>(1, opts.speed_rounds);
    const size_t n = p.candidates.size();
    std::vector<std::vector<double>> enc(n), dec(n);
    for (size_t i = 0; i < n; ++i) {
      BoCandidate& c = p.candidates[i];
      KV_ASSIGN_OR_RETURN(Pipeline pipe, Pipeline::Create(c.spec, opts.codec_env));
      uint64_t raw = 0, packed = 0;
      ByteBuffer frame;
      for (uint32_t k = 0; k < n_ctx; ++k) {
        const KvBlock& kv = ev.prompt_kv(k);
        Status st = pipe.Encode(kv, &frame);
        if (!st.ok()) return Status(st.code(), "candidate '" + c.spec + "': " + st.message());
        raw += kv.shape().numel() * 2;
        packed += frame.size();
      }
      c.ratio = double(raw) / double(packed);
    }
    for (uint32_t round = 0; round < rounds; ++round) {
      for (size_t i = 0; i < n; ++i) {
        const BoCandidate& c = p.candidates[i];
        auto m = MeasureCodec(bench, c.spec, bo);
        if (!m.ok()) return Status(m.status().code(), "candidate '" + c.spec + "': " + m.status().message());
        enc[i].push_back(m.value().encode_gbps);
        dec[i].push_back(m.value().decode_gbps);
        if (progress) progress({"measure", round * n + i + 1, rounds * n, 0});
      }
    }
    for (size_t i = 0; i < n; ++i) {
      p.candidates[i].encode_gbps = MedianOf(std::move(enc[i]));
      p.candidates[i].decode_gbps = MedianOf(std::move(dec[i]));
    }
  }

  auto oracle = [&](uint32_t i) -> Result<BoObservation> {
    KV_ASSIGN_OR_RETURN(EvalMetrics m, ev.Evaluate(p.candidates[i].spec));
    BoObservation o;
    o.candidate = i;
    o.quality = m.relative_accuracy;
    o.quality_se = m.relative_accuracy_se;
    o.kl = m.kl;
    o.seconds = m.seconds;
    return o;
  };
  auto checkpoint = [&](const std::vector<BoObservation>& log) -> Status {
    p.log = log;
    ComputeProfileFrontier(&p);
    if (progress) progress({"evaluate", log.size(), p.budget, p.hypervolume});
    if (opts.out.empty()) return Status::Ok();
    return SaveProfile(opts.out, p);
  };
  if (!opts.out.empty() && !measured) KV_RETURN_IF_ERROR(checkpoint(p.log));

  if (opts.grid) {
    std::vector<BoObservation> log = p.log;
    for (size_t i = 0; i < log.size(); ++i)
      if (log[i].candidate != i) return Status::InvalidArgument("grid log entry " + std::to_string(i) + " is out of order");
    // One evaluation per quality group: later members copy the first member's entry.
    std::map<int64_t, uint32_t> evaluated;  // quality group -> log entry
    for (uint32_t i = 0; i < log.size(); ++i)
      if (p.candidates[i].quality_group >= 0 && log[i].shared_from < 0) evaluated.emplace(p.candidates[i].quality_group, i);
    for (uint32_t i = uint32_t(log.size()); i < p.candidates.size(); ++i) {
      const int64_t g = p.candidates[i].quality_group;
      if (auto it = evaluated.find(g); g >= 0 && it != evaluated.end()) {
        BoObservation o = log[it->second];
        o.candidate = i;
        o.seconds = 0;
        o.shared_from = it->second;
        log.push_back(o);
        continue;  // nothing new to checkpoint
      }
      KV_ASSIGN_OR_RETURN(BoObservation o, oracle(i));
      if (g >= 0) evaluated.emplace(g, i);
      log.push_back(o);
      KV_RETURN_IF_ERROR(checkpoint(log));
    }
    p.log = std::move(log);
  } else {
    std::vector<BoObservation> log = p.log;
    BoOptions bo = opts.bo;
    bo.budget = p.budget;
    KV_RETURN_IF_ERROR(RunBayesianSearch(p.candidates, bo, oracle, &log, checkpoint));
    p.log = std::move(log);
  }
  ComputeProfileFrontier(&p);
  if (!opts.out.empty()) KV_RETURN_IF_ERROR(SaveProfile(opts.out, p));
  return p;
}

}  // namespace kvserve
