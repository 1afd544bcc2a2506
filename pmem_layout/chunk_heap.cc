// The chunk heap of a pool (chunk_heap.h): a doubly linked list of pmemobj
// allocations with a DRAM mirror, charged against a budget.
#include "pmsnap/pmem_layout/chunk_heap.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "detail/chunk_heap_state.h"
#include "detail/persistence.h"
#include "detail/pmdk.h"

namespace pmsnap::layout {
namespace {

using detail::ChunkHeader;

// Chunk allocations up to kSmallChunkMax bytes come from one custom
// allocation class of 4 KiB units in 256 KiB runs (at least four per run, so
// runs stay >= 80% used); larger ones are libpmemobj "huge" allocations of
// whole 256 KiB chunks. Without this, libpmemobj's default classes each keep
// their own multi-megabyte runs and a heap of mixed sizes runs dry early.
constexpr std::uint64_t kChunkUnitBytes = 4096;
constexpr std::uint64_t kChunkRunUnits = 64;
constexpr std::uint64_t kSmallChunkMax = 16 * kChunkUnitBytes;

// Heap bytes an allocation of `bytes` really occupies, as charged against the
// chunk-heap budget.
std::uint64_t ChargedBytes(std::uint64_t bytes) {
  const std::uint64_t with_header = bytes + detail::kAllocationHeaderBytes;
  return with_header <= kSmallChunkMax ? detail::AlignUp(with_header, kChunkUnitBytes)
                                       : detail::AlignUp(with_header, detail::kPmemobjChunkBytes);
}

std::string NoChunk(const std::string& path, std::uint64_t chunk_id) {
  return "pool '" + path + "': no chunk with id " + std::to_string(chunk_id);
}

}  // namespace

namespace detail {

std::uint64_t ChunkHeapFileBytes(std::uint64_t budget) {
  if (budget == 0) return 0;
  // The budget is charged in real heap bytes (ChargedBytes); on top: runs of
  // small chunks at >= 80% use, and one partly filled run per arena.
  return AlignUp(budget + budget / 4 + (8ull << 20), kPmemobjChunkBytes);
}

}  // namespace detail

ChunkHeap::ChunkHeap(std::unique_ptr<State> state) : state_(std::move(state)) {}
ChunkHeap::~ChunkHeap() = default;

Result<std::unique_ptr<ChunkHeap>> ChunkHeap::Load(std::unique_ptr<State> state) {
  State& s = *state;
  if (!s.read_only) {  // allocations only
    pobj_alloc_class_desc small_chunks{};
    small_chunks.unit_size = kChunkUnitBytes;
    small_chunks.units_per_block = kChunkRunUnits;
    small_chunks.header_type = POBJ_HEADER_COMPACT;
    if (pmemobj_ctl_set(s.pop, "heap.alloc_class.new.desc", &small_chunks) != 0) {
      return Status(StatusCode::kIOError,
                    detail::PmdkError(("pool '" + s.path +
                                       "': cannot register the chunk allocation class").c_str()));
    }
    s.small_chunk_class = small_chunks.class_id;
  }

  auto in_bounds = [&](std::uint64_t offset, std::uint64_t bytes) {
    return offset >= sizeof(detail::PoolRoot) && offset <= s.file_bytes &&
           bytes <= s.file_bytes - offset;
  };
  std::uint64_t offset = s.root->head_offset;
  std::uint64_t prev = 0;
  // No other thread has the heap yet; the lock is for the analysis.
  MutexLock lock(s.mutex);
  while (offset != 0) {
    // More chunks than the root counts: a cycle, or a link into garbage.
    // A misaligned offset cannot be a chunk (libpmemobj aligns allocations);
    // reading a header there would be undefined behaviour.
    const bool header_fits = offset % alignof(ChunkHeader) == 0 &&
                             in_bounds(offset, sizeof(ChunkHeader)) &&
                             s.chunks.size() <= s.root->count;
    const ChunkHeader* chunk = header_fits ? s.At<ChunkHeader>(offset) : nullptr;
    if (chunk == nullptr || chunk->magic != detail::kChunkMagic || chunk->prev_offset != prev ||
        !in_bounds(offset + sizeof(ChunkHeader), chunk->bytes)) {
      s.list_problem =
          "pool '" + s.path + "': chunk list is damaged at offset " + std::to_string(offset);
      break;
    }
    s.chunks.emplace(offset,
                     ChunkInfo{offset, chunk->epoch, chunk->tag, chunk->bytes, chunk->sealed == 1});
    prev = offset;
    offset = chunk->next_offset;
  }
  return std::unique_ptr<ChunkHeap>(new ChunkHeap(std::move(state)));
}

const std::string& ChunkHeap::list_problem() const { return state_->list_problem; }

std::uint64_t ChunkHeap::ChargedBytesFor(std::uint64_t payload_bytes) {
  return ChargedBytes(sizeof(ChunkHeader) + payload_bytes);
}

Status ChunkHeap::RefuseReadOnly(const char* what) const {
  if (!state_->read_only) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                "pool '" + state_->path + "' is open read-only: cannot " + what + " a chunk");
}

