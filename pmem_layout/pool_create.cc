// Pool creation (Pool::RequiredBytes, Pool::Create): the file is built under
// a temporary name, filled in, and renamed into place only once complete.
#include <fcntl.h>
#include <libpmemobj.h>
#include <signal.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "detail/chunk_heap_state.h"
#include "detail/file_system.h"
#include "detail/format.h"
#include "detail/persistence.h"
#include "detail/pmdk.h"
#include "detail/pool_impl.h"
#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::layout {
namespace {

using detail::AlignUp;
using detail::kPmemobjBaseOverhead;
using detail::kPmemobjChunkBytes;
using detail::kPmemobjMinPool;
using detail::kPmemobjZoneBytes;
using detail::kPmemobjZoneOverhead;
using detail::PmdkError;
using detail::PmdkMessage;
using detail::PoolFileError;
using detail::PoolHeader;
using detail::PoolRoot;
using detail::RecordBytes;
using detail::RunTransaction;

// "'<dir>' has N bytes and M inodes free": a full file system may be out of
// either, and only the figures tell which.
std::string FreeSpaceOf(const std::filesystem::path& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return "'" + dir.string() + "': free space unknown";
  return "'" + dir.string() + "' has " +
         std::to_string(static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize) + " bytes and " +
         std::to_string(fs.f_favail) + " inodes free";
}

// A process killed inside Create leaves "<path>.creating-<pid>"; remove those
// whose process is gone (and our own stale one).
void RemoveAbandonedCreations(const std::string& path) {
  const std::filesystem::path target(path);
  std::filesystem::path dir = target.parent_path();
  if (dir.empty()) dir = ".";
  const std::string prefix = target.filename().string() + ".creating-";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(name.c_str() + prefix.size(), &end, 10);
    if (end == nullptr || *end != '\0' || pid <= 0) continue;
    const bool gone = ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    if (gone || pid == ::getpid()) std::filesystem::remove(entry.path(), ec);
  }
}

// The slot layout of a pool made with `options`: one piece where the slot
// fits in options.slot_extent_bytes, else extents of that size or of the
// largest tensor's (libpmemobj allocates at most one zone, just under 16
// GiB, in one piece).
Result<SlotLayout> PoolSlotLayout(const Manifest& manifest, const PoolOptions& options) {
  std::uint64_t extent = options.slot_extent_bytes;
  if (extent == 0 || extent % detail::kSlotDataAlignment != 0 || extent > kMaxSlotExtentBytes) {
    return Status(StatusCode::kInvalidArgument,
                  "slot_extent_bytes " + std::to_string(extent) + " must be a multiple of " +
                      std::to_string(detail::kSlotDataAlignment) + " between " +
                      std::to_string(detail::kSlotDataAlignment) + " and " +
                      std::to_string(kMaxSlotExtentBytes));
  }
  SlotLayout whole = ComputeLayout(manifest, options.part_bytes);
  if (whole.slot_bytes <= extent) return whole;
  for (const UnitSpec& unit : manifest.units) {
    if ((unit.flags & kUnitFlagEncoded) != 0) continue;
    for (const TensorSpec& tensor : unit.tensors) {
      if (tensor.bytes() > kMaxSlotExtentBytes) {
        return Status(StatusCode::kInvalidArgument,
                      "unit '" + unit.name + "' tensor '" + tensor.name + "' holds " +
                          std::to_string(tensor.bytes()) +
                          " bytes, more than one piece of a pool slot can (" +
                          std::to_string(kMaxSlotExtentBytes) +
                          " bytes; libpmemobj allocates at most about 16 GiB at once): split or "
                          "shard the tensor");
      }
      extent = std::max(extent, AlignUp(tensor.bytes(), detail::kSlotDataAlignment));
    }
  }
  return ComputeLayout(manifest, options.part_bytes, extent);
}

std::uint64_t Allocation(std::uint64_t bytes) { return AlignUp(bytes + 64, kPmemobjChunkBytes); }

}  // namespace

