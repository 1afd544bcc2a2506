// Pool: one pmsnap checkpoint file (a libpmemobj pool) with two preallocated
// slots, a per-slot commit record and a chunk heap. Format: FORMAT.md;
// overview: docs/ARCHITECTURE.md, "The pool file".
//
// Writer protocol (one epoch in flight at a time):
//   BeginEpoch(iteration) -> WritePart / WriteTensor (or PartDestination +
//   SealPart) from any threads, any order, each part exactly once ->
//   Commit(extra_state).
// Commit persists the part checksums and the record, then publishes the
// epoch with one 8-byte atomic store. A crash at any point leaves a pool that
// opens to the last committed epoch, bit-exact.
//
// Reader: Latest() is the newest COMPLETE slot whose record and (on open, by
// default) data checksums verify; a corrupt newest slot falls back to the
// older one with a warning (see warnings()).
//
// Thread-safety:
//  - Slot writers: WritePart, WriteTensor, PartDestination and SealPart may
//    run concurrently on any threads for different parts, between
//    BeginEpoch and Commit/Abandon (which must not overlap them).
//  - Slot readers: ReadPart, VerifyPart, CopyPart and PrefaultPart may run
//    concurrently for different parts.
//  - Chunk heap: chunk_heap() and every ChunkHeap call may be used from any
//    threads at once, also beside the slot writers (contract in
//    chunk_heap.h).
//  - prefault_progress and WaitForPrefault: any thread; so are the
//    accessors of what is fixed at open (path, manifest, layout, options,
//    file_bytes, FindUnit, signature, format_version, created_unix_ns).
//  - Everything else (BeginEpoch, Commit, Abandon, Latest, Slot, slot_info,
//    RejectLatest, Verify, ...) one call at a time, not beside the calls
//    above. The Engine calls BeginEpoch on the training thread and Commit or
//    Abandon on whichever thread finishes the epoch (a worker or the
//    training thread), never at once.
// Read-only spans stay valid until the Pool is destroyed; a slot's spans
// change content once that slot is rewritten.
//
// Prefault (PoolOptions / OpenOptions::prefault_mapping, on by default):
// after Create and Open return, one background thread of the Pool faults
// its whole file mapping in for writing, so that the first epochs' writers
// do not take one page fault per 4 KiB (on some VMs ~20 us each: a fresh
// pool was written at 0.2-0.7 GB/s instead of ~15 GB/s). See
// OpenOptions::prefault_mapping for the contract.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pmsnap/common/page_prefault.h"
#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/chunk_heap.h"
#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::layout {

// Version 1: each slot one piece. Version 2 (written only for slots stored
// in extents, PoolOptions::slot_extent_bytes): the same plus an extent
// table. This build reads both; builds before extents refuse version 2.
inline constexpr std::uint32_t kFormatVersion = 1;
inline constexpr std::uint32_t kFormatVersionSlotExtents = 2;
// libpmemobj allocates at most PMEMOBJ_MAX_ALLOC_SIZE (just under 16 GiB,
// one zone) in one piece: a larger slot is split into extents. Two default
// extents fill a zone but for 1 GiB, which the small structures use.
inline constexpr std::uint64_t kMaxSlotExtentBytes = 15ull << 30;
inline constexpr std::uint64_t kDefaultSlotExtentBytes = 7680ull << 20;
inline constexpr char kPoolLayoutName[] = "pmsnap";

// Which rank of which multi-rank run a pool belongs to (docs/ARCHITECTURE.md,
// "Many ranks"). Stored in the header at creation; world_size 0 means a pool
// of a single process. run_id is drawn once per run and shared by every
// rank's pool; model_fingerprint identifies the whole model (every rank's
// units, before sharding), where the manifest's signature covers only the
// units this rank writes.
struct RankGroup {
  std::uint64_t run_id = 0;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::uint64_t model_fingerprint = 0;
  // Created while other ranks' pools already held committed epochs: the
  // pool replaces a lost one, so its lack of a checkpoint is a loss, not a
  // sign that the run never committed one (EpochAgreement::AgreeOnRestore).
  bool created_beside_checkpoints = false;
  bool in_group() const { return world_size != 0; }
  bool operator==(const RankGroup&) const = default;
};

