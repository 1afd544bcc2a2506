// Row tracking for embedding tables: one bit per row, set for every row a
// forward lookup or a sparse gradient touched since the last checkpoint
// (Check-N-Run 5.1: rows read in the forward pass are the rows the backward
// pass updates).
//
// Thread-safety: a RowTracker belongs to the training thread; the checkpointer
// takes the interval's bits on that thread too (at capture).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::diff {

class BitVector {
 public:
  explicit BitVector(std::uint64_t bits = 0) : bits_(bits), words_((bits + 63) / 64, 0) {}
  std::uint64_t size() const { return bits_; }
  void Set(std::uint64_t i) { words_[i / 64] |= 1ull << (i % 64); }
  bool Test(std::uint64_t i) const { return (words_[i / 64] >> (i % 64)) & 1; }
  void SetAll();
  void Clear();
  std::uint64_t Count() const;
  void OrWith(const BitVector& other);
  // Indices of set bits, ascending.
  std::vector<std::uint64_t> SetIndices() const;

 private:
  std::uint64_t bits_;
  std::vector<std::uint64_t> words_;
};

class RowTracker {
 public:
  RowTracker(std::string table, std::uint64_t rows) : table_(std::move(table)), marked_(rows) {}
  // Marks rows touched by a lookup (or sparse-gradient indices). An id out of
  // [0, rows) is kInvalidArgument naming the table and the id; nothing is
  // marked then.
  Status Mark(std::span<const std::int64_t> ids);
  // Marks every row (e.g. a dense update of the whole table).
  void MarkAll() { marked_.SetAll(); }
  // Rows marked since the last call; starts a new interval.
  BitVector TakeInterval();
  const BitVector& marked() const { return marked_; }
  std::uint64_t rows() const { return marked_.size(); }
  const std::string& table() const { return table_; }

 private:
  std::string table_;
  BitVector marked_;
};

}  // namespace pmsnap::diff
