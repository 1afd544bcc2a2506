// Opening a pool and recovering its newest intact checkpoint (Pool::Open,
// Pool::LoadAndRecover, the recovery and slot checks behind Latest(),
// RejectLatest and Verify), and starting the prefault of the mapping.
#include <fcntl.h>
#include <libpmem.h>
#include <libpmemobj.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "detail/chunk_heap_state.h"
#include "detail/file_system.h"
#include "detail/format.h"
#include "detail/persistence.h"
#include "detail/pmdk.h"
#include "detail/pool_impl.h"
#include "detail/prefault_order.h"
#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::layout {

using detail::kPmemobjMinPool;
using detail::PmdkMessage;
using detail::PoolFileError;
using detail::PoolHeader;
using detail::PoolRoot;
using detail::PrefaultPause;
using detail::RecordBytes;
using detail::SlotRecordHeader;
using detail::Warn;

namespace {

// The process holding a lock on the file (`device`, `inode`) as /proc/locks
// lists it (libpmemobj flocks a pool it opens), or 0. Takes no lock itself.
long LockHolder(std::uint64_t device, std::uint64_t inode) {
  std::FILE* locks = std::fopen("/proc/locks", "r");
  if (locks == nullptr) return 0;
  char line[512];
  long holder = 0;
  while (holder == 0 && std::fgets(line, sizeof(line), locks) != nullptr) {
    // "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" ("->" marks waiters).
    char type[16] = {}, mode[16] = {}, access[16] = {};
    long pid = 0;
    unsigned major_id = 0, minor_id = 0;
    unsigned long file_inode = 0;
    if (std::sscanf(line, "%*d: %15s %15s %15s %ld %x:%x:%lu", type, mode, access, &pid,
                    &major_id, &minor_id, &file_inode) == 7 &&
        file_inode == inode && makedev(major_id, minor_id) == device) {
      holder = pid;
    }
  }
  std::fclose(locks);
  return holder;
}

std::uint64_t LoadU64(const std::byte* at) {
  std::uint64_t value = 0;
  std::memcpy(&value, at, sizeof(value));
  return value;
}

// kCorruption saying both sizes when the file is shorter than its pmsnap
// header says it was made (PoolHeader::file_bytes), read with pread before
// anything maps the file: libpmemobj's own message for a cut file is "pool
// initialization failed". OK when the header cannot tell (an older pool, a
// header out of reach or damaged: the open reports those itself).
Status CheckNotTruncated(const std::string& path, std::uint64_t actual) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Ok();
  std::uint64_t root_offset = 0;
  PoolHeader header{};
  const bool read =
      ::pread(fd, &root_offset, sizeof(root_offset), detail::kPmemobjRootOffsetAt) ==
          static_cast<ssize_t>(sizeof(root_offset)) &&
      root_offset < actual &&
      ::pread(fd, &header, sizeof(header), static_cast<off_t>(root_offset)) ==
          static_cast<ssize_t>(sizeof(header));
  ::close(fd);
  if (root_offset >= actual && root_offset != 0 && root_offset < (1ull << 56)) {
    return Status(StatusCode::kCorruption,
                  "pool '" + path + "' is truncated: the file is " + std::to_string(actual) +
                      " bytes, but its root object is at byte " + std::to_string(root_offset));
  }
  if (!read || std::memcmp(header.magic, detail::kPoolMagic, 8) != 0 ||
      detail::HeaderChecksum(header) != header.header_checksum || header.file_bytes <= actual) {
    return Status::Ok();
  }
  return Status(StatusCode::kCorruption,
                "pool '" + path + "' is truncated: the file is " + std::to_string(actual) +
                    " bytes, it was created with " + std::to_string(header.file_bytes) +
                    " (expected a file of " + std::to_string(header.file_bytes) + " bytes)");
}

}  // namespace

Result<std::unique_ptr<Pool>> Pool::Open(const std::string& path, const OpenOptions& options) {
  return OpenImpl(path, nullptr, options);
}

Result<std::unique_ptr<Pool>> Pool::Open(const std::string& path, const Manifest& expected,
                                         const OpenOptions& options) {
  return OpenImpl(path, &expected, options);
}

