// On-media structures of a pmsnap pool (FORMAT.md describes them in prose).
// Every struct here is stored in persistent memory or hashed as raw bytes:
// size and every field's offset are pinned by static_asserts (the offsets
// FORMAT.md gives), and changing any of them needs a new kFormatVersion.
// Structs hashed whole also assert that they have no padding, whose bytes
// would otherwise enter the checksum undefined.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::layout::detail {

inline constexpr char kPoolMagic[8] = {'P', 'M', 'S', 'N', 'A', 'P', 'P', 'L'};
inline constexpr std::uint64_t kChunkMagic = 0x4b4e4843534d50ull;  // "PMSCHNK"
inline constexpr std::uint64_t kSlotDataAlignment = 4096;

// Root header: immutable after creation, protected by header_checksum.
struct PoolHeader {
  char magic[8];                  // kPoolMagic, written last at creation
  std::uint32_t format_version;   // kFormatVersion
  std::uint32_t header_bytes;     // sizeof(PoolHeader)
  std::uint64_t header_checksum;  // XXH3 of the header with this field 0
  std::uint64_t model_signature;  // Manifest::Signature()
  std::uint64_t created_unix_ns;
  std::uint64_t part_bytes;
  std::uint64_t extra_state_capacity;
  std::uint64_t chunk_heap_bytes;
  std::uint64_t unit_count;
  std::uint64_t part_count;
  std::uint64_t slot_bytes;
  std::uint64_t record_bytes;
  std::uint64_t manifest_offset;  // pool offsets (PMEMoid.off)
  std::uint64_t manifest_bytes;
  std::uint64_t manifest_checksum;
  std::uint64_t slot_alloc_offset[2];  // allocation, for pmemobj
  std::uint64_t slot_data_offset[2];   // kSlotDataAlignment-aligned data start
  std::uint64_t slot_record_offset[2];
  // RankGroup (pool.h): all 0 for a pool of a single process. Pools made
  // before these fields existed hold 0 here too (reserved bytes were 0).
  std::uint64_t group_run_id;
  std::uint32_t group_rank;
  std::uint32_t group_world_size;
  std::uint64_t group_model_fingerprint;
  // The file's size at creation, so that a truncated file is reported with
  // both sizes. 0 in pools made before this field existed (the reserved
  // bytes were 0): size unknown.
  std::uint64_t file_bytes;
  // A slot stored in extents (SlotLayout::extent_bytes; format version
  // kFormatVersionSlotExtents): the extent size, and a table of 2 x n data
  // offsets (kSlotDataAlignment-aligned; slot 0's n extents, then slot 1's)
  // with its XXH3. slot_*_offset[s] then name extent 0. All 0 in a version-1
  // pool, whose slots are one piece each.
  std::uint64_t slot_extent_bytes;
  std::uint64_t slot_extent_table_offset;
  std::uint64_t slot_extent_table_checksum;
  // kGroupCreatedBesideCheckpoints: this rank's pool was created while other
  // ranks' pools already held committed epochs, so it replaces a lost pool
  // (RankGroup::created_beside_checkpoints). 0 in older pools.
  std::uint64_t group_flags;
  std::uint64_t reserved[3];
};
static_assert(std::is_standard_layout_v<PoolHeader>);
static_assert(std::has_unique_object_representations_v<PoolHeader>);  // hashed whole
static_assert(sizeof(PoolHeader) == 256);
static_assert(offsetof(PoolHeader, magic) == 0);
static_assert(offsetof(PoolHeader, format_version) == 8);
static_assert(offsetof(PoolHeader, header_bytes) == 12);
static_assert(offsetof(PoolHeader, header_checksum) == 16);
static_assert(offsetof(PoolHeader, model_signature) == 24);
static_assert(offsetof(PoolHeader, created_unix_ns) == 32);
static_assert(offsetof(PoolHeader, part_bytes) == 40);
static_assert(offsetof(PoolHeader, extra_state_capacity) == 48);
static_assert(offsetof(PoolHeader, chunk_heap_bytes) == 56);
static_assert(offsetof(PoolHeader, unit_count) == 64);
static_assert(offsetof(PoolHeader, part_count) == 72);
static_assert(offsetof(PoolHeader, slot_bytes) == 80);
static_assert(offsetof(PoolHeader, record_bytes) == 88);
static_assert(offsetof(PoolHeader, manifest_offset) == 96);
static_assert(offsetof(PoolHeader, manifest_bytes) == 104);
static_assert(offsetof(PoolHeader, manifest_checksum) == 112);
static_assert(offsetof(PoolHeader, slot_alloc_offset) == 120);
static_assert(offsetof(PoolHeader, slot_data_offset) == 136);
static_assert(offsetof(PoolHeader, slot_record_offset) == 152);
static_assert(offsetof(PoolHeader, group_run_id) == 168);
static_assert(offsetof(PoolHeader, group_rank) == 176);
static_assert(offsetof(PoolHeader, group_world_size) == 180);
static_assert(offsetof(PoolHeader, group_model_fingerprint) == 184);
static_assert(offsetof(PoolHeader, file_bytes) == 192);
static_assert(offsetof(PoolHeader, slot_extent_bytes) == 200);
static_assert(offsetof(PoolHeader, slot_extent_table_offset) == 208);
static_assert(offsetof(PoolHeader, slot_extent_table_checksum) == 216);
static_assert(offsetof(PoolHeader, group_flags) == 224);
static_assert(offsetof(PoolHeader, reserved) == 232);
inline constexpr std::uint64_t kGroupCreatedBesideCheckpoints = 1;

