// The AVX2 and AVX-512 kernel sets produce exactly the bytes of the portable
// set, for every method, bit width, scale type, layout and row length
// (including tails shorter than a vector). Sets the CPU lacks are skipped.
#include <gtest/gtest.h>

#include <string>

#include "pmsnap/quant/quant.h"
#include "quant_test_tables.h"

namespace pmsnap::quant {
namespace {

using testing::MakeTable;
using testing::RowShape;

class SimdEquivalenceTest : public ::testing::TestWithParam<Isa> {};

TEST_P(SimdEquivalenceTest, IdenticalBytesToPortable) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa)) GTEST_SKIP() << IsaName(isa) << " not available on this CPU";
  std::vector<std::uint32_t> dims;
  for (std::uint32_t d = 1; d <= 70; ++d) dims.push_back(d);
  dims.insert(dims.end(), {127, 128, 129, 200});
  int compared = 0;
  for (std::uint32_t dim : dims) {
    for (RowShape shape : {RowShape::kNormal, RowShape::kHeavyTailed}) {
      const auto table = MakeTable(shape, dim <= 70 ? 40 : 400, dim, 1000 + dim);
      for (Method method :
           {Method::kSymmetric, Method::kAsymmetric, Method::kAdaptive, Method::kKMeans}) {
        for (int bits : {2, 3, 4, 8}) {
          for (ScaleType st : {ScaleType::kFp16, ScaleType::kFp32}) {
            for (Layout layout : {Layout::kPmsnap, Layout::kTorchFused}) {
              QuantOptions options;
              options.method = method;
              options.bits = bits;
              options.scale_type = st;
              options.layout = layout;
              options.adaptive = {20, 0.9f};
              options.max_threads = 1;
              if (!ValidateOptions(options, dim).ok()) continue;
              options.isa = Isa::kPortable;
              auto reference = Quantize(table.view(), options);
              options.isa = isa;
              auto vector = Quantize(table.view(), options);
              ASSERT_TRUE(reference.ok() && vector.ok());
              ASSERT_EQ(reference->payload, vector->payload)
                  << IsaName(isa) << " " << MethodName(method) << " " << bits << "-bit "
                  << ScaleTypeName(st) << " " << LayoutName(layout) << " dim " << dim;
              ++compared;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 1000);
}

INSTANTIATE_TEST_SUITE_P(VectorSets, SimdEquivalenceTest,
                         ::testing::Values(Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

TEST(IsaTest, DetectionIsConsistent) {
  const Isa best = DetectIsa();
  EXPECT_NE(best, Isa::kAuto);
  EXPECT_TRUE(IsaSupported(best));
  EXPECT_TRUE(IsaSupported(Isa::kPortable));
  if (best == Isa::kAvx512) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx2));
  }
  if (!IsaSupported(Isa::kAvx512)) {
    QuantOptions options;
    options.isa = Isa::kAvx512;
    EXPECT_EQ(ValidateOptions(options, 8).code(), StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace pmsnap::quant
