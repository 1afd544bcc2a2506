// Round trip of the uniform methods: every element comes back within half of
// its row's stored step, for every bit width, scale type and awkward row
// length; results do not depend on the thread count; more bits, less error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::RowShape;

class RoundTripTest
    : public ::testing::TestWithParam<std::tuple<Method, int, ScaleType, std::uint32_t>> {};

TEST_P(RoundTripTest, EveryElementWithinHalfAStep) {
  const auto [method, bits, scale_type, dim] = GetParam();
  for (RowShape shape : {RowShape::kNormal, RowShape::kHeavyTailed}) {
    const auto table = MakeTable(shape, 300, dim, 42 + dim);
    QuantOptions options;
    options.method = method;
    options.bits = bits;
    options.scale_type = scale_type;
    auto q = Quantize(table.view(), options);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    ASSERT_EQ(q->payload.size(), q->spec.row_bytes() * table.rows);
    const std::vector<float> back = testing::DequantizeAll(q->view());
    ASSERT_EQ(back.size(), table.values.size());
    for (std::uint64_t r = 0; r < table.rows; ++r) {
      const float step = testing::StoredScale(q->view(), r);
      const float* x = table.values.data() + r * dim;
      const float magnitude = std::max(std::fabs(*std::min_element(x, x + dim)),
                                       std::fabs(*std::max_element(x, x + dim)));
      // Half a step, plus float rounding of the dequantization arithmetic.
      const float tolerance = 0.5f * step * (1.0f + 1e-5f) + 4e-7f * magnitude;
      for (std::uint32_t c = 0; c < dim; ++c) {
        ASSERT_LE(std::fabs(back[r * dim + c] - x[c]), tolerance)
            << MethodName(method) << " " << bits << "-bit " << ScaleTypeName(scale_type) << " row "
            << r << " col " << c << " x=" << x[c] << " back=" << back[r * dim + c]
            << " step=" << step;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllUniform, RoundTripTest,
                         ::testing::Combine(::testing::Values(Method::kSymmetric,
                                                              Method::kAsymmetric),
                                            ::testing::Values(2, 3, 4, 8),
                                            ::testing::Values(ScaleType::kFp16, ScaleType::kFp32),
                                            ::testing::Values(1u, 5u, 64u, 100u, 128u)),
                         testing::TupleParamName());

TEST(RoundTripTest, RowBytesArePackedTightly) {
  for (int bits : {2, 3, 4, 8}) {
    for (std::uint32_t dim : {1u, 3u, 8u, 13u, 64u}) {
      QuantOptions options;
      options.bits = bits;
      options.scale_type = ScaleType::kFp32;
      const QuantSpec spec = SpecFor(options, dim, 10);
      EXPECT_EQ(spec.code_bytes(), (dim * static_cast<std::uint32_t>(bits) + 7) / 8);
      EXPECT_EQ(spec.param_bytes(), 8u);
      EXPECT_EQ(spec.payload_bytes(), 10 * spec.row_bytes());
    }
  }
}

TEST(RoundTripTest, ThreadCountDoesNotChangeBytes) {
  const auto table = MakeTable(RowShape::kHeavyTailed, 5000, 64, 7);
  for (Method method : {Method::kAsymmetric, Method::kAdaptive, Method::kKMeans}) {
    QuantOptions options;
    options.method = method;
    options.bits = 3;
    options.max_threads = 1;
    auto serial = Quantize(table.view(), options);
    options.max_threads = 0;
    auto parallel = Quantize(table.view(), options);
    ASSERT_TRUE(serial.ok() && parallel.ok());
    EXPECT_EQ(serial->payload, parallel->payload) << MethodName(method);
  }
}

TEST(RoundTripTest, MoreBitsGiveLowerMeanL2Error) {
  const auto table = MakeTable(RowShape::kNormal, 2000, 64, 3);
  double previous = 1e30;
  for (int bits : {2, 3, 4, 8}) {
    QuantOptions options;
    options.bits = bits;
    options.scale_type = ScaleType::kFp32;
    auto q = Quantize(table.view(), options);
    ASSERT_TRUE(q.ok());
    auto err = MeanL2Error(table.view(), q->view());
    ASSERT_TRUE(err.ok());
    EXPECT_LT(*err, previous) << bits;
    EXPECT_GT(*err, 0.0);
    previous = *err;
  }
}

TEST(RoundTripTest, MeanL2ErrorMatchesDefinition) {
  const auto table = MakeTable(RowShape::kNormal, 257, 33, 5);
  QuantOptions options;
  options.bits = 2;
  auto q = Quantize(table.view(), options);
  ASSERT_TRUE(q.ok());
  const std::vector<float> back = testing::DequantizeAll(q->view());
  double sum = 0;
  for (std::uint64_t r = 0; r < table.rows; ++r) {
    double sq = 0;
    for (std::uint32_t c = 0; c < table.dim; ++c) {
      const double d = static_cast<double>(table.values[r * 33 + c]) - back[r * 33 + c];
      sq += d * d;
    }
    sum += std::sqrt(sq);
  }
  auto err = MeanL2Error(table.view(), q->view());
  ASSERT_TRUE(err.ok());
  EXPECT_NEAR(*err, sum / table.rows, 1e-12);
  auto single = MeanL2Error(table.view(), q->view(), 1);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(*err, *single);  // deterministic reduction
}

TEST(RoundTripTest, AsymmetricBeatsSymmetricOnShiftedRows) {
  // Paper, Figure 9: rows are not centred, so the asymmetric range is tighter.
  const auto table = MakeTable(RowShape::kNormal, 2000, 64, 11);
  for (int bits : {2, 3, 4, 8}) {
    QuantOptions options;
    options.bits = bits;
    options.method = Method::kSymmetric;
    auto sym = Quantize(table.view(), options);
    options.method = Method::kAsymmetric;
    auto asym = Quantize(table.view(), options);
    ASSERT_TRUE(sym.ok() && asym.ok());
    EXPECT_LT(*MeanL2Error(table.view(), asym->view()), *MeanL2Error(table.view(), sym->view()))
        << bits;
  }
}

TEST(RoundTripTest, RowStrideAndDequantizeRowAgree) {
  auto table = MakeTable(RowShape::kNormal, 10, 20, 9);
  // Same rows with a padded stride of 24 floats.
  std::vector<float> padded(10 * 24, 123.0f);
  for (int r = 0; r < 10; ++r) std::copy_n(table.row(r), 20, padded.data() + r * 24);
  const TableView strided{"strided", padded.data(), 10, 20, 24};
  QuantOptions options;
  auto a = Quantize(table.view(), options);
  auto b = Quantize(strided, options);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->payload, b->payload);
  std::vector<float> all(10 * 20), one(20);
  ASSERT_TRUE(Dequantize(a->view(), all.data()).ok());
  ASSERT_TRUE(DequantizeRow(a->view(), 7, one.data()).ok());
  EXPECT_TRUE(std::equal(one.begin(), one.end(), all.begin() + 7 * 20));
  EXPECT_EQ(DequantizeRow(a->view(), 10, one.data()).code(), StatusCode::kInvalidArgument);
}

TEST(RoundTripTest, InvalidOptionsAreRejected) {
  const auto table = MakeTable(RowShape::kNormal, 4, 8, 1);
  QuantOptions options;
  options.bits = 5;
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
  options.bits = 4;
  options.layout = Layout::kTorchFused;
  options.method = Method::kSymmetric;
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
  options.method = Method::kAsymmetric;
  options.bits = 8;
  options.scale_type = ScaleType::kFp16;  // PyTorch's byte layout is fp32
  EXPECT_EQ(Quantize(table.view(), options).status().code(), StatusCode::kInvalidArgument);
  std::vector<std::uint8_t> small(3);
  options = {};
  EXPECT_EQ(QuantizeInto(table.view(), options, small).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::quant
