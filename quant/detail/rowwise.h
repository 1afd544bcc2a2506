// Per-row building blocks shared by the quantizer driver, k-means and the
// parameter search (internal).
// Thread-safety: pure functions; RowContext is read-only once built.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "detail/kernels.h"
#include "pmsnap/quant/quant.h"

namespace pmsnap::quant::detail {

// Why a row could not be quantized; the driver turns the first failing row
// into a Status with table, row and column.
enum class RowError : std::uint8_t {
  kOk = 0,
  kNonFinite,      // NaN or Inf element
  kRangeOverflow,  // max - min overflows fp32
  kHalfOverflow,   // fp16 scale/bias/centroid cannot represent the row
};

struct RowContext {
  QuantOptions options;
  const Kernels* kernels = nullptr;
  std::uint32_t dim = 0;
  float qmax = 0;  // 2^bits - 1
  std::uint64_t code_bytes = 0;
  std::uint64_t param_bytes = 0;
  // Adaptive fp16 pmsnap rows go through kernels->adaptive_fp16 with this plan.
  bool fast_adaptive = false;
  // Asymmetric 8-bit fp32 pmsnap rows go through kernels->asym8_fp32_rows.
  bool fused_asym8 = false;
  SearchPlan plan{};
};

RowContext MakeRowContext(const QuantOptions& options, std::uint32_t dim);

// Uniform-grid parameters for one row in stored form and as the floats the
// encoder and decoder use.
struct UniformParams {
  EncodeParams enc;            // bias, inv_scale, scale
  std::uint32_t stored_scale;  // fp32 bits or fp16 bits (low 16)
  std::uint32_t stored_bias;   // unused for symmetric
};

// Parameters for the clipping range [lo, hi] under the context's method,
// layout and scale type. Returns kOk or the overflow kind.
RowError MakeUniformParams(const RowContext& ctx, float lo, float hi, UniformParams* out);

// The iteration plan of the adaptive greedy search (quantize.cc AdaptiveSearch):
// main walk from iteration min_bins to num_bins, then refine_iterations
// quarter-step iterations around the best range: 12 (three steps) whenever the
// main walk runs. A fixed length shifts the error of every ratio alike, which
// keeps the sampled num_bins / ratio choice stable (param_search.cc).
struct AdaptiveSchedule {
  std::uint32_t num_bins;
  std::uint32_t min_bins;
  std::uint32_t refine_iterations;
};

inline AdaptiveSchedule ScheduleFor(const AdaptiveParams& p) {
  AdaptiveSchedule s;
  s.num_bins = p.num_bins;
  s.min_bins = static_cast<std::uint32_t>(static_cast<double>(p.num_bins) *
                                          (1.0 - static_cast<double>(p.ratio)));
  const std::uint32_t searched = s.num_bins > s.min_bins ? s.num_bins - s.min_bins : 0;
  s.refine_iterations = searched > 0 ? 12 : 0;
  return s;
}

// Quantizes one row of ctx.dim floats into `out_row` (ctx code_bytes +
// param_bytes bytes). `scratch` must hold at least ctx.dim bytes.
RowError QuantizeRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                     std::uint8_t* scratch);

// Quantizes `count` <= kSearchRows adaptive rows through the fast search when
// ctx.fast_adaptive; false (nothing reported) when a row needs QuantizeRow,
// which then gives the same bytes or the row's error.
bool QuantizeAdaptiveGroup(const RowContext& ctx, const float* const* x, int count,
                           std::uint8_t* const* out_rows, std::uint8_t* scratch);

// K-means row quantizer (kmeans.cc).
RowError KMeansRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                   std::vector<float>& sorted, std::vector<double>& prefix);

// Decodes one row; false if a stored parameter is not finite.
bool DequantizeRowInto(const QuantSpec& spec, const std::uint8_t* row, float* out,
                       std::uint8_t* scratch);

}  // namespace pmsnap::quant::detail