Result<std::uint64_t> Pool::RequiredBytes(const Manifest& manifest, const PoolOptions& options) {
  PMSNAP_RETURN_IF_ERROR(manifest.Validate());
  if (options.part_bytes < 4096 || options.part_bytes % kTensorAlignment != 0) {
    return Status(StatusCode::kInvalidArgument, "part_bytes " + std::to_string(options.part_bytes) +
                                                    " must be at least 4096 and a multiple of " +
                                                    std::to_string(kTensorAlignment));
  }
  PMSNAP_ASSIGN_OR_RETURN(const SlotLayout layout, PoolSlotLayout(manifest, options));
  // libpmemobj places each allocation inside one zone: pack them zone by
  // zone in the order Create allocates, each into the first zone with room
  // (a slot in one piece of a few GiB packs as tightly as before; extents
  // of 15 GiB take a zone each).
  const std::uint64_t zone_capacity = kPmemobjZoneBytes - kPmemobjZoneOverhead;
  std::vector<std::uint64_t> zone_used;
  auto place = [&](std::uint64_t bytes) {
    for (std::uint64_t& used : zone_used) {
      if (used + bytes <= zone_capacity) {
        used += bytes;
        return;
      }
    }
    zone_used.push_back(bytes);
  };
  place(Allocation(sizeof(PoolRoot)));
  place(Allocation(manifest.Serialize().size()));
  const bool in_extents = layout.extent_bytes != 0;
  if (in_extents) place(Allocation(2 * 8 * layout.extent_used.size()));
  for (int s = 0; s < 2; ++s) {
    for (std::uint64_t used : layout.extent_used) place(Allocation(used + detail::kSlotDataAlignment));
    place(Allocation(RecordBytes(layout.parts.size(), options.extra_state_capacity)));
  }
  std::uint64_t heap = (zone_used.size() - 1) * kPmemobjZoneBytes + zone_used.back();
  heap += detail::ChunkHeapFileBytes(options.chunk_heap_bytes);
  const std::uint64_t zones = heap / kPmemobjZoneBytes + 1;
  return std::max(kPmemobjMinPool, kPmemobjBaseOverhead + zones * kPmemobjZoneOverhead + heap);
}

namespace {
void (*g_before_create_rename)(const char* path) = nullptr;
}  // namespace

namespace detail {

int RenameNoReplace(const char* from, const char* to) {
  if (::renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0) return 0;
  if (errno != EINVAL && errno != ENOSYS) return errno;
  // A file system without RENAME_NOREPLACE: link fails with EEXIST just the same.
  if (::link(from, to) != 0) return errno;
  ::unlink(from);
  return 0;
}

void SetBeforeCreateRenameForTesting(void (*hook)(const char* path)) {
  g_before_create_rename = hook;
}

}  // namespace detail