Result<ChunkInfo> ChunkHeap::Alloc(std::uint64_t bytes, std::uint64_t epoch, std::uint64_t tag) {
  State& s = *state_;
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("allocate"));
  MutexLock lock(s.mutex);
  const std::uint64_t needed = ChargedBytesFor(bytes);
  const std::uint64_t used = s.root->used_bytes;
  const std::uint64_t capacity = s.capacity;
  if (used > capacity || needed > capacity - used) {
    return Status(StatusCode::kNoSpace, "pool '" + s.path + "': chunk heap full: chunk needs " +
                                            std::to_string(needed) + " bytes, " +
                                            std::to_string(capacity - std::min(used, capacity)) +
                                            " of " + std::to_string(capacity) + " free");
  }
  std::uint64_t offset = 0;
  Status status = detail::RunTransaction(s.pop, "allocating a chunk", [&]() -> int {
    auto& heap = *s.root;
    if (pmemobj_tx_add_range_direct(&heap, sizeof(heap)) != 0) return errno ? errno : EIO;
    // Small chunks: our class. Large ones ask for whole 256 KiB chunks, which
    // libpmemobj serves as huge allocations (its default run classes would
    // otherwise take mid-size requests into runs of their own).
    const bool small =
        sizeof(ChunkHeader) + bytes + detail::kAllocationHeaderBytes <= kSmallChunkMax;
    const std::uint64_t size =
        small ? sizeof(ChunkHeader) + bytes : needed - detail::kAllocationHeaderBytes;
    const std::uint64_t flags = small ? POBJ_CLASS_ID(s.small_chunk_class) : 0;
    PMEMoid oid = pmemobj_tx_xalloc(size, 0, flags | POBJ_XALLOC_NO_ABORT);
    if (OID_IS_NULL(oid)) return ENOMEM;
    offset = oid.off;
    auto& chunk = *s.At<ChunkHeader>(offset);
    // Fresh allocation: undo not needed for its contents.
    std::memset(&chunk, 0, sizeof(chunk));
    chunk.magic = detail::kChunkMagic;
    chunk.next_offset = heap.head_offset;
    chunk.epoch = epoch;
    chunk.tag = tag;
    chunk.bytes = bytes;
    chunk.header_checksum = detail::ChunkHeaderChecksum(chunk);
    detail::seam::Persist(s.pop, &chunk, sizeof(chunk));
    if (heap.head_offset != 0) {
      auto& old_head = *s.At<ChunkHeader>(heap.head_offset);
      if (pmemobj_tx_add_range_direct(&old_head.prev_offset, 8) != 0) return errno ? errno : EIO;
      old_head.prev_offset = offset;
    }
    heap.head_offset = offset;
    heap.used_bytes += needed;
    heap.count += 1;
    return 0;
  });
  if (!status.ok()) {
    std::string message =
        "pool '" + s.path + "': cannot allocate a chunk of " + std::to_string(bytes) + " bytes";
    if (status.code() == StatusCode::kNoSpace) {
      // Within the budget, yet libpmemobj found no free range this large:
      // the figures show it is fragmentation, not a full heap.
      message += " (" + std::to_string(needed) + " bytes of heap; the chunk heap has " +
                 std::to_string(capacity - used) + " of " + std::to_string(capacity) +
                 " bytes free, but not in one piece)";
    }
    return Status(status.code(), message + ": " + status.message());
  }
  ChunkInfo info{offset, epoch, tag, bytes, false};
  s.chunks.emplace(offset, info);
  return info;
}

