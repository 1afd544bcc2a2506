// Automatic parameter choice: the sampled choice of num_bins / ratio equals
// the full-table choice (paper 5.2, "Parameter selection"); the sample is
// uniform, deterministic and sized as asked; the bit width follows the
// expected number of resumes (paper 6.2.1).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "pmsnap/quant/param_search.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::RowShape;

class SampledChoiceTest : public ::testing::TestWithParam<std::tuple<RowShape, int>> {};

TEST_P(SampledChoiceTest, SampledChoiceEqualsFullTableChoice) {
  const auto [shape, bits] = GetParam();
  const auto table = MakeTable(shape, 30000, 64, 101);
  ParamSearchOptions sampled;  // 0.001% -> the 4096-row minimum
  auto from_sample = ChooseAdaptiveParams(table.view(), bits, sampled);
  ParamSearchOptions full = sampled;
  full.sample_fraction = 1.0;
  auto from_table = ChooseAdaptiveParams(table.view(), bits, full);
  ASSERT_TRUE(from_sample.ok()) << from_sample.status().ToString();
  ASSERT_TRUE(from_table.ok()) << from_table.status().ToString();
  EXPECT_EQ(from_sample->sampled_rows, 4096u);
  EXPECT_EQ(from_table->sampled_rows, 30000u);
  EXPECT_EQ(from_sample->params.num_bins, from_table->params.num_bins);
  EXPECT_EQ(from_sample->params.ratio, from_table->params.ratio);
  // The choice improves on asymmetric, and the curve is what it was chosen from.
  const double asym = from_table->asymmetric_mean_l2;
  double chosen = 0;
  for (const auto& p : from_table->ratio_curve) {
    if (p.ratio == from_table->params.ratio) chosen = p.mean_l2;
  }
  EXPECT_LT(chosen, asym);
  EXPECT_EQ(from_table->bins_curve.size(), full.bins_candidates.size());
}

INSTANTIATE_TEST_SUITE_P(Tables, SampledChoiceTest,
                         ::testing::Combine(::testing::Values(RowShape::kNormal,
                                                              RowShape::kHeavyTailed),
                                            ::testing::Values(2, 3, 4)),
                         testing::TupleParamName());

TEST(ParamSearchTest, TaperPointFollowsTheGainThreshold) {
  const auto table = MakeTable(RowShape::kHeavyTailed, 5000, 64, 7);
  ParamSearchOptions options;
  options.sample_fraction = 1.0;
  auto chosen = ChooseAdaptiveParams(table.view(), 2, options);
  ASSERT_TRUE(chosen.ok());
  // Recompute the rule from the reported curve.
  const auto& curve = chosen->bins_curve;
  const double base = chosen->asymmetric_mean_l2;
  std::size_t steepest = 0;
  for (std::size_t i = 0; i + 1 < curve.size(); ++i) {
    if (curve[i].mean_l2 - curve[i + 1].mean_l2 >
        curve[steepest].mean_l2 - curve[steepest + 1].mean_l2) {
      steepest = i;
    }
  }
  std::size_t expected = curve.size() - 1;
  for (std::size_t i = steepest + 1; i + 1 < curve.size(); ++i) {
    if ((curve[i].mean_l2 - curve[i + 1].mean_l2) / base < options.taper_gain) {
      expected = i;
      break;
    }
  }
  EXPECT_EQ(chosen->params.num_bins, curve[expected].num_bins);
  // A zero threshold never sees the curve flatten: the last (largest) candidate.
  options.taper_gain = 0.0;
  options.ratio_candidates = {1.0f};
  auto greedy = ChooseAdaptiveParams(table.view(), 2, options);
  ASSERT_TRUE(greedy.ok());
  EXPECT_GE(greedy->params.num_bins, chosen->params.num_bins);
  // A threshold above every gain keeps the cheapest candidate.
  options.taper_gain = 0.9;
  auto cheap = ChooseAdaptiveParams(table.view(), 2, options);
  ASSERT_TRUE(cheap.ok());
  EXPECT_EQ(cheap->params.num_bins, options.bins_candidates.front());
}

TEST(ParamSearchTest, SampleIsUniformSortedDistinctAndDeterministic) {
  const auto a = SampleRows(10'000'000, 1e-5, 50, 9);
  EXPECT_EQ(a.size(), 100u);
  EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
  EXPECT_EQ(std::set<std::uint64_t>(a.begin(), a.end()).size(), a.size());
  EXPECT_EQ(a, SampleRows(10'000'000, 1e-5, 50, 9));
  EXPECT_NE(a, SampleRows(10'000'000, 1e-5, 50, 10));
  // One row per stratum of 100000 rows.
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_GE(a[i], i * 100000);
    EXPECT_LT(a[i], (i + 1) * 100000);
  }
  EXPECT_EQ(SampleRows(1000, 1e-5, 4096, 1).size(), 1000u);   // small table: all rows
  EXPECT_EQ(SampleRows(1'000'000, 1e-5, 64, 1).size(), 64u);  // minimum wins
  EXPECT_TRUE(SampleRows(0, 0.5, 1, 1).empty());
}

TEST(ParamSearchTest, RejectsBadOptions) {
  const auto table = MakeTable(RowShape::kNormal, 100, 8, 1);
  ParamSearchOptions options;
  options.sample_fraction = 0;
  EXPECT_EQ(ChooseAdaptiveParams(table.view(), 4, options).status().code(),
            StatusCode::kInvalidArgument);
  options = {};
  options.bins_candidates.clear();
  EXPECT_EQ(ChooseAdaptiveParams(table.view(), 4, options).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ChooseAdaptiveParams(table.view(), 5, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ChooseAdaptiveParams({"e", nullptr, 0, 8, 0}, 4, {}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(BitWidthTest, PaperThresholds) {
  EXPECT_EQ(BitsForExpectedResumes(0), 2);
  EXPECT_EQ(BitsForExpectedResumes(1), 2);
  EXPECT_EQ(BitsForExpectedResumes(1.5), 3);
  EXPECT_EQ(BitsForExpectedResumes(3), 3);
  EXPECT_EQ(BitsForExpectedResumes(4), 4);
  EXPECT_EQ(BitsForExpectedResumes(20), 4);
  EXPECT_EQ(BitsForExpectedResumes(21), 8);
  EXPECT_EQ(BitsForExpectedResumes(-1), 8);
}

TEST(BitWidthTest, ConfigurableThresholds) {
  BitWidthPolicy strict;
  strict.max_resumes_2bit = 0;
  strict.max_resumes_3bit = 0;
  strict.max_resumes_4bit = 5;
  EXPECT_EQ(BitsForExpectedResumes(0, strict), 2);
  EXPECT_EQ(BitsForExpectedResumes(1, strict), 4);
  EXPECT_EQ(BitsForExpectedResumes(6, strict), 8);
}

}  // namespace
}  // namespace pmsnap::quant
