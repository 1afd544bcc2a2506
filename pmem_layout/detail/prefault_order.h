// The order in which a pool's mapping is faulted in (Pool::StartPrefault):
// page-aligned file ranges, each page of the file once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::layout::detail {

// `wanted` in order, each widened to whole pages and clipped to the file,
// less the pages an earlier entry already gave; then whatever of the file no
// entry named, in file order. Together: every page of [0, file_bytes) once.
// `page` is a power of two.
inline std::vector<FileRegion> PrefaultOrder(std::span<const FileRegion> wanted,
                                             std::uint64_t file_bytes, std::uint64_t page) {
  // Both stay within [0, file_bytes]: a region past the file's end is
  // clipped, never wrapped around.
  auto page_down = [&](std::uint64_t offset) { return std::min(file_bytes, offset / page * page); };
  auto page_up = [&](std::uint64_t offset) {
    return std::min(file_bytes, (offset + page - 1) / page * page);
  };
  std::vector<FileRegion> order;
  std::vector<FileRegion> covered;  // sorted by offset, disjoint, not adjacent
  auto add = [&](std::uint64_t begin, std::uint64_t end) {
    for (const FileRegion& done : covered) {
      if (begin >= end) break;
      if (done.offset + done.bytes <= begin) continue;
      if (done.offset >= end) break;
      if (done.offset > begin) order.push_back({begin, done.offset - begin});
      begin = std::max(begin, done.offset + done.bytes);
    }
    if (begin < end) order.push_back({begin, end - begin});
  };
  auto cover = [&](std::uint64_t begin, std::uint64_t end) {
    if (begin >= end) return;
    covered.push_back({begin, end - begin});
    std::sort(covered.begin(), covered.end(),
              [](const FileRegion& a, const FileRegion& b) { return a.offset < b.offset; });
    std::vector<FileRegion> merged;
    for (const FileRegion& r : covered) {
      if (!merged.empty() && r.offset <= merged.back().offset + merged.back().bytes) {
        const std::uint64_t merged_end =
            std::max(merged.back().offset + merged.back().bytes, r.offset + r.bytes);
        merged.back().bytes = merged_end - merged.back().offset;
      } else {
        merged.push_back(r);
      }
    }
    covered = std::move(merged);
  };
  for (const FileRegion& region : wanted) {
    const std::uint64_t offset = std::min(region.offset, file_bytes);
    const std::uint64_t begin = page_down(offset);
    const std::uint64_t end = page_up(offset + std::min(region.bytes, file_bytes - offset));
    add(begin, end);
    cover(begin, end);
  }
  add(0, file_bytes);
  return order;
}

}  // namespace pmsnap::layout::detail
