// Trace-driven simulation of one link and one codec worker per side shared by a request stream:
// traces and workloads from CSV, injectable drift, and the per-policy report.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <queue>
#include <sstream>

#include "kvserve/codec.h"
#include "kvserve/controller.h"
#include "kvserve/file.h"
#include "control/simulator.h"

namespace kvserve {
namespace {

// Splits CSV text into (line number, fields) rows, skipping blank lines, '#' comments and a
// header (a first row whose first field is not a number).
std::vector<std::pair<size_t, std::vector<std::string>>> CsvRows(std::string_view text) {
  std::vector<std::pair<size_t, std::vector<std::string>>> rows;
  size_t line_no = 0, pos = 0;
  bool first = true;
  while (pos <= text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string line(text.substr(pos, end - pos));
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos || line[b] == '#') {
      if (end == text.size()) break;
      continue;
    }
    std::vector<std::string> fields;
    std::stringstream ss(line);
    std::string f;
    while (std::getline(ss, f, ',')) {
      size_t s = f.find_first_not_of(" \t"), e = f.find_last_not_of(" \t");
      fields.push_back(s == std::string::npos ? "" : f.substr(s, e - s + 1));
    }
    const bool header = first && !fields.empty() && !fields[0].empty() &&
                        !(std::isdigit(static_cast<unsigned char>(fields[0][0])) || fields[0][0] == '.' || fields[0][0] == '-');
    first = false;
    if (!header) rows.push_back({line_no, std::move(fields)});
    if (end == text.size()) break;
  }
  return rows;
}

Status LineError(std::string_view origin, size_t line, const std::string& what) {
  return Status::InvalidArgument(std::string(origin) + ":" + std::to_string(line) + ": " + what);
}

// Times in traces and workloads: 1e7 s is 115 days, beyond any replay; past it double
// arithmetic on latencies (t + milliseconds) loses the milliseconds.
constexpr double kMaxSeconds = 1e7;

bool ParseNumber(const std::string& s, double* v) {
  if (s.empty()) return false;
  char* end = nullptr;
  *v = std::strtod(s.c_str(), &end);
  return *end == '\0' && std::isfinite(*v);
}

std::string_view AsText(const ByteBuffer& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t k = size_t(std::ceil(p * double(v.size()))) - (p > 0 ? 1 : 0);
  return v[std::min(k, v.size() - 1)];
}

struct Resources {
  double enc_free = 0, link_free = 0, dec_free = 0;
};

struct Outcome {
  double latency = 0;      // seconds from arrival
  double enc_start = 0, enc_end = 0, link_start = 0, link_end = 0, dec_start = 0, done = 0;
  double link_bytes = 0;
};

class World {
 public:
  World(const std::vector<StrategyCost>& s, const std::vector<TracePoint>& trace, const SimOptions& o)
      : s_(s), trace_(trace), o_(o) {}