// Mutable list head of the chunk heap; changed only inside transactions.
struct ChunkHeapRoot {
  std::uint64_t head_offset;  // 0: empty
  std::uint64_t used_bytes;   // header + payload bytes of linked chunks
  std::uint64_t count;
  std::uint64_t reserved[5];
};
static_assert(std::is_standard_layout_v<ChunkHeapRoot>);
static_assert(sizeof(ChunkHeapRoot) == 64);
static_assert(offsetof(ChunkHeapRoot, head_offset) == 0);
static_assert(offsetof(ChunkHeapRoot, used_bytes) == 8);
static_assert(offsetof(ChunkHeapRoot, count) == 16);
static_assert(offsetof(ChunkHeapRoot, reserved) == 24);

struct PoolRoot {
  PoolHeader header;
  ChunkHeapRoot chunks;
};
static_assert(std::is_standard_layout_v<PoolRoot>);
static_assert(sizeof(PoolRoot) == 320);
static_assert(offsetof(PoolRoot, header) == 0);
static_assert(offsetof(PoolRoot, chunks) == 256);

// commit_word = epoch << 2 | SlotState; the one 8-byte store that commits.
inline constexpr std::uint64_t MakeCommitWord(std::uint64_t epoch, std::uint8_t state) {
  return (epoch << 2) | state;
}
inline constexpr std::uint64_t CommitWordEpoch(std::uint64_t word) { return word >> 2; }
inline constexpr std::uint8_t CommitWordState(std::uint64_t word) {
  return static_cast<std::uint8_t>(word & 3);
}

// Per-slot commit record, followed in PM by
//   std::uint64_t part_checksums[part_count];
//   std::byte     extra_state[extra_state_capacity];
struct SlotRecordHeader {
  std::atomic<std::uint64_t> commit_word;
  std::uint64_t iteration;
  std::uint64_t commit_time_unix_ns;
  std::uint64_t extra_bytes;
  std::uint64_t extra_checksum;
  std::uint64_t parts_checksum;   // XXH3 over part_checksums[]
  std::uint64_t record_checksum;  // over RecordChecksumInput
  std::uint64_t reserved;
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);
static_assert(std::is_standard_layout_v<SlotRecordHeader>);
static_assert(sizeof(std::atomic<std::uint64_t>) == 8);  // the commit word is a plain u64 in PM
static_assert(sizeof(SlotRecordHeader) == 64);
static_assert(offsetof(SlotRecordHeader, commit_word) == 0);
static_assert(offsetof(SlotRecordHeader, iteration) == 8);
static_assert(offsetof(SlotRecordHeader, commit_time_unix_ns) == 16);
static_assert(offsetof(SlotRecordHeader, extra_bytes) == 24);
static_assert(offsetof(SlotRecordHeader, extra_checksum) == 32);
static_assert(offsetof(SlotRecordHeader, parts_checksum) == 40);
static_assert(offsetof(SlotRecordHeader, record_checksum) == 48);
static_assert(offsetof(SlotRecordHeader, reserved) == 56);

