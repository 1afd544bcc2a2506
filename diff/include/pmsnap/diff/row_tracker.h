// Row tracking for embedding tables: one bit per row, set for every row a
// forward lookup or a sparse gradient touched since the last checkpoint
// (Check-N-Run 5.1: rows read in the forward pass are the rows the backward
// pass updates).
//
// CPR's prioritised policies (CPR 4.2) add one of two access records:
//   MFU: a 4-byte access counter per row, incremented by every lookup; a save
//        takes the r*N rows with the largest counts and clears theirs.
//   SSU: every `period`-th looked-up id is sampled into a non-duplicate list of
//        at most r*N rows; an id sampled into a full list replaces a random
//        entry (or is itself discarded), so frequently used rows are the
//        likeliest to stay. A save takes the list and empties it.
//
// Thread-safety: a RowTracker belongs to the training thread; the checkpointer
// takes the interval's bits (and the prioritised rows) on that thread too (at
// capture).
#pragma once

#include <cstdint>
#include <random>
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
  void Reset(std::uint64_t i) { words_[i / 64] &= ~(1ull << (i % 64)); }
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

enum class AccessRecord : std::uint8_t { kNone, kMostFrequentlyUsed, kSubSampledUsed };

// What a prioritised save took, and what the access record costs.
struct PriorityTake {
  std::vector<std::uint64_t> rows;  // ascending
  double select_seconds = 0;        // time to choose them (MFU: the top-k selection)
};

class RowTracker {
 public:
  RowTracker(std::string table, std::uint64_t rows) : table_(std::move(table)), marked_(rows) {}
  // Marks rows touched by a lookup (or sparse-gradient indices). An id out of
  // [0, rows) is kInvalidArgument naming the table and the id; nothing is
  // marked then. With an access record, every occurrence counts (MFU) or is a
  // sampling candidate (SSU).
  Status Mark(std::span<const std::int64_t> ids);
  // Marks every row (e.g. a dense update of the whole table). Access records
  // are not changed: a dense update is no lookup.
  void MarkAll() { marked_.SetAll(); }

  // Starts recording accesses for a prioritised policy. `capacity` = r*N
  // rows a save takes (>= 1). SSU samples every `ssu_period`-th id (>= 1)
  // with eviction drawn from `seed`. Replaces any earlier record.
  // kInvalidArgument (naming the table) for SSU on a table of more than 2^32
  // rows; the tracker is unchanged then.
  Status EnableAccessRecord(AccessRecord record, std::uint64_t capacity, std::uint32_t ssu_period,
                            std::uint64_t seed);
  AccessRecord access_record() const { return record_; }
  std::uint64_t priority_capacity() const { return capacity_; }
  // MFU: the (at most) capacity rows with the highest non-zero counts (ties
  // to the lower id), whose counters are cleared. SSU: the sampled list,
  // emptied. Without a record: no rows.
  PriorityTake TakePriorityRows();
  // Puts rows a lost save took back (their counts are gone; MFU gives them
  // count 1 so the next save still considers them, SSU re-inserts them
  // within capacity).
  void ReturnPriorityRows(std::span<const std::uint64_t> rows);
  // MFU counter of `row` (0 without MFU).
  std::uint32_t access_count(std::uint64_t row) const {
    return row < counters_.size() ? counters_[row] : 0;
  }
  // SSU: rows in the list now.
  std::uint64_t sampled_rows() const { return sampled_list_.size(); }
  // Bytes the access record holds in DRAM (MFU: 4 B per row; SSU: 4 B per
  // list entry plus a membership bit per row), for CPR's Table 1 comparison.
  std::uint64_t access_record_bytes() const;
  // Rows marked since the last call; starts a new interval.
  BitVector TakeInterval();
  const BitVector& marked() const { return marked_; }
  std::uint64_t rows() const { return marked_.size(); }
  const std::string& table() const { return table_; }

 private:
  void Sample(std::uint64_t row);

  std::string table_;
  BitVector marked_;
  AccessRecord record_ = AccessRecord::kNone;
  std::uint64_t capacity_ = 0;
  std::vector<std::uint32_t> counters_;        // MFU
  std::uint32_t ssu_period_ = 1;               // SSU
  std::uint64_t ssu_seen_ = 0;                 // ids offered so far
  // SSU: <= capacity_ row ids (4 bytes each, as CPR's Table 1 counts them;
  // EnableAccessRecord refuses SSU above 2^32 rows) and a membership bit per
  // row, so a sample is a bit test instead of a hash lookup.
  std::vector<std::uint32_t> sampled_list_;
  BitVector sampled_;
  std::mt19937_64 rng_;
};

}  // namespace pmsnap::diff
