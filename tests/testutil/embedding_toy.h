// A toy recommendation model for diff/ tests without libtorch: one embedding
// table (weights [rows, dim] + a per-row accumulator [rows]) whose skewed
// (Zipf-like) rows are updated each step, and one small dense unit. Every
// value at step k depends only on k, so a reference at any iteration can be
// recomputed from scratch.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::testing {

class EmbeddingToy {
 public:
  EmbeddingToy(std::uint64_t rows, std::uint32_t dim)
      : rows_(rows), dim_(dim), weights_(rows * dim), accumulator_(rows), dense_(64) {
    for (std::uint64_t i = 0; i < weights_.size(); ++i) weights_[i] = 0.01f * (i % 101);
  }

  std::vector<runtime::UnitRegistration> Registrations() {
    return {{"dense.weight", {{"param", dense_.data(), layout::DType::kFloat32, {64}}}, false},
            {"emb.users",
             {{"weight",
               weights_.data(),
               layout::DType::kFloat32,
               {static_cast<std::int64_t>(rows_), dim_}},
              {"accumulator",
               accumulator_.data(),
               layout::DType::kFloat32,
               {static_cast<std::int64_t>(rows_)}}},
             true}};
  }

  // Rows step k touches: skewed toward low ids, ~3% of the table.
  std::vector<std::int64_t> RowsOf(std::uint64_t k) const {
    std::vector<std::int64_t> ids;
    std::uint64_t x = k * 0x9E3779B97F4A7C15ull + 1;
    for (std::uint64_t i = 0; i < rows_ / 32 + 1; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      const double u = static_cast<double>(x >> 11) / static_cast<double>(1ull << 53);
      ids.push_back(static_cast<std::int64_t>(static_cast<double>(rows_) * u * u * u));
    }
    return ids;
  }

  void Update(std::uint64_t k) {
    for (std::int64_t r : RowsOf(k)) {
      for (std::uint32_t d = 0; d < dim_; ++d) {
        weights_[r * dim_ + d] += 0.001f * static_cast<float>((k + d) % 17) - 0.008f;
      }
      accumulator_[r] += 1.0f;
    }
    for (std::size_t i = 0; i < dense_.size(); ++i) dense_[i] += 0.5f * static_cast<float>(k % 3);
  }

  // One training step through the engine; the tracker sees the lookups.
  // `extra` goes to EndStep (stored with the epoch this step captures).
  Status Step(runtime::Engine& engine, diff::RowTracker& tracker, std::uint64_t k,
              const std::string& extra = "") {
    const std::vector<std::int64_t> ids = RowsOf(k);
    PMSNAP_RETURN_IF_ERROR(tracker.Mark(ids));  // forward lookups
    PMSNAP_RETURN_IF_ERROR(engine.BeginStep(k));
    for (std::uint32_t u : {1u, 0u}) {
      PMSNAP_RETURN_IF_ERROR(engine.BeforeUpdate(u));
      if (u == 1) {
        UpdateTable(k, ids);
      } else {
        UpdateDense(k);
      }
      PMSNAP_RETURN_IF_ERROR(engine.AfterUpdate(u));
    }
    return engine.EndStep({reinterpret_cast<const std::byte*>(extra.data()), extra.size()});
  }

  // The table after steps 1..k from the initial state.
  static std::vector<float> ReferenceWeights(std::uint64_t rows, std::uint32_t dim,
                                             std::uint64_t k) {
    EmbeddingToy toy(rows, dim);
    for (std::uint64_t s = 1; s <= k; ++s) toy.Update(s);
    return toy.weights_;
  }
  static std::vector<float> ReferenceAccumulator(std::uint64_t rows, std::uint32_t dim,
                                                 std::uint64_t k) {
    EmbeddingToy toy(rows, dim);
    for (std::uint64_t s = 1; s <= k; ++s) toy.Update(s);
    return toy.accumulator_;
  }

  const std::vector<float>& weights() const { return weights_; }
  const std::vector<float>& accumulator() const { return accumulator_; }
  const std::vector<float>& dense() const { return dense_; }
  void Zero() {
    std::fill(weights_.begin(), weights_.end(), 0.0f);
    std::fill(accumulator_.begin(), accumulator_.end(), 0.0f);
    std::fill(dense_.begin(), dense_.end(), 0.0f);
  }

 private:
  void UpdateTable(std::uint64_t k, const std::vector<std::int64_t>& ids) {
    for (std::int64_t r : ids) {
      for (std::uint32_t d = 0; d < dim_; ++d) {
        weights_[r * dim_ + d] += 0.001f * static_cast<float>((k + d) % 17) - 0.008f;
      }
      accumulator_[r] += 1.0f;
    }
  }
  void UpdateDense(std::uint64_t k) {
    for (std::size_t i = 0; i < dense_.size(); ++i) dense_[i] += 0.5f * static_cast<float>(k % 3);
  }

  std::uint64_t rows_;
  std::uint32_t dim_;
  std::vector<float> weights_;
  std::vector<float> accumulator_;
  std::vector<float> dense_;
};

}  // namespace pmsnap::testing
