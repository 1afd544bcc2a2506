// Synthetic embedding tables for the quant tests and benchmark: deterministic
// for a given seed. "normal" rows are Gaussian with a per-row mean and spread
// (embedding rows are not centred, which is why asymmetric beats symmetric);
// "heavy" rows are Student-t with 3 degrees of freedom, so a few elements sit
// far from the rest (where adaptive clipping pays off).
// Thread-safety: values only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "pmsnap/quant/quant.h"

namespace pmsnap::quant::testing {

enum class RowShape { kNormal, kHeavyTailed };

struct OwnedTable {
  std::string name;
  std::vector<float> values;
  std::uint64_t rows = 0;
  std::uint32_t dim = 0;

  TableView view() const { return {name, values.data(), rows, dim, 0}; }
  float* row(std::uint64_t r) { return values.data() + r * dim; }
};

inline OwnedTable MakeTable(RowShape shape, std::uint64_t rows, std::uint32_t dim,
                            std::uint64_t seed, std::string name = "emb") {
  OwnedTable t{std::move(name), std::vector<float>(rows * dim), rows, dim};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mean(-0.05f, 0.05f), spread(0.01f, 0.1f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::student_t_distribution<float> heavy(3.0f);
  for (std::uint64_t r = 0; r < rows; ++r) {
    const float mu = mean(rng), sigma = spread(rng);
    for (std::uint32_t c = 0; c < dim; ++c) {
      const float z = shape == RowShape::kNormal ? normal(rng) : heavy(rng);
      t.values[r * dim + c] = mu + sigma * z;
    }
  }
  return t;
}

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

inline std::vector<float> DequantizeAll(const QuantizedView& q) {
  std::vector<float> out(q.spec.rows * q.spec.dim);
  const Status s = Dequantize(q, out.data());
  if (!s.ok()) out.clear();
  return out;
}

}  // namespace pmsnap::quant::testing