// A persistent-memory bandwidth model ("simulated PM"). Pools are emulated in
// DRAM (/dev/shm) at 10-20 GB/s; real PM is slower (Optane PMem: ~2.3 GB/s
// write and ~6.6 GB/s read per DIMM, ~13.9 / 39.4 GB/s for six interleaved
// DIMMs; a CXL Gen5 x8 expander ~32 GB/s). With a rate set, the pool's data
// path is held to it like the simulated device's link
// (pmsnap/common/bandwidth_pacer.h): every durable store of part or chunk
// data, and of the extra state, reserves bytes / write rate on one channel
// per pool, and every bulk read (ReadPart, VerifyPart, CopyPart, deep
// checks, ChunkHeap::Read) bytes / read rate on another; callers return
// when their reservation has elapsed, so concurrent workers share the rate.
// Small metadata stores (checksums, commit words, chunk headers) are not
// charged. 0 leaves that direction at the machine's speed; where a value is
// 0 the environment variables PMSNAP_PM_WRITE_GBPS / PMSNAP_PM_READ_GBPS
// (GB/s, 1e9 B/s) supply it. Unset, the data path pays one well-predicted
// null test per part. Not stored in the pool: it applies at every open.
struct PmBandwidth {
  double write_gbps = 0;
  double read_gbps = 0;
  bool simulated() const { return write_gbps > 0 || read_gbps > 0; }
  // "" when nothing is modelled, else e.g.
  // "simulated PM (2.3 GB/s write, 6.6 GB/s read)".
  std::string Label() const;
};

// `requested` with every 0 filled from PMSNAP_PM_WRITE_GBPS /
// PMSNAP_PM_READ_GBPS where those are set. kInvalidArgument naming the
// variable when one is not a positive number; negative option values too.
Result<PmBandwidth> ResolvePmBandwidth(const PmBandwidth& requested);

struct PoolOptions {
  // Largest piece of a tensor copied, persisted and checksummed as one part.
  std::uint64_t part_bytes = 4ull << 20;
  // Capacity of the user's extra-state blob per slot (data-loader position,
  // RNG state, LR scheduler...).
  std::uint64_t extra_state_capacity = 64ull << 10;
  // Bytes reserved for variable-size chunks (differential / quantized
  // payloads). 0 for a pool without a chunk heap.
  std::uint64_t chunk_heap_bytes = 0;
  // Refuse to create when the file system has less free space than needed.
  bool check_free_space = true;
  // Fault the new pool's mapping in on a background thread, and how (see
  // OpenOptions::prefault_mapping). Not stored in the pool.
  bool prefault_mapping = true;
  PrefaultMethod prefault_method = PrefaultMethod::kAuto;
  // The rank group this pool belongs to (stored; read back by Open).
  RankGroup group;
  // Simulated PM bandwidth (PmBandwidth). Not stored in the pool.
  PmBandwidth pm_bandwidth;
  // Largest piece of a slot stored as one allocation: a larger slot is split
  // into extents of this many bytes, or of its largest tensor's where that
  // is larger (no tensor crosses an extent; one over kMaxSlotExtentBytes is
  // refused). A multiple of 4096, at most kMaxSlotExtentBytes; smaller
  // values are for tests. Stored in the pool.
  std::uint64_t slot_extent_bytes = kDefaultSlotExtentBytes;
};

