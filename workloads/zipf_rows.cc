#include "pmsnap/workloads/zipf_rows.h"

#include <algorithm>
#include <cmath>

namespace pmsnap::workloads {

ZipfRows::ZipfRows(std::int64_t rows, double exponent)
    : rows_(rows), cdf_(static_cast<std::size_t>(rows)) {
  double sum = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    sum += 1.0 / std::pow(static_cast<double>(r + 1), exponent);
    cdf_[static_cast<std::size_t>(r)] = sum;
  }
  for (double& c : cdf_) c /= sum;
}

std::int64_t ZipfRows::Rank(double uniform) const {
  return static_cast<std::int64_t>(std::lower_bound(cdf_.begin(), cdf_.end(), uniform) -
                                   cdf_.begin());
}

std::int64_t ZipfRows::Row(std::int64_t rank, std::int64_t table) const {
  // Multiplicative hashing (Knuth's 2654435761) plus a per-table shift.
  return static_cast<std::int64_t>(
      (static_cast<std::uint64_t>(rank) * 2654435761ull + static_cast<std::uint64_t>(table) * 97) %
      static_cast<std::uint64_t>(rows_));
}

}  // namespace pmsnap::workloads
