// RowTracker (see row_tracker.h).
#include "row_tracker.h"

#include <algorithm>
#include <bit>

namespace pmsnap::python {

RowTracker::RowTracker(std::uint64_t rows) : rows_(rows), words_((rows + 63) / 64, 0) {}

void RowTracker::MarkOne(std::int64_t id) {
  if (id < 0 || static_cast<std::uint64_t>(id) >= rows_) {
    ++out_of_range_;
    return;
  }
  const auto row = static_cast<std::uint64_t>(id);
  std::uint64_t& word = words_[row / 64];
  const std::uint64_t bit = std::uint64_t{1} << (row % 64);
  touched_ += (word & bit) == 0 ? 1 : 0;
  word |= bit;
}

void RowTracker::Mark(const std::int64_t* ids, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) MarkOne(ids[i]);
}

void RowTracker::Mark(const std::int32_t* ids, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) MarkOne(ids[i]);
}

bool RowTracker::IsTouched(std::int64_t id) const {
  if (id < 0 || static_cast<std::uint64_t>(id) >= rows_) return false;
  const auto row = static_cast<std::uint64_t>(id);
  return (words_[row / 64] >> (row % 64)) & 1;
}

std::vector<std::int64_t> RowTracker::Touched() const {
  std::vector<std::int64_t> out;
  out.reserve(touched_);
  for (std::size_t w = 0; w < words_.size(); ++w) {
    std::uint64_t word = words_[w];
    while (word != 0) {
      const int bit = std::countr_zero(word);
      out.push_back(static_cast<std::int64_t>(w * 64 + static_cast<std::size_t>(bit)));
      word &= word - 1;
    }
  }
  return out;
}

void RowTracker::Clear() {
  std::fill(words_.begin(), words_.end(), 0);
  touched_ = 0;
  out_of_range_ = 0;
}

}  // namespace pmsnap::python
