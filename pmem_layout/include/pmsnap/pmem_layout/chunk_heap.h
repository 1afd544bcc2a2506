// ChunkHeap: the variable-size chunks of a pool (the payloads of encoded
// units: differential, incremental and quantized embedding checkpoints).
// Each chunk carries the epoch that made it and a caller's tag; a chunk of an
// epoch that never committed is freed by the pool at the first BeginEpoch
// after open. Format: FORMAT.md, "Chunk heap"; overview:
// docs/ARCHITECTURE.md, "Embedding tables: diff/ and the chunk heap".
//
// A ChunkHeap belongs to its Pool (Pool::chunk_heap()) and lives as long as
// it; it is never created on its own.
//
// Life of a chunk: Alloc (linked into the pool in one pmemobj transaction)
// -> Payload, written by its one writer -> Seal (payload persisted, its
// checksum stored: the chunk becomes readable) -> Read any number of times
// -> Free (unlinked and freed in one transaction). A crash at any point
// leaves the list intact: a chunk is either linked with a valid header or
// not there at all; an unsealed chunk is listed but not readable.
//
// Thread-safety: every method may be called from any threads at once, also
// beside the pool's slot writers (diff::EmbeddingCheckpointer encodes
// different tables on different workers at once and relies on this). One
// mutex guards the DRAM mirror of the list and the list in PM: Alloc and
// Free hold it across their pmemobj transaction; Seal persists and hashes
// the payload, and Read verifies it, outside it. Left to the caller: one
// writer per chunk (Payload..Seal), and no Free of a chunk another thread
// still writes, seals or reads (its spans then dangle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::layout {

struct ChunkInfo {
  std::uint64_t id = 0;  // stable handle: the chunk's offset in the pool
  std::uint64_t epoch = 0;
  std::uint64_t tag = 0;  // caller's meaning (table id, policy, ...)
  std::uint64_t bytes = 0;
  bool sealed = false;
};

class ChunkHeap {
 public:
  ~ChunkHeap();
  ChunkHeap(const ChunkHeap&) = delete;
  ChunkHeap& operator=(const ChunkHeap&) = delete;

  // Heap bytes a chunk of `payload_bytes` is charged against the budget:
  // its header and libpmemobj's rounding included (4 KiB units up to
  // 64 KiB, whole 256 KiB chunks above). Pure; for planning what fits.
  static std::uint64_t ChargedBytesFor(std::uint64_t payload_bytes);
  // Allocates and links an unsealed chunk of `bytes` payload bytes for
  // `epoch`. kNoSpace when the budget (capacity_bytes) cannot hold it, with
  // needed and free bytes; also when the budget has room but libpmemobj
  // finds no free range that large (a fragmented heap: the message gives
  // the budget's free bytes). kIOError for another libpmemobj failure. A
  // failed allocation changes nothing in the pool. Errors name the pool.
  Result<ChunkInfo> Alloc(std::uint64_t bytes, std::uint64_t epoch, std::uint64_t tag);
  // The writable payload of an unsealed chunk, valid until Free. kNotFound
  // for an unknown id, kFailedPrecondition for a sealed chunk.
  Result<std::span<std::byte>> Payload(std::uint64_t chunk_id);
  // Persists the payload, then stores and persists its checksum and the
  // sealed mark: the chunk becomes readable. Errors as Payload.
  Status Seal(std::uint64_t chunk_id);
  // The payload of a sealed chunk after checking the header's and the
  // payload's checksums (reads every byte). Valid until Free of the chunk
  // or the pool's destruction. kNotFound for an unknown id,
  // kFailedPrecondition for an unsealed one, kCorruption naming the chunk,
  // its epoch and tag on a checksum mismatch.
  Result<std::span<const std::byte>> Read(std::uint64_t chunk_id) const;
  // Unlinks and frees a chunk in one transaction, sealed or not. kNotFound
  // for an unknown id; on kIOError the chunk stays.
  Status Free(std::uint64_t chunk_id);
  // Every chunk in the list, by id (pool offset).
  std::vector<ChunkInfo> List() const;
  // Heap bytes the chunks take, each rounded up to what libpmemobj really
  // allocates for it: what the budget is charged.
  std::uint64_t used_bytes() const;
  // The budget set at creation (PoolOptions::chunk_heap_bytes); 0 for a
  // pool without a chunk heap, where every Alloc fails.
  std::uint64_t capacity_bytes() const;
  // Problems of the heap: a list walk that stopped at a damaged chunk at
  // open, and with `deep` every sealed chunk that does not Read. Empty:
  // consistent.
  std::vector<std::string> Verify(bool deep) const;

 private:
  friend class Pool;
  struct State;  // the mapping and the DRAM mirror: detail/chunk_heap_state.h
  // kFailedPrecondition naming the pool when it was opened read-only
  // (OpenOptions::read_only) and `what` would change a chunk.
  Status RefuseReadOnly(const char* what) const;
  explicit ChunkHeap(std::unique_ptr<State> state);
  // Registers the chunk allocation class (allocation classes are not
  // persistent) and mirrors the list in DRAM. A damaged list ends the walk
  // early, and `list_problem` says where, which Verify reports and the pool
  // warns about; only failing to register the class is an error.
  static Result<std::unique_ptr<ChunkHeap>> Load(std::unique_ptr<State> state);
  const std::string& list_problem() const;
  // Frees every chunk of an epoch after `committed_epoch`: chunks of epochs
  // that never committed.
  Status FreeNewerThan(std::uint64_t committed_epoch);

  std::unique_ptr<State> state_;
};

}  // namespace pmsnap::layout