Result<std::unique_ptr<Pool>> Pool::OpenImpl(const std::string& path, const Manifest* expected,
                                             const OpenOptions& options) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) {
      return Status(StatusCode::kNotFound, "pool file '" + path + "' does not exist");
    }
    const int err = errno;
    return PoolFileError(err, "cannot stat pool file '" + path + "'", std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) {
    return Status(StatusCode::kInvalidArgument,
                  "'" + path + "' is a directory, expected a pmsnap pool file");
  }
  if (st.st_size == 0) {
    return Status(StatusCode::kNotAPool, "'" + path + "' is empty (0 bytes), not a pmsnap pool");
  }
  {
    char signature[8] = {};
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) {
      const int err = errno;
      return PoolFileError(err, "cannot read pool file '" + path + "'", std::strerror(err));
    }
    const ssize_t got = ::pread(fd, signature, sizeof(signature), 0);
    ::close(fd);
    if (got != static_cast<ssize_t>(sizeof(signature)) ||
        std::memcmp(signature, "PMEMOBJ", 7) != 0) {
      return Status(StatusCode::kNotAPool, "'" + path +
                                               "' is not a pmsnap pool (no PMDK object-pool "
                                               "signature at offset 0)");
    }
  }
  if (static_cast<std::uint64_t>(st.st_size) < kPmemobjMinPool) {
    return Status(StatusCode::kCorruption,
                  "pool '" + path + "' is truncated: " + std::to_string(st.st_size) +
                      " bytes, a pool has at least " + std::to_string(kPmemobjMinPool));
  }

  PMSNAP_RETURN_IF_ERROR(CheckNotTruncated(path, static_cast<std::uint64_t>(st.st_size)));
  PMSNAP_ASSIGN_OR_RETURN(const PmBandwidth pm_bandwidth, ResolvePmBandwidth(options.pm_bandwidth));

  std::unique_ptr<Pool> pool(new Pool());
  pool->path_ = path;
  pool->file_bytes_ = static_cast<std::uint64_t>(st.st_size);
  Impl& impl = *pool->impl_;
  impl.pm_bandwidth = pm_bandwidth;
  if (pm_bandwidth.write_gbps > 0) {
    impl.pm.write = std::make_unique<BandwidthPacer>(pm_bandwidth.write_gbps);
  }
  if (pm_bandwidth.read_gbps > 0) {
    impl.pm.read = std::make_unique<BandwidthPacer>(pm_bandwidth.read_gbps);
  }
  if (options.read_only) {
    PMSNAP_RETURN_IF_ERROR(pool->MapReadOnly(st.st_dev, st.st_ino));
  } else {
    impl.pop = pmemobj_open(path.c_str(), kPoolLayoutName);
  }
  if (!options.read_only && impl.pop == nullptr) {
    const int err = errno;
    const std::string pmdk = PmdkMessage(err);
    const std::string message = "cannot open pool '" + path + "': " + pmdk;
    if (err == EWOULDBLOCK || err == EAGAIN) {
      return Status(StatusCode::kBusy, message + " (is it open in another process?)");
    }
    // The file system refused (read-only mount, permissions, no shared
    // mappings): errno says so, whatever libpmemobj's text contains.
    if (detail::ClassifyPoolOsError(err).code != StatusCode::kIOError) {
      return PoolFileError(err, "cannot open pool '" + path + "'", pmdk);
    }
    // libpmemobj's text quotes the path: words in the path ("layout",
    // "size") must not pick the code.
    std::string reason = pmdk;
    for (std::size_t at = reason.find(path); !path.empty() && at != std::string::npos;
         at = reason.find(path, at)) {
      reason.erase(at, path.size());
    }
    if (reason.find("layout") != std::string::npos) {
      return Status(StatusCode::kNotAPool, message + " (a PMDK pool of another program)");
    }
    if (reason.find("size") != std::string::npos || reason.find("trunc") != std::string::npos) {
      return Status(StatusCode::kCorruption, message + " (the file looks truncated)");
    }
    return Status(err == EINVAL ? StatusCode::kCorruption : StatusCode::kIOError, message);
  }
  if (!options.read_only) {
    detail::seam::Mapped(impl.pop, reinterpret_cast<std::byte*>(impl.pop), pool->file_bytes_);
  }
  PMSNAP_RETURN_IF_ERROR(pool->LoadAndRecover(options));

  if (expected != nullptr && expected->Signature() != pool->signature()) {
    std::string difference = pool->manifest_.FirstDifference(*expected);
    if (difference.empty()) difference = "signatures differ";
    return Status(StatusCode::kModelMismatch, "pool '" + path +
                                                  "' was made for another model: pool has " +
                                                  difference + " (pool vs this model)");
  }
  if (options.prefault_mapping && !options.read_only) pool->StartPrefault(options.prefault_method);
  return pool;
}

