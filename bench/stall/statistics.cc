#include "stall/statistics.h"

#include <algorithm>
#include <random>

namespace pmsnap::bench::stall {

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}
double Median(const std::vector<double>& v) { return Quantile(v, 0.5); }

std::pair<double, double> MedianInterval95(const std::vector<double>& v) {
  if (v.size() < 2) return {Median(v), Median(v)};
  std::mt19937_64 random(0x5eed);
  std::uniform_int_distribution<std::size_t> pick(0, v.size() - 1);
  std::vector<double> medians, sample(v.size());
  for (int i = 0; i < 4000; ++i) {
    for (double& x : sample) x = v[pick(random)];
    medians.push_back(Median(sample));
  }
  return {Quantile(medians, 0.025), Quantile(medians, 0.975)};
}
double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

}  // namespace pmsnap::bench::stall
