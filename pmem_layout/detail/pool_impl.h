// Pool's private state, shared by the files that implement Pool: pool.cc
// (readers, writers, accessors), pool_open.cc (open and recovery) and
// pool_create.cc (creation). Internal to pmem_layout.
#pragma once

#include <libpmemobj.h>
#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "detail/format.h"
#include "detail/persistence.h"
#include "detail/pmdk.h"
#include "pmsnap/common/page_prefault.h"
#include "pmsnap/pmem_layout/chunk_heap.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::layout {

struct Pool::Impl {
  PMEMobjpool* pop = nullptr;  // null for a read-only open (OpenOptions::read_only)
  std::byte* base = nullptr;   // the mapping: pool offsets are relative to it
  // A read-only open's own PROT_READ mapping (unmapped here), the file's
  // identity and libpmemobj's run id when it was mapped (CheckUndisturbed).
  bool read_only = false;
  std::uint64_t read_only_bytes = 0;
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  std::uint64_t run_id_at_open = 0;
  detail::PoolRoot* root = nullptr;
  bool is_pmem = false;  // true: flushes + drain persist; false: msync
  std::unordered_map<std::string, std::uint32_t> unit_index;

  // Writer state. written[] is per part: a relaxed flag set by WritePart on
  // any thread, read by Commit after the caller joined those threads.
  std::optional<std::uint64_t> open_epoch;
  std::optional<std::uint64_t> last_committed;
  std::unique_ptr<std::atomic<std::uint8_t>[]> written;
  bool orphans_swept = false;

  // Deferred data verification (OpenOptions::defer_data_verification): the
  // slot whose data is unchecked, and which of its parts ReadPart/VerifyPart
  // have checked so far (any thread).
  std::atomic<int> unverified_slot{-1};
  std::unique_ptr<std::atomic<std::uint8_t>[]> part_verified;
  std::atomic<std::uint32_t> parts_verified{0};

  // Simulated PM bandwidth (PmBandwidth), fixed at open before anything is
  // read or written; the chunk heap points at `pm`.
  PmBandwidth pm_bandwidth;
  detail::PmPacers pm;

  // Loaded at open; thread-safe on its own (chunk_heap.h).
  std::unique_ptr<ChunkHeap> chunk_heap;

  // Background prefault of the mapping (OpenOptions::prefault_mapping).
  std::unique_ptr<PagePrefaulter> prefault;

  ~Impl() {
    // Both point into the mapping: gone before it is unmapped. The
    // prefault's thread still writes into it.
    prefault.reset();
    chunk_heap.reset();
    if (pop != nullptr) {
      detail::seam::Unmapping(pop);
      pmemobj_close(pop);
    }
    if (read_only && base != nullptr) ::munmap(base, read_only_bytes);
  }

  template <typename T = std::byte>
  T* At(std::uint64_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }
  detail::PoolHeader& header() const { return root->header; }
  detail::SlotRecordHeader& record(int slot) const {
    return *At<detail::SlotRecordHeader>(header().slot_record_offset[slot]);
  }
  // Stores slot `slot`'s commit word, the one 8-byte store that changes a
  // slot's state, and persists it.
  void PersistCommitWord(int slot, std::uint64_t epoch, SlotState state) const {
    detail::SlotRecordHeader& slot_record = record(slot);
    slot_record.commit_word.store(detail::MakeCommitWord(epoch, static_cast<std::uint8_t>(state)),
                                  std::memory_order_release);
    detail::seam::Persist(pop, &slot_record.commit_word, sizeof(slot_record.commit_word));
  }
  std::uint64_t* part_checksums(int slot) const {
    return reinterpret_cast<std::uint64_t*>(&record(slot) + 1);
  }
  std::byte* extra_state(int slot) const {
    return reinterpret_cast<std::byte*>(part_checksums(slot) + header().part_count);
  }
  // Where each slot's extents start (one for a version-1 pool; their sizes
  // are the layout's extent_used), set at open.
  std::vector<std::byte*> extent_data[2];
  std::uint64_t extent_bytes = 0;  // SlotLayout::extent_bytes
  SlotAddressing slot_addressing(int slot) const {
    return {extent_data[slot].data(), extent_data[slot].size(), extent_bytes};
  }
};

namespace detail {

// Bytes of one slot's commit record: header, part checksums, extra state.
inline std::uint64_t RecordBytes(std::uint64_t part_count, std::uint64_t extra_capacity) {
  return AlignUp(sizeof(SlotRecordHeader) + 8 * part_count + extra_capacity, 64);
}

// Appends `message` to `into` and hands it to the warning sink
// (SetWarningSink). Any thread.
void Warn(std::vector<std::string>* into, const std::string& message);

std::uint64_t NowUnixNs();

// A failed operation on a pool file: `what` names the file and the step,
// `figures` (optional) what the file system has left, `cause` is the OS's
// or libpmemobj's own text; the code follows errno (ClassifyPoolOsError).
Status PoolFileError(int err, const std::string& what, const std::string& cause,
                     const std::string& figures = "");

// Holds the background prefault back while the pool is read in bulk (a
// restore, a verification): those reads are what the caller waits for, and
// on a machine with few cores the prefault would take CPU from them (a
// 1 GiB restore on 2 vCPUs: 218 -> 306 ms).
class PrefaultPause {
 public:
  explicit PrefaultPause(PagePrefaulter* prefault) : prefault_(prefault) {
    if (prefault_ != nullptr) prefault_->Pause();
  }
  ~PrefaultPause() {
    if (prefault_ != nullptr) prefault_->Resume();
  }
  PrefaultPause(const PrefaultPause&) = delete;
  PrefaultPause& operator=(const PrefaultPause&) = delete;

 private:
  PagePrefaulter* prefault_;
};

}  // namespace detail
}  // namespace pmsnap::layout
