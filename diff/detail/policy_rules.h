// The two decisions that turn a differential chain back into a full
// baseline, as pure functions so they can be tested on their own.
#pragma once

#include <cstdint>
#include <span>

namespace pmsnap::diff::detail {

// Check-N-Run 5.1: with differential sizes S_1..S_i since the baseline (as
// fractions of the table), take a full checkpoint when
// F_c = 1 + S_1 + ... + S_i <= I_c = (i + 1) * S_i.
inline bool IntermittentTakesFull(std::span<const double> sizes) {
  if (sizes.empty()) return false;
  double f_c = 1.0;
  for (double s : sizes) f_c += s;
  const double i_c = static_cast<double>(sizes.size() + 1) * sizes.back();
  return f_c <= i_c;
}

// IncrCP 4.5: T_base = C_base + R_base, T_incre = C_incre + R_base + R_i; a
// new baseline when T_base < T_incre, with R_i estimated from the bytes a
// recovery of the newest checkpoint reads beyond the baseline.
inline bool IncrCPResetsBaseline(double baseline_seconds, double increment_seconds,
                                 std::uint64_t increment_bytes, double read_bytes_per_second) {
  if (read_bytes_per_second <= 0) return false;
  const double r_i = static_cast<double>(increment_bytes) / read_bytes_per_second;
  return baseline_seconds < increment_seconds + r_i;
}

}  // namespace pmsnap::diff::detail
