// Rewrites the checksums of a pool image after a fuzzer changed it, so that
// mutations get past the checksums and reach the checks behind them (bounds,
// layout, chunk list). Mirrors the definitions of pmem_layout/FORMAT.md;
// reads every field with bounds checks, so any image is safe to reseal.
//
// Thread-safety: pure function over the caller's buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace pmsnap::fuzz {

enum ResealFlags : unsigned {
  // Manifest checksum and the header's model signature (if it parses).
  kResealManifest = 1u << 0,
  // Unit count, part count, slot and record bytes recomputed from the
  // manifest (if it parses, validates and its slots fit the image).
  kResealLayout = 1u << 1,
  // Every part checksum of both slots (needs a layout as above).
  kResealParts = 1u << 2,
  // Part-table, extra-state and record checksums of both commit records.
  kResealRecords = 1u << 3,
  // Header and payload checksums of every chunk on the list.
  kResealChunks = 1u << 4,
  // The header checksum, after everything above.
  kResealHeader = 1u << 5,
};

// `image` is a whole pool file; `root_offset` where its PoolRoot lies
// (Pool::regions().header.offset of the pool it was copied from).
void ResealPool(std::span<std::byte> image, std::uint64_t root_offset, unsigned flags);

}  // namespace pmsnap::fuzz