  double TrueBandwidth(double t) const {
    double bps = TraceBandwidthGbps(trace_, t) * 1e9 / 8;
    if (o_.drift.link_slowdown != 1.0 && t >= o_.drift.link_at) bps /= o_.drift.link_slowdown;
    return bps;
  }
  double CodecFactor(double t) const {
    double f = o_.codec_threads;
    if (o_.drift.codec_slowdown != 1.0 && t >= o_.drift.codec_at) f /= o_.drift.codec_slowdown;
    return f;
  }
  // Finish time of `bytes` sent from `start`, following the trace (and the link drift).
  double Transfer(double start, double bytes) const {
    double t = start;
    for (int guard = 0; guard < 1000000; ++guard) {
      const double bw = TrueBandwidth(t);
      double next = INFINITY;
      auto it = std::upper_bound(trace_.begin(), trace_.end(), t, [](double v, const TracePoint& p) { return v < p.t; });
      if (it != trace_.end()) next = it->t;
      if (o_.drift.link_slowdown != 1.0 && t < o_.drift.link_at) next = std::min(next, o_.drift.link_at);
      if (bytes <= bw * (next - t)) return t + bytes / bw;
      bytes -= bw * (next - t);
      t = next;
    }
    return t;
  }
  // Bytes the link delivers between t0 and t1.
  double Delivered(double t0, double t1) const {
    double bytes = 0, t = t0;
    while (t < t1) {
      auto it = std::upper_bound(trace_.begin(), trace_.end(), t, [](double v, const TracePoint& p) { return v < p.t; });
      double next = it != trace_.end() ? it->t : INFINITY;
      if (o_.drift.link_slowdown != 1.0 && t < o_.drift.link_at) next = std::min(next, o_.drift.link_at);
      next = std::min(next, t1);
      bytes += TrueBandwidth(t) * (next - t);
      t = next;
    }
    return bytes;
  }
  // Runs strategy i for request (arrival, v, model) against `res`; commits if `commit`.
  Outcome Execute(uint32_t i, double arrival, double v, double model, Resources* res, bool commit) const {
    const StrategyCost& s = s_[i];
    Outcome out;
    const double ready = arrival + model;
    Resources r = *res;
    if (s.none()) {
      out.enc_start = out.enc_end = ready;
      out.link_start = std::max(ready, r.link_free);
      out.link_end = Transfer(out.link_start, v);
      out.link_bytes = v;
      r.link_free = out.link_end;
      out.done = out.dec_start = out.link_end;
    } else if (o_.controller.pipelined) {
      const double start = std::max({ready, r.enc_free, r.link_free, r.dec_free});
      const double f = CodecFactor(start);
      StrategyCost t = s;
      t.encode_Bps *= f, t.decode_Bps *= f;
      // Link-bound part follows the trace; codec-bound parts at the (drifted) codec speed.
      const double link_end = Transfer(start + (v / o_.controller.n_layer) / t.encode_Bps, v / s.ratio);
      const double codec_end = start + LatencyModel::Pipelined(t, v, 1e30, o_.controller.n_layer);
      out.enc_start = out.link_start = start;
      out.link_end = link_end;
      out.link_bytes = v / s.ratio;
      out.done = std::max(codec_end, link_end + (v / o_.controller.n_layer) / t.decode_Bps);
      out.enc_end = out.dec_start = start;  // overlapped: the link span stands for all three
      r.enc_free = r.link_free = r.dec_free = out.done;
    } else {
      const double e_start = std::max(ready, r.enc_free);
      const double e_end = e_start + v / (s.encode_Bps * CodecFactor(e_start));
      out.enc_start = e_start, out.enc_end = e_end;
      out.link_start = std::max(e_end, r.link_free);
      out.link_end = Transfer(out.link_start, v / s.ratio);
      out.link_bytes = v / s.ratio;
      const double d_start = std::max(out.link_end, r.dec_free);
      out.dec_start = d_start;
      out.done = d_start + v / (s.decode_Bps * CodecFactor(d_start));
      r.enc_free = e_end, r.link_free = out.link_end, r.dec_free = out.done;
    }
    out.latency = out.done - arrival;
    if (commit) *res = r;
    return out;
  }
  // The best strategy for this request in hindsight (true speeds and link), given the queues.
  uint32_t Best(double arrival, double v, double model, double floor, const Resources& res, double* latency) const {
    uint32_t best = 0;
    double best_t = INFINITY;
    for (uint32_t i = 0; i < s_.size(); ++i) {
      if (i != 0 && s_[i].quality < floor) continue;
      Resources copy = res;
      const double t = Execute(i, arrival, v, model, &copy, false).latency;
      if (t < best_t) best_t = t, best = i;
    }
    *latency = best_t;
    return best;
  }

 private:
  const std::vector<StrategyCost>& s_;
  const std::vector<TracePoint>& trace_;
  const SimOptions& o_;
};

}  // namespace

