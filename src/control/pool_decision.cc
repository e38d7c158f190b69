// The pool fetch decision: fetch a stored copy of the prefix (and compute the suffix) or
// recompute, from the latency model extended by the prefill time and by the work in flight at
// the node that a fetch would share; explained in one line.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kvserve/controller.h"

namespace kvserve {

namespace {
// What other jobs still needing x_i seconds of a resource add to one needing `own` of it, shared
// with them on `servers` servers (processor sharing): sum of min(x_i, own) / servers.
double SharedDelay(const std::vector<double>& ahead, double own, double servers) {
  double d = 0;
  for (double x : ahead) d += std::min(std::max(0.0, x), own);
  return d / std::max(1.0, servers);
}
double Sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += std::max(0.0, x);
  return s;
}
}  // namespace

double PoolFetchSecondsShared(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_chunks,
                              const PoolFetchRequest& r) {
  if (bytes <= 0) return 0;
  double wire = s.none() ? bytes / bandwidth_Bps : bytes / (s.ratio * bandwidth_Bps);
  wire += SharedDelay(r.link_ahead_s, wire, 1);
  if (s.none()) return wire;
  double decode = bytes / s.decode_Bps;
  decode += SharedDelay(r.codec_ahead_s, decode, r.codec_cores);
  return std::max(wire, decode) + std::min(wire, decode) / std::max<uint32_t>(1, n_chunks);
}

double PoolFetchSeconds(const StrategyCost& s, double bytes, double bandwidth_Bps, uint32_t n_chunks) {
  return PoolFetchSecondsShared(s, bytes, bandwidth_Bps, n_chunks, PoolFetchRequest{});  // nothing in flight
}

PoolFetchDecision DecidePoolFetch(const std::vector<StrategyCost>& strategies, const std::vector<PoolOption>& options,
                                  const PoolFetchRequest& r, double bandwidth_Bps) {
  PoolFetchDecision d;
  const double P = std::max(1e-9, r.prefill_tokens_per_second);
  d.recompute_seconds = r.gpu_wait_s + r.prompt_tokens / P;
  d.predicted_seconds = d.recompute_seconds;
  char b[256];
  std::string others;
  uint32_t below_floor = 0;
  for (size_t i = 0; i < options.size(); ++i) {
    const PoolOption& o = options[i];
    if (o.cached_tokens == 0 || o.strategy >= strategies.size()) continue;
    const StrategyCost& s = strategies[o.strategy];
    if (s.quality < r.floor) {
      below_floor++;
      continue;
    }
    const double bytes = double(o.cached_tokens) * r.kv_bytes_per_token;
    const uint32_t chunks = std::max<uint32_t>(1, o.cached_tokens / std::max<uint32_t>(1, r.chunk_tokens));
    StrategyCost live = {{}, {}, s.quality, s.ratio, s.encode_Bps, s.decode_Bps * r.decode_speed};  // numbers only
    const double t = std::max(PoolFetchSecondsShared(live, bytes, bandwidth_Bps, chunks, r), r.gpu_wait_s) +
                     (r.prompt_tokens - std::min(r.prompt_tokens, o.cached_tokens)) / P;
    std::snprintf(b, sizeof b, "%s%s %.3f s", others.empty() ? "" : ", ", s.name.empty() ? s.spec.c_str() : s.name.c_str(), t);
    others += b;
    if (t < d.predicted_seconds) d.predicted_seconds = t, d.option = int(i);
  }
  if (d.option < 0) {
    std::snprintf(b, sizeof b, "recompute %u tokens: %.3f s", r.prompt_tokens, d.recompute_seconds);
  } else {
    const PoolOption& o = options[size_t(d.option)];
    const StrategyCost& s = strategies[o.strategy];
    std::snprintf(b, sizeof b, "fetch %u cached tokens as %s (ratio %.1f, quality %.4f) and prefill %u: %.3f s vs recompute %.3f s",
                  o.cached_tokens, s.name.empty() ? s.spec.c_str() : s.name.c_str(), s.ratio, s.quality,
                  r.prompt_tokens - std::min(r.prompt_tokens, o.cached_tokens), d.predicted_seconds, d.recompute_seconds);
  }
  d.explanation = b;
  std::snprintf(b, sizeof b, "; pool GETs at %.2f Gbit/s, gpu wait %.3f s", bandwidth_Bps * 8 / 1e9, r.gpu_wait_s);
  d.explanation += b;
  if (std::abs(r.decode_speed - 1) > 0.05) {
    std::snprintf(b, sizeof b, ", decode measured at %.2f× of profile", r.decode_speed);
    d.explanation += b;
  }
  const double link_ahead = Sum(r.link_ahead_s), codec_ahead = Sum(r.codec_ahead_s);
  if (link_ahead > 0 || codec_ahead > 0) {
    std::snprintf(b, sizeof b, "; in flight here: link %.3f s (%zu), codec %.3f s (%zu) on %g core%s", link_ahead,
                  r.link_ahead_s.size(), codec_ahead, r.codec_ahead_s.size(), r.codec_cores, r.codec_cores == 1 ? "" : "s");
    d.explanation += b;
  }
  if (!others.empty()) d.explanation += "; options: " + others;
  if (below_floor) d.explanation += "; " + std::to_string(below_floor) + " stored copies below the floor " + std::to_string(r.floor).substr(0, 5);
  return d;
}

}  // namespace kvserve