Status Pool::MapReadOnly(std::uint64_t device, std::uint64_t inode) {
  Impl& impl = *impl_;
  const long holder = LockHolder(device, inode);
  if (holder != 0) {
    return Status(StatusCode::kBusy, "pool '" + path_ + "' is open in process " +
                                         std::to_string(holder) +
                                         " (a trainer writes it): read it once that process "
                                         "closed it, or read a copy");
  }
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return PoolFileError(err, "cannot open pool '" + path_ + "' for reading", std::strerror(err));
  }
  void* mapping = ::mmap(nullptr, file_bytes_, PROT_READ, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (mapping == MAP_FAILED) {
    return PoolFileError(map_error, "cannot map pool '" + path_ + "' for reading",
                         std::strerror(map_error));
  }
  impl.read_only = true;
  impl.base = static_cast<std::byte*>(mapping);
  impl.read_only_bytes = file_bytes_;
  impl.device = device;
  impl.inode = inode;
  std::uint32_t major = 0;
  std::memcpy(&major, impl.base + detail::kPmemobjMajorAt, sizeof(major));
  if (major != detail::kPmemobjMajor) {
    return Status(StatusCode::kUnsupportedVersion,
                  "pool '" + path_ + "' has libpmemobj pool format " + std::to_string(major) +
                      ", this build reads format " + std::to_string(detail::kPmemobjMajor));
  }
  impl.run_id_at_open = LoadU64(impl.base + detail::kPmemobjRunIdAt);
  return Status::Ok();
}

Status Pool::CheckUndisturbed() const {
  const Impl& impl = *impl_;
  if (!impl.read_only) return Status::Ok();
  const long holder = LockHolder(impl.device, impl.inode);
  if (holder == 0 && LoadU64(impl.base + detail::kPmemobjRunIdAt) == impl.run_id_at_open) {
    return Status::Ok();
  }
  return Status(StatusCode::kBusy,
                "pool '" + path_ + "' was opened by " +
                    (holder != 0 ? "process " + std::to_string(holder) : "another process") +
                    " while it was read: what was read may be torn; read it again once that "
                    "process closed it");
}

void Pool::StartPrefault(PrefaultMethod method) {
  Impl& impl = *impl_;
  // Only a hint: tmpfs maps huge pages only where shmem huge pages are
  // enabled, and only for pages the file does not already hold as 4 KiB
  // pages (until khugepaged collapses them).
  (void)::madvise(impl.base, file_bytes_, MADV_HUGEPAGE);
  // Page-aligned file ranges in the order the writers meet them: the next
  // epoch's commit record and slot, the other slot, then the rest of the
  // file (chunk heap, libpmemobj's metadata); each page once.
  const PoolHeader& header = impl.header();
  const int first_slot = static_cast<int>((impl.last_committed.value_or(0) + 1) % 2);
  std::vector<FileRegion> wanted;
  const FileRegions file_regions = regions();
  for (int slot : {first_slot, 1 - first_slot}) {
    wanted.push_back({header.slot_record_offset[slot], header.record_bytes});
    for (const FileRegion& extent : file_regions.slot_extents[slot]) wanted.push_back(extent);
  }
  std::vector<PrefaultRange> ranges;
  for (const FileRegion& region : detail::PrefaultOrder(wanted, file_bytes_, PageBytes())) {
    ranges.push_back({impl.At(region.offset), region.bytes});
  }
  impl.prefault = std::make_unique<PagePrefaulter>(ranges, method);
}

