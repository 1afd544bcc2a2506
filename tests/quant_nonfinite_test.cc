// NaN or Inf anywhere in a table fails quantization with a message naming the
// table, the row and the column; with several bad rows the lowest is named,
// whatever the thread schedule.
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

namespace pmsnap::quant {
namespace {

struct BadValue {
  float value;
  const char* name;
};

TEST(NonFiniteTest, ErrorNamesTableRowAndColumn) {
  const BadValue bad_values[] = {{std::numeric_limits<float>::quiet_NaN(), "NaN"},
                                 {std::numeric_limits<float>::infinity(), "+Inf"},
                                 {-std::numeric_limits<float>::infinity(), "-Inf"}};
  for (const BadValue& bad : bad_values) {
    for (Method method :
         {Method::kSymmetric, Method::kAsymmetric, Method::kAdaptive, Method::kKMeans}) {
      for (std::uint32_t column : {0u, 3u, 63u}) {
        auto table = workloads::MakeTable(workloads::RowShape::kNormal, 40, 64, 2, "user_emb");
        table.row(17)[column] = bad.value;
        QuantOptions options;
        options.method = method;
        auto q = Quantize(table.view(), options);
        ASSERT_FALSE(q.ok());
        EXPECT_EQ(q.status().code(), StatusCode::kInvalidArgument);
        const std::string expected =
            "table 'user_emb' row 17 column " + std::to_string(column) + " holds " + bad.name;
        EXPECT_NE(q.status().message().find(expected), std::string::npos)
            << MethodName(method) << ": " << q.status().message();
      }
    }
  }
}

TEST(NonFiniteTest, LowestBadRowIsReportedUnderThreads) {
  auto table = workloads::MakeTable(workloads::RowShape::kNormal, 200000, 16, 3, "big");
  table.row(199990)[1] = std::numeric_limits<float>::quiet_NaN();
  table.row(123457)[5] = std::numeric_limits<float>::infinity();
  table.row(150000)[0] = std::numeric_limits<float>::quiet_NaN();
  for (int threads : {0, 1, 2}) {
    QuantOptions options;
    options.max_threads = threads;
    auto q = Quantize(table.view(), options);
    ASSERT_FALSE(q.ok());
    EXPECT_NE(q.status().message().find("row 123457 column 5 holds +Inf"), std::string::npos)
        << q.status().message();
  }
}

TEST(NonFiniteTest, NanInFirstElementOfShortRowIsCaught) {
  // The vector kernels seed min/max with x[0]; the check must not rely on it.
  for (std::uint32_t dim : {1u, 2u, 15u, 16u, 17u}) {
    std::vector<float> row(dim, 1.0f);
    row[0] = std::numeric_limits<float>::quiet_NaN();
    auto q = Quantize({"short", row.data(), 1, dim, 0}, QuantOptions{});
    ASSERT_FALSE(q.ok()) << dim;
    EXPECT_NE(q.status().message().find("row 0 column 0 holds NaN"), std::string::npos);
  }
}

}  // namespace
}  // namespace pmsnap::quant
