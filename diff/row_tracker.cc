#include "pmsnap/diff/row_tracker.h"

#include <bit>

namespace pmsnap::diff {

void BitVector::SetAll() {
  for (auto& w : words_) w = ~0ull;
  if (bits_ % 64 != 0 && !words_.empty()) words_.back() = (1ull << (bits_ % 64)) - 1;
}

void BitVector::Clear() {
  for (auto& w : words_) w = 0;
}

std::uint64_t BitVector::Count() const {
  std::uint64_t n = 0;
  for (std::uint64_t w : words_) n += static_cast<std::uint64_t>(std::popcount(w));
  return n;
}

void BitVector::OrWith(const BitVector& other) {
  for (std::size_t i = 0; i < words_.size() && i < other.words_.size(); ++i) {
    words_[i] |= other.words_[i];
  }
}

std::vector<std::uint64_t> BitVector::SetIndices() const {
  std::vector<std::uint64_t> out;
  out.reserve(Count());
  for (std::size_t i = 0; i < words_.size(); ++i) {
    std::uint64_t w = words_[i];
    while (w != 0) {
      out.push_back(i * 64 + static_cast<std::uint64_t>(std::countr_zero(w)));
      w &= w - 1;
    }
  }
  return out;
}

Status RowTracker::Mark(std::span<const std::int64_t> ids) {
  for (std::int64_t id : ids) {
    if (id < 0 || static_cast<std::uint64_t>(id) >= marked_.size()) {
      return Status(StatusCode::kInvalidArgument, "table '" + table_ + "': row id " +
                                                      std::to_string(id) + " out of range [0, " +
                                                      std::to_string(marked_.size()) + ")");
    }
  }
  for (std::int64_t id : ids) marked_.Set(static_cast<std::uint64_t>(id));
  return Status::Ok();
}

BitVector RowTracker::TakeInterval() {
  BitVector taken(marked_.size());
  std::swap(taken, marked_);
  return taken;
}

}  // namespace pmsnap::diff
