// Per-row building blocks shared by the quantizer driver, k-means and the
// parameter search (internal).
// Thread-safety: pure functions; RowContext is read-only once built.
#pragma once

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
};

RowContext MakeRowContext(const QuantOptions& options, std::uint32_t dim);

// Uniform-grid parameters for one row in stored form and as the floats the
// encoder and decoder use.
struct UniformParams {
  EncodeParams enc;             // bias, inv_scale, scale
  std::uint32_t stored_scale;   // fp32 bits or fp16 bits (low 16)
  std::uint32_t stored_bias;    // unused for symmetric
};

// Parameters for the clipping range [lo, hi] under the context's method,
// layout and scale type. Returns kOk or the overflow kind.
RowError MakeUniformParams(const RowContext& ctx, float lo, float hi, UniformParams* out);

// Quantizes one row of ctx.dim floats into `out_row` (ctx code_bytes +
// param_bytes bytes). `scratch` must hold at least ctx.dim bytes.
RowError QuantizeRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                     std::uint8_t* scratch);

// K-means row quantizer (kmeans.cc).
RowError KMeansRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                   std::vector<float>& sorted, std::vector<double>& prefix);

// Decodes one row; false if a stored parameter is not finite.
bool DequantizeRowInto(const QuantSpec& spec, const std::uint8_t* row, float* out,
                       std::uint8_t* scratch);

}  // namespace pmsnap::quant::detail
