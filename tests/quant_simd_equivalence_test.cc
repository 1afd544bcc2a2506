// The AVX2 and AVX-512 kernel sets produce exactly the bytes of the portable
// set, for every method, bit width, scale type, layout and row length
// (including tails shorter than a vector). Sets the CPU lacks are skipped.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include "detail/half.h"
#include "pmsnap/quant/quant.h"
#include "testutil/quant_checks.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pmsnap::quant {
namespace {

using workloads::MakeTable;
using workloads::RowShape;

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

// The AVX-512 adaptive fast path (4 rows in lock step, F16C directed rounding)
// at the default 45 bins / ratio 1.0 with fp16 pmsnap parameters, on rows
// whose ranges sweep the fp16 range (subnormal steps up to the overflow
// edge), constant rows, and groups cut short by the row count.
TEST_P(SimdEquivalenceTest, AdaptiveFastPathIdenticalToPortable) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa)) GTEST_SKIP() << IsaName(isa) << " not available on this CPU";
  for (std::uint32_t dim : {1u, 3u, 16u, 17u, 64u, 100u, 128u}) {
    for (std::uint64_t rows : {1ull, 3ull, 4ull, 7ull, 61ull}) {
      auto table = MakeTable(RowShape::kHeavyTailed, rows, dim, 77 + dim + rows);
      for (std::uint64_t r = 0; r < rows; ++r) {
        const float magnitude = std::pow(10.0f, static_cast<float>(r % 14) - 9.0f);
        for (std::uint32_t c = 0; c < dim; ++c) table.row(r)[c] *= magnitude;
        if (r % 14 == 13) {
          for (std::uint32_t c = 0; c < dim; ++c)
            table.row(r)[c] = std::fmin(table.row(r)[c], 65504.0f);
        }
        if (r % 9 == 5) std::fill_n(table.row(r), dim, -0.75f);
      }
      for (int bits : {2, 3, 4, 8}) {
        QuantOptions options;
        options.method = Method::kAdaptive;
        options.bits = bits;
        options.max_threads = 1;
        options.isa = Isa::kPortable;
        auto reference = Quantize(table.view(), options);
        options.isa = isa;
        auto vector = Quantize(table.view(), options);
        ASSERT_EQ(reference.ok(), vector.ok());
        if (!reference.ok()) {
          EXPECT_EQ(reference.status().ToString(), vector.status().ToString());
          continue;
        }
        ASSERT_EQ(reference->payload, vector->payload)
            << IsaName(isa) << " " << bits << "-bit dim " << dim << " rows " << rows;
      }
    }
  }
}

// A row past the fp16 range reports the same error through the fast path.
TEST_P(SimdEquivalenceTest, AdaptiveFastPathReportsOverflowLikePortable) {
  const Isa isa = GetParam();
  if (!IsaSupported(isa)) GTEST_SKIP() << IsaName(isa) << " not available on this CPU";
  auto table = MakeTable(RowShape::kNormal, 9, 64, 3);
  table.row(6)[10] = 70000.0f;
  QuantOptions options;
  options.method = Method::kAdaptive;
  options.max_threads = 1;
  options.isa = Isa::kPortable;
  auto reference = Quantize(table.view(), options);
  options.isa = isa;
  auto vector = Quantize(table.view(), options);
  ASSERT_FALSE(reference.ok());
  ASSERT_FALSE(vector.ok());
  EXPECT_EQ(reference.status().ToString(), vector.status().ToString());
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) std::uint16_t HwDown(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, 0x01));  // toward -inf
}
__attribute__((target("f16c"))) std::uint16_t HwUp(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, 0x02));  // toward +inf
}

// The fast path's F16C directed conversions equal the portable outward
// rounding on a stride through every finite float (both signs, subnormals,
// the overflow edge) and on every float near a half boundary.
TEST(HalfRoundingTest, F16cDirectedRoundingEqualsPortable) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C";
  auto check = [](std::uint32_t bits) {
    const float f = std::bit_cast<float>(bits);
    if (!std::isfinite(f)) return;
    ASSERT_EQ(detail::FloatToHalfRoundDown(f), HwDown(f)) << std::hexfloat << f;
    ASSERT_EQ(detail::FloatToHalfRoundUp(f), HwUp(f)) << std::hexfloat << f;
  };
  for (std::uint64_t b = 0; b < (1ull << 32); b += 4099) check(static_cast<std::uint32_t>(b));
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float v = detail::HalfToFloat(static_cast<std::uint16_t>(h));
    if (!std::isfinite(v)) continue;
    const std::uint32_t vb = std::bit_cast<std::uint32_t>(v);
    for (std::uint32_t d = 0; d < 3; ++d) {
      check(vb + d);
      if (vb >= d) check(vb - d);
    }
  }
}
#endif

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
