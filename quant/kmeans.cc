// Non-uniform per-row k-means quantization (paper 5.2, "Approach 2"), kept for
// comparison with the uniform methods.
//
// One dimension makes Lloyd's algorithm cheap and exact: with the row sorted,
// each cluster is a contiguous run between midpoints of neighbouring
// centroids, and its mean comes from prefix sums. Seeding is deterministic
// (centroid i starts at the sorted row's (i + 0.5) / k quantile), so the same
// row always gives the same codebook. The codebook is stored sorted, rounded to
// the scale type, and each element takes the nearest stored centroid (the lower
// one on a tie).
// Thread-safety: pure function of its arguments; scratch is the caller's.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "detail/half.h"
#include "detail/pack.h"
#include "detail/rowwise.h"

namespace pmsnap::quant::detail {

RowError KMeansRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                   std::vector<float>& sorted, std::vector<double>& prefix) {
  const std::uint32_t n = ctx.dim;
  const std::uint32_t k = 1u << ctx.options.bits;
  const bool fp16 = ctx.options.scale_type == ScaleType::kFp16;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return RowError::kNonFinite;
    if (fp16 && std::fabs(x[i]) > 65504.0f) return RowError::kHalfOverflow;
  }
  sorted.assign(x, x + n);
  std::sort(sorted.begin(), sorted.end());
  prefix.resize(n + 1);
  prefix[0] = 0;
  for (std::uint32_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + sorted[i];

  double centroids[256];
  for (std::uint32_t c = 0; c < k; ++c) {
    const auto at = static_cast<std::uint32_t>((static_cast<double>(c) + 0.5) * n / k);
    centroids[c] = sorted[std::min(at, n - 1)];
  }
  for (std::uint32_t iter = 0; iter < ctx.options.kmeans_iterations; ++iter) {
    bool moved = false;
    std::uint32_t begin = 0;
    for (std::uint32_t c = 0; c < k; ++c) {
      // Cluster c takes the sorted elements below the midpoint to c + 1.
      std::uint32_t end = n;
      if (c + 1 < k) {
        const double boundary = 0.5 * (centroids[c] + centroids[c + 1]);
        end = static_cast<std::uint32_t>(
            std::upper_bound(sorted.begin() + begin, sorted.end(), boundary,
                             [](double b, float v) { return b < static_cast<double>(v); }) -
            sorted.begin());
      }
      if (end > begin) {
        const double mean = (prefix[end] - prefix[begin]) / (end - begin);
        moved |= mean != centroids[c];
        centroids[c] = mean;
      }  // an empty cluster keeps its centroid
      begin = end;
    }
    std::sort(centroids, centroids + k);
    if (!moved) break;  // converged: further iterations change nothing
  }

  float codebook[256];
  std::uint8_t* params = out_row + ctx.code_bytes;
  for (std::uint32_t c = 0; c < k; ++c) {
    const auto value = static_cast<float>(centroids[c]);
    if (fp16) {
      const std::uint16_t h = FloatToHalfRne(value);
      codebook[c] = HalfToFloat(h);
      std::memcpy(params + 2 * c, &h, 2);
    } else {
      codebook[c] = value;
      std::memcpy(params + 4 * c, &value, 4);
    }
  }
  std::uint8_t codes[8];
  std::uint32_t filled = 0;
  std::uint64_t group = 0;
  const int bits = ctx.options.bits;
  for (std::uint32_t i = 0; i < n; ++i) {
    // Nearest centroid: the first one at or above x, or its lower neighbour.
    const float v = x[i];
    std::uint32_t hi =
        static_cast<std::uint32_t>(std::lower_bound(codebook, codebook + k, v) - codebook);
    std::uint32_t code;
    if (hi == k) {
      code = k - 1;
    } else if (hi == 0) {
      code = 0;
    } else {
      code = (v - codebook[hi - 1] <= codebook[hi] - v) ? hi - 1 : hi;
    }
    codes[filled++] = static_cast<std::uint8_t>(code);
    if (filled == 8 || i + 1 == n) {
      if (bits == 8) {
        std::memcpy(out_row + 8 * group, codes, filled);
      } else {
        PackCodes(codes, filled, bits, out_row + static_cast<std::uint64_t>(bits) * group);
      }
      ++group;
      filled = 0;
    }
  }
  return RowError::kOk;
}

}  // namespace pmsnap::quant::detail