struct OpenOptions {
  // Verify the data checksums of the slot recovery picks (reads every byte
  // once). Without it only commit records are verified at open.
  bool verify_data = true;
  // With verify_data: check only the commit records at open and verify the
  // recovered slot's data later, in the pass a restore makes anyway
  // (ReadPart over every part), or else before BeginEpoch first overwrites a
  // slot. Every byte is then read once instead of twice. Damage found later
  // is handled as at open: Latest() falls back to the older slot.
  bool defer_data_verification = false;
  // Fault the whole pool mapping in for writing on a background thread once
  // the open succeeded, in the order the writers need it: the slot (and
  // commit record) the next epoch writes, then the other slot, then the
  // rest of the file (chunk heap, libpmemobj's metadata). Every process that
  // maps the pool takes its own page faults, so a restart gains as much as
  // a fresh pool. The open is not delayed.
  //  - Method (pmsnap/common/page_prefault.h): kAuto takes the faults in
  //    2 MiB pieces with MADV_POPULATE_WRITE where the pages are new (a
  //    fresh pool's slots) and by read faults, which map 16 cached pages at
  //    a time, where they are already in the page cache (a reopened pool);
  //    touches alone on kernels before 5.14. Nothing changes a byte, also
  //    while workers and libpmemobj write the pool. The mapping is advised
  //    MADV_HUGEPAGE first, which tmpfs follows where shmem huge pages are
  //    enabled (sysfs transparent_hugepage/shmem_enabled, or the mount's
  //    huge= option).
  //  - Costs: one thread until done (a 2 GiB pool in tmpfs here: ~0.9 s
  //    fresh, ~0.2 s reopened), the kernel time of faults the writers would
  //    otherwise take themselves (one per 4 KiB page, ~6x slower in the
  //    first epochs), page tables for the whole mapping (2 MiB per GiB with
  //    4 KiB pages). No memory: the file is allocated in full at creation.
  //  - It holds back while the pool is read in bulk (ReadPart, VerifyPart,
  //    CopyPart, deep checks, and 5 ms after), which a restore waits for.
  //  - Destroying the Pool stops it, waiting for at most the piece in
  //    progress (milliseconds). A failure (prefault_progress().problem)
  //    only loses the head start.
  //  - prefault_progress() says how far it got; WaitForPrefault waits.
  // Off: nothing is faulted in or advised ahead of the writers.
  bool prefault_mapping = true;
  PrefaultMethod prefault_method = PrefaultMethod::kAuto;
  // Simulated PM bandwidth (PmBandwidth), for this open only.
  PmBandwidth pm_bandwidth;
  // For readers (pmsnap verify, info, list, export; load_state_dict): the
  // file is opened O_RDONLY and mapped read-only without libpmemobj, whose
  // own open writes the pool (its run id, lane descriptors), and no lock is
  // taken, so a trainer can open the pool meanwhile. The pool's bytes stay
  // as they are, whatever it finds. A pool another process holds open
  // (libpmemobj's lock, as /proc/locks shows it) is kBusy naming the
  // process; a change that would write (BeginEpoch, DiscardOlderEpoch, the
  // chunk heap's Alloc, Free, Seal) is kFailedPrecondition. prefault_mapping
  // and pm_bandwidth's writes do not apply.
  bool read_only = false;
};

enum class SlotState : std::uint8_t { kEmpty = 0, kWriting = 1, kComplete = 2 };
const char* SlotStateName(SlotState state);

struct SlotInfo {
  int slot = 0;
  SlotState state = SlotState::kEmpty;
  std::uint64_t epoch = 0;
  std::uint64_t iteration = 0;
  std::uint64_t commit_time_unix_ns = 0;
  std::uint64_t extra_state_bytes = 0;
  bool record_valid = false;  // commit record checksum verifies (COMPLETE only)
};

// Where a slot's bytes are mapped: the data of each extent
// (SlotLayout::extent_bytes), valid while the pool is open. Cheap to copy.
struct SlotAddressing {
  std::byte* const* extents = nullptr;
  std::uint64_t extent_count = 0;
  std::uint64_t extent_bytes = 0;  // 0: one extent
  // The mapped byte at `slot_offset` (the layout's offsets). A zero-byte
  // tensor at the very end of the slot maps past the last extent's data.
  std::byte* at(std::uint64_t slot_offset) const {
    if (extent_bytes == 0) return extents[0] + slot_offset;
    std::uint64_t extent = slot_offset / extent_bytes;
    if (extent >= extent_count) extent = extent_count - 1;
    return extents[extent] + (slot_offset - extent * extent_bytes);
  }
};

// A committed epoch as seen through the pool mapping. Cheap to copy.
class SnapshotView {
 public:
  int slot() const { return info_.slot; }
  std::uint64_t epoch() const { return info_.epoch; }
  std::uint64_t iteration() const { return info_.iteration; }
  std::uint64_t commit_time_unix_ns() const { return info_.commit_time_unix_ns; }
  std::span<const std::byte> extra_state() const { return extra_state_; }
  // Bytes of tensor `tensor` of unit `unit` in this slot.
  std::span<const std::byte> tensor(std::uint32_t unit, std::uint32_t tensor) const;

 private:
  friend class Pool;
  SlotInfo info_;
  SlotAddressing data_;
  const SlotLayout* layout_ = nullptr;
  std::span<const std::byte> extra_state_;
};

struct VerifyReport {
  struct SlotReport {
    SlotInfo info;
    std::vector<std::string> problems;  // empty: slot is consistent
  };
  SlotReport slots[2];
  std::vector<std::string> chunk_problems;
  std::optional<int> recoverable_slot;  // what Latest() would return
  bool ok() const;
};