// Not stored: record_checksum is XXH3-64 of this struct's 48 raw bytes, so
// its layout is part of the format as much as a stored struct's.
struct RecordChecksumInput {
  std::uint64_t epoch;  // the commit word's epoch, so a record cannot pass for another epoch
  std::uint64_t iteration;
  std::uint64_t commit_time_unix_ns;
  std::uint64_t extra_bytes;
  std::uint64_t extra_checksum;
  std::uint64_t parts_checksum;
};
static_assert(std::is_standard_layout_v<RecordChecksumInput>);
static_assert(std::has_unique_object_representations_v<RecordChecksumInput>);  // hashed whole
static_assert(sizeof(RecordChecksumInput) == 48);
static_assert(offsetof(RecordChecksumInput, epoch) == 0);
static_assert(offsetof(RecordChecksumInput, iteration) == 8);
static_assert(offsetof(RecordChecksumInput, commit_time_unix_ns) == 16);
static_assert(offsetof(RecordChecksumInput, extra_bytes) == 24);
static_assert(offsetof(RecordChecksumInput, extra_checksum) == 32);
static_assert(offsetof(RecordChecksumInput, parts_checksum) == 40);

// A chunk of the chunk heap; the payload follows the header.
struct ChunkHeader {
  std::uint64_t magic;        // kChunkMagic
  std::uint64_t prev_offset;  // doubly linked: O(1) unlink in a transaction
  std::uint64_t next_offset;
  std::uint64_t epoch;
  std::uint64_t tag;
  std::uint64_t bytes;            // payload bytes
  std::uint64_t header_checksum;  // over magic, epoch, tag, bytes
  std::uint64_t sealed;           // 1 once payload_checksum is valid
  std::uint64_t payload_checksum;
  std::uint64_t reserved[7];
};
static_assert(std::is_standard_layout_v<ChunkHeader>);
static_assert(sizeof(ChunkHeader) == 128);
static_assert(offsetof(ChunkHeader, magic) == 0);
static_assert(offsetof(ChunkHeader, prev_offset) == 8);
static_assert(offsetof(ChunkHeader, next_offset) == 16);
static_assert(offsetof(ChunkHeader, epoch) == 24);
static_assert(offsetof(ChunkHeader, tag) == 32);
static_assert(offsetof(ChunkHeader, bytes) == 40);
static_assert(offsetof(ChunkHeader, header_checksum) == 48);
static_assert(offsetof(ChunkHeader, sealed) == 56);
static_assert(offsetof(ChunkHeader, payload_checksum) == 64);
static_assert(offsetof(ChunkHeader, reserved) == 72);

// The checksums that protect these structs, as the format defines them.

// XXH3-64 of the whole header with header_checksum read as zero.
inline std::uint64_t HeaderChecksum(const PoolHeader& header) {
  PoolHeader copy = header;
  copy.header_checksum = 0;
  return Checksum64(&copy, sizeof(copy));
}

// XXH3-64 of RecordChecksumInput built from `record` and the epoch its
// commit word names.
inline std::uint64_t RecordChecksum(std::uint64_t epoch, const SlotRecordHeader& record) {
  const RecordChecksumInput input{epoch,
                                  record.iteration,
                                  record.commit_time_unix_ns,
                                  record.extra_bytes,
                                  record.extra_checksum,
                                  record.parts_checksum};
  return Checksum64(&input, sizeof(input));
}

// XXH3-64 of {magic, epoch, tag, bytes}: the fields fixed at allocation (the
// links change at every neighbour's allocation and free).
inline std::uint64_t ChunkHeaderChecksum(const ChunkHeader& chunk) {
  const std::uint64_t fields[4] = {chunk.magic, chunk.epoch, chunk.tag, chunk.bytes};
  return Checksum64(fields, sizeof(fields));
}

}  // namespace pmsnap::layout::detail
