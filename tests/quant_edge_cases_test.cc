// Edge cases: constant rows, rows of one element, 3-bit rows whose length is
// not a multiple of 8 (packing checked against a naive bit writer), all-zero
// tables, negative zero, and huge or tiny magnitudes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

const Method kAllMethods[] = {Method::kSymmetric, Method::kAsymmetric, Method::kAdaptive,
                              Method::kKMeans};

TEST(EdgeCaseTest, ConstantRowsComeBackExactly) {
  for (float value : {0.0f, 0.5f, -3.25f, 1000.0f}) {
    std::vector<float> row(37, value);
    const TableView table{"constant", row.data(), 1, 37, 0};
    for (Method method : {Method::kAsymmetric, Method::kAdaptive, Method::kKMeans}) {
      for (int bits : {2, 3, 4, 8}) {
        QuantOptions options;
        options.method = method;
        options.bits = bits;
        auto q = Quantize(table, options);
        ASSERT_TRUE(q.ok()) << q.status().ToString();
        EXPECT_EQ(testing::DequantizeAll(q->view()), row)
            << MethodName(method) << " " << bits << " value " << value;
      }
    }
  }
}

TEST(EdgeCaseTest, RowOfLengthOne) {
  const float values[4] = {0.7f, -2.0f, 0.0f, 1e-3f};
  const TableView table{"len1", values, 4, 1, 0};
  for (Method method : kAllMethods) {
    for (int bits : {2, 3, 4, 8}) {
      QuantOptions options;
      options.method = method;
      options.bits = bits;
      options.scale_type = ScaleType::kFp32;
      auto q = Quantize(table, options);
      ASSERT_TRUE(q.ok()) << q.status().ToString();
      EXPECT_EQ(q->spec.code_bytes(), 1u);
      const auto back = testing::DequantizeAll(q->view());
      for (int r = 0; r < 4; ++r) {
        // Symmetric keeps no bias: x sits on the grid's end, up to rounding.
        EXPECT_NEAR(back[r], values[r], 1e-6f * std::fabs(values[r]) + 1e-12f)
            << MethodName(method) << " " << bits;
      }
    }
  }
}

TEST(EdgeCaseTest, ThreeBitRowsOfEveryLengthPackTightly) {
  for (std::uint32_t dim = 1; dim <= 41; ++dim) {
    // Codes 0..7 in a known order: x = code exactly (min 0, max 7 in each row).
    std::vector<float> row(dim);
    for (std::uint32_t i = 0; i < dim; ++i) row[i] = static_cast<float>((i * 5 + 3) % 8);
    if (dim >= 2) {
      row[0] = 0.0f;
      row[1] = 7.0f;
    }
    const TableView table{"three", row.data(), 1, dim, 0};
    QuantOptions options;
    options.bits = 3;
    options.scale_type = ScaleType::kFp32;
    auto q = Quantize(table, options);
    ASSERT_TRUE(q.ok());
    ASSERT_EQ(q->spec.code_bytes(), (3 * dim + 7) / 8);
    if (dim >= 2) {
      // Expected bytes from a naive LSB-first bit writer.
      std::vector<std::uint8_t> expected(q->spec.code_bytes(), 0);
      for (std::uint32_t i = 0; i < dim; ++i) {
        const auto code = static_cast<std::uint32_t>(row[i]);
        for (int b = 0; b < 3; ++b) {
          if (code & (1u << b))
            expected[(3 * i + b) / 8] |= static_cast<std::uint8_t>(1u << ((3 * i + b) % 8));
        }
      }
      EXPECT_EQ(std::vector<std::uint8_t>(q->payload.begin(), q->payload.begin() + expected.size()),
                expected)
          << "dim " << dim;
    }
    EXPECT_EQ(testing::DequantizeAll(q->view()), row) << "dim " << dim;
  }
}