Status Pool::LoadAndRecover(const OpenOptions& options) {
  Impl& impl = *impl_;
  if (!impl.read_only) impl.base = reinterpret_cast<std::byte*>(impl.pop);
  impl.is_pmem = pmem_is_pmem(impl.base, file_bytes_) != 0;
  const std::string where = "pool '" + path_ + "'";
  auto corruption = [&](const std::string& what) {
    return Status(StatusCode::kCorruption, where + ": " + what);
  };

  std::uint64_t pool_uuid_lo = 0;
  if (impl.read_only) {
    // Where libpmemobj's descriptor says (detail/pmdk.h), checked as any
    // other offset a damaged file could hold.
    const std::uint64_t root_offset = LoadU64(impl.base + detail::kPmemobjRootOffsetAt);
    if (LoadU64(impl.base + detail::kPmemobjRootSizeAt) < sizeof(PoolRoot)) {
      return Status(StatusCode::kNotAPool, where + " has no pmsnap root object");
    }
    if (root_offset % alignof(PoolRoot) != 0 || root_offset > file_bytes_ ||
        sizeof(PoolRoot) > file_bytes_ - root_offset) {
      return corruption("libpmemobj's root object offset " + std::to_string(root_offset) +
                        " lies outside the file of " + std::to_string(file_bytes_) +
                        " bytes (truncated?)");
    }
    impl.root = impl.At<PoolRoot>(root_offset);
  } else {
    if (pmemobj_root_size(impl.pop) < sizeof(PoolRoot)) {
      return Status(StatusCode::kNotAPool, where + " has no pmsnap root object");
    }
    PMEMoid root_oid = pmemobj_root(impl.pop, sizeof(PoolRoot));
    impl.root = static_cast<PoolRoot*>(pmemobj_direct(root_oid));
    pool_uuid_lo = root_oid.pool_uuid_lo;
  }
  const PoolHeader& header = impl.header();

  static constexpr char kZeroMagic[8] = {};
  if (std::memcmp(header.magic, kZeroMagic, 8) == 0) {
    return Status(StatusCode::kNotAPool, where + " was never completely created (no header)");
  }
  if (std::memcmp(header.magic, detail::kPoolMagic, 8) != 0) {
    return corruption("header magic is damaged");
  }
  if (header.header_bytes != sizeof(PoolHeader)) {
    return corruption("header size " + std::to_string(header.header_bytes) + ", expected " +
                      std::to_string(sizeof(PoolHeader)));
  }
  if (detail::HeaderChecksum(header) != header.header_checksum) {
    return corruption("header checksum mismatch (the header was damaged)");
  }
  if (header.format_version != kFormatVersion &&
      header.format_version != kFormatVersionSlotExtents) {
    return Status(StatusCode::kUnsupportedVersion,
                  where + " has format version " + std::to_string(header.format_version) +
                      ", this build reads versions " + std::to_string(kFormatVersion) + " and " +
                      std::to_string(kFormatVersionSlotExtents));
  }
  const bool in_extents = header.format_version == kFormatVersionSlotExtents;
  if (in_extents != (header.slot_extent_bytes != 0) ||
      (in_extents && (header.slot_extent_bytes % detail::kSlotDataAlignment != 0 ||
                      header.slot_extent_bytes > kMaxSlotExtentBytes))) {
    return corruption("format version " + std::to_string(header.format_version) +
                      " with slot extents of " + std::to_string(header.slot_extent_bytes) +
                      " bytes (expected 0 for version 1; a multiple of " +
                      std::to_string(detail::kSlotDataAlignment) + " up to " +
                      std::to_string(kMaxSlotExtentBytes) + " for version 2)");
  }
  auto in_bounds = [&](std::uint64_t offset, std::uint64_t bytes) {
    return offset >= sizeof(PoolRoot) && offset <= file_bytes_ && bytes <= file_bytes_ - offset;
  };
  // A file cut short: say how long it is and how long the header says it
  // must be (the end of its furthest structure), not just that it is.
  auto outside = [&](const std::string& what, std::uint64_t offset, std::uint64_t bytes) {
    std::uint64_t end = offset + bytes;
    if (end < offset) end = ~0ull;
    if (offset < sizeof(PoolRoot) || end <= file_bytes_ || offset > (1ull << 56)) {
      return corruption(what + " lies outside the file");
    }
    return corruption("the file is truncated: it is " + std::to_string(file_bytes_) +
                      " bytes, but its " + what + " reaches byte " + std::to_string(end) +
                      " (expected a file of at least " + std::to_string(end) + " bytes)");
  };
  if (!in_bounds(header.manifest_offset, header.manifest_bytes)) {
    return outside("manifest", header.manifest_offset, header.manifest_bytes);
  }
  for (int s = 0; s < 2; ++s) {
    // A slot in extents: each extent is checked once the layout says its size.
    if (!in_extents && !in_bounds(header.slot_data_offset[s], header.slot_bytes)) {
      return outside("slot " + std::to_string(s), header.slot_data_offset[s], header.slot_bytes);
    }
    if (!in_bounds(header.slot_record_offset[s], header.record_bytes)) {
      return outside("slot " + std::to_string(s) + "'s commit record",
                     header.slot_record_offset[s], header.record_bytes);
    }
    // The record is read through a SlotRecordHeader (8-byte words, the
    // commit word atomic) and the slot data by 64-byte non-temporal stores:
    // offsets Create never writes must not reach those accesses.
    if (header.slot_record_offset[s] % alignof(detail::SlotRecordHeader) != 0) {
      return corruption("slot " + std::to_string(s) + "'s commit record offset " +
                        std::to_string(header.slot_record_offset[s]) + " is not " +
                        std::to_string(alignof(detail::SlotRecordHeader)) + "-byte aligned");
    }
    if (header.slot_data_offset[s] % detail::kSlotDataAlignment != 0) {
      return corruption("slot " + std::to_string(s) + "'s data offset " +
                        std::to_string(header.slot_data_offset[s]) + " is not " +
                        std::to_string(detail::kSlotDataAlignment) + "-byte aligned");
    }
  }
  const std::byte* manifest_bytes = impl.At(header.manifest_offset);
  if (Checksum64(manifest_bytes, header.manifest_bytes) != header.manifest_checksum) {
    return corruption("manifest checksum mismatch (the manifest was damaged)");
  }
  PMSNAP_ASSIGN_OR_RETURN(manifest_,
                          Manifest::Parse({manifest_bytes, header.manifest_bytes}, where));
  if (manifest_.Signature() != header.model_signature) {
    return corruption("manifest does not match the model signature in the header");
  }
  options_.part_bytes = header.part_bytes;
  options_.extra_state_capacity = header.extra_state_capacity;
  options_.chunk_heap_bytes = header.chunk_heap_bytes;
  options_.group = {.run_id = header.group_run_id,
                    .rank = header.group_rank,
                    .world_size = header.group_world_size,
                    .model_fingerprint = header.group_model_fingerprint,
                    .created_beside_checkpoints =
                        (header.group_flags & detail::kGroupCreatedBesideCheckpoints) != 0};
  if (options_.part_bytes < 4096 || options_.part_bytes % kTensorAlignment != 0) {
    return corruption("part size " + std::to_string(options_.part_bytes) + " is invalid");
  }
  // The manifest's tensors must fit the slot the header sized (and the
  // bounds check above placed in the file) before laying them out: a
  // manifest with absurd shapes under valid checksums would otherwise make
  // ComputeLayout list billions of parts.
  std::uint64_t manifest_slot_bytes = 0;
  for (const UnitSpec& unit : manifest_.units) {
    if ((unit.flags & kUnitFlagEncoded) != 0) continue;
    for (const TensorSpec& tensor : unit.tensors) {
      manifest_slot_bytes = detail::AlignUp(manifest_slot_bytes, kTensorAlignment);
      if (manifest_slot_bytes > header.slot_bytes ||
          tensor.bytes() > header.slot_bytes - manifest_slot_bytes) {
        return corruption("manifest tensors need more than the header's slot of " +
                          std::to_string(header.slot_bytes) + " bytes");
      }
      manifest_slot_bytes += tensor.bytes();
    }
  }
  layout_ = ComputeLayout(manifest_, options_.part_bytes, header.slot_extent_bytes);
  if (layout_.slot_bytes != header.slot_bytes || layout_.parts.size() != header.part_count ||
      RecordBytes(header.part_count, header.extra_state_capacity) != header.record_bytes) {
    return corruption("slot layout recomputed from the manifest differs from the header");
  }
  // Each slot's extents: one piece at slot_data_offset (version 1), else
  // where the extent table says, each as large as the layout stores in it.
  const std::uint64_t extent_count = layout_.extent_used.size();
  std::vector<std::uint64_t> extent_offsets = {header.slot_data_offset[0],
                                               header.slot_data_offset[1]};
  if (in_extents) {
    const std::uint64_t table_bytes = 2 * 8 * extent_count;
    if (!in_bounds(header.slot_extent_table_offset, table_bytes)) {
      return outside("slot extent table", header.slot_extent_table_offset, table_bytes);
    }
    extent_offsets.resize(2 * extent_count);
    std::memcpy(extent_offsets.data(), impl.At(header.slot_extent_table_offset), table_bytes);
    if (Checksum64(extent_offsets.data(), table_bytes) != header.slot_extent_table_checksum) {
      return corruption("slot extent table checksum mismatch (the table was damaged)");
    }
  }
  impl.extent_bytes = header.slot_extent_bytes;
  for (int s = 0; s < 2; ++s) {
    impl.extent_data[s].clear();
    for (std::uint64_t i = 0; i < extent_count; ++i) {
      const std::uint64_t offset = extent_offsets[s * extent_count + i];
      const std::uint64_t bytes = layout_.extent_used[i];
      const std::string what = "slot " + std::to_string(s) + " extent " + std::to_string(i);
      if (!in_bounds(offset, bytes)) return outside(what, offset, bytes);
      if (offset % detail::kSlotDataAlignment != 0) {
        return corruption(what + "'s data offset " + std::to_string(offset) + " is not " +
                          std::to_string(detail::kSlotDataAlignment) + "-byte aligned");
      }
      impl.extent_data[s].push_back(impl.At(offset));
    }
  }
  for (std::uint32_t u = 0; u < manifest_.units.size(); ++u) {
    impl.unit_index.emplace(manifest_.units[u].name, u);
  }
  impl.written = std::make_unique<std::atomic<std::uint8_t>[]>(layout_.parts.size());

  const bool deferred = options.verify_data && options.defer_data_verification;
  PMSNAP_RETURN_IF_ERROR(PickRecoveredSlot(options.verify_data && !deferred, std::nullopt, {}));
  if (deferred && recovered_slot_) {
    impl.part_verified = std::make_unique<std::atomic<std::uint8_t>[]>(layout_.parts.size());
    impl.unverified_slot.store(layout_.parts.empty() ? -1 : *recovered_slot_);
  }

  auto chunk_heap = std::make_unique<ChunkHeap::State>();
  chunk_heap->pop = impl.pop;
  chunk_heap->read_only = impl.read_only;
  chunk_heap->base = impl.base;
  chunk_heap->file_bytes = file_bytes_;
  chunk_heap->pool_uuid_lo = pool_uuid_lo;
  chunk_heap->root = &impl.root->chunks;
  chunk_heap->capacity = header.chunk_heap_bytes;
  chunk_heap->path = path_;
  chunk_heap->pm = &impl.pm;
  PMSNAP_ASSIGN_OR_RETURN(impl.chunk_heap, ChunkHeap::Load(std::move(chunk_heap)));
  // A damaged chunk list costs only the chunks past the damage: the slots
  // still open.
  if (!impl.chunk_heap->list_problem().empty()) {
    detail::Warn(&warnings_, impl.chunk_heap->list_problem());
  }
  return Status::Ok();
}