// Byte ranges of the pool's structures in the file (file offset == pool
// offset for a single-file pool). For `pmsnap info` and fault-injection tests.
struct FileRegion {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};
struct FileRegions {
  FileRegion header;
  FileRegion manifest;
  FileRegion record[2];  // commit record incl. part checksums and extra state
  FileRegion slot_data[2];  // the slot's first extent: the whole slot unless in extents
  std::vector<FileRegion> slot_extents[2];  // every extent's stored bytes
  FileRegion chunk_heap_root;
};

// Where warnings go (default: stderr, prefixed "pmsnap: warning: ").
using WarningSink = std::function<void(const std::string&)>;
void SetWarningSink(WarningSink sink);

class Pool {
 public:
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Bytes the pool file for `manifest` with `options` occupies: slots,
  // records, manifest, chunk heap and libpmemobj's own metadata.
  static Result<std::uint64_t> RequiredBytes(const Manifest& manifest, const PoolOptions& options);

  // Creates a new pool file. Fails without touching `path` if it exists
  // (kInvalidArgument; also when a file appears there while the pool is
  // being built: the final rename never replaces one), if its directory
  // does not exist (kNotFound), the manifest is invalid, or the file system has less
  // free space than RequiredBytes (kNoSpace, with both figures). The file
  // appears at `path` only once complete (built under a temporary name), and
  // a failure leaves no partial file behind. Errors of the file system, naming
  // `path`: kNoSpace when it fills up during creation (or has no inodes
  // left; the bytes and inodes free), kFailedPrecondition when the
  // directory may not be written or searched (the uid refused) or is on a
  // read-only mount, kInvalidArgument when it cannot hold a mapped pool
  // (hugetlbfs, mqueue, proc, sysfs, no shared mappings).
  static Result<std::unique_ptr<Pool>> Create(const std::string& path, const Manifest& manifest,
                                              const PoolOptions& options = {});

  // Opens an existing pool and recovers: picks the newest committed slot that
  // verifies. Errors name the file and what is wrong: kNotFound, kNotAPool,
  // kUnsupportedVersion, kCorruption, kBusy (open in another process),
  // kFailedPrecondition (the process may not read and write the file, or it
  // is on a read-only mount: libpmemobj maps a pool writable even to read
  // it), kInvalidArgument (a file system without shared mappings).
  static Result<std::unique_ptr<Pool>> Open(const std::string& path,
                                            const OpenOptions& options = {});
  // As Open, and checks the pool was made for `expected`
  // (kModelMismatch naming the first unit that differs).
  static Result<std::unique_ptr<Pool>> Open(const std::string& path, const Manifest& expected,
                                            const OpenOptions& options = {});

  // Read-only opens (OpenOptions::read_only): OK while nothing opened the
  // pool for writing since this open; kBusy naming the pool when some
  // process opened it meanwhile (its libpmemobj run id moved, or it holds
  // the lock), so that what was read may be torn: a reader reports that
  // instead of damage. Always OK for other opens.
  Status CheckUndisturbed() const;

  const std::string& path() const { return path_; }
  const Manifest& manifest() const { return manifest_; }
  const SlotLayout& layout() const { return layout_; }
  const PoolOptions& options() const { return options_; }
  const RankGroup& group() const { return options_.group; }
  std::uint64_t signature() const;
  std::uint32_t format_version() const;
  std::uint64_t created_unix_ns() const;
  std::uint64_t file_bytes() const { return file_bytes_; }
  // Unit id for a name, via the DRAM hash index built at open.
  std::optional<std::uint32_t> FindUnit(std::string_view name) const;
  // Warnings raised while opening (e.g. fallback to the older slot).
  const std::vector<std::string>& warnings() const { return warnings_; }

  // What the background prefault of the mapping has done (prefault_mapping):
  // state, bytes of the mapping faulted in of the total, time, method, the
  // prefault thread's page faults. With the option off: state kDone, no
  // bytes, method "off". Any thread.
  PrefaultProgress prefault_progress() const;
  // The PM bandwidth this pool is held to (PmBandwidth, after the
  // environment filled it in); simulated() is false at the machine's speed.
  // Any thread.
  const PmBandwidth& pm_bandwidth() const;
  // Waits up to `timeout` for the prefault to settle (done, stopped or
  // failed); true if it has. Any thread.
  bool WaitForPrefault(std::chrono::nanoseconds timeout) const;

