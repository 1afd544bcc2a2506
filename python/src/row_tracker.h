// RowTracker: which rows of one embedding table were touched, as a bit vector.
//
// The Python embedding hooks (pmsnap/embedding.py) hand every lookup's index
// tensor to Mark; differential and incremental checkpoint policies read the
// touched set (Touched) and clear it once a checkpoint has taken the rows.
// Ids outside [0, rows) are counted (out_of_range) and otherwise ignored:
// torch raises for them itself, and a tracker must never write out of bounds.
//
// Thread-safety: not thread-safe; one training thread marks and reads. The
// binding calls Mark with the GIL released, so a tracker must not be shared
// between Python threads that step concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pmsnap::python {

class RowTracker {
 public:
  explicit RowTracker(std::uint64_t rows);

  // Marks ids[0..count) (int64 or int32 elements).
  void Mark(const std::int64_t* ids, std::size_t count);
  void Mark(const std::int32_t* ids, std::size_t count);
  // Marks one row id.
  void MarkOne(std::int64_t id);

  bool IsTouched(std::int64_t id) const;
  // Touched row ids in increasing order.
  std::vector<std::int64_t> Touched() const;
  // Number of touched rows (kept up to date by Mark, O(1)).
  std::uint64_t touched_count() const { return touched_; }
  std::uint64_t rows() const { return rows_; }
  std::uint64_t out_of_range() const { return out_of_range_; }
  // The bit vector itself: bit i of word i / 64 is row i.
  const std::vector<std::uint64_t>& words() const { return words_; }
  void Clear();

 private:
  std::uint64_t rows_;
  std::vector<std::uint64_t> words_;
  std::uint64_t touched_ = 0;
  std::uint64_t out_of_range_ = 0;
};

}  // namespace pmsnap::python
