// Bandwidth estimation from completed transfers and probes: an EWMA of throughput that rejects
// a lone outlier but follows a step change once two samples agree on the new level; small
// transfers estimate the per-transfer latency instead, which larger ones then discount.
#include <algorithm>
#include <cmath>

#include "kvserve/controller.h"

namespace kvserve {

void BandwidthEstimator::AddSample(double bytes, double seconds, double now) {
  if (!(bytes > 0) || !(seconds > 0) || !std::isfinite(bytes) || !std::isfinite(seconds)) return;
  if (bytes < o_.min_bandwidth_bytes) {
    // Mostly latency: what is left after its bytes at the current level (all of it before one).
    const double sample = std::max(0.0, seconds - (n_ > 0 ? bytes / estimate_ : 0.0));
    latency_ = has_latency_ ? latency_ + o_.latency_alpha * (sample - latency_) : sample;
    has_latency_ = true;
    return;
  }
  AddThroughput(bytes / (seconds - std::min(latency_, 0.5 * seconds)), now);
}

void BandwidthEstimator::AddThroughput(double x, double now) {
  if (!(x > 0) || !std::isfinite(x)) return;
  history_.push_back({now, x});
  size_t drop = 0;
  while (drop < history_.size() && history_[drop].first < now - o_.window_seconds) ++drop;
  if (drop > 0) history_.erase(history_.begin(), history_.begin() + drop);
  // After an idle period the old level is stale: the first sample restarts the estimate.
  if (n_ == 0 || now - last_time_ > 4 * o_.idle_seconds) {
    estimate_ = x, dev_ = 0, suspect_ = 0, n_ = 1, last_time_ = now;
    return;
  }
  last_time_ = now;
  const double ratio = x / estimate_;
  if (ratio > o_.outlier_factor || ratio < 1 / o_.outlier_factor) {
    if (suspect_ > 0 && std::fabs(x - suspect_) <= o_.step_agree * std::max(x, suspect_)) {
      // Two suspect samples agree: the link changed. Jump to the new level.
      estimate_ = 0.5 * (x + suspect_), dev_ = std::fabs(x - suspect_) / 2, suspect_ = 0, n_ = 2;
    } else {
      suspect_ = x;  // held back until confirmed
    }
    return;
  }
  suspect_ = 0;
  const double err = x - estimate_;
  estimate_ += o_.alpha * err;
  dev_ = (1 - o_.alpha) * dev_ + o_.alpha * std::fabs(err);
  ++n_;
}

double BandwidthEstimator::PlanningEstimate(double now) const {
  double inv = 0;
  size_t n = 0;
  for (const auto& [t, x] : history_)
    if (t >= now - o_.window_seconds) inv += 1 / x, ++n;
  if (n == 0) return estimate_;
  return std::min(estimate_, double(n) / inv);
}

double BandwidthEstimator::Confidence(double now) const {
  if (n_ == 0) return 0;
  const double count = 1 - std::exp(-double(n_) / 3);
  const double spread = 1 / (1 + dev_ / estimate_);
  const double age = std::max(0.0, now - last_time_);
  const double fresh = std::exp(-age / o_.idle_seconds);
  return std::clamp(count * spread * fresh * (suspect_ > 0 ? 0.5 : 1.0), 0.0, 1.0);
}

}  // namespace kvserve
