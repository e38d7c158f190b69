// Summary statistics for benchmarks: one percentile definition and 95% confidence intervals, so
// every figure a benchmark reports over repeats carries its interval, computed one way.
#pragma once

#include <cstddef>
#include <vector>

namespace kvserve {

// The q-quantile (q in [0, 1]) by linear interpolation between order statistics (numpy's
// default, Hyndman & Fan type 7): 0 for no values.
double Percentile(std::vector<double> values, double q);

// Two-sided 95% quantile of Student's t with `df` degrees of freedom (df >= 1).
double StudentT95(size_t df);

// A mean with the half-width of its 95% confidence interval (Student's t over the values'
// standard error); half_width is 0 for fewer than two values.
struct MeanCi {
  double mean = 0, half_width = 0;
  size_t n = 0;
};
MeanCi MeanCi95(const std::vector<double>& values);

}  // namespace kvserve