Result<std::unique_ptr<Pool>> Pool::Create(const std::string& path, const Manifest& manifest,
                                           const PoolOptions& options) {
  // A malformed PM bandwidth is refused before the file is made.
  PMSNAP_RETURN_IF_ERROR(ResolvePmBandwidth(options.pm_bandwidth).status());
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t required, RequiredBytes(manifest, options));
  std::error_code ec;
  if (std::filesystem::exists(path, ec)) {
    return Status(StatusCode::kInvalidArgument,
                  "cannot create pool '" + path + "': the file already exists");
  }
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) parent = ".";
  if (!std::filesystem::is_directory(parent, ec)) {
    // An unsearchable parent (EACCES) is not a missing one: the fix differs.
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
      return PoolFileError(
          ec.value(),
          "cannot create pool '" + path + "': cannot reach directory '" + parent.string() + "'",
          ec.message());
    }
    return Status(StatusCode::kNotFound, "cannot create pool '" + path + "': directory '" +
                                             parent.string() + "' does not exist");
  }
  struct statfs file_system {};
  if (::statfs(parent.c_str(), &file_system) == 0) {
    const std::string problem =
        detail::PoolFileSystemProblem(static_cast<unsigned long>(file_system.f_type));
    if (!problem.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    "cannot create pool '" + path + "': '" + parent.string() + "': " + problem);
    }
  }
  if (options.check_free_space) {
    struct statvfs fs {};
    if (::statvfs(parent.c_str(), &fs) == 0) {
      const std::uint64_t free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
      if (free_bytes < required) {
        return Status(StatusCode::kNoSpace, "cannot create pool '" + path + "': needs " +
                                                std::to_string(required) + " bytes, only " +
                                                std::to_string(free_bytes) + " free on " +
                                                parent.string());
      }
    }
  }

  PMSNAP_ASSIGN_OR_RETURN(const SlotLayout layout, PoolSlotLayout(manifest, options));
  const bool in_extents = layout.extent_bytes != 0;
  const std::size_t extent_count = layout.extent_used.size();
  const std::vector<std::byte> manifest_bytes = manifest.Serialize();
  const std::uint64_t record_bytes = RecordBytes(layout.parts.size(), options.extra_state_capacity);
  const std::string temp_path = path + ".creating-" + std::to_string(::getpid());
  RemoveAbandonedCreations(path);

  PMEMobjpool* pop = pmemobj_create(temp_path.c_str(), kPoolLayoutName, required, 0644);
  if (pop == nullptr) {
    const int err = errno;
    const std::string cause = PmdkMessage(err);
    // libpmemobj deletes the file it made when it fails, but a file left
    // behind anyway would make every retry fail as "already exists".
    std::filesystem::remove(temp_path, ec);
    const std::string what =
        "cannot create pool '" + path + "' (" + std::to_string(required) + " bytes)";
    if (err == EINVAL || err == EOPNOTSUPP) {
      // pmemobj_create's own arguments are valid by construction here: what
      // failed is posix_fallocate or mmap on a file system that cannot do it.
      return Status(StatusCode::kInvalidArgument,
                    what + ": the file system of '" + parent.string() +
                        "' cannot preallocate or map the pool file (" + cause + ")");
    }
    return PoolFileError(err, what, cause,
                         err == ENOSPC || err == EDQUOT ? FreeSpaceOf(parent) : "");
  }
  detail::seam::Mapped(pop, reinterpret_cast<std::byte*>(pop), required);
  auto fail = [&](Status status) {
    detail::seam::Unmapping(pop);
    pmemobj_close(pop);
    std::filesystem::remove(temp_path, ec);
    return status;
  };
  PMEMoid root_oid = [&] {
    const detail::seam::LibraryWrites library_writes(pop);  // allocates the root
    return pmemobj_root(pop, sizeof(PoolRoot));
  }();
  if (OID_IS_NULL(root_oid)) {
    return fail({errno == ENOMEM ? StatusCode::kNoSpace : StatusCode::kIOError,
                 PmdkError(("cannot create pool '" + path + "': cannot make its root").c_str())});
  }
  auto* root = static_cast<PoolRoot*>(pmemobj_direct(root_oid));
  auto* base = reinterpret_cast<std::byte*>(pop);

  PoolHeader header{};
  // Slot 0's extents, then slot 1's: where each allocation, and its
  // kSlotDataAlignment-aligned data, start.
  std::vector<std::uint64_t> extent_alloc(2 * extent_count);
  std::vector<std::uint64_t> extent_data(2 * extent_count);
  Status allocated = RunTransaction(pop, "allocating pool structures", [&]() -> int {
    auto alloc = [&](std::uint64_t bytes, std::uint64_t flags) -> std::uint64_t {
      PMEMoid oid = pmemobj_tx_xalloc(bytes, 0, flags | POBJ_XALLOC_NO_ABORT);
      return OID_IS_NULL(oid) ? 0 : oid.off;
    };
    header.manifest_offset = alloc(manifest_bytes.size(), 0);
    if (header.manifest_offset == 0) return ENOMEM;
    if (in_extents) {
      header.slot_extent_table_offset = alloc(2 * 8 * extent_count, 0);
      if (header.slot_extent_table_offset == 0) return ENOMEM;
    }
    for (int s = 0; s < 2; ++s) {
      // Not flushed at commit: on the PM path libpmemobj flushes every byte
      // of a new allocation, which faults in and zeroes each page of both
      // slots through Create's own mapping (a 2 GiB pool in tmpfs: Create
      // 1.75-1.97 s with the flush, 0.51-0.65 s without), and a slot holds
      // nothing until an epoch writes and persists its parts.
      for (std::size_t i = 0; i < extent_count; ++i) {
        std::uint64_t& offset = extent_alloc[s * extent_count + i];
        offset = alloc(layout.extent_used[i] + detail::kSlotDataAlignment, POBJ_XALLOC_NO_FLUSH);
        if (offset == 0) return ENOMEM;
      }
      header.slot_record_offset[s] = alloc(record_bytes, POBJ_XALLOC_ZERO);
      if (header.slot_record_offset[s] == 0) return ENOMEM;
    }
    return 0;
  });
  if (!allocated.ok()) {
    std::string layout_note;
    if (allocated.code() == StatusCode::kNoSpace) {
      layout_note = " (two slots of " + std::to_string(layout.slot_bytes) + " bytes in " +
                    std::to_string(extent_count) + " piece(s) each, in a file of " +
                    std::to_string(required) + " bytes)";
    }
    return fail({allocated.code(),
                 "cannot create pool '" + path + "': " + allocated.message() + layout_note});
  }
  for (std::size_t e = 0; e < extent_alloc.size(); ++e) {
    const auto data_address = reinterpret_cast<std::uintptr_t>(base + extent_alloc[e]);
    extent_data[e] =
        AlignUp(data_address, detail::kSlotDataAlignment) - reinterpret_cast<std::uintptr_t>(base);
  }
  for (int s = 0; s < 2; ++s) {
    header.slot_alloc_offset[s] = extent_alloc[s * extent_count];
    header.slot_data_offset[s] = extent_data[s * extent_count];
  }
  if (in_extents) {
    const std::uint64_t table_bytes = 8 * extent_data.size();
    detail::seam::CopyPersist(pop, base + header.slot_extent_table_offset, extent_data.data(),
                              table_bytes);
    header.slot_extent_bytes = layout.extent_bytes;
    header.slot_extent_table_checksum = Checksum64(extent_data.data(), table_bytes);
  }
  detail::seam::CopyPersist(pop, base + header.manifest_offset, manifest_bytes.data(),
                            manifest_bytes.size());

  header.format_version = in_extents ? kFormatVersionSlotExtents : kFormatVersion;
  header.header_bytes = sizeof(PoolHeader);
  header.model_signature = manifest.Signature();
  header.created_unix_ns = detail::NowUnixNs();
  header.part_bytes = options.part_bytes;
  header.extra_state_capacity = options.extra_state_capacity;
  header.chunk_heap_bytes = options.chunk_heap_bytes;
  header.file_bytes = required;
  header.group_run_id = options.group.run_id;
  header.group_rank = options.group.rank;
  header.group_world_size = options.group.world_size;
  header.group_model_fingerprint = options.group.model_fingerprint;
  header.group_flags =
      options.group.created_beside_checkpoints ? detail::kGroupCreatedBesideCheckpoints : 0;
  header.unit_count = manifest.units.size();
  header.part_count = layout.parts.size();
  header.slot_bytes = layout.slot_bytes;
  header.record_bytes = record_bytes;
  header.manifest_bytes = manifest_bytes.size();
  header.manifest_checksum = Checksum64(manifest_bytes.data(), manifest_bytes.size());
  std::memcpy(header.magic, detail::kPoolMagic, sizeof(header.magic));
  header.header_checksum = detail::HeaderChecksum(header);
  detail::seam::CopyPersist(pop, &root->header, &header, sizeof(header));
  detail::seam::Unmapping(pop);
  pmemobj_close(pop);

  // The file appears under its real name only once complete, and never
  // over a file created there since the check above.
  if (g_before_create_rename != nullptr) g_before_create_rename(path.c_str());
  if (const int err = detail::RenameNoReplace(temp_path.c_str(), path.c_str()); err != 0) {
    std::filesystem::remove(temp_path, ec);
    if (err == EEXIST) {
      return Status(StatusCode::kInvalidArgument,
                    "cannot create pool '" + path +
                        "': the file already exists (it appeared while the pool was created)");
    }
    return PoolFileError(err, "cannot rename new pool to '" + path + "'", std::strerror(err));
  }
  const int dir_fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  OpenOptions open_options;
  open_options.verify_data = false;  // nothing committed yet
  open_options.prefault_mapping = options.prefault_mapping;
  open_options.prefault_method = options.prefault_method;
  open_options.pm_bandwidth = options.pm_bandwidth;
  return OpenImpl(path, &manifest, open_options);
}

}  // namespace pmsnap::layout