  SlotInfo slot_info(int slot) const;
  // How many of the two slots hold a committed epoch, verified or not: 0 for
  // a pool that never committed one. Any thread.
  int committed_slots() const;
  // Newest recoverable committed epoch; kNotFound when none was committed.
  Result<SnapshotView> Latest() const;
  // A specific slot if it is COMPLETE and its record verifies (data is
  // verified only by Verify(deep=true)).
  Result<SnapshotView> Slot(int slot) const;

  // Copies part `part` (index into layout().parts) of `view` to `dst` and
  // checks the part's checksum in the same pass. kCorruption naming the
  // unit, tensor and byte range if it fails (dst then holds the damaged
  // bytes; see RejectLatest). Thread-safe for distinct parts.
  Status ReadPart(const SnapshotView& view, std::uint32_t part, void* dst) const;
  // Checks a part's checksum without copying it, for callers that copy it by
  // other means (to a GPU).
  Status VerifyPart(const SnapshotView& view, std::uint32_t part) const;
  // Copies a part of `view` to `dst` without checking its checksum (data
  // verification off, or already done), with streaming stores as ReadPart:
  // a restore writes far more than the cache holds. Thread-safe for
  // distinct parts.
  Status CopyPart(const SnapshotView& view, std::uint32_t part, void* dst) const;
  // Maps the pages of a part of `view` into the page table ahead of a copy
  // that reads them (ReadPart and VerifyPart do it themselves). Only a hint:
  // on file systems without huge-page mappings (tmpfs) a first read of a
  // fresh mapping otherwise faults every 16 pages, ~10% of a restore.
  void PrefaultPart(const SnapshotView& view, std::uint32_t part) const;
  // Drops Latest()'s slot after ReadPart/VerifyPart found its part
  // `damaged_part` damaged, as open would have: Latest() moves to the older
  // slot if that verifies in full (with a warning), else kCorruption (no
  // slot verifies; new epochs still number on from the damaged one).
  Status RejectLatest(std::uint32_t damaged_part);
  // Multi-rank recovery: drops Latest()'s slot, intact but newer than the
  // newest epoch every rank holds (`reason`, kept in warnings(), says so).
  // Latest() moves to the older slot if that verifies in full, else
  // kCorruption; the next epoch overwrites the dropped slot, never the one
  // every rank holds. kFailedPrecondition without a recovered checkpoint.
  Status RollBackLatest(const std::string& reason);
  // `pmsnap prune --keep 1`: drops the committed epoch older than Latest()
  // by marking its slot EMPTY (one 8-byte atomic store of its commit word,
  // persisted: a crash leaves it either retained or dropped), so that no
  // later open, restore or reader picks it. Returns the epoch dropped, or
  // nullopt when no older intact-record epoch exists (Latest() itself is
  // never dropped: after a fallback to the older slot, nothing is).
  // kFailedPrecondition without a recovered checkpoint, kBusy while an epoch
  // is open. The slot's bytes stay allocated (slots are preallocated).
  Result<std::optional<std::uint64_t>> DiscardOlderEpoch();
  // Multi-rank recovery, when the ranks start afresh because no epoch was
  // ever committed by every rank (EpochAgreement::AgreeOnRestore): marks
  // both slots EMPTY (one persisted 8-byte store each; after a crash in
  // between, the next recovery starts afresh and forgets the rest), so that
  // no later recovery or reader takes an epoch of the abandoned start for
  // one of the new run. Epochs then number from 1 again, and the first new
  // epoch frees the forgotten epochs' chunks. `reason` goes to warnings()
  // when a committed epoch is forgotten. Returns how many were. kBusy while
  // an epoch is open; kFailedPrecondition on a read-only pool.
  Result<int> ForgetEpochs(const std::string& reason);
  // Whether the recovered slot's data still awaits its deferred check.
  bool data_verification_pending() const;

