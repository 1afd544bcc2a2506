// Adaptive asymmetric quantization (paper 5.2, approach 3): never worse than
// plain asymmetric on any row, clearly better where rows have outliers, and
// the greedy search honours num_bins / ratio.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::RowShape;

double RowL2(const float* x, const float* y, std::uint32_t dim) {
  double sq = 0;
  for (std::uint32_t c = 0; c < dim; ++c) {
    const double d = static_cast<double>(x[c]) - y[c];
    sq += d * d;
  }
  return std::sqrt(sq);
}

class AdaptiveTest : public ::testing::TestWithParam<std::tuple<int, ScaleType, Layout, RowShape>> {
};

TEST_P(AdaptiveTest, NeverWorseThanAsymmetricOnAnyRow) {
  const auto [bits, scale_type, layout, shape] = GetParam();
  const auto table = MakeTable(shape, 1500, 64, 17);
  QuantOptions options;
  options.bits = bits;
  options.scale_type = scale_type;
  options.layout = layout;
  auto asym = Quantize(table.view(), options);
  options.method = Method::kAdaptive;
  options.adaptive = {25, 1.0f};
  auto adaptive = Quantize(table.view(), options);
  ASSERT_TRUE(asym.ok()) << asym.status().ToString();
  ASSERT_TRUE(adaptive.ok()) << adaptive.status().ToString();
  const auto a = testing::DequantizeAll(asym->view());
  const auto b = testing::DequantizeAll(adaptive->view());
  int improved = 0;
  for (std::uint64_t r = 0; r < table.rows; ++r) {
    const float* x = table.values.data() + r * 64;
    const double e_asym = RowL2(x, a.data() + r * 64, 64);
    const double e_adaptive = RowL2(x, b.data() + r * 64, 64);
    // The search compares float sums; allow their rounding, nothing more.
    ASSERT_LE(e_adaptive, e_asym * (1 + 1e-5) + 1e-12) << "row " << r;
    improved += e_adaptive < e_asym * (1 - 1e-3);
  }
  if (bits <= 4) {
    EXPECT_GT(improved, static_cast<int>(table.rows) / 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Pmsnap, AdaptiveTest,
                         ::testing::Combine(::testing::Values(2, 3, 4, 8),
                                            ::testing::Values(ScaleType::kFp16, ScaleType::kFp32),
                                            ::testing::Values(Layout::kPmsnap),
                                            ::testing::Values(RowShape::kNormal,
                                                              RowShape::kHeavyTailed)),
                         testing::TupleParamName());
INSTANTIATE_TEST_SUITE_P(TorchFused, AdaptiveTest,
                         ::testing::Values(std::make_tuple(2, ScaleType::kFp16, Layout::kTorchFused,
                                                           RowShape::kHeavyTailed),
                                           std::make_tuple(4, ScaleType::kFp16, Layout::kTorchFused,
                                                           RowShape::kHeavyTailed),
                                           std::make_tuple(8, ScaleType::kFp32, Layout::kTorchFused,
                                                           RowShape::kHeavyTailed)),
                         testing::TupleParamName());

TEST(AdaptiveSearchTest, ClipsAnOutlierAtTwoBits) {
  // 63 elements in [-0.1, 0.1] and one at 5: the plain 2-bit grid spends all
  // levels on the gap; the search clips the outlier and wins overall.
  std::vector<float> row(64);
  for (int i = 0; i < 63; ++i) row[i] = -0.1f + 0.2f * static_cast<float>(i) / 62.0f;
  row[63] = 5.0f;
  const TableView table{"outlier", row.data(), 1, 64, 0};
  QuantOptions options;
  options.bits = 2;
  options.scale_type = ScaleType::kFp32;
  auto asym = Quantize(table, options);
  options.method = Method::kAdaptive;
  options.adaptive = {50, 1.0f};
  auto adaptive = Quantize(table, options);
  ASSERT_TRUE(asym.ok() && adaptive.ok());
  const double e_asym = *MeanL2Error(table, asym->view());
  const double e_adaptive = *MeanL2Error(table, adaptive->view());
  EXPECT_LT(e_adaptive, 0.8 * e_asym);
}

TEST(AdaptiveSearchTest, MoreBinsOrLargerRatioSearchMore) {
  // Two bins are too coarse to find good ranges; a small ratio stops the same
  // greedy path after one step, so it lies between plain asymmetric and the
  // full search.
  const auto table = MakeTable(RowShape::kHeavyTailed, 2000, 64, 23);
  QuantOptions options;
  options.method = Method::kAdaptive;
  options.bits = 3;
  double coarse = 0, fine = 0, narrow = 0;
  options.adaptive = {2, 1.0f};
  coarse = *MeanL2Error(table.view(), Quantize(table.view(), options)->view());
  options.adaptive = {45, 1.0f};
  fine = *MeanL2Error(table.view(), Quantize(table.view(), options)->view());
  options.adaptive = {45, 0.02f};  // min_bins = 44: a single greedy step
  narrow = *MeanL2Error(table.view(), Quantize(table.view(), options)->view());
  options.method = Method::kAsymmetric;
  const double asym = *MeanL2Error(table.view(), Quantize(table.view(), options)->view());
  EXPECT_LT(fine, coarse);
  EXPECT_LT(fine, narrow);
  EXPECT_LT(narrow, asym);
}

TEST(AdaptiveSearchTest, RejectsBadParameters) {
  const auto table = MakeTable(RowShape::kNormal, 2, 8, 1);
  QuantOptions options;
  options.method = Method::kAdaptive;
  options.adaptive = {0, 1.0f};
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
  options.adaptive = {10, 0.0f};
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
  options.adaptive = {10, 1.5f};
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::quant