Result<std::span<std::byte>> ChunkHeap::Payload(std::uint64_t chunk_id) {
  State& s = *state_;
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("write"));
  MutexLock lock(s.mutex);
  auto it = s.chunks.find(chunk_id);
  if (it == s.chunks.end()) return Status(StatusCode::kNotFound, NoChunk(s.path, chunk_id));
  if (it->second.sealed) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool '" + s.path + "': chunk " + std::to_string(chunk_id) + " is sealed");
  }
  return std::span<std::byte>(s.At(chunk_id + sizeof(ChunkHeader)), it->second.bytes);
}

Status ChunkHeap::Seal(std::uint64_t chunk_id) {
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, Payload(chunk_id));
  State& s = *state_;
  // The encoder wrote the payload before Seal: its PM time is charged from
  // here (a modelled rate, not the DRAM copy, is what it would have waited).
  const auto started = detail::seam::PaceStart(s.pm->write);
  detail::seam::Persist(s.pop, payload.data(), payload.size());
  detail::seam::PaceWrite(*s.pm, payload.size(), started);
  auto& chunk = *s.At<ChunkHeader>(chunk_id);
  chunk.payload_checksum = Checksum64(payload.data(), payload.size());
  detail::seam::Persist(s.pop, &chunk.payload_checksum, sizeof(chunk.payload_checksum));
  // Only after the checksum is durable: a sealed chunk always verifies.
  chunk.sealed = 1;
  detail::seam::Persist(s.pop, &chunk.sealed, sizeof(chunk.sealed));
  MutexLock lock(s.mutex);
  s.chunks[chunk_id].sealed = true;
  return Status::Ok();
}

Result<std::span<const std::byte>> ChunkHeap::Read(std::uint64_t chunk_id) const {
  const State& s = *state_;
  {
    MutexLock lock(s.mutex);
    auto it = s.chunks.find(chunk_id);
    if (it == s.chunks.end()) return Status(StatusCode::kNotFound, NoChunk(s.path, chunk_id));
    if (!it->second.sealed) {
      return Status(StatusCode::kFailedPrecondition,
                    "pool '" + s.path + "': chunk " + std::to_string(chunk_id) +
                        " was never sealed (its writer did not finish)");
    }
  }
  const auto& chunk = *s.At<ChunkHeader>(chunk_id);
  const std::string where = "pool '" + s.path + "': chunk " + std::to_string(chunk_id) +
                            " (epoch " + std::to_string(chunk.epoch) + ", tag " +
                            std::to_string(chunk.tag) + ")";
  if (detail::ChunkHeaderChecksum(chunk) != chunk.header_checksum) {
    return Status(StatusCode::kCorruption, where + ": chunk header checksum mismatch");
  }
  std::span<const std::byte> payload(s.At(chunk_id + sizeof(ChunkHeader)), chunk.bytes);
  // The checksum reads the whole payload from PM; the caller reads it again
  // (from the cache, for chunks this size), so one read is charged.
  const auto started = detail::seam::PaceStart(s.pm->read);
  const std::uint64_t payload_checksum = Checksum64(payload.data(), payload.size());
  detail::seam::PaceRead(*s.pm, payload.size(), started);
  if (payload_checksum != chunk.payload_checksum) {
    return Status(StatusCode::kCorruption, where + ": payload checksum mismatch");
  }
  return payload;
}

