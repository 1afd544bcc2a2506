// Checks shared by the quant tests: the scale a row stored, a whole table
// decoded, and readable names for parameterized tests. The tables they run
// on come from workloads/ (pmsnap/workloads/synthetic_tables.h), which the
// quant benchmark uses too.
//
// Thread-safety: values only.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "pmsnap/quant/quant.h"
#include "pmsnap/workloads/synthetic_tables.h"

namespace pmsnap::quant::testing {

// The step (scale) stored with a uniform-method row, as a float.
inline float StoredScale(const QuantizedView& q, std::uint64_t r) {
  const std::uint8_t* p = q.row(r) + q.spec.code_bytes();
  if (q.spec.scale_type == ScaleType::kFp32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, p, 2);
  // binary16 -> float, written out so the tests do not share library code.
  const std::uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  float v = exp == 0
                ? static_cast<float>(mant) * 5.9604644775390625e-8f
                : std::ldexp(1.0f + static_cast<float>(mant) / 1024.0f, static_cast<int>(exp) - 15);
  return (h & 0x8000) ? -v : v;
}

// Every row of `q` decoded; empty if Dequantize fails.
inline std::vector<float> DequantizeAll(const QuantizedView& q) {
  std::vector<float> out(q.spec.rows * q.spec.dim);
  const Status s = Dequantize(q, out.data());
  if (!s.ok()) out.clear();
  return out;
}

// Name parts of the values the quant tests are parameterized over. By
// convention an `int` parameter is a bit width and an unsigned one a row
// width (dim).
inline std::string ParamNamePart(int bits) { return "bits" + std::to_string(bits); }
inline std::string ParamNamePart(std::uint32_t dim) { return "dim" + std::to_string(dim); }
inline std::string ParamNamePart(Method method) { return MethodName(method); }
inline std::string ParamNamePart(ScaleType type) { return ScaleTypeName(type); }
inline std::string ParamNamePart(Layout layout) { return LayoutName(layout); }
inline std::string ParamNamePart(workloads::RowShape shape) {
  return workloads::RowShapeName(shape);
}

// Name generator for INSTANTIATE_TEST_SUITE_P over a tuple of the values
// above: "asymmetric_bits4_fp16_dim64" instead of an index, so that ctest
// lists which case each test is (a letter first: a digit after the "/"
// would read as gtest's index).
struct TupleParamName {
  template <typename... Values>
  std::string operator()(const ::testing::TestParamInfo<std::tuple<Values...>>& info) const {
    std::string name;
    std::apply(
        [&name](const auto&... value) {
          ((name += (name.empty() ? "" : "_") + ParamNamePart(value)), ...);
        },
        info.param);
    return name;
  }
};

}  // namespace pmsnap::quant::testing