  // --- writer ---
  // Starts epoch last_committed+1 for training iteration `iteration`, marks
  // its slot WRITING. kBusy if an epoch is already open. The first call after
  // open also finishes a deferred data verification (the slot it keeps must
  // be the good one) and frees chunks left by epochs that never committed.
  Result<std::uint64_t> BeginEpoch(std::uint64_t iteration);
  // Copies part `part` (index into layout().parts) from `src` (that part's
  // bytes) into the open epoch's slot with non-temporal stores, drains, and
  // records the part's checksum.
  Status WritePart(std::uint32_t part, const void* src);
  // All parts of one tensor from the tensor's contiguous bytes.
  Status WriteTensor(std::uint32_t unit, std::uint32_t tensor, const void* src);
  // Destination of a part in the open epoch's slot, for writers that copy by
  // other means (a GPU DMA); follow with SealPart.
  Result<std::span<std::byte>> PartDestination(std::uint32_t part);
  // Persists a part written through PartDestination and records its checksum.
  Status SealPart(std::uint32_t part);
  // Publishes the open epoch. Every part must have been written
  // (kFailedPrecondition names the first missing unit/tensor); extra_state
  // must fit the configured capacity (kCapacityExceeded, epoch stays open).
  Status Commit(std::span<const std::byte> extra_state = {});
  // Gives up the open epoch; the pool keeps its last committed epoch.
  void Abandon();
  std::optional<std::uint64_t> open_epoch() const;
  std::optional<std::uint64_t> last_committed_epoch() const;

  // --- chunk heap ---
  // The pool's chunks (encoded units' payloads), open and loaded as long as
  // the pool is; thread-safe (see chunk_heap.h). Chunks of epochs after the
  // last committed one are freed by the first BeginEpoch after open.
  ChunkHeap& chunk_heap();
  const ChunkHeap& chunk_heap() const;

  FileRegions regions() const;
  // The mapped data of a slot, one span per extent (one for a slot in one
  // piece; both slots stay mapped while the pool is open), e.g. to register
  // it for GPU DMA.
  std::vector<std::span<std::byte>> slot_extents(int slot) const;
  // The file offset of the byte at `slot_offset` of `slot` (a tensor's
  // bytes are contiguous in the file, whatever extent holds them).
  std::uint64_t SlotFileOffset(int slot, std::uint64_t slot_offset) const;
  // The whole file as mapped (file_bytes() from its first byte), e.g. to
  // measure how much of it is in memory. Valid while the pool is open.
  std::span<const std::byte> mapping() const;

  // Checks both slots' records and, if deep, every data checksum and chunk.
  VerifyReport Verify(bool deep) const;

 private:
  struct Impl;
  Pool();
  static Result<std::unique_ptr<Pool>> OpenImpl(const std::string& path, const Manifest* expected,
                                                const OpenOptions& options);
  Status LoadAndRecover(const OpenOptions& options);
  // OpenOptions::read_only: maps the file PROT_READ (kBusy if a process
  // holds it open; kUnsupportedVersion for another libpmemobj format).
  Status MapReadOnly(std::uint64_t device, std::uint64_t inode);
  // kFailedPrecondition naming the pool if it was opened read-only.
  Status RefuseReadOnly(const char* what) const;
  // Recovery: the newest COMPLETE slot not in `excluded` whose record (and,
  // if deep, data) verifies; `rejected` lists earlier rejections for the
  // warning or the error.
  // `fallback` says why a rejected newer slot was passed over (warnings()).
  Status PickRecoveredSlot(bool deep, std::optional<int> excluded, std::vector<std::string> rejected,
                           std::string_view fallback = kDamagedFallback);
  Status RejectRecovered(const std::string& problem, std::string_view fallback);
  static constexpr std::string_view kDamagedFallback =
      "newest checkpoint is damaged, falling back to the older one";
  std::vector<std::string> CheckSlot(int slot, bool deep) const;
  std::string PartProblem(std::uint32_t part) const;
  // ReadPart, or with dst == nullptr VerifyPart.
  Status CopyAndVerifyPart(const SnapshotView& view, std::uint32_t part, std::byte* dst) const;
  // Where part `part` of `view` starts; kInvalidArgument if `view` is not
  // this pool's or the part is out of range.
  Result<const std::byte*> PartSource(const SnapshotView& view, std::uint32_t part) const;
  // Records a verified part of the slot awaiting deferred verification.
  void NotePartVerified(int slot, std::uint32_t part) const;
  Result<SnapshotView> MakeView(int slot) const;
  // Starts the background prefault of the mapping (OpenOptions).
  void StartPrefault(PrefaultMethod method);

  std::string path_;
  Manifest manifest_;
  SlotLayout layout_;
  PoolOptions options_;
  std::uint64_t file_bytes_ = 0;
  std::vector<std::string> warnings_;
  std::optional<int> recovered_slot_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pmsnap::layout