TEST(EdgeCaseTest, AllZeroTableIsExactAndNegativeZeroIsNormalized) {
  std::vector<float> zeros(100 * 16, 0.0f);
  std::vector<float> mixed = zeros;
  for (std::size_t i = 0; i < mixed.size(); i += 3) mixed[i] = -0.0f;
  for (Method method : kAllMethods) {
    QuantOptions options;
    options.method = method;
    auto a = Quantize({"zeros", zeros.data(), 100, 16, 0}, options);
    auto b = Quantize({"mixed", mixed.data(), 100, 16, 0}, options);
    ASSERT_TRUE(a.ok() && b.ok());
    for (float v : testing::DequantizeAll(a->view())) ASSERT_EQ(v, 0.0f);
    EXPECT_EQ(*MeanL2Error({"zeros", zeros.data(), 100, 16, 0}, a->view()), 0.0);
    if (method != Method::kKMeans) {
      EXPECT_EQ(a->payload, b->payload) << MethodName(method);
    }
  }
}

TEST(EdgeCaseTest, HugeMagnitudesWithFp32Scale) {
  auto table = workloads::MakeTable(workloads::RowShape::kNormal, 50, 32, 5);
  for (std::size_t i = 0; i < table.values.size(); ++i) table.values[i] *= 1e36f;
  table.values[0] = 3e37f;
  table.values[1] = -3e37f;
  for (Method method : {Method::kSymmetric, Method::kAsymmetric}) {
    QuantOptions options;
    options.method = method;
    options.bits = 8;
    options.scale_type = ScaleType::kFp32;
    auto q = Quantize(table.view(), options);
    ASSERT_TRUE(q.ok()) << q.status().ToString();
    const auto back = testing::DequantizeAll(q->view());
    for (std::uint64_t r = 0; r < table.rows; ++r) {
      const float step = testing::StoredScale(q->view(), r);
      ASSERT_TRUE(std::isfinite(step));
      for (std::uint32_t c = 0; c < 32; ++c) {
        ASSERT_LE(std::fabs(back[r * 32 + c] - table.values[r * 32 + c]), 0.5001f * step + 1e31f);
      }
    }
  }
  // max - min beyond fp32: a clear error rather than garbage.
  std::vector<float> wide = {3e38f, -3e38f};
  QuantOptions options;
  options.scale_type = ScaleType::kFp32;
  auto q = Quantize({"wide", wide.data(), 1, 2, 0}, options);
  EXPECT_EQ(q.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(q.status().message().find("overflows fp32"), std::string::npos) << q.status().message();
}

TEST(EdgeCaseTest, MagnitudeBeyondFp16NamesRowAndSuggestsFp32) {
  auto table = workloads::MakeTable(workloads::RowShape::kNormal, 10, 8, 5, "big");
  table.values[6 * 8 + 2] = 70000.0f;
  for (Method method : kAllMethods) {
    QuantOptions options;
    options.method = method;
    options.scale_type = ScaleType::kFp16;
    auto q = Quantize(table.view(), options);
    ASSERT_EQ(q.status().code(), StatusCode::kInvalidArgument) << MethodName(method);
    EXPECT_NE(q.status().message().find("table 'big' row 6"), std::string::npos)
        << q.status().message();
    EXPECT_NE(q.status().message().find("kFp32"), std::string::npos);
  }
}

TEST(EdgeCaseTest, TinyMagnitudesKeepRelativePrecision) {
  auto table = workloads::MakeTable(workloads::RowShape::kNormal, 20, 64, 8);
  for (float& v : table.values) v *= 1e-20f;
  QuantOptions options;
  options.bits = 4;
  options.scale_type = ScaleType::kFp32;
  auto q = Quantize(table.view(), options);
  ASSERT_TRUE(q.ok());
  const auto back = testing::DequantizeAll(q->view());
  for (std::uint64_t r = 0; r < table.rows; ++r) {
    const float step = testing::StoredScale(q->view(), r);
    ASSERT_GT(step, 0.0f);
    for (std::uint32_t c = 0; c < 64; ++c) {
      ASSERT_LE(std::fabs(back[r * 64 + c] - table.values[r * 64 + c]), 0.5001f * step);
    }
  }
}

TEST(EdgeCaseTest, EmptyTableQuantizesToNothing) {
  QuantOptions options;
  auto q = Quantize({"empty", nullptr, 0, 16, 0}, options);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(q->payload.empty());
  EXPECT_EQ(*MeanL2Error({"empty", nullptr, 0, 16, 0}, q->view()), 0.0);
  EXPECT_EQ(Quantize({"nodim", nullptr, 0, 0, 0}, options).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::quant
