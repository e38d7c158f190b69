// Non-dominated filtering, exact 3-D hypervolume (slicing along speed) and the exact expected
// hypervolume improvement when only the quality of the new point is uncertain.
#include <algorithm>
#include <cmath>
#include <functional>

#include "kvserve/profile.h"
#include "profile/search.h"

namespace kvserve {
namespace {

bool Dominates(const Objectives& a, const Objectives& b) {
  const bool ge = a.quality >= b.quality && a.ratio >= b.ratio && a.speed >= b.speed;
  const bool gt = a.quality > b.quality || a.ratio > b.ratio || a.speed > b.speed;
  return ge && gt;
}

struct Point2 {
  double x, y;
};

// Area of the union of boxes [rx, x] x [ry, y] (every point strictly above the reference).
double Area2D(std::vector<Point2> pts, double rx, double ry) {
  std::sort(pts.begin(), pts.end(), [](const Point2& a, const Point2& b) { return a.x > b.x; });
  double area = 0, ymax = ry;
  for (const Point2& p : pts) {
    if (p.x <= rx || p.y <= ymax) continue;
    area += (p.x - rx) * (p.y - ymax);
    ymax = p.y;
  }
  return area;
}

double NormalPdf(double z) { return std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI); }
double NormalSf(double z) { return 0.5 * std::erfc(z / std::sqrt(2.0)); }  // 1 - Phi(z)

// Antiderivative of P(Q >= t) for Q ~ N(mu, sd^2): d/dt G = 1 - Phi((t - mu) / sd).
double TailIntegral(double t, double mu, double sd) {
  const double z = (t - mu) / sd;
  return (t - mu) * NormalSf(z) - sd * NormalPdf(z);
}

// Integral of P(Q >= t) over [a, b) (b may be +inf).
double ProbabilityMass(double a, double b, double mu, double sd) {
  if (b <= a) return 0;
  if (sd <= 0) return std::max(0.0, std::min(b, mu) - a);
  const double gb = std::isinf(b) ? 0.0 : TailIntegral(b, mu, sd);
  return std::max(0.0, gb - TailIntegral(a, mu, sd));
}

}  // namespace

// E[HVI] given mass(a, b) = integral of P(Q >= t) over [a, b).
static double ExpectedImprovementCore(const std::vector<Objectives>& front, const Objectives& ref,
                               const std::vector<std::pair<double, double>>& boxes,
                               const std::function<double(double, double)>& mass);

std::vector<uint32_t> ParetoFront(const std::vector<Objectives>& points) {
  std::vector<uint32_t> front;
  for (uint32_t i = 0; i < points.size(); ++i) {
    bool keep = true;
    for (uint32_t j = 0; j < points.size() && keep; ++j) {
      if (j == i) continue;
      if (Dominates(points[j], points[i])) keep = false;
      // Identical points: keep the first only.
      if (j < i && points[j].quality == points[i].quality && points[j].ratio == points[i].ratio &&
          points[j].speed == points[i].speed)
        keep = false;
    }
    if (keep) front.push_back(i);
  }
  return front;
}

double Hypervolume3D(const std::vector<Objectives>& points, const Objectives& ref) {
  std::vector<Objectives> p;
  for (const Objectives& o : points)
    if (o.quality > ref.quality && o.ratio > ref.ratio && o.speed > ref.speed) p.push_back(o);
  // Slices along speed: between consecutive speed levels the dominated set's cross-section is the
  // 2-D union of the points at least that fast.
  std::sort(p.begin(), p.end(), [](const Objectives& a, const Objectives& b) { return a.speed > b.speed; });
  double volume = 0;
  std::vector<Point2> active;
  for (size_t i = 0; i < p.size(); ++i) {
    active.push_back({p[i].ratio, p[i].quality});
    const double next = i + 1 < p.size() ? p[i + 1].speed : ref.speed;
    if (p[i].speed > next) volume += Area2D(active, ref.ratio, ref.quality) * (p[i].speed - next);
  }
  return volume;
}

double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref, double ratio,
                                      double speed, double quality_mean, double quality_sd) {
  return ExpectedHypervolumeImprovement(front, ref, {{ratio, speed}}, quality_mean, quality_sd);
}

double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref,
                                      const std::vector<std::pair<double, double>>& boxes, double quality_mean,
                                      double quality_sd) {
  return ExpectedImprovementCore(front, ref, boxes, [&](double a, double b) {
    return ProbabilityMass(a, b, quality_mean, quality_sd);
  });
}

double ExpectedHypervolumeImprovement(const std::vector<Objectives>& front, const Objectives& ref,
                                      const std::vector<std::pair<double, double>>& boxes,
                                      const std::function<double(double)>& survival, double quality_max) {
  return ExpectedImprovementCore(front, ref, boxes, [&](double a, double b) {
    b = std::min(b, quality_max);
    if (!(b > a)) return 0.0;
    constexpr int kIntervals = 16;  // composite Simpson
    const double h = (b - a) / kIntervals;
    double sum = survival(a) + survival(b);
    for (int i = 1; i < kIntervals; ++i) sum += (i % 2 ? 4 : 2) * survival(a + i * h);
    return sum * h / 3;
  });
}

static double ExpectedImprovementCore(const std::vector<Objectives>& front, const Objectives& ref,
                               const std::vector<std::pair<double, double>>& boxes,
                               const std::function<double(double, double)>& mass) {
  // HVI(q) = integral over t in [ref.quality, q) of A(t), where A(t) is the part of the new
  // points' (ratio, speed) boxes not covered by front points of quality >= t. A is a step
  // function of t with steps at the front's qualities, so E[HVI] = sum of A over each step times
  // the integral of P(Q >= t) over it, which has a closed form.
  std::vector<Point2> fresh;
  for (const auto& [r, s] : boxes)
    if (r > ref.ratio && s > ref.speed) fresh.push_back({r, s});
  if (fresh.empty()) return 0;
  std::vector<Objectives> f;
  for (const Objectives& o : front)
    if (o.quality > ref.quality) f.push_back(o);
  std::sort(f.begin(), f.end(), [](const Objectives& a, const Objectives& b) { return a.quality > b.quality; });
  double expected = 0, upper = INFINITY;
  std::vector<Point2> covered, both = fresh;
  double covered_area = 0;
  for (size_t k = 0; k <= f.size(); ++k) {
    const double lower = k < f.size() ? std::max(f[k].quality, ref.quality) : ref.quality;
    const double area = Area2D(both, ref.ratio, ref.speed) - covered_area;
    if (area > 0) expected += area * mass(lower, upper);
    if (k == f.size()) break;
    covered.push_back({f[k].ratio, f[k].speed});
    both.push_back({f[k].ratio, f[k].speed});
    covered_area = Area2D(covered, ref.ratio, ref.speed);
    upper = lower;
  }
  return expected;
}

}  // namespace kvserve
