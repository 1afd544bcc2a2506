// Automatic choice of quantization parameters (Check-N-Run 5.2 and 6.2.1).
//
//  - ChooseAdaptiveParams: quantizes a uniform sample of rows with a list of
//    num_bins candidates (ratio 1), then a list of ratio candidates (with the
//    chosen num_bins), and picks in each list the candidate where the mean l2
//    improvement has tapered off: past the steepest step of the curve, the
//    first candidate whose successor gains less than taper_gain (a fraction
//    of the plain asymmetric error). Candidate lists must be in increasing
//    order of cost.
//  - BitsForExpectedResumes: the bit width from the number of times the job is
//    expected to resume from a checkpoint (paper thresholds by default).
//
// Thread-safety: reentrant; reads the table only.
#pragma once

#include <cstdint>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/quant/quant.h"

namespace pmsnap::quant {

struct ParamSearchOptions {
  // Fraction of rows sampled (paper default 0.001%); at least min_sample_rows
  // rows (or all rows when the table is smaller). 1.0 searches the full table.
  double sample_fraction = 1e-5;
  std::uint64_t min_sample_rows = 4096;
  std::uint64_t seed = 0x5eed5eedULL;  // the sample is a deterministic function of it
  std::vector<std::uint32_t> bins_candidates = {5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60};
  std::vector<float> ratio_candidates = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f,
                                         0.6f, 0.7f, 0.8f, 0.9f, 1.0f};
  double taper_gain = 0.005;  // 0.5% of the asymmetric mean l2 error
  ScaleType scale_type = ScaleType::kFp16;
  Layout layout = Layout::kPmsnap;
  int max_threads = 0;
};

struct ParamCurvePoint {
  std::uint32_t num_bins = 0;
  float ratio = 0;
  double mean_l2 = 0;
};

struct ParamChoice {
  AdaptiveParams params;
  std::uint64_t sampled_rows = 0;
  double asymmetric_mean_l2 = 0;             // baseline on the sample
  std::vector<ParamCurvePoint> bins_curve;   // ratio = 1
  std::vector<ParamCurvePoint> ratio_curve;  // num_bins = params.num_bins
};

// The rows a sample of `rows` rows uses: sorted, distinct, one drawn uniformly
// from each of n equal strata (n = max(min_rows, fraction * rows), capped at
// rows).
std::vector<std::uint64_t> SampleRows(std::uint64_t rows, double fraction, std::uint64_t min_rows,
                                      std::uint64_t seed);

// Picks num_bins and ratio for adaptive quantization of `table` at `bits`.
// Fails with kInvalidArgument for bad options or an empty table, or with the
// error Quantize() reports for a sampled row (NaN/Inf).
Result<ParamChoice> ChooseAdaptiveParams(const TableView& table, int bits,
                                         const ParamSearchOptions& options = {});

// Expected-resume thresholds: resumes <= max_resumes_2bit -> 2 bits, <=
// max_resumes_3bit -> 3, <= max_resumes_4bit -> 4, else 8.
struct BitWidthPolicy {
  double max_resumes_2bit = 1;
  double max_resumes_3bit = 3;
  double max_resumes_4bit = 20;
};

// Bit width for a job expected to resume `expected_resumes` times (>= 0; a
// negative or NaN value is treated as "unknown" and gets 8 bits).
int BitsForExpectedResumes(double expected_resumes, const BitWidthPolicy& policy = {});

}  // namespace pmsnap::quant
