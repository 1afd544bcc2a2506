// Zipf-distributed embedding ids, as in recommendation traces: a few hot rows
// take most lookups. The demo and the stall benchmark draw their DLRM
// batches with it; the caller owns the random generator, so each decides
// how batches are seeded (the demo: from the iteration, for resumes).
//
// Thread-safety: const after construction; share freely.
#pragma once

#include <cstdint>
#include <vector>

namespace pmsnap::workloads {

class ZipfRows {
 public:
  // Ranks 0..rows-1 with P(rank r) proportional to 1 / (r + 1)^exponent.
  // rows must be positive.
  ZipfRows(std::int64_t rows, double exponent);

  // The rank a uniform draw in [0, 1) falls on (0 is the hottest).
  std::int64_t Rank(double uniform) const;

  // The row id of `rank` in table `table`: hot ranks are scattered over the
  // table by a fixed permutation per table, so tables do not share hot rows.
  std::int64_t Row(std::int64_t rank, std::int64_t table) const;

  std::int64_t rows() const { return rows_; }

 private:
  std::int64_t rows_;
  std::vector<double> cdf_;  // cumulative probability of ranks 0..r
};

}  // namespace pmsnap::workloads
