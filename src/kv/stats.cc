// Summary statistics for benchmarks (kvserve/stats.h).
#include "kvserve/stats.h"

#include <algorithm>
#include <cmath>

namespace kvserve {

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double at = std::clamp(q, 0.0, 1.0) * double(values.size() - 1);
  const size_t lo = size_t(std::floor(at)), hi = std::min(values.size() - 1, lo + 1);
  return values[lo] + (at - double(lo)) * (values[hi] - values[lo]);
}

double StudentT95(size_t df) {
  static const double kTable[] = {12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                                  2.201,  2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                                  2.080,  2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042};
  if (df == 0) return INFINITY;
  if (df <= 30) return kTable[df - 1];
  return 1.96 + 2.5 / double(df);  // within 0.002 of the exact quantile from 30 on
}

MeanCi MeanCi95(const std::vector<double>& values) {
  MeanCi m;
  m.n = values.size();
  if (values.empty()) return m;
  double sum = 0;
  for (double v : values) sum += v;
  m.mean = sum / double(values.size());
  if (values.size() < 2) return m;
  double ss = 0;
  for (double v : values) ss += (v - m.mean) * (v - m.mean);
  const double sd = std::sqrt(ss / double(values.size() - 1));
  m.half_width = StudentT95(values.size() - 1) * sd / std::sqrt(double(values.size()));
  return m;
}

}  // namespace kvserve