Status Pool::PickRecoveredSlot(bool deep, std::optional<int> excluded,
                               std::vector<std::string> rejected, std::string_view fallback) {
  Impl& impl = *impl_;
  const std::string where = "pool '" + path_ + "'";
  std::vector<int> candidates;
  for (int s = 0; s < 2; ++s) {
    if (s != excluded && slot_info(s).state == SlotState::kComplete) candidates.push_back(s);
  }
  std::sort(candidates.begin(), candidates.end(),
            [&](int a, int b) { return slot_info(a).epoch > slot_info(b).epoch; });
  // last_committed stays when nothing verifies: new epochs number on from it.
  recovered_slot_.reset();
  for (int s : candidates) {
    std::vector<std::string> problems = CheckSlot(s, deep);
    if (problems.empty()) {
      recovered_slot_ = s;
      impl.last_committed = slot_info(s).epoch;
      break;
    }
    std::string summary = "slot " + std::to_string(s) + " (epoch " +
                          std::to_string(slot_info(s).epoch) + "): " + problems.front();
    if (problems.size() > 1) summary += " (+" + std::to_string(problems.size() - 1) + " more)";
    rejected.push_back(summary);
  }
  if (!recovered_slot_ && !rejected.empty()) {
    std::string all;
    for (const std::string& r : rejected) all += (all.empty() ? "" : "; ") + r;
    return Status(StatusCode::kCorruption, where + ": no committed slot verifies: " + all);
  }
  for (const std::string& r : rejected) {
    Warn(&warnings_, where + ": " + std::string(fallback) + ": " + r);
  }
  return Status::Ok();
}

