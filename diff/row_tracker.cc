#include "pmsnap/diff/row_tracker.h"

#include <algorithm>
#include <bit>
#include <chrono>

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
  if (record_ == AccessRecord::kMostFrequentlyUsed) {
    for (std::int64_t id : ids) {
      std::uint32_t& c = counters_[static_cast<std::uint64_t>(id)];
      if (c != UINT32_MAX) ++c;  // saturate rather than wrap to "never used"
    }
  } else if (record_ == AccessRecord::kSubSampledUsed) {
    for (std::int64_t id : ids) {
      if (ssu_seen_++ % ssu_period_ == 0) Sample(static_cast<std::uint64_t>(id));
    }
  }
  return Status::Ok();
}

Status RowTracker::EnableAccessRecord(AccessRecord record, std::uint64_t capacity,
                                      std::uint32_t ssu_period, std::uint64_t seed) {
  if (record == AccessRecord::kSubSampledUsed && marked_.size() > (1ull << 32)) {
    return Status(StatusCode::kInvalidArgument,
                  "table '" + table_ + "': the sub-sampled used-row list keeps 4-byte row ids, "
                  "the table has " + std::to_string(marked_.size()) + " rows");
  }
  record_ = record;
  capacity_ = std::max<std::uint64_t>(1, std::min(capacity, marked_.size()));
  counters_.clear();
  sampled_list_.clear();
  sampled_ = BitVector();
  ssu_seen_ = 0;
  ssu_period_ = std::max<std::uint32_t>(1, ssu_period);
  rng_.seed(seed);
  if (record == AccessRecord::kMostFrequentlyUsed) {
    counters_.assign(marked_.size(), 0);
  } else if (record == AccessRecord::kSubSampledUsed) {
    sampled_list_.reserve(capacity_);
    sampled_ = BitVector(marked_.size());
  }
  return Status::Ok();
}

void RowTracker::Sample(std::uint64_t row) {
  if (sampled_.Test(row)) return;
  if (sampled_list_.size() < capacity_) {
    sampled_list_.push_back(static_cast<std::uint32_t>(row));
    sampled_.Set(row);
    return;
  }
  // Overflow: one of the capacity + 1 candidates is dropped at random.
  const std::uint64_t victim = std::uniform_int_distribution<std::uint64_t>(0, capacity_)(rng_);
  if (victim == capacity_) return;  // the new id itself
  sampled_.Reset(sampled_list_[victim]);
  sampled_list_[victim] = static_cast<std::uint32_t>(row);
  sampled_.Set(row);
}

PriorityTake RowTracker::TakePriorityRows() {
  PriorityTake take;
  const auto start = std::chrono::steady_clock::now();
  if (record_ == AccessRecord::kMostFrequentlyUsed) {
    std::vector<std::uint64_t> used;
    for (std::uint64_t r = 0; r < counters_.size(); ++r) {
      if (counters_[r] != 0) used.push_back(r);
    }
    auto hotter = [this](std::uint64_t a, std::uint64_t b) {
      return counters_[a] != counters_[b] ? counters_[a] > counters_[b] : a < b;
    };
    if (used.size() > capacity_) {
      std::nth_element(used.begin(), used.begin() + static_cast<std::ptrdiff_t>(capacity_),
                       used.end(), hotter);
      used.resize(capacity_);
    }
    for (std::uint64_t r : used) counters_[r] = 0;
    take.rows = std::move(used);
  } else if (record_ == AccessRecord::kSubSampledUsed) {
    take.rows.assign(sampled_list_.begin(), sampled_list_.end());
    for (std::uint32_t r : sampled_list_) sampled_.Reset(r);
    sampled_list_.clear();
  }
  std::sort(take.rows.begin(), take.rows.end());
  take.select_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return take;
}

void RowTracker::ReturnPriorityRows(std::span<const std::uint64_t> rows) {
  for (std::uint64_t r : rows) {
    if (r >= marked_.size()) continue;
    if (record_ == AccessRecord::kMostFrequentlyUsed) {
      counters_[r] = std::max<std::uint32_t>(counters_[r], 1);
    } else if (record_ == AccessRecord::kSubSampledUsed) {
      Sample(r);
    }
  }
}

std::uint64_t RowTracker::access_record_bytes() const {
  if (record_ == AccessRecord::kMostFrequentlyUsed) {
    return counters_.size() * sizeof(std::uint32_t);
  }
  if (record_ == AccessRecord::kSubSampledUsed) {
    return capacity_ * sizeof(std::uint32_t) + (sampled_.size() + 63) / 64 * 8;
  }
  return 0;
}

BitVector RowTracker::TakeInterval() {
  BitVector taken(marked_.size());
  std::swap(taken, marked_);
  return taken;
}

}  // namespace pmsnap::diff
