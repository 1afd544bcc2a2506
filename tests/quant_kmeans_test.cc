// Per-row k-means quantization (paper 5.2, approach 2): deterministic,
// sorted codebook, nearest-centroid codes, and lower error than asymmetric at
// low bit widths (Figure 9).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::RowShape;

QuantOptions KMeans(int bits, ScaleType scale_type = ScaleType::kFp32) {
  QuantOptions options;
  options.method = Method::kKMeans;
  options.bits = bits;
  options.scale_type = scale_type;
  return options;
}

TEST(KMeansTest, DeterministicAcrossRunsAndThreads) {
  const auto table = MakeTable(RowShape::kHeavyTailed, 3000, 64, 31);
  for (int bits : {2, 3, 4, 8}) {
    QuantOptions options = KMeans(bits, ScaleType::kFp16);
    options.max_threads = 1;
    auto first = Quantize(table.view(), options);
    options.max_threads = 0;
    auto second = Quantize(table.view(), options);
    auto third = Quantize(table.view(), options);
    ASSERT_TRUE(first.ok() && second.ok() && third.ok());
    EXPECT_EQ(first->payload, second->payload) << bits;
    EXPECT_EQ(second->payload, third->payload) << bits;
  }
}

TEST(KMeansTest, CodebookSortedAndCodesPickNearestCentroid) {
  const auto table = MakeTable(RowShape::kNormal, 200, 50, 37);
  auto q = Quantize(table.view(), KMeans(3));
  ASSERT_TRUE(q.ok());
  const auto back = testing::DequantizeAll(q->view());
  for (std::uint64_t r = 0; r < table.rows; ++r) {
    float codebook[8];
    std::memcpy(codebook, q->view().row(r) + q->spec.code_bytes(), sizeof(codebook));
    ASSERT_TRUE(std::is_sorted(codebook, codebook + 8)) << r;
    for (std::uint32_t c = 0; c < 50; ++c) {
      const float x = table.values[r * 50 + c];
      float nearest = codebook[0];
      for (float centroid : codebook) {
        if (std::fabs(centroid - x) < std::fabs(nearest - x)) nearest = centroid;
      }
      ASSERT_EQ(std::fabs(back[r * 50 + c] - x), std::fabs(nearest - x)) << r << "," << c;
    }
  }
}

TEST(KMeansTest, BeatsAsymmetricAtLowBitWidths) {
  const auto table = MakeTable(RowShape::kHeavyTailed, 2000, 64, 41);
  for (int bits : {2, 3}) {
    QuantOptions asym_options;
    asym_options.bits = bits;
    asym_options.scale_type = ScaleType::kFp32;
    auto asym = Quantize(table.view(), asym_options);
    auto kmeans = Quantize(table.view(), KMeans(bits));
    ASSERT_TRUE(asym.ok() && kmeans.ok());
    EXPECT_LT(*MeanL2Error(table.view(), kmeans->view()),
              0.9 * *MeanL2Error(table.view(), asym->view()))
        << bits;
  }
}

TEST(KMeansTest, FewerElementsThanCentroidsIsExact) {
  const float row[3] = {-1.5f, 0.25f, 7.0f};
  const TableView table{"tiny", row, 1, 3, 0};
  auto q = Quantize(table, KMeans(8));
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->spec.param_bytes(), 256u * 4);
  const auto back = testing::DequantizeAll(q->view());
  EXPECT_EQ(back, std::vector<float>(row, row + 3));
}

TEST(KMeansTest, SingleIterationDiffersFromFifteen) {
  // Lloyd iterations must actually move centroids away from the quantile seeds.
  const auto table = MakeTable(RowShape::kHeavyTailed, 500, 64, 43);
  QuantOptions one = KMeans(2);
  one.kmeans_iterations = 1;
  auto a = Quantize(table.view(), one);
  auto b = Quantize(table.view(), KMeans(2));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(a->payload, b->payload);
  EXPECT_LT(*MeanL2Error(table.view(), b->view()), *MeanL2Error(table.view(), a->view()));
}

}  // namespace
}  // namespace pmsnap::quant