Status Pool::RejectLatest(std::uint32_t damaged_part) {
  if (damaged_part >= layout_.parts.size()) {
    return Status(StatusCode::kInvalidArgument,
                  "pool '" + path_ + "': no part " + std::to_string(damaged_part));
  }
  return RejectRecovered(PartProblem(damaged_part), kDamagedFallback);
}

Status Pool::RollBackLatest(const std::string& reason) {
  return RejectRecovered(reason, "the ranks restore an older iteration, rolling back the newest "
                                 "checkpoint");
}

Status Pool::RejectRecovered(const std::string& problem, std::string_view fallback) {
  if (!recovered_slot_) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool '" + path_ + "': no recovered checkpoint to reject");
  }
  if (impl_->open_epoch) {
    return Status(StatusCode::kBusy, "pool '" + path_ +
                                         "': cannot change the recovered "
                                         "checkpoint while epoch " +
                                         std::to_string(*impl_->open_epoch) + " is open");
  }
  const int damaged = *recovered_slot_;
  impl_->unverified_slot.store(-1);
  return PickRecoveredSlot(/*deep=*/true, damaged,
                           {"slot " + std::to_string(damaged) + " (epoch " +
                            std::to_string(slot_info(damaged).epoch) + "): " + problem},
                           fallback);
}

