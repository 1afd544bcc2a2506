// Sampled choice of adaptive-quantization parameters and the bit width from
// the expected number of resumes (paper 5.2 "Parameter selection", 6.2.1).
// Thread-safety: reentrant.
#include "pmsnap/quant/param_search.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace pmsnap::quant {

namespace {

std::uint64_t SplitMix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Status Invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

// Where the improvement over the baseline tapers off: after the steepest
// step of the curve, the first candidate from which the next candidate gains
// less than `taper_gain` of the baseline error. Judging increments rather than
// closeness to the best keeps the pick stable when the curve is estimated
// from a sample (tests/quant_param_selection_test.cc). The last candidate if
// the curve never flattens.
std::size_t TaperPoint(const std::vector<double>& errors, double baseline, double taper_gain) {
  if (errors.size() < 2 || !(baseline > 0)) return 0;
  std::vector<double> gain(errors.size() - 1);  // gain[i]: improvement from i to i + 1
  std::size_t steepest = 0;
  for (std::size_t i = 0; i + 1 < errors.size(); ++i) {
    gain[i] = (errors[i] - errors[i + 1]) / baseline;
    if (gain[i] > gain[steepest]) steepest = i;
  }
  // Improving at all from the first candidate on? Otherwise stay at the cheapest.
  if (gain[steepest] < taper_gain) return 0;
  for (std::size_t i = steepest + 1; i < gain.size(); ++i) {
    if (gain[i] < taper_gain) return i;
  }
  return errors.size() - 1;
}

}  // namespace

std::vector<std::uint64_t> SampleRows(std::uint64_t rows, double fraction, std::uint64_t min_rows,
                                      std::uint64_t seed) {
  if (rows == 0) return {};
  // The small relative slack keeps 1e-5 * 1e7 from rounding up to 101.
  const double wanted = std::ceil(fraction * static_cast<double>(rows) * (1 - 1e-12));
  std::uint64_t n = std::max<std::uint64_t>(
      min_rows, wanted >= static_cast<double>(rows) ? rows : static_cast<std::uint64_t>(wanted));
  n = std::clamp<std::uint64_t>(n, 1, rows);
  std::vector<std::uint64_t> picked;
  picked.reserve(n);
  if (n == rows) {
    for (std::uint64_t i = 0; i < rows; ++i) picked.push_back(i);
    return picked;
  }
  // Stratified: one uniform draw inside each of n equal strata, so the sample
  // covers the whole table and is sorted and distinct by construction.
  std::uint64_t state = seed;
  for (std::uint64_t s = 0; s < n; ++s) {
    const std::uint64_t begin =
        static_cast<std::uint64_t>(static_cast<unsigned __int128>(s) * rows / n);
    const std::uint64_t end =
        static_cast<std::uint64_t>(static_cast<unsigned __int128>(s + 1) * rows / n);
    picked.push_back(begin + SplitMix64(state) % (end - begin));
  }
  return picked;
}

Result<ParamChoice> ChooseAdaptiveParams(const TableView& table, int bits,
                                         const ParamSearchOptions& options) {
  if (table.rows == 0) return Invalid("cannot choose parameters for an empty table");
  if (!(options.sample_fraction > 0 && options.sample_fraction <= 1)) {
    return Invalid("sample_fraction must be in (0, 1]");
  }
  if (options.bins_candidates.empty() || options.ratio_candidates.empty()) {
    return Invalid("bins_candidates and ratio_candidates must not be empty");
  }
  if (!(options.taper_gain >= 0 && options.taper_gain < 1)) {
    return Invalid("taper_gain must be in [0, 1)");
  }
  QuantOptions quant;
  quant.bits = bits;
  quant.scale_type = options.scale_type;
  quant.layout = options.layout;
  quant.max_threads = options.max_threads;
  quant.method = Method::kAdaptive;
  PMSNAP_RETURN_IF_ERROR(ValidateOptions(quant, table.dim));

  // Gather the sample into one contiguous table.
  const std::vector<std::uint64_t> rows =
      SampleRows(table.rows, options.sample_fraction, options.min_sample_rows, options.seed);
  std::vector<float> sample(rows.size() * table.dim);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::copy_n(table.row(rows[i]), table.dim, sample.data() + i * table.dim);
  }
  const TableView sampled{table.name, sample.data(), rows.size(), table.dim, 0};

  auto mean_l2 = [&](const QuantOptions& o) -> Result<double> {
    PMSNAP_ASSIGN_OR_RETURN(QuantizedTable q, Quantize(sampled, o));
    return MeanL2Error(sampled, q.view(), options.max_threads);
  };

  ParamChoice choice;
  choice.sampled_rows = rows.size();
  QuantOptions asym = quant;
  asym.method = Method::kAsymmetric;
  PMSNAP_ASSIGN_OR_RETURN(choice.asymmetric_mean_l2, mean_l2(asym));

  std::vector<double> errors;
  for (std::uint32_t bins : options.bins_candidates) {
    quant.adaptive = {bins, 1.0f};
    PMSNAP_ASSIGN_OR_RETURN(double e, mean_l2(quant));
    choice.bins_curve.push_back({bins, 1.0f, e});
    errors.push_back(e);
  }
  const std::uint32_t bins =
      options.bins_candidates[TaperPoint(errors, choice.asymmetric_mean_l2, options.taper_gain)];

  errors.clear();
  for (float ratio : options.ratio_candidates) {
    quant.adaptive = {bins, ratio};
    PMSNAP_ASSIGN_OR_RETURN(double e, mean_l2(quant));
    choice.ratio_curve.push_back({bins, ratio, e});
    errors.push_back(e);
  }
  const float ratio =
      options.ratio_candidates[TaperPoint(errors, choice.asymmetric_mean_l2, options.taper_gain)];
  choice.params = {bins, ratio};
  return choice;
}

int BitsForExpectedResumes(double expected_resumes, const BitWidthPolicy& policy) {
  if (!(expected_resumes >= 0)) return 8;
  if (expected_resumes <= policy.max_resumes_2bit) return 2;
  if (expected_resumes <= policy.max_resumes_3bit) return 3;
  if (expected_resumes <= policy.max_resumes_4bit) return 4;
  return 8;
}

}  // namespace pmsnap::quant