Status ChunkHeap::Free(std::uint64_t chunk_id) {
  State& s = *state_;
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("free"));
  MutexLock lock(s.mutex);
  if (s.chunks.find(chunk_id) == s.chunks.end()) {
    return Status(StatusCode::kNotFound, NoChunk(s.path, chunk_id));
  }
  // A damaged list ends the open's walk early, and the last chunk it kept
  // may point on to anything: only a chunk the walk (or Alloc) kept is
  // written, never whatever bytes a damaged pointer names.
  const std::uint64_t next_offset = s.At<ChunkHeader>(chunk_id)->next_offset;
  const bool next_is_kept = next_offset != 0 && s.chunks.count(next_offset) != 0;
  Status status = detail::RunTransaction(s.pop, "freeing a chunk", [&]() -> int {
    auto& heap = *s.root;
    auto& chunk = *s.At<ChunkHeader>(chunk_id);
    if (pmemobj_tx_add_range_direct(&heap, sizeof(heap)) != 0) return errno ? errno : EIO;
    if (chunk.prev_offset != 0) {
      auto& prev = *s.At<ChunkHeader>(chunk.prev_offset);
      if (pmemobj_tx_add_range_direct(&prev.next_offset, 8) != 0) return errno ? errno : EIO;
      prev.next_offset = chunk.next_offset;
    } else {
      heap.head_offset = chunk.next_offset;
    }
    if (next_is_kept) {
      auto& next = *s.At<ChunkHeader>(chunk.next_offset);
      if (pmemobj_tx_add_range_direct(&next.prev_offset, 8) != 0) return errno ? errno : EIO;
      next.prev_offset = chunk.prev_offset;
    }
    heap.used_bytes -= std::min(heap.used_bytes, ChunkHeap::ChargedBytesFor(chunk.bytes));
    heap.count -= std::min<std::uint64_t>(heap.count, 1);
    return pmemobj_tx_free(PMEMoid{s.pool_uuid_lo, chunk_id});
  });
  if (!status.ok()) {
    return Status(status.code(), "pool '" + s.path + "': cannot free chunk " +
                                     std::to_string(chunk_id) + ": " + status.message());
  }
  s.chunks.erase(chunk_id);
  return Status::Ok();
}

Status ChunkHeap::FreeNewerThan(std::uint64_t committed_epoch) {
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("free"));
  std::vector<std::uint64_t> orphans;
  {
    MutexLock lock(state_->mutex);
    for (const auto& [id, info] : state_->chunks) {
      if (info.epoch > committed_epoch) orphans.push_back(id);
    }
  }
  for (std::uint64_t id : orphans) PMSNAP_RETURN_IF_ERROR(Free(id));
  return Status::Ok();
}

std::vector<ChunkInfo> ChunkHeap::List() const {
  MutexLock lock(state_->mutex);
  std::vector<ChunkInfo> out;
  out.reserve(state_->chunks.size());
  for (const auto& [id, info] : state_->chunks) out.push_back(info);
  std::sort(out.begin(), out.end(),
            [](const ChunkInfo& a, const ChunkInfo& b) { return a.id < b.id; });
  return out;
}

std::uint64_t ChunkHeap::used_bytes() const {
  MutexLock lock(state_->mutex);
  return state_->root->used_bytes;
}

std::uint64_t ChunkHeap::capacity_bytes() const { return state_->capacity; }

std::vector<std::string> ChunkHeap::Verify(bool deep) const {
  std::vector<std::string> problems;
  if (deep) {
    for (const ChunkInfo& chunk : List()) {
      if (!chunk.sealed) continue;
      Result<std::span<const std::byte>> payload = Read(chunk.id);
      if (!payload.ok()) problems.push_back(payload.status().message());
    }
  }
  if (!state_->list_problem.empty()) problems.push_back(state_->list_problem);
  return problems;
}

}  // namespace pmsnap::layout
