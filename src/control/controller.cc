// The per-request decision: filter by floor, break-even bandwidth and cooldown, predict through
// the queues, correct with the learned residual, and (optionally) let a discounted Thompson
// bandit pick among the top-k; plus the one-line explanation of every decision.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kv/rng.h"
#include "kvserve/codec.h"
#include "kvserve/controller.h"

namespace kvserve {

const char* DropReasonName(DropReason r) {
  switch (r) {
    case DropReason::kKept: return "kept";
    case DropReason::kFloor: return "floor";
    case DropReason::kNoGain: return "no-gain";
    case DropReason::kCooldown: return "cooldown";
  }
  return "?";
}

std::string ShortSpec(std::string_view spec) {
  auto parsed = ParseStrategy(spec);
  if (!parsed.ok()) return std::string(spec);
  if (parsed.value().stages.empty()) return "none";
  std::string out;
  for (const StageSpec& s : parsed.value().stages) {
    const StageInfo* info = FindStageInfo(s.name);
    std::string args;
    for (const auto& [k, v] : s.params) {
      const ParamSpec* p = info ? info->FindParam(k) : nullptr;
      bool is_default = p && p->default_value == v;
      if (p && !is_default && (p->type == ParamSpec::Type::kFloat || p->type == ParamSpec::Type::kInt))
        is_default = std::strtod(p->default_value.c_str(), nullptr) == std::strtod(v.c_str(), nullptr);
      if (!is_default) args += (args.empty() ? "" : ",") + k + "=" + v;
    }
    out += (out.empty() ? "" : "|") + s.name + (args.empty() ? "" : "(" + args + ")");
  }
  return out;
}

std::vector<StrategyCost> StrategiesFromProfile(const Profile& p) {
  std::vector<StrategyCost> out;
  for (const ProfileEntry& e : p.pareto)
    out.push_back({e.spec, ShortSpec(e.spec), e.quality, e.ratio, e.encode_gbps * 1e9, e.decode_gbps * 1e9});
  return out;
}

void LiveCodecSpeeds::Observe(const StrategyCost& s, double bytes, const StageTimes& t) {
  // Sends are timed for every transfer that carried enough bytes, none's included.
  const bool sends_timed = t.send_cpu_s > 0 && std::isfinite(t.send_cpu_s);
  if (sends_timed && t.wire_bytes >= o_.min_sample_bytes) {
    const double x = t.send_cpu_s / t.wire_bytes;
    send_cpu_per_byte_ = has_send_ ? (1 - o_.alpha) * send_cpu_per_byte_ + o_.alpha * x : x;
    has_send_ = true;
  }
  if (s.none() || !(bytes > 0) || bytes < o_.min_sample_bytes) return;
  const double profiled[2] = {bytes / s.encode_Bps, bytes / s.decode_Bps};
  // The encode's own time: where sends shared its cores, they ran during it (frames are sent as
  // the next ones are encoded), and what they cost is counted apart (EncodeStageBps). Never
  // below half the time measured: a send timing cannot make an encode look free.
  double encode_s = t.encode_s;
  if (o_.sends_share_codec_cores && sends_timed)
    encode_s = std::max(0.5 * t.encode_s, t.encode_s - t.send_cpu_s);
  const double measured[2] = {encode_s, t.decode_s};
  for (int k = 0; k < 2; ++k) {
    if (!(measured[k] > 0) || !std::isfinite(measured[k]) || !std::isfinite(profiled[k])) continue;
    const double x = std::log(profiled[k] / measured[k]);
    log_factor_[k] = has_[k] ? (1 - o_.alpha) * log_factor_[k] + o_.alpha * x : x;
    has_[k] = true;
    factor_[k] = std::exp(log_factor_[k]);
  }
}

Controller::Controller(std::vector<StrategyCost> strategies, ControllerOptions opts)
    : o_(std::move(opts)), speeds_(o_.speeds) {
  s_.push_back({"none", "none", 1.0, 1.0, 0, 0});
  for (StrategyCost& s : strategies) {
    if (s.none() || s.spec == "none") continue;
    if (s.name.empty()) s.name = ShortSpec(s.spec);
    s_.push_back(std::move(s));
  }
  state_.resize(s_.size());
  rng_ = o_.seed * 0x9E3779B97F4A7C15ull + 1;
}

Result<Controller> Controller::FromProfile(const Profile& p, ControllerOptions opts) {
  if (p.pareto.empty()) return Status::InvalidArgument("profile has no Pareto strategies");
  return Controller(StrategiesFromProfile(p), std::move(opts));
}

double Controller::Uniform() { return double(SplitMix(rng_) >> 11) * 0x1.0p-53; }
double Controller::Normal() {
  const double u1 = 1.0 - Uniform(), u2 = Uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

double Controller::FloorFor(const Request& r) const {
  double f = r.floor;
  for (const auto& [label, floor] : o_.label_floors)
    if (label == r.label) f = std::max(f, floor);
  return f;
}

double Controller::Predict(uint32_t i, const Request& r, double bw, const QueueState& q) const {
  const StrategyCost& s = s_[i];
  const double v = r.kv_bytes, ready = r.model_seconds;
  if (s.none()) return std::max(ready, q.link_wait) + v / bw;
  const double encode_Bps = speeds_.EncodeStageBps(s), decode_Bps = s.decode_Bps * speeds_.decode();
  if (o_.pipelined) {
    const double start = std::max({ready, q.encode_wait, q.link_wait, q.decode_wait});
    const StrategyCost live{{}, {}, s.quality, s.ratio, encode_Bps, decode_Bps};  // numbers only: no string copies
    return start + LatencyModel::Pipelined(live, v, bw, o_.n_layer);
  }
  // Sequential stages through three FIFO resources: encoder, link, decoder.
  const double e_end = std::max(ready, q.encode_wait) + v / encode_Bps;
  const double l_end = std::max(e_end, q.link_wait) + v / (s.ratio * bw);
  return std::max(l_end, q.decode_wait) + v / decode_Bps;
}

double Controller::QueueCost(uint32_t i, const Request& r, double bw, const QueueState& q) const {
  if (!o_.queue_aware) return 0;
  const StrategyCost& s = s_[i];
  const double v = r.kv_bytes;
  if (s.none()) return q.link_jobs * v / bw;
  return q.link_jobs * v / (s.ratio * bw) + q.encode_jobs * v / speeds_.EncodeStageBps(s) +
         q.decode_jobs * v / (s.decode_Bps * speeds_.decode());
}

double Controller::Correction(uint32_t i) const {
  const ArmState& a = state_[i];
  return o_.moving_average && a.has_residual ? std::exp(a.log_residual) : 1.0;
}

void Controller::Decide(const Request& r, double bw, double confidence, const QueueState& q, Decision* d) {
  const uint32_t n = uint32_t(s_.size());
  d->notes.resize(n);
  d->bandwidth_Bps = bw;
  d->confidence = confidence;
  d->floor = FloorFor(r);
  d->explored = false;
  d->queues = q;
  d->encode_speed = EncodeSpeedFactor();
  d->decode_speed = DecodeSpeedFactor();
  d->send_cost_per_byte = speeds_.encode_send_cost_per_byte();
  uint32_t best = 0;
  double best_cost = INFINITY;
  for (uint32_t i = 0; i < n; ++i) {
    CandidateNote& note = d->notes[i];
    note.strategy = i;
    note.reason = DropReason::kKept;
    note.predicted_seconds = 0;
    note.cost = 0;
    const StrategyCost& s = s_[i];
    if (i != 0) {
      const double bstar = o_.pipelined ? LatencyModel::BreakEvenPipelined(s, o_.n_layer) : LatencyModel::BreakEvenSequential(s);
      if (s.quality < d->floor) note.reason = DropReason::kFloor;
      else if (bw >= bstar) note.reason = DropReason::kNoGain;
      else if (state_[i].cooldown_left > 0) note.reason = DropReason::kCooldown;
    }
    if (note.reason != DropReason::kKept) continue;
    const double raw = Predict(i, r, bw, q);
    note.predicted_seconds = r.model_seconds + (raw - r.model_seconds) * Correction(i);
    note.cost = note.predicted_seconds + QueueCost(i, r, bw, q);
    if (note.cost < best_cost) best_cost = note.cost, best = i;
  }
  const double best_t = d->notes[best].predicted_seconds;
  d->choice = best;
  d->predicted_seconds = best_t;

  // Explore only while the link is idle: under a backlog a worse pick delays every request
  // queued behind it.
  if (o_.bandit && o_.top_k > 1 && q.link_wait <= 0) {
    // Top-k kept strategies by corrected prediction, those meeting the SLO first.
    uint32_t top[16];
    uint32_t k = 0;
    const uint32_t want = std::min<uint32_t>(o_.top_k, 16);
    const bool slo_possible = best_t <= r.slo_seconds;
    for (uint32_t i = 0; i < n; ++i) {
      const CandidateNote& note = d->notes[i];
      if (note.reason != DropReason::kKept) continue;
      if (slo_possible && note.predicted_seconds > r.slo_seconds) continue;
      if (note.predicted_seconds > best_t * o_.arm_margin) continue;
      if (k < want) {
        top[k++] = i;
      } else if (note.predicted_seconds < d->notes[top[want - 1]].predicted_seconds) {
        top[want - 1] = i;
      } else {
        continue;
      }
      for (uint32_t pos = k - 1; pos > 0 && d->notes[top[pos - 1]].predicted_seconds > d->notes[top[pos]].predicted_seconds; --pos)
        std::swap(top[pos - 1], top[pos]);
    }
    double best_score = INFINITY;
    uint32_t pick = best;
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t i = top[j];
      const ArmState& a = state_[i];
      const double raw = Predict(i, r, bw, q);
      // Posterior of the log correction: discounted mean of observed residuals, shrunk to 0.
      const double mean = a.w > 0 ? a.wsum / (a.w + 1) : 0;
      const double sd = o_.prior_sd / std::sqrt(1 + a.w);
      const double score = r.model_seconds + (raw - r.model_seconds) * std::exp(mean + sd * Normal());
      if (score < best_score) best_score = score, pick = i;
    }
    d->explored = pick != best;
    d->choice = pick;
    d->predicted_seconds = d->notes[pick].predicted_seconds;
  }
  d->meets_slo = d->predicted_seconds <= r.slo_seconds;
  for (ArmState& a : state_)
    if (a.cooldown_left > 0) --a.cooldown_left;
}

void Controller::Observe(const Decision& d, const Request& r, double observed, const StageTimes& stages) {
  const uint32_t i = d.choice;
  if (i >= s_.size()) return;
  ArmState& a = state_[i];
  if (o_.live_speeds) speeds_.Observe(s_[i], r.kv_bytes, stages);
  // Residual of the service part (queue + codec + link), as a log ratio so that it carries over
  // between requests of different sizes.
  const double corr = Correction(i);
  const double predicted_raw = r.model_seconds + (d.notes[i].predicted_seconds - r.model_seconds) / corr;
  const double rho = std::log(std::max(1e-9, observed - r.model_seconds) / std::max(1e-9, predicted_raw - r.model_seconds));
  const double alpha = 2.0 / (o_.ma_window + 1.0);
  a.log_residual = a.has_residual ? (1 - alpha) * a.log_residual + alpha * rho : rho;
  a.has_residual = true;
  a.w = o_.discount * a.w + 1;
  a.wsum = o_.discount * a.wsum + rho;
  // Cooldown only for violations the model did not foresee; none is never benched.
  if (i != 0 && d.meets_slo && observed > r.slo_seconds &&
      observed > d.notes[i].predicted_seconds * (1 + o_.cooldown_margin)) {
    if (++a.violations >= o_.cooldown_after) a.cooldown_left = o_.cooldown_requests, a.violations = 0;
  } else if (observed <= r.slo_seconds) {
    a.violations = 0;
  }
}

std::string Controller::Explain(const Request& r, const Decision& d) const {
  char buf[256];
  std::snprintf(buf, sizeof buf, "req %llu [%s, %u tok, %.1f MiB, SLO %.0f ms, floor %.3f]: B≈%.2f Gbps (conf %.2f); ",
                (unsigned long long)r.id, r.label.c_str(), r.prompt_tokens, r.kv_bytes / 1048576.0, r.slo_seconds * 1e3,
                d.floor, d.bandwidth_Bps * 8 / 1e9, d.confidence);
  std::string out = buf;
  std::vector<const CandidateNote*> kept;
  uint32_t dropped[4] = {0, 0, 0, 0};
  for (const CandidateNote& n : d.notes) {
    if (n.reason == DropReason::kKept) kept.push_back(&n);
    else dropped[int(n.reason)]++;
  }
  // Live codec speeds and queues, where they moved the plan.
  if (std::abs(d.encode_speed - 1) > 0.05 || std::abs(d.decode_speed - 1) > 0.05) {
    std::snprintf(buf, sizeof buf, "codec measured at %.2f× (encode) / %.2f× (decode) of profile; ", d.encode_speed,
                  d.decode_speed);
    out += buf;
  }
  if (d.send_cost_per_byte > 0) {
    std::snprintf(buf, sizeof buf, "sends take %.2f ms of the codec's cores per MB on the wire; ", d.send_cost_per_byte * 1e9);
    out += buf;
  }
  const QueueState& q = d.queues;
  const bool queued = o_.queue_aware && (q.link_jobs || q.encode_jobs || q.decode_jobs);
  if (queued) {
    // Each wait as it delays this request: past the moment its KV is ready.
    auto past_ready = [&](double wait) { return std::max(0.0, wait - r.model_seconds); };
    std::snprintf(buf, sizeof buf, "queued: link %.2f s (%u), encode %.2f s (%u), decode %.2f s (%u)%s; ",
                  past_ready(q.link_wait), q.link_jobs, past_ready(q.encode_wait), q.encode_jobs,
                  past_ready(q.decode_wait), q.decode_jobs,
                  q.link_jobs && q.link_wait >= std::max(q.encode_wait, q.decode_wait) ? ": prefer ratio"
                                                                                       : ": prefer codec speed");
    out += buf;
  }
  std::sort(kept.begin(), kept.end(), [](auto* a, auto* b) { return a->cost < b->cost; });
  out += "kept " + std::to_string(kept.size()) + ":";
  for (size_t i = 0; i < kept.size() && i < 4; ++i) {
    const double extra = kept[i]->cost - kept[i]->predicted_seconds;
    char delay[48] = "";
    if (queued && extra > 0) std::snprintf(delay, sizeof delay, " (+%.0f ms to those behind)", extra * 1e3);
    std::snprintf(buf, sizeof buf, " %s %.0f ms%s%s", s_[kept[i]->strategy].name.c_str(), kept[i]->predicted_seconds * 1e3,
                  delay, i + 1 < std::min<size_t>(kept.size(), 4) ? "," : "");
    out += buf;
  }
  if (kept.size() > 4) out += " …";
  out += "; dropped:";
  bool any = false;
  for (DropReason reason : {DropReason::kFloor, DropReason::kNoGain, DropReason::kCooldown}) {
    if (!dropped[int(reason)]) continue;
    out += std::string(any ? "," : "") + " " + std::to_string(dropped[int(reason)]) + " " + DropReasonName(reason);
    if (reason == DropReason::kNoGain) out += " (B ≥ B*)";
    if (reason == DropReason::kFloor) out += " (quality < floor)";
    any = true;
  }
  if (!any) out += " none";
  std::snprintf(buf, sizeof buf, "; chose %s, predicted %.0f ms%s%s", s_[d.choice].name.c_str(), d.predicted_seconds * 1e3,
                d.meets_slo ? " (meets SLO)" : " (no strategy meets the SLO: fastest that meets the floor)",
                d.explored ? " [bandit exploring]" : "");
  out += buf;
  return out;
}

}  // namespace kvserve