Result<std::vector<TracePoint>> ParseTrace(std::string_view csv, std::string_view origin) {
  std::vector<TracePoint> out;
  for (auto& [line, f] : CsvRows(csv)) {
    if (f.size() != 2) return LineError(origin, line, "want 2 fields (time_s,gbps), got " + std::to_string(f.size()));
    TracePoint p;
    if (!ParseNumber(f[0], &p.t) || p.t < 0 || p.t > kMaxSeconds)
      return LineError(origin, line, "time '" + f[0] + "' is not a number in [0, 1e7] seconds");
    if (!ParseNumber(f[1], &p.gbps) || !(p.gbps > 0) || p.gbps > 1e6)
      return LineError(origin, line, "gbps '" + f[1] + "' is not a number in (0, 1e6]");
    if (!out.empty() && p.t < out.back().t)
      return LineError(origin, line, "time " + f[0] + " goes back (previous row is at " + std::to_string(out.back().t) + ")");
    out.push_back(p);
  }
  if (out.empty()) return Status::InvalidArgument(std::string(origin) + ": no rows (want time_s,gbps lines)");
  return out;
}

Result<std::vector<TracePoint>> LoadTrace(const std::string& path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer b, ReadFile(path));
  return ParseTrace(AsText(b), path);
}

double TraceBandwidthGbps(const std::vector<TracePoint>& trace, double t) {
  auto it = std::upper_bound(trace.begin(), trace.end(), t, [](double v, const TracePoint& p) { return v < p.t; });
  if (it == trace.begin()) return trace.front().gbps;
  return std::prev(it)->gbps;
}

Result<std::vector<WorkloadRequest>> ParseWorkload(std::string_view csv, std::string_view origin) {
  std::vector<WorkloadRequest> out;
  for (auto& [line, f] : CsvRows(csv)) {
    if (f.size() != 5)
      return LineError(origin, line, "want 5 fields (arrival_s,prompt_tokens,label,slo_ms,floor), got " + std::to_string(f.size()));
    WorkloadRequest r;
    double tokens;
    if (!ParseNumber(f[0], &r.arrival) || r.arrival < 0 || r.arrival > kMaxSeconds)
      return LineError(origin, line, "arrival_s '" + f[0] + "' is not a number in [0, 1e7] seconds");
    if (!out.empty() && r.arrival < out.back().arrival) return LineError(origin, line, "arrival_s " + f[0] + " goes back");
    if (!ParseNumber(f[1], &tokens) || tokens < 1 || tokens > 1e7 || tokens != std::floor(tokens))
      return LineError(origin, line, "prompt_tokens '" + f[1] + "' is not an integer in 1..10000000");
    r.prompt_tokens = uint32_t(tokens);
    r.label = f[2];
    if (r.label.empty() || !std::all_of(r.label.begin(), r.label.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }))
      return LineError(origin, line, "label '" + f[2] + "' must be letters, digits, '_' or '-'");
    if (!ParseNumber(f[3], &r.slo_ms) || !(r.slo_ms > 0)) return LineError(origin, line, "slo_ms '" + f[3] + "' is not a number > 0");
    if (!ParseNumber(f[4], &r.floor) || !(r.floor > 0 && r.floor <= 1.5)) return LineError(origin, line, "floor '" + f[4] + "' is not in (0, 1.5]");
    out.push_back(std::move(r));
  }
  if (out.empty()) return Status::InvalidArgument(std::string(origin) + ": no requests");
  return out;
}

Result<std::vector<WorkloadRequest>> LoadWorkload(const std::string& path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer b, ReadFile(path));
  return ParseWorkload(AsText(b), path);
}

double Drift::at() const {
  double t = INFINITY;
  if (codec_slowdown != 1.0) t = std::min(t, codec_at);
  if (link_slowdown != 1.0) t = std::min(t, link_at);
  return t;
}

