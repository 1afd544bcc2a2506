// Rowwise N-bit quantization of fp32 embedding tables for checkpoints
// (Check-N-Run, section 5.2).
//
// Each row (embedding vector) is quantized on its own. Methods:
//  - kSymmetric:  uniform grid over [-max|x|, max|x|]; stores one scale per row.
//  - kAsymmetric: uniform grid over [min x, max x]; stores scale and bias.
//  - kAdaptive:   asymmetric, but x_min / x_max come from the paper's greedy
//                 search (num_bins, ratio); the lowest-l2 iteration wins, and the
//                 plain asymmetric range is iteration 0, so it is never worse.
//  - kKMeans:     non-uniform; per-row 1-D k-means (2^bits centroids, quantile
//                 seeding, a fixed number of Lloyd iterations); stores a codebook.
// Bit widths 2, 3, 4 and 8. Codes are packed tightly, LSB first, as one bit
// stream per row (3-bit rows of any length included); a row is
// `[codes: ceil(dim * bits / 8) bytes][per-row parameters]`.
//
// Layout::kTorchFused emits exactly what PyTorch's
// quantized::embedding_bag_{byte,4bit,2bit}_prepack produce (8-bit: fp32 scale
// and bias; 4/2-bit: fp16), so a checkpoint can be served by PyTorch's quantized
// EmbeddingBag ops. Layout::kPmsnap uses the same row shape but rounds the fp16
// parameters outward (bias down, scale up) so every element stays within half a
// stored step of its original value.
//
// Errors are returned as Status / Result (never thrown). A NaN or Inf in the
// input fails the whole call with kInvalidArgument naming the table, row and
// column.
//
// Thread-safety: all functions are reentrant; they read the input table and
// write only the output they are given. Large calls split rows across oneTBB
// worker threads (see QuantOptions::max_threads); results do not depend on the
// thread count or on the instruction set used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/quant/cpu.h"

namespace pmsnap::quant {

enum class Method : std::uint8_t {
  kSymmetric = 1,
  kAsymmetric = 2,
  kAdaptive = 3,
  kKMeans = 4,
};

enum class ScaleType : std::uint8_t {
  kFp16 = 1,
  kFp32 = 2,
};

enum class Layout : std::uint8_t {
  kPmsnap = 1,      // outward-rounded parameters: error <= half a step
  kTorchFused = 2,  // byte-identical to PyTorch's fused rowwise prepack ops
};

const char* MethodName(Method method);      // "symmetric", "asymmetric", ...
const char* ScaleTypeName(ScaleType type);  // "fp16", "fp32"
const char* LayoutName(Layout layout);      // "pmsnap", "torch_fused"

// Greedy range search of adaptive asymmetric quantization. step = (max - min) /
// num_bins; the search shrinks the range one step at a time, from the side
// that lowers the l2 error more, while the remaining range exceeds
// (1 - ratio) * (max - min). The paper picks 25 bins for 2 and 3 bits and 45
// for 4 bits.
struct AdaptiveParams {
  std::uint32_t num_bins = 45;  // >= 1
  float ratio = 1.0f;           // in (0, 1]
};

// A read-only fp32 table: `rows` rows of `dim` floats, row i at
// data + i * row_stride (row_stride >= dim, in floats; 0 means dim).
struct TableView {
  std::string_view name;  // used in error messages only
  const float* data = nullptr;
  std::uint64_t rows = 0;
  std::uint32_t dim = 0;
  std::uint64_t row_stride = 0;

