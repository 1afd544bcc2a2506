// Synthetic embedding tables for quant/'s tests and benchmark, deterministic
// for a given seed. "normal" rows are Gaussian with a per-row mean and spread
// (embedding rows are not centred, which is why asymmetric beats symmetric);
// "heavy" rows are Student-t with 3 degrees of freedom, so a few elements sit
// far from the rest (where adaptive clipping pays off).
//
// Header-only (target pmsnap::workloads_tables, needs quant/ for TableView
// only): it builds without libtorch, unlike the rest of workloads/.
// Thread-safety: values only.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "pmsnap/quant/quant.h"

namespace pmsnap::workloads {

enum class RowShape { kNormal, kHeavyTailed };

// "normal", "heavy": for labels in benchmark output and test names.
inline const char* RowShapeName(RowShape shape) {
  return shape == RowShape::kNormal ? "normal" : "heavy";
}

// A table that owns its values, rows x dim floats, row-major.
struct OwnedTable {
  std::string name;
  std::vector<float> values;
  std::uint64_t rows = 0;
  std::uint32_t dim = 0;

  // A view for quant::Quantize; valid while this table lives and keeps its size.
  quant::TableView view() const { return {name, values.data(), rows, dim, 0}; }
  float* row(std::uint64_t r) { return values.data() + r * dim; }
};

// rows x dim values of `shape`; the same (shape, rows, dim, seed) gives the
// same bytes on every run and machine with the same standard library.
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

}  // namespace pmsnap::workloads
