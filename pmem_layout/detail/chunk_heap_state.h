// What a ChunkHeap works on: the pool mapping it lives in (filled in by the
// pool's open) and its DRAM mirror of the chunk list. Internal to
// pmem_layout.
#pragma once

#include <libpmemobj.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "detail/format.h"
#include "detail/persistence.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/pmem_layout/chunk_heap.h"

namespace pmsnap::layout {

struct ChunkHeap::State {
  // Fixed at open, before any call.
  PMEMobjpool* pop = nullptr;  // null for a read-only open: nothing may be written
  bool read_only = false;
  std::byte* base = nullptr;  // the mapping: pool offsets are relative to it
  std::uint64_t file_bytes = 0;
  std::uint64_t pool_uuid_lo = 0;
  detail::ChunkHeapRoot* root = nullptr;  // list head and budget use, in PM
  std::uint64_t capacity = 0;             // the budget (PoolHeader::chunk_heap_bytes)
  std::string path;                       // for errors
  std::uint32_t small_chunk_class = 0;    // custom allocation class id (Load)
  std::string list_problem;               // set by Load if the list walk stopped early
  const detail::PmPacers* pm = nullptr;   // the pool's PM bandwidth model (Pool::Impl::pm)

  mutable Mutex mutex;  // guards `chunks` and the list in PM
  std::unordered_map<std::uint64_t, ChunkInfo> chunks PMSNAP_GUARDED_BY(mutex);  // id -> info

  template <typename T = std::byte>
  T* At(std::uint64_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }
};

namespace detail {

// File bytes a chunk heap with a budget of `budget` bytes needs (for
// Pool::RequiredBytes): the budget plus the slack of partly used runs.
std::uint64_t ChunkHeapFileBytes(std::uint64_t budget);

}  // namespace detail
}  // namespace pmsnap::layout
