// Summary statistics of bench/stall's rounds: quantiles, a bootstrap
// interval of the median, the mean. Empty input gives 0.
//
// Thread-safety: plain functions.
#pragma once

#include <utility>
#include <vector>

namespace pmsnap::bench::stall {

// Linear interpolation between the closest ranks, q in [0, 1].
double Quantile(std::vector<double> v, double q);
double Median(const std::vector<double>& v);
// 95% percentile-bootstrap interval of the median of `v` (fixed seed, so a
// run's table and CSV agree); a single value is its own interval.
std::pair<double, double> MedianInterval95(const std::vector<double>& v);
double Mean(const std::vector<double>& v);

}  // namespace pmsnap::bench::stall