Result<Drift> ParseDrift(const std::vector<std::string>& specs) {
  Drift d;
  for (const std::string& s : specs) {
    const size_t colon = s.find(':'), at = s.find('@');
    double factor, time;
    if (colon == std::string::npos || at == std::string::npos || at < colon || !ParseNumber(s.substr(colon + 1, at - colon - 1), &factor) ||
        !ParseNumber(s.substr(at + 1), &time) || !(factor > 0) || time < 0)
      return Status::InvalidArgument("drift '" + s + "': want codec:FACTOR@SECONDS or link:FACTOR@SECONDS (e.g. codec:1.5@20)");
    const std::string what = s.substr(0, colon);
    if (what == "codec") d.codec_slowdown = factor, d.codec_at = time;
    else if (what == "link") d.link_slowdown = factor, d.link_at = time;
    else return Status::InvalidArgument("drift '" + s + "': '" + what + "' is not codec or link");
  }
  return d;
}

Result<PolicyReport> Simulate(const std::vector<StrategyCost>& strategies_in, const std::vector<TracePoint>& trace,
                              const std::vector<WorkloadRequest>& workload, std::string_view policy, const SimOptions& opts) {
  if (trace.empty()) return Status::InvalidArgument("simulate: empty trace");
  if (workload.empty()) return Status::InvalidArgument("simulate: empty workload");
  ControllerOptions co = opts.controller;
  enum { kAdaptive, kNone, kOracle, kStatic } kind;
  uint32_t static_index = 0;
  if (policy == "adaptive") kind = kAdaptive;
  else if (policy == "adaptive-bandit") kind = kAdaptive, co.bandit = true;
  else if (policy == "adaptive-ma") kind = kAdaptive, co = ControllerOptions::KvServeRule(co);
  else if (policy == "none") kind = kNone;
  else if (policy == "oracle") kind = kOracle;
  else if (policy.rfind("static:", 0) == 0) kind = kStatic;
  else return Status::InvalidArgument("policy '" + std::string(policy) + "': want adaptive, adaptive-bandit, adaptive-ma, oracle, none or static:SPEC");

  Controller ctl(strategies_in, co);
  const std::vector<StrategyCost>& s = ctl.strategies();
  if (kind == kStatic) {
    const std::string want(policy.substr(7));
    auto canon = CanonicalStrategy(want);
    const std::string key = canon.ok() ? canon.value() : want;
    bool found = false;
    for (uint32_t i = 0; i < s.size() && !found; ++i) {
      auto mine = CanonicalStrategy(s[i].spec);
      if (s[i].spec == want || s[i].name == want || (mine.ok() && mine.value() == key)) static_index = i, found = true;
    }
    if (!found) return Status::InvalidArgument("policy '" + std::string(policy) + "': the strategy is not in the profile");
  }

  SimOptions o = opts;
  o.controller = co;
  World world(s, trace, o);
  Resources res;
  // The simulated link has no per-transfer latency (a transfer's time is its bytes at the
  // link's rate), and partial samples of a transfer's tail may be small: every sample counts.
  BandwidthEstimator est({.min_bandwidth_bytes = 0});
  PolicyReport rep;
  rep.policy = std::string(policy);
  std::vector<uint32_t> counts(s.size(), 0);
  // Every committed request, in commit (arrival) order. The link, the encoder and the decoder
  // each serve their jobs one at a time in that order, so at any moment each has at most one job
  // in progress, the jobs before it are finished and those after it have not started: what a
  // sender sees queued is one partial job plus a suffix sum, and the whole replay stays linear
  // in the number of requests however deep the backlog.
  struct Job {
    Outcome out;
    uint32_t strategy;
    Decision decision;
    Request request;
  };
  std::vector<Job> jobs;
  std::vector<double> link_sum = {0};                // prefix sums of link bytes over jobs
  std::vector<uint32_t> codec_jobs;                  // jobs with a codec, in order
  std::vector<double> enc_sum = {0}, dec_sum = {0};  // prefix sums of their encode/decode seconds
  size_t link_head = 0, enc_head = 0, dec_head = 0;  // first job not yet finished on each resource
  // Jobs not yet observed by the controller, soonest done first (a request without a codec can
  // finish before an earlier one still decoding).
  using Done = std::pair<double, size_t>;
  std::priority_queue<Done, std::vector<Done>, std::greater<Done>> undone;
  std::vector<size_t> finished;
  double partial_from = 0;  // start of the next in-progress throughput sample
  Decision d;
  uint32_t ok_slo = 0;
  std::vector<char> right;  // after the drift: was the choice within 5% of the best in hindsight
  const double drift_at = o.drift.at();
  // Share of [start, end) still ahead at `now` (1 before it starts, even when it is empty).
  auto remaining = [](double now, double start, double end) {
    return now <= start ? 1.0 : (end - now) / std::max(1e-12, end - start);
  };

  for (size_t j = 0; j < workload.size(); ++j) {
    const WorkloadRequest& w = workload[j];
    const double now = w.arrival;
    // Feedback from what has completed by now: transfer samples and observed latencies.
    for (; link_head < jobs.size() && jobs[link_head].out.link_end <= now; ++link_head) {
      const Outcome& po = jobs[link_head].out;
      const double from = std::max(po.link_start, std::min(partial_from, po.link_end));
      if (po.link_end > from) est.AddSample(world.Delivered(from, po.link_end), po.link_end - from, po.link_end);
    }
    finished.clear();
    while (!undone.empty() && undone.top().first <= now) {
      finished.push_back(undone.top().second);
      undone.pop();
    }
    std::sort(finished.begin(), finished.end());  // observed in arrival order
    if (kind == kAdaptive) {
      for (size_t k : finished) {
        // The stages' own times, as the nodes measure them (in the layer-streamed form the three
        // overlap and are not told apart).
        const Outcome& po = jobs[k].out;
        StageTimes st;
        if (!o.controller.pipelined && !s[jobs[k].strategy].none())
          st.encode_s = po.enc_end - po.enc_start, st.decode_s = po.done - po.dec_start;
        ctl.Observe(jobs[k].decision, jobs[k].request, po.latency, st);
      }
    }
    // What the sender sees of the transfer in progress: bytes acknowledged so far.
    QueueState seen;
    double link_backlog = link_sum.back() - link_sum[link_head];
    if (link_head < jobs.size() && jobs[link_head].out.link_start <= now) {
      const Outcome& po = jobs[link_head].out;
      const double from = std::max(po.link_start, partial_from);
      if (now - from >= 0.01) {
        est.AddSample(world.Delivered(from, now), now - from, now);
        partial_from = now;
      }
      link_backlog -= world.Delivered(po.link_start, now);
    }
    // Codec backlog: the share of each job not done yet, at the profiled speed.
    while (enc_head < codec_jobs.size() && !(now < jobs[codec_jobs[enc_head]].out.enc_end ||
                                             now < jobs[codec_jobs[enc_head]].out.enc_start)) ++enc_head;
    while (dec_head < codec_jobs.size() && !(now < jobs[codec_jobs[dec_head]].out.done)) ++dec_head;
    if (enc_head < codec_jobs.size()) {
      const Outcome& po = jobs[codec_jobs[enc_head]].out;
      const double head = enc_sum[enc_head + 1] - enc_sum[enc_head];
      seen.encode_wait = enc_sum.back() - enc_sum[enc_head + 1] + head * remaining(now, po.enc_start, po.enc_end);
    }
    if (dec_head < codec_jobs.size()) {
      const Outcome& po = jobs[codec_jobs[dec_head]].out;
      const double head = dec_sum[dec_head + 1] - dec_sum[dec_head];
      seen.decode_wait = dec_sum.back() - dec_sum[dec_head + 1] + head * remaining(now, po.dec_start, po.done);
    }
    // Requests at each resource: those not finished there (in progress or queued).
    seen.link_jobs = uint32_t(jobs.size() - link_head);
    seen.encode_jobs = seen.encode_wait > 0 ? uint32_t(codec_jobs.size() - enc_head) : 0;
    seen.decode_jobs = seen.decode_wait > 0 ? uint32_t(codec_jobs.size() - dec_head) : 0;
    if (est.NeedsProbe(now)) est.AddThroughput(world.TrueBandwidth(now), now);  // a probe measures the link

    Request r;
    r.id = j;
    r.label = w.label;
    r.prompt_tokens = w.prompt_tokens;
    r.kv_bytes = double(w.prompt_tokens) * o.kv_bytes_per_token;
    r.slo_seconds = w.slo_ms / 1e3;
    r.floor = w.floor;
    r.model_seconds = double(w.prompt_tokens) / o.prefill_tokens_per_second;
    const double floor = ctl.FloorFor(r);

    uint32_t choice = 0;
    // The hindsight best: the oracle's choice, and the yardstick of recovery after a drift.
    const bool track_recovery = kind == kAdaptive && now >= drift_at;
    double best_latency = 0;
    const uint32_t best =
        kind == kOracle || track_recovery ? world.Best(now, r.kv_bytes, r.model_seconds, floor, res, &best_latency) : 0;
    switch (kind) {
      case kNone: choice = 0; break;
      case kStatic: choice = s[static_index].quality >= floor ? static_index : 0; break;
      case kOracle: choice = best; break;
      case kAdaptive: {
        // The controller sees only what a sender can: its bandwidth estimate and the work queued
        // (bytes not yet sent, codec work not yet done), not the true future of the link.
        const double bw = est.has_estimate() ? est.PlanningEstimate(now) : world.TrueBandwidth(now);
        seen.link_wait = link_backlog / bw;
        ctl.Decide(r, bw, est.Confidence(now), seen, &d);
        choice = d.choice;
        if (opts.explain) rep.explanations.push_back(ctl.Explain(r, d));
        break;
      }
    }
    const Outcome out = world.Execute(choice, now, r.kv_bytes, r.model_seconds, &res, true);
    jobs.push_back({out, choice, kind == kAdaptive ? d : Decision{}, r});
    link_sum.push_back(link_sum.back() + out.link_bytes);
    if (!s[choice].none()) {
      codec_jobs.push_back(uint32_t(jobs.size() - 1));
      enc_sum.push_back(enc_sum.back() + r.kv_bytes / s[choice].encode_Bps);
      dec_sum.push_back(dec_sum.back() + r.kv_bytes / s[choice].decode_Bps);
    }
    undone.push({out.done, jobs.size() - 1});
    if (s[choice].quality < floor && choice != 0) rep.floor_violations++;
    rep.latencies_ms.push_back(out.latency * 1e3);
    if (out.latency <= r.slo_seconds) ok_slo++;
    counts[choice]++;
    if (track_recovery) right.push_back(out.latency <= 1.05 * best_latency + 1e-9);
  }
  rep.requests = uint32_t(workload.size());
  double sum = 0;
  for (double v : rep.latencies_ms) sum += v;
  rep.mean_ms = sum / rep.latencies_ms.size();
  rep.p50_ms = Percentile(rep.latencies_ms, 0.5);
  rep.p99_ms = Percentile(rep.latencies_ms, 0.99);
  rep.slo_attainment = double(ok_slo) / workload.size();
  for (uint32_t i = 0; i < s.size(); ++i)
    if (counts[i]) rep.choices.push_back({s[i].name, counts[i]});
  if (kind == kAdaptive && o.drift.any() && !right.empty()) {
    // Requests after the drift until a window of 10 starts in which at least 8 choices are right
    // (a bandit keeps exploring now and then, so "every one right" would never hold).
    const size_t run = std::min<size_t>(10, right.size()), need = (run * 8 + 9) / 10;
    for (size_t k = 0; k + run <= right.size(); ++k) {
      if (size_t(std::count(right.begin() + k, right.begin() + k + run, 1)) >= need) {
        rep.recovery_requests = int64_t(k);
        break;
      }
    }
  }
  return rep;
}

}  // namespace kvserve