  std::uint64_t stride() const { return row_stride == 0 ? dim : row_stride; }
  const float* row(std::uint64_t i) const { return data + i * stride(); }
};

struct QuantOptions {
  Method method = Method::kAsymmetric;
  int bits = 4;  // 2, 3, 4 or 8
  ScaleType scale_type = ScaleType::kFp16;
  Layout layout = Layout::kPmsnap;
  AdaptiveParams adaptive;               // kAdaptive only
  std::uint32_t kmeans_iterations = 15;  // kKMeans only
  // 0: oneTBB decides (all cores); 1: the calling thread only; n: at most n.
  int max_threads = 0;
  Isa isa = Isa::kAuto;  // force a kernel set (tests and benchmarks)
};

// Everything a reader needs to interpret quantized rows. Stored in the
// serialized header (format.h).
struct QuantSpec {
  Method method = Method::kAsymmetric;
  int bits = 4;
  ScaleType scale_type = ScaleType::kFp16;
  Layout layout = Layout::kPmsnap;
  std::uint32_t dim = 0;
  std::uint64_t rows = 0;
  AdaptiveParams adaptive;  // informational: how the ranges were searched

  // Bytes of packed codes per row: ceil(dim * bits / 8).
  std::uint64_t code_bytes() const;
  // Bytes of per-row parameters (scale; scale + bias; or the codebook).
  std::uint64_t param_bytes() const;
  std::uint64_t row_bytes() const { return code_bytes() + param_bytes(); }
  std::uint64_t payload_bytes() const { return row_bytes() * rows; }
};

// Checks that `options` can quantize rows of `dim` floats: bits in {2,3,4,8},
// known enums, adaptive params in range, kTorchFused only for
// asymmetric/adaptive at 8 bits with fp32 or 2/4 bits with fp16 and dim a
// multiple of 8 / bits (PyTorch refuses other shapes). kInvalidArgument says
// which rule failed.
Status ValidateOptions(const QuantOptions& options, std::uint32_t dim);

// The spec Quantize() will produce for `table` under `options`.
QuantSpec SpecFor(const QuantOptions& options, std::uint32_t dim, std::uint64_t rows);

// Non-owning view of quantized rows (e.g. parsed in place from a pool chunk).
struct QuantizedView {
  QuantSpec spec;
  std::span<const std::uint8_t> payload;  // spec.rows * spec.row_bytes() bytes

  const std::uint8_t* row(std::uint64_t i) const { return payload.data() + i * spec.row_bytes(); }
};

// Quantized rows that own their bytes.
struct QuantizedTable {
  QuantSpec spec;
  std::vector<std::uint8_t> payload;

  QuantizedView view() const { return {spec, payload}; }
};

// Quantizes every row of `table`. On success the result holds
// table.rows * row_bytes() bytes. Fails with kInvalidArgument for bad options,
// a NaN/Inf element (message names table, row, column), a row whose range
// overflows fp32 (max - min > 3.4e38), or a magnitude beyond fp16 when
// scale_type is kFp16 (|x| > 65504).
Result<QuantizedTable> Quantize(const TableView& table, const QuantOptions& options);

// As Quantize(), into caller memory: `out.size()` must equal
// SpecFor(options, table.dim, table.rows).payload_bytes(). On error the
// content of `out` is unspecified.
Status QuantizeInto(const TableView& table, const QuantOptions& options,
                    std::span<std::uint8_t> out);

// Reconstructs fp32 rows: out row i at out + i * out_row_stride (floats; 0
// means dim). Fails with kCorruption if a stored scale, bias or centroid is
// not finite, or kInvalidArgument if the view's payload size does not match
// its spec.
Status Dequantize(const QuantizedView& quantized, float* out, std::uint64_t out_row_stride = 0);

// Reconstructs one row into `out` (quantized.spec.dim floats).
Status DequantizeRow(const QuantizedView& quantized, std::uint64_t row, float* out);

// Mean l2 error (1/m) * sum_i ||X_i - Q_i||_2 over all rows, the paper's
// metric. `original` and `quantized` must have the same rows and dim. The sum
// is deterministic (independent of thread count).
Result<double> MeanL2Error(const TableView& original, const QuantizedView& quantized,
                           int max_threads = 0);

}  // namespace pmsnap::quant