std::vector<std::string> Pool::CheckSlot(int slot, bool deep) const {
  const Impl& impl = *impl_;
  std::vector<std::string> problems;
  const SlotInfo info = slot_info(slot);
  if (info.state != SlotState::kComplete) return problems;
  const SlotRecordHeader& record = impl.record(slot);
  if (!info.record_valid) {
    problems.push_back("commit record checksum mismatch (the record was damaged)");
    return problems;
  }
  if (record.extra_bytes > options_.extra_state_capacity) {
    problems.push_back("commit record claims " + std::to_string(record.extra_bytes) +
                       " bytes of extra state, capacity is " +
                       std::to_string(options_.extra_state_capacity));
    return problems;
  }
  if (Checksum64(impl.part_checksums(slot), 8 * layout_.parts.size()) != record.parts_checksum) {
    problems.push_back("part checksum table is damaged");
    return problems;
  }
  if (Checksum64(impl.extra_state(slot), record.extra_bytes) != record.extra_checksum) {
    problems.push_back("extra state checksum mismatch");
  }
  if (deep) {
    const PrefaultPause pause(impl.prefault.get());
    for (std::uint32_t p = 0; p < layout_.parts.size(); ++p) {
      const PartLayout& part = layout_.parts[p];
      const auto started = detail::seam::PaceStart(impl.pm.read);
      const std::uint64_t actual =
          Checksum64(impl.slot_addressing(slot).at(part.slot_offset), part.bytes);
      detail::seam::PaceRead(impl.pm, part.bytes, started);
      if (actual != impl.part_checksums(slot)[p]) problems.push_back(PartProblem(p));
    }
  }
  return problems;
}

}  // namespace pmsnap::layout
