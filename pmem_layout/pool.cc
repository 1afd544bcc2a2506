#include "pmsnap/pmem_layout/pool.h"

#include <fcntl.h>
#include <libpmem.h>
#include <libpmemobj.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <unordered_map>

#include "detail/file_system.h"
#include "detail/format.h"
#include "detail/prefault_order.h"
#include "detail/xxh3_kernels.h"
#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::layout {
namespace {

using detail::ChunkHeader;
using detail::PoolHeader;
using detail::PoolRoot;
using detail::SlotRecordHeader;

constexpr std::uint64_t AlignUp(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}
// libpmemobj internals, sized generously: pool header, lanes, heap header.
constexpr std::uint64_t kPmemobjBaseOverhead = 16ull << 20;
// Per zone (up to ~16 GiB of heap): zone header plus chunk headers.
constexpr std::uint64_t kPmemobjZoneBytes = 16ull << 30;
constexpr std::uint64_t kPmemobjZoneOverhead = 1ull << 20;
// Allocation unit of large pmemobj objects.
constexpr std::uint64_t kPmemobjChunkBytes = 256ull << 10;
constexpr std::uint64_t kPmemobjMinPool = 8ull << 20;
// Chunk-heap allocations up to kSmallChunkMax bytes come from one custom
// allocation class of 4 KiB units in 256 KiB runs (at least four per run, so
// runs stay >= 80% used); larger ones are libpmemobj "huge" allocations of
// whole 256 KiB chunks. Without this, libpmemobj's default classes each keep
// their own multi-megabyte runs and a heap of mixed sizes runs dry early.
constexpr std::uint64_t kChunkUnitBytes = 4096;
constexpr std::uint64_t kChunkRunUnits = 64;
constexpr std::uint64_t kSmallChunkMax = 16 * kChunkUnitBytes;
constexpr std::uint64_t kAllocationHeaderBytes = 16;  // libpmemobj compact header

// Heap bytes an allocation of `bytes` really occupies, as charged against the
// chunk-heap budget.
std::uint64_t ChargedBytes(std::uint64_t bytes) {
  const std::uint64_t with_header = bytes + kAllocationHeaderBytes;
  return with_header <= kSmallChunkMax ? AlignUp(with_header, kChunkUnitBytes)
                                       : AlignUp(with_header, kPmemobjChunkBytes);
}

std::mutex g_warning_mutex;
WarningSink& WarningSinkRef() {
  static WarningSink sink = [](const std::string& message) {
    std::cerr << "pmsnap: warning: " << message << std::endl;
  };
  return sink;
}

void Warn(std::vector<std::string>* into, const std::string& message) {
  into->push_back(message);
  std::lock_guard<std::mutex> lock(g_warning_mutex);
  if (WarningSinkRef()) WarningSinkRef()(message);
}

std::uint64_t NowUnixNs() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

std::string PmdkError(const char* what) {
  const char* msg = pmemobj_errormsg();
  return std::string(what) + ": " + ((msg != nullptr && *msg != '\0') ? msg : std::strerror(errno));
}

// libpmemobj's text for a failed pmemobj_create/open that set errno `err`.
std::string PmdkMessage(int err) {
  const char* msg = pmemobj_errormsg();
  return (msg != nullptr && *msg != '\0') ? msg : std::strerror(err);
}

// A failed operation on a pool file: `what` names the file and the step,
// `figures` (optional) what the file system has left, `cause` is the OS's
// or libpmemobj's own text; the code follows errno
// (detail::ClassifyPoolOsError).
Status PoolFileError(int err, const std::string& what, const std::string& cause,
                     const std::string& figures = "") {
  const detail::PoolOsError meaning = detail::ClassifyPoolOsError(err);
  std::string message = what;
  if (*meaning.hint != '\0') {
    message += ": ";
    message += meaning.hint;
    // Services often run as another user than the one who set the
    // permissions up: say which one was refused.
    if (err == EACCES || err == EPERM) {
      message += " for uid " + std::to_string(::geteuid()) + " gid " + std::to_string(::getegid());
    }
  }
  if (!figures.empty()) message += ": " + figures;
  return {meaning.code, message + " (" + cause + ")"};
}

// "'<dir>' has N bytes and M inodes free": a full file system may be out of
// either, and only the figures tell which.
std::string FreeSpaceOf(const std::filesystem::path& dir) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return "'" + dir.string() + "': free space unknown";
  return "'" + dir.string() + "' has " +
         std::to_string(static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize) + " bytes and " +
         std::to_string(fs.f_favail) + " inodes free";
}

std::uint64_t RecordBytes(std::uint64_t part_count, std::uint64_t extra_capacity) {
  return AlignUp(sizeof(SlotRecordHeader) + 8 * part_count + extra_capacity, 64);
}

std::uint64_t HeaderChecksum(const PoolHeader& header) {
  PoolHeader copy = header;
  copy.header_checksum = 0;
  return Checksum64(&copy, sizeof(copy));
}

std::uint64_t ChunkHeaderChecksum(const ChunkHeader& chunk) {
  const std::uint64_t fields[4] = {chunk.magic, chunk.epoch, chunk.tag, chunk.bytes};
  return Checksum64(fields, sizeof(fields));
}

std::uint64_t RecordChecksum(std::uint64_t epoch, const SlotRecordHeader& record) {
  const detail::RecordChecksumInput input{epoch,
                                          record.iteration,
                                          record.commit_time_unix_ns,
                                          record.extra_bytes,
                                          record.extra_checksum,
                                          record.parts_checksum};
  return Checksum64(&input, sizeof(input));
}

// Runs `body` inside a pmemobj transaction that returns (never longjmps) on
// failure. `body` returns 0 or an errno value.
template <typename Body>
Status RunTransaction(PMEMobjpool* pop, const std::string& what, Body&& body) {
  if (pmemobj_tx_begin(pop, nullptr, TX_PARAM_NONE) != 0) {
    return {StatusCode::kIOError, PmdkError(("cannot begin transaction for " + what).c_str())};
  }
  pmemobj_tx_set_failure_behavior(POBJ_TX_FAILURE_RETURN);
  int rc = body();
  std::string failure;
  if (rc != 0 && pmemobj_tx_stage() == TX_STAGE_WORK) {
    failure = PmdkError(what.c_str());
    pmemobj_tx_abort(rc);
  } else if (rc == 0) {
    pmemobj_tx_commit();
  } else {
    failure = PmdkError(what.c_str());
  }
  const int end_rc = pmemobj_tx_end();
  if (rc == 0 && end_rc == 0) return Status::Ok();
  const int err = rc != 0 ? rc : end_rc;
  if (failure.empty()) failure = PmdkError(what.c_str());
  return {err == ENOMEM ? StatusCode::kNoSpace : StatusCode::kIOError, failure};
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

}  // namespace

void SetWarningSink(WarningSink sink) {
  std::lock_guard<std::mutex> lock(g_warning_mutex);
  WarningSinkRef() = std::move(sink);
}

const char* SlotStateName(SlotState state) {
  switch (state) {
    case SlotState::kEmpty:
      return "EMPTY";
    case SlotState::kWriting:
      return "WRITING";
    case SlotState::kComplete:
      return "COMPLETE";
  }
  return "INVALID";
}

bool VerifyReport::ok() const {
  for (const SlotReport& slot : slots) {
    if (!slot.problems.empty()) return false;
  }
  return chunk_problems.empty();
}

std::span<const std::byte> SnapshotView::tensor(std::uint32_t unit, std::uint32_t tensor) const {
  const TensorLayout& t = layout_->units.at(unit).tensors.at(tensor);
  return {slot_data_ + t.slot_offset, t.bytes};
}

struct Pool::Impl {
  PMEMobjpool* pop = nullptr;
  std::byte* base = nullptr;  // the mapping: pool offsets are relative to it
  PoolRoot* root = nullptr;
  bool is_pmem = false;  // true: flushes + drain persist; false: msync
  std::uint64_t pool_uuid_lo = 0;
  std::uint32_t small_chunk_class = 0;  // custom allocation class id
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

  // Chunk heap mirror: chunk id -> info, rebuilt at open.
  mutable std::mutex chunk_mutex;  // guards chunks and the pmemobj chunk list
  std::unordered_map<std::uint64_t, ChunkInfo> chunks;
  std::string chunk_list_problem;  // set at open if the list walk stopped early

  // Background prefault of the mapping (OpenOptions::prefault_mapping).
  std::unique_ptr<PagePrefaulter> prefault;

  ~Impl() {
    prefault.reset();  // its thread writes into the mapping: stop it before unmapping
    if (pop != nullptr) pmemobj_close(pop);
  }

  template <typename T = std::byte>
  T* At(std::uint64_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }
  PoolHeader& header() const { return root->header; }
  SlotRecordHeader& record(int slot) const {
    return *At<SlotRecordHeader>(header().slot_record_offset[slot]);
  }
  std::uint64_t* part_checksums(int slot) const {
    return reinterpret_cast<std::uint64_t*>(&record(slot) + 1);
  }
  std::byte* extra_state(int slot) const {
    return reinterpret_cast<std::byte*>(part_checksums(slot) + header().part_count);
  }
  std::byte* slot_data(int slot) const { return At(header().slot_data_offset[slot]); }
  PMEMoid Oid(std::uint64_t offset) const { return PMEMoid{pool_uuid_lo, offset}; }
};

namespace {
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
}  // namespace

Pool::Pool() : impl_(std::make_unique<Impl>()) {}
Pool::~Pool() = default;

Result<std::uint64_t> Pool::RequiredBytes(const Manifest& manifest, const PoolOptions& options) {
  PMSNAP_RETURN_IF_ERROR(manifest.Validate());
  if (options.part_bytes < 4096 || options.part_bytes % kTensorAlignment != 0) {
    return Status(StatusCode::kInvalidArgument, "part_bytes " + std::to_string(options.part_bytes) +
                                                    " must be at least 4096 and a multiple of " +
                                                    std::to_string(kTensorAlignment));
  }
  const SlotLayout layout = ComputeLayout(manifest, options.part_bytes);
  auto allocation = [](std::uint64_t bytes) { return AlignUp(bytes + 64, kPmemobjChunkBytes); };
  std::uint64_t heap = allocation(sizeof(PoolRoot)) + allocation(manifest.Serialize().size());
  heap += 2 * allocation(layout.slot_bytes + detail::kSlotDataAlignment);
  heap += 2 * allocation(RecordBytes(layout.parts.size(), options.extra_state_capacity));
  if (options.chunk_heap_bytes > 0) {
    // The budget is charged in real heap bytes (ChargedBytes); on top: runs
    // of small chunks at >= 80% use, and one partly filled run per arena.
    heap += AlignUp(options.chunk_heap_bytes + options.chunk_heap_bytes / 4 + (8ull << 20),
                    kPmemobjChunkBytes);
  }
  const std::uint64_t zones = heap / kPmemobjZoneBytes + 1;
  return std::max(kPmemobjMinPool, kPmemobjBaseOverhead + zones * kPmemobjZoneOverhead + heap);
}

Result<std::unique_ptr<Pool>> Pool::Create(const std::string& path, const Manifest& manifest,
                                           const PoolOptions& options) {
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

  const SlotLayout layout = ComputeLayout(manifest, options.part_bytes);
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
  auto fail = [&](Status status) {
    pmemobj_close(pop);
    std::filesystem::remove(temp_path, ec);
    return status;
  };
  PMEMoid root_oid = pmemobj_root(pop, sizeof(PoolRoot));
  if (OID_IS_NULL(root_oid)) {
    return fail({errno == ENOMEM ? StatusCode::kNoSpace : StatusCode::kIOError,
                 PmdkError(("cannot create pool '" + path + "': cannot make its root").c_str())});
  }
  auto* root = static_cast<PoolRoot*>(pmemobj_direct(root_oid));
  auto* base = reinterpret_cast<std::byte*>(pop);

  PoolHeader header{};
  Status allocated = RunTransaction(pop, "allocating pool structures", [&]() -> int {
    auto alloc = [&](std::uint64_t bytes, std::uint64_t flags) -> std::uint64_t {
      PMEMoid oid = pmemobj_tx_xalloc(bytes, 0, flags | POBJ_XALLOC_NO_ABORT);
      return OID_IS_NULL(oid) ? 0 : oid.off;
    };
    header.manifest_offset = alloc(manifest_bytes.size(), 0);
    for (int s = 0; s < 2; ++s) {
      // Not flushed at commit: on the PM path libpmemobj flushes every byte
      // of a new allocation, which faults in and zeroes each page of both
      // slots through Create's own mapping (a 2 GiB pool in tmpfs: Create
      // 1.75-1.97 s with the flush, 0.51-0.65 s without), and a slot holds
      // nothing until an epoch writes and persists its parts.
      header.slot_alloc_offset[s] =
          alloc(layout.slot_bytes + detail::kSlotDataAlignment, POBJ_XALLOC_NO_FLUSH);
      header.slot_record_offset[s] = alloc(record_bytes, POBJ_XALLOC_ZERO);
      if (header.slot_alloc_offset[s] == 0 || header.slot_record_offset[s] == 0) return ENOMEM;
    }
    return header.manifest_offset == 0 ? ENOMEM : 0;
  });
  if (!allocated.ok()) {
    return fail({allocated.code(), "cannot create pool '" + path + "': " + allocated.message()});
  }
  for (int s = 0; s < 2; ++s) {
    const auto data_address = reinterpret_cast<std::uintptr_t>(base + header.slot_alloc_offset[s]);
    header.slot_data_offset[s] =
        AlignUp(data_address, detail::kSlotDataAlignment) - reinterpret_cast<std::uintptr_t>(base);
  }
  pmemobj_memcpy_persist(pop, base + header.manifest_offset, manifest_bytes.data(),
                         manifest_bytes.size());

  header.format_version = kFormatVersion;
  header.header_bytes = sizeof(PoolHeader);
  header.model_signature = manifest.Signature();
  header.created_unix_ns = NowUnixNs();
  header.part_bytes = options.part_bytes;
  header.extra_state_capacity = options.extra_state_capacity;
  header.chunk_heap_bytes = options.chunk_heap_bytes;
  header.unit_count = manifest.units.size();
  header.part_count = layout.parts.size();
  header.slot_bytes = layout.slot_bytes;
  header.record_bytes = record_bytes;
  header.manifest_bytes = manifest_bytes.size();
  header.manifest_checksum = Checksum64(manifest_bytes.data(), manifest_bytes.size());
  std::memcpy(header.magic, detail::kPoolMagic, sizeof(header.magic));
  header.header_checksum = HeaderChecksum(header);
  pmemobj_memcpy_persist(pop, &root->header, &header, sizeof(header));
  pmemobj_close(pop);

  // The file appears under its real name only once complete.
  std::filesystem::rename(temp_path, path, ec);
  if (ec) {
    const std::error_code rename_error = ec;
    std::filesystem::remove(temp_path, ec);
    return PoolFileError(rename_error.value(), "cannot rename new pool to '" + path + "'",
                         rename_error.message());
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
  return OpenImpl(path, &manifest, open_options);
}

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

  std::unique_ptr<Pool> pool(new Pool());
  pool->path_ = path;
  pool->file_bytes_ = static_cast<std::uint64_t>(st.st_size);
  Impl& impl = *pool->impl_;
  impl.pop = pmemobj_open(path.c_str(), kPoolLayoutName);
  if (impl.pop == nullptr) {
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
  PMSNAP_RETURN_IF_ERROR(pool->LoadAndRecover(options));

  if (expected != nullptr && expected->Signature() != pool->signature()) {
    std::string difference = pool->manifest_.FirstDifference(*expected);
    if (difference.empty()) difference = "signatures differ";
    return Status(StatusCode::kModelMismatch, "pool '" + path +
                                                  "' was made for another model: pool has " +
                                                  difference + " (pool vs this model)");
  }
  if (options.prefault_mapping) pool->StartPrefault(options.prefault_method);
  return pool;
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
  for (int slot : {first_slot, 1 - first_slot}) {
    wanted.push_back({header.slot_record_offset[slot], header.record_bytes});
    wanted.push_back({header.slot_data_offset[slot], header.slot_bytes});
  }
  std::vector<PrefaultRange> ranges;
  for (const FileRegion& region : detail::PrefaultOrder(wanted, file_bytes_, PageBytes())) {
    ranges.push_back({impl.At(region.offset), region.bytes});
  }
  impl.prefault = std::make_unique<PagePrefaulter>(ranges, method);
}

PrefaultProgress Pool::prefault_progress() const {
  if (impl_->prefault == nullptr) {
    PrefaultProgress off;
    off.state = PrefaultProgress::State::kDone;
    off.method = "off";
    return off;
  }
  return impl_->prefault->progress();
}

bool Pool::WaitForPrefault(std::chrono::nanoseconds timeout) const {
  return impl_->prefault == nullptr || impl_->prefault->WaitUntilSettled(timeout);
}

Status Pool::LoadAndRecover(const OpenOptions& options) {
  Impl& impl = *impl_;
  impl.base = reinterpret_cast<std::byte*>(impl.pop);
  impl.is_pmem = pmem_is_pmem(impl.base, file_bytes_) != 0;
  // Allocation classes are not persistent: register ours at every open.
  pobj_alloc_class_desc small_chunks{};
  small_chunks.unit_size = kChunkUnitBytes;
  small_chunks.units_per_block = kChunkRunUnits;
  small_chunks.header_type = POBJ_HEADER_COMPACT;
  if (pmemobj_ctl_set(impl.pop, "heap.alloc_class.new.desc", &small_chunks) != 0) {
    return Status(
        StatusCode::kIOError,
        PmdkError(("pool '" + path_ + "': cannot register the chunk allocation class").c_str()));
  }
  impl.small_chunk_class = small_chunks.class_id;
  const std::string where = "pool '" + path_ + "'";
  auto corruption = [&](const std::string& what) {
    return Status(StatusCode::kCorruption, where + ": " + what);
  };

  if (pmemobj_root_size(impl.pop) < sizeof(PoolRoot)) {
    return Status(StatusCode::kNotAPool, where + " has no pmsnap root object");
  }
  PMEMoid root_oid = pmemobj_root(impl.pop, sizeof(PoolRoot));
  impl.pool_uuid_lo = root_oid.pool_uuid_lo;
  impl.root = static_cast<PoolRoot*>(pmemobj_direct(root_oid));
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
  if (HeaderChecksum(header) != header.header_checksum) {
    return corruption("header checksum mismatch (the header was damaged)");
  }
  if (header.format_version != kFormatVersion) {
    return Status(StatusCode::kUnsupportedVersion,
                  where + " has format version " + std::to_string(header.format_version) +
                      ", this build reads version " + std::to_string(kFormatVersion));
  }
  auto in_bounds = [&](std::uint64_t offset, std::uint64_t bytes) {
    return offset >= sizeof(PoolRoot) && offset <= file_bytes_ && bytes <= file_bytes_ - offset;
  };
  if (!in_bounds(header.manifest_offset, header.manifest_bytes)) {
    return corruption("manifest lies outside the file");
  }
  for (int s = 0; s < 2; ++s) {
    if (!in_bounds(header.slot_data_offset[s], header.slot_bytes) ||
        !in_bounds(header.slot_record_offset[s], header.record_bytes)) {
      return corruption("slot " + std::to_string(s) + " lies outside the file (truncated?)");
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
      manifest_slot_bytes = AlignUp(manifest_slot_bytes, kTensorAlignment);
      if (manifest_slot_bytes > header.slot_bytes ||
          tensor.bytes() > header.slot_bytes - manifest_slot_bytes) {
        return corruption("manifest tensors need more than the header's slot of " +
                          std::to_string(header.slot_bytes) + " bytes");
      }
      manifest_slot_bytes += tensor.bytes();
    }
  }
  layout_ = ComputeLayout(manifest_, options_.part_bytes);
  if (layout_.slot_bytes != header.slot_bytes || layout_.parts.size() != header.part_count ||
      RecordBytes(header.part_count, header.extra_state_capacity) != header.record_bytes) {
    return corruption("slot layout recomputed from the manifest differs from the header");
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

  // Mirror the chunk list in DRAM; a damaged list stops the walk with a warning.
  std::uint64_t offset = impl.root->chunks.head_offset;
  std::uint64_t prev = 0;
  while (offset != 0) {
    // A misaligned offset cannot be a chunk (libpmemobj aligns allocations);
    // reading a header there would be undefined behaviour.
    const bool header_fits = offset % alignof(ChunkHeader) == 0 &&
                             in_bounds(offset, sizeof(ChunkHeader)) &&
                             impl.chunks.size() <= impl.root->chunks.count;
    const ChunkHeader* chunk = header_fits ? impl.At<ChunkHeader>(offset) : nullptr;
    if (chunk == nullptr || chunk->magic != detail::kChunkMagic || chunk->prev_offset != prev ||
        !in_bounds(offset + sizeof(ChunkHeader), chunk->bytes)) {
      impl.chunk_list_problem =
          where + ": chunk list is damaged at offset " + std::to_string(offset);
      Warn(&warnings_, impl.chunk_list_problem);
      break;
    }
    impl.chunks.emplace(
        offset, ChunkInfo{offset, chunk->epoch, chunk->tag, chunk->bytes, chunk->sealed == 1});
    prev = offset;
    offset = chunk->next_offset;
  }
  return Status::Ok();
}

std::uint64_t Pool::signature() const { return impl_->header().model_signature; }
std::uint32_t Pool::format_version() const { return impl_->header().format_version; }
std::uint64_t Pool::created_unix_ns() const { return impl_->header().created_unix_ns; }

std::optional<std::uint32_t> Pool::FindUnit(std::string_view name) const {
  auto it = impl_->unit_index.find(std::string(name));
  if (it == impl_->unit_index.end()) return std::nullopt;
  return it->second;
}

SlotInfo Pool::slot_info(int slot) const {
  const SlotRecordHeader& record = impl_->record(slot);
  // Acquire pairs with the release store in Commit: the record fields read
  // below are at least as new as the commit word.
  const std::uint64_t word = record.commit_word.load(std::memory_order_acquire);
  SlotInfo info;
  info.slot = slot;
  const std::uint8_t state = detail::CommitWordState(word);
  info.state = state <= 2 ? static_cast<SlotState>(state) : SlotState::kEmpty;
  info.epoch = detail::CommitWordEpoch(word);
  if (info.state == SlotState::kComplete) {
    info.iteration = record.iteration;
    info.commit_time_unix_ns = record.commit_time_unix_ns;
    info.extra_state_bytes = record.extra_bytes;
    info.record_valid = RecordChecksum(info.epoch, record) == record.record_checksum;
  }
  return info;
}

Status Pool::PickRecoveredSlot(bool deep, std::optional<int> excluded,
                               std::vector<std::string> rejected) {
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
    Warn(&warnings_, where + ": newest checkpoint is damaged, falling back to the older one: " + r);
  }
  return Status::Ok();
}

Status Pool::RejectLatest(std::uint32_t damaged_part) {
  if (damaged_part >= layout_.parts.size()) {
    return Status(StatusCode::kInvalidArgument,
                  "pool '" + path_ + "': no part " + std::to_string(damaged_part));
  }
  return RejectRecovered(PartProblem(damaged_part));
}

Status Pool::RejectRecovered(const std::string& problem) {
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
                            std::to_string(slot_info(damaged).epoch) + "): " + problem});
}

bool Pool::data_verification_pending() const { return impl_->unverified_slot.load() >= 0; }

void Pool::NotePartVerified(int slot, std::uint32_t part) const {
  Impl& impl = *impl_;
  if (impl.unverified_slot.load(std::memory_order_acquire) != slot) return;
  if (impl.part_verified[part].exchange(1) == 0 &&
      impl.parts_verified.fetch_add(1) + 1 == layout_.parts.size()) {
    impl.unverified_slot.store(-1, std::memory_order_release);
  }
}

std::string Pool::PartProblem(std::uint32_t part) const {
  const PartLayout& p = layout_.parts[part];
  const UnitSpec& unit = manifest_.units[p.unit];
  return "unit '" + unit.name + "' tensor '" + unit.tensors[p.tensor].name + "' bytes [" +
         std::to_string(p.offset_in_tensor) + ", " + std::to_string(p.offset_in_tensor + p.bytes) +
         ") fail their checksum";
}

Status Pool::ReadPart(const SnapshotView& view, std::uint32_t part, void* dst) const {
  if (dst == nullptr) {
    return Status(StatusCode::kInvalidArgument, "pool '" + path_ + "': ReadPart into nullptr");
  }
  return CopyAndVerifyPart(view, part, static_cast<std::byte*>(dst));
}

Status Pool::CopyPart(const SnapshotView& view, std::uint32_t part, void* dst) const {
  if (dst == nullptr) {
    return Status(StatusCode::kInvalidArgument, "pool '" + path_ + "': CopyPart into nullptr");
  }
  PMSNAP_ASSIGN_OR_RETURN(const std::byte* src, PartSource(view, part));
  const PrefaultPause pause(impl_->prefault.get());
  PrefaultPart(view, part);
  // Not PMEM_F_MEM_NODRAIN: the streaming stores are fenced before return.
  pmem_memcpy(dst, src, layout_.parts[part].bytes, PMEM_F_MEM_NONTEMPORAL);
  return Status::Ok();
}

Result<const std::byte*> Pool::PartSource(const SnapshotView& view, std::uint32_t part) const {
  if (part >= layout_.parts.size() || view.layout_ != &layout_) {
    return Status(StatusCode::kInvalidArgument,
                  "pool '" + path_ + "': no part " + std::to_string(part) + " in this pool's view");
  }
  return view.slot_data_ + layout_.parts[part].slot_offset;
}

Status Pool::VerifyPart(const SnapshotView& view, std::uint32_t part) const {
  return CopyAndVerifyPart(view, part, nullptr);
}

void Pool::PrefaultPart(const SnapshotView& view, std::uint32_t part) const {
  if (part >= layout_.parts.size() || view.layout_ != &layout_) return;
#ifdef MADV_POPULATE_READ
  const PartLayout& p = layout_.parts[part];
  const auto start = reinterpret_cast<std::uintptr_t>(view.slot_data_ + p.slot_offset);
  const std::uintptr_t page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t first = start & ~(page - 1);
  // Kernels before 5.14 answer EINVAL: the copy then faults as before.
  (void)::madvise(reinterpret_cast<void*>(first), start + p.bytes - first, MADV_POPULATE_READ);
#else
  (void)view;
#endif
}

Status Pool::CopyAndVerifyPart(const SnapshotView& view, std::uint32_t part, std::byte* dst) const {
  PMSNAP_ASSIGN_OR_RETURN(const std::byte* src, PartSource(view, part));
  const PartLayout& p = layout_.parts[part];
  const PrefaultPause pause(impl_->prefault.get());
  PrefaultPart(view, part);
  std::uint64_t digest = 0;
  std::size_t streamed = 0;
  if (dst != nullptr && reinterpret_cast<std::uintptr_t>(dst) % 64 == 0) {
    // One pass over PM: the loads that feed the copy feed the hash.
    streamed = detail::BestXxh3Kernels().copy_and_hash(dst, src, p.bytes, &digest);
    std::atomic_thread_fence(std::memory_order_seq_cst);  // orders the streaming stores
  }
  if (dst != nullptr && streamed < p.bytes) {
    std::memcpy(dst + streamed, src + streamed, p.bytes - streamed);
  }
  if (streamed == 0) digest = Checksum64(src, p.bytes);
  if (digest != impl_->part_checksums(view.slot())[part]) {
    return Status(StatusCode::kCorruption,
                  "pool '" + path_ + "' slot " + std::to_string(view.slot()) + " (epoch " +
                      std::to_string(view.epoch()) + "): " + PartProblem(part));
  }
  NotePartVerified(view.slot(), part);
  return Status::Ok();
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
      const std::uint64_t actual = Checksum64(impl.slot_data(slot) + part.slot_offset, part.bytes);
      if (actual != impl.part_checksums(slot)[p]) problems.push_back(PartProblem(p));
    }
  }
  return problems;
}

Result<SnapshotView> Pool::MakeView(int slot) const {
  SnapshotView view;
  view.info_ = slot_info(slot);
  view.slot_data_ = impl_->slot_data(slot);
  view.layout_ = &layout_;
  view.extra_state_ = {impl_->extra_state(slot), view.info_.extra_state_bytes};
  return view;
}

Result<SnapshotView> Pool::Latest() const {
  if (!recovered_slot_) {
    return Status(StatusCode::kNotFound, "pool '" + path_ + "' has no committed checkpoint yet");
  }
  return MakeView(*recovered_slot_);
}

Result<SnapshotView> Pool::Slot(int slot) const {
  if (slot != 0 && slot != 1) {
    return Status(StatusCode::kInvalidArgument, "slot must be 0 or 1, got " + std::to_string(slot));
  }
  const SlotInfo info = slot_info(slot);
  if (info.state != SlotState::kComplete) {
    return Status(StatusCode::kNotFound, "pool '" + path_ + "' slot " + std::to_string(slot) +
                                             " is " + SlotStateName(info.state) +
                                             ", not a committed checkpoint");
  }
  std::vector<std::string> problems = CheckSlot(slot, /*deep=*/false);
  if (!problems.empty()) {
    return Status(StatusCode::kCorruption,
                  "pool '" + path_ + "' slot " + std::to_string(slot) + ": " + problems.front());
  }
  return MakeView(slot);
}

std::optional<std::uint64_t> Pool::open_epoch() const { return impl_->open_epoch; }
std::optional<std::uint64_t> Pool::last_committed_epoch() const { return impl_->last_committed; }

Result<std::uint64_t> Pool::BeginEpoch(std::uint64_t iteration) {
  Impl& impl = *impl_;
  if (impl.open_epoch) {
    return Status(StatusCode::kBusy, "pool '" + path_ + "': epoch " +
                                         std::to_string(*impl.open_epoch) +
                                         " is still open; commit or abandon it first");
  }
  if (data_verification_pending()) {
    // Deferred verification must end before a slot is overwritten: with a
    // damaged newest slot, the epoch goes there and the older one is kept.
    const int slot = impl.unverified_slot.load();
    std::vector<std::string> problems = CheckSlot(slot, /*deep=*/true);
    impl.unverified_slot.store(-1);
    if (!problems.empty()) PMSNAP_RETURN_IF_ERROR(RejectRecovered(problems.front()));
  }
  if (!impl.orphans_swept) {
    PMSNAP_RETURN_IF_ERROR(SweepOrphanChunks());
    impl.orphans_swept = true;
  }
  const std::uint64_t epoch = impl.last_committed ? *impl.last_committed + 1 : 1;
  const int slot = static_cast<int>(epoch % 2);
  SlotRecordHeader& record = impl.record(slot);
  record.commit_word.store(
      detail::MakeCommitWord(epoch, static_cast<std::uint8_t>(SlotState::kWriting)),
      std::memory_order_release);
  pmemobj_persist(impl.pop, &record.commit_word, sizeof(record.commit_word));
  record.iteration = iteration;
  for (std::size_t p = 0; p < layout_.parts.size(); ++p) {
    impl.written[p].store(0, std::memory_order_relaxed);
  }
  impl.open_epoch = epoch;
  return epoch;
}

Status Pool::WritePart(std::uint32_t part, const void* src) {
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> dst, PartDestination(part));
  Impl& impl = *impl_;
  const auto* in = static_cast<const std::byte*>(src);
  std::uint64_t digest = 0;
  std::size_t streamed = 0;
  if (reinterpret_cast<std::uintptr_t>(dst.data()) % 64 == 0) {
    // Bulk of the part: one pass that streams to PM and hashes the same loads.
    streamed = detail::BestXxh3Kernels().copy_and_hash(dst.data(), in, dst.size(), &digest);
  }
  if (streamed == 0) {
    digest = Checksum64(in, dst.size());
  }
  if (streamed < dst.size()) {
    pmemobj_memcpy(impl.pop, dst.data() + streamed, in + streamed, dst.size() - streamed,
                   PMEMOBJ_F_MEM_NONTEMPORAL | PMEMOBJ_F_MEM_NODRAIN);
  }
  if (streamed > 0 && !impl.is_pmem) {
    pmemobj_persist(impl.pop, dst.data(), streamed);  // msync path: stores are in the page cache
  }
  pmemobj_drain(impl.pop);
  const int slot = static_cast<int>(*impl.open_epoch % 2);
  std::uint64_t* stored = &impl.part_checksums(slot)[part];
  *stored = digest;
  pmemobj_persist(impl.pop, stored, sizeof(*stored));
  impl.written[part].store(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status Pool::WriteTensor(std::uint32_t unit, std::uint32_t tensor, const void* src) {
  if (unit >= layout_.units.size() || tensor >= layout_.units[unit].tensors.size()) {
    return Status(StatusCode::kInvalidArgument, "pool '" + path_ + "': no tensor " +
                                                    std::to_string(tensor) + " in unit " +
                                                    std::to_string(unit));
  }
  const TensorLayout& t = layout_.units[unit].tensors[tensor];
  for (std::uint32_t p = t.first_part; p < t.first_part + t.part_count; ++p) {
    PMSNAP_RETURN_IF_ERROR(
        WritePart(p, static_cast<const std::byte*>(src) + layout_.parts[p].offset_in_tensor));
  }
  return Status::Ok();
}

Result<std::span<std::byte>> Pool::PartDestination(std::uint32_t part) {
  const Impl& impl = *impl_;
  if (!impl.open_epoch) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool '" + path_ + "': no epoch is open (call BeginEpoch first)");
  }
  if (part >= layout_.parts.size()) {
    return Status(StatusCode::kInvalidArgument,
                  "pool '" + path_ + "': part " + std::to_string(part) + " out of range (" +
                      std::to_string(layout_.parts.size()) + " parts)");
  }
  const int slot = static_cast<int>(*impl.open_epoch % 2);
  const PartLayout& p = layout_.parts[part];
  return std::span<std::byte>(impl.slot_data(slot) + p.slot_offset, p.bytes);
}

Status Pool::SealPart(std::uint32_t part) {
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> dst, PartDestination(part));
  Impl& impl = *impl_;
  pmemobj_persist(impl.pop, dst.data(), dst.size());
  const int slot = static_cast<int>(*impl.open_epoch % 2);
  std::uint64_t* stored = &impl.part_checksums(slot)[part];
  *stored = Checksum64(dst.data(), dst.size());
  pmemobj_persist(impl.pop, stored, sizeof(*stored));
  impl.written[part].store(1, std::memory_order_relaxed);
  return Status::Ok();
}

Status Pool::Commit(std::span<const std::byte> extra_state) {
  Impl& impl = *impl_;
  if (!impl.open_epoch) {
    return Status(StatusCode::kFailedPrecondition, "pool '" + path_ + "': no epoch to commit");
  }
  if (extra_state.size() > options_.extra_state_capacity) {
    return Status(StatusCode::kCapacityExceeded, "pool '" + path_ + "': extra state of " +
                                                     std::to_string(extra_state.size()) +
                                                     " bytes exceeds the configured capacity of " +
                                                     std::to_string(options_.extra_state_capacity) +
                                                     " bytes (PoolOptions::extra_state_capacity)");
  }
  for (std::uint32_t p = 0; p < layout_.parts.size(); ++p) {
    if (impl.written[p].load(std::memory_order_relaxed) == 0) {
      const PartLayout& part = layout_.parts[p];
      const UnitSpec& unit = manifest_.units[part.unit];
      return Status(StatusCode::kFailedPrecondition,
                    "pool '" + path_ + "': cannot commit epoch " +
                        std::to_string(*impl.open_epoch) + ": unit '" + unit.name + "' tensor '" +
                        unit.tensors[part.tensor].name + "' was not written");
    }
  }
  const std::uint64_t epoch = *impl.open_epoch;
  const int slot = static_cast<int>(epoch % 2);
  SlotRecordHeader& record = impl.record(slot);
  if (!extra_state.empty()) {
    pmemobj_memcpy_persist(impl.pop, impl.extra_state(slot), extra_state.data(),
                           extra_state.size());
  }
  record.commit_time_unix_ns = NowUnixNs();
  record.extra_bytes = extra_state.size();
  record.extra_checksum = Checksum64(extra_state.data(), extra_state.size());
  record.parts_checksum = Checksum64(impl.part_checksums(slot), 8 * layout_.parts.size());
  record.record_checksum = RecordChecksum(epoch, record);
  pmemobj_persist(impl.pop, &record.iteration,
                  sizeof(SlotRecordHeader) - sizeof(record.commit_word));
  // The commit point: one 8-byte atomic store, then persist.
  record.commit_word.store(
      detail::MakeCommitWord(epoch, static_cast<std::uint8_t>(SlotState::kComplete)),
      std::memory_order_release);
  pmemobj_persist(impl.pop, &record.commit_word, sizeof(record.commit_word));
  impl.last_committed = epoch;
  impl.open_epoch.reset();
  recovered_slot_ = slot;
  return Status::Ok();
}

void Pool::Abandon() { impl_->open_epoch.reset(); }

Status Pool::SweepOrphanChunks() {
  const std::uint64_t committed = impl_->last_committed.value_or(0);
  std::vector<std::uint64_t> orphans;
  {
    std::lock_guard<std::mutex> lock(impl_->chunk_mutex);
    for (const auto& [id, info] : impl_->chunks) {
      if (info.epoch > committed) orphans.push_back(id);
    }
  }
  for (std::uint64_t id : orphans) PMSNAP_RETURN_IF_ERROR(FreeChunk(id));
  return Status::Ok();
}

Result<ChunkInfo> Pool::AllocChunk(std::uint64_t bytes, std::uint64_t epoch, std::uint64_t tag) {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.chunk_mutex);
  const std::uint64_t needed = ChargedBytes(sizeof(ChunkHeader) + bytes);
  const std::uint64_t used = impl.root->chunks.used_bytes;
  const std::uint64_t capacity = options_.chunk_heap_bytes;
  if (used > capacity || needed > capacity - used) {
    return Status(StatusCode::kNoSpace, "pool '" + path_ + "': chunk heap full: chunk needs " +
                                            std::to_string(needed) + " bytes, " +
                                            std::to_string(capacity - std::min(used, capacity)) +
                                            " of " + std::to_string(capacity) + " free");
  }
  std::uint64_t offset = 0;
  Status status = RunTransaction(impl.pop, "allocating a chunk", [&]() -> int {
    auto& heap = impl.root->chunks;
    if (pmemobj_tx_add_range_direct(&heap, sizeof(heap)) != 0) return errno ? errno : EIO;
    // Small chunks: our class. Large ones ask for whole 256 KiB chunks, which
    // libpmemobj serves as huge allocations (its default run classes would
    // otherwise take mid-size requests into runs of their own).
    const bool small = sizeof(ChunkHeader) + bytes + kAllocationHeaderBytes <= kSmallChunkMax;
    const std::uint64_t size =
        small ? sizeof(ChunkHeader) + bytes : needed - kAllocationHeaderBytes;
    const std::uint64_t flags = small ? POBJ_CLASS_ID(impl.small_chunk_class) : 0;
    PMEMoid oid = pmemobj_tx_xalloc(size, 0, flags | POBJ_XALLOC_NO_ABORT);
    if (OID_IS_NULL(oid)) return ENOMEM;
    offset = oid.off;
    auto& chunk = *impl.At<ChunkHeader>(offset);
    // Fresh allocation: undo not needed for its contents.
    std::memset(&chunk, 0, sizeof(chunk));
    chunk.magic = detail::kChunkMagic;
    chunk.next_offset = heap.head_offset;
    chunk.epoch = epoch;
    chunk.tag = tag;
    chunk.bytes = bytes;
    chunk.header_checksum = ChunkHeaderChecksum(chunk);
    pmemobj_persist(impl.pop, &chunk, sizeof(chunk));
    if (heap.head_offset != 0) {
      auto& old_head = *impl.At<ChunkHeader>(heap.head_offset);
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
        "pool '" + path_ + "': cannot allocate a chunk of " + std::to_string(bytes) + " bytes";
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
  impl.chunks.emplace(offset, info);
  return info;
}

Result<std::span<std::byte>> Pool::ChunkPayload(std::uint64_t chunk_id) {
  std::lock_guard<std::mutex> lock(impl_->chunk_mutex);
  auto it = impl_->chunks.find(chunk_id);
  if (it == impl_->chunks.end()) {
    return Status(StatusCode::kNotFound,
                  "pool '" + path_ + "': no chunk with id " + std::to_string(chunk_id));
  }
  if (it->second.sealed) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool '" + path_ + "': chunk " + std::to_string(chunk_id) + " is sealed");
  }
  return std::span<std::byte>(impl_->At(chunk_id + sizeof(ChunkHeader)), it->second.bytes);
}

Status Pool::SealChunk(std::uint64_t chunk_id) {
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, ChunkPayload(chunk_id));
  Impl& impl = *impl_;
  pmemobj_persist(impl.pop, payload.data(), payload.size());
  auto& chunk = *impl.At<ChunkHeader>(chunk_id);
  chunk.payload_checksum = Checksum64(payload.data(), payload.size());
  pmemobj_persist(impl.pop, &chunk.payload_checksum, sizeof(chunk.payload_checksum));
  chunk.sealed = 1;
  pmemobj_persist(impl.pop, &chunk.sealed, sizeof(chunk.sealed));
  std::lock_guard<std::mutex> lock(impl.chunk_mutex);
  impl.chunks[chunk_id].sealed = true;
  return Status::Ok();
}

Result<std::span<const std::byte>> Pool::ReadChunk(std::uint64_t chunk_id) const {
  const Impl& impl = *impl_;
  {
    std::lock_guard<std::mutex> lock(impl.chunk_mutex);
    auto it = impl.chunks.find(chunk_id);
    if (it == impl.chunks.end()) {
      return Status(StatusCode::kNotFound,
                    "pool '" + path_ + "': no chunk with id " + std::to_string(chunk_id));
    }
    if (!it->second.sealed) {
      return Status(StatusCode::kFailedPrecondition,
                    "pool '" + path_ + "': chunk " + std::to_string(chunk_id) +
                        " was never sealed (its writer did not finish)");
    }
  }
  const auto& chunk = *impl.At<ChunkHeader>(chunk_id);
  const std::string where = "pool '" + path_ + "': chunk " + std::to_string(chunk_id) + " (epoch " +
                            std::to_string(chunk.epoch) + ", tag " + std::to_string(chunk.tag) +
                            ")";
  if (ChunkHeaderChecksum(chunk) != chunk.header_checksum) {
    return Status(StatusCode::kCorruption, where + ": chunk header checksum mismatch");
  }
  std::span<const std::byte> payload(impl.At(chunk_id + sizeof(ChunkHeader)), chunk.bytes);
  if (Checksum64(payload.data(), payload.size()) != chunk.payload_checksum) {
    return Status(StatusCode::kCorruption, where + ": payload checksum mismatch");
  }
  return payload;
}

Status Pool::FreeChunk(std::uint64_t chunk_id) {
  Impl& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.chunk_mutex);
  if (impl.chunks.find(chunk_id) == impl.chunks.end()) {
    return Status(StatusCode::kNotFound,
                  "pool '" + path_ + "': no chunk with id " + std::to_string(chunk_id));
  }
  Status status = RunTransaction(impl.pop, "freeing a chunk", [&]() -> int {
    auto& heap = impl.root->chunks;
    auto& chunk = *impl.At<ChunkHeader>(chunk_id);
    if (pmemobj_tx_add_range_direct(&heap, sizeof(heap)) != 0) return errno ? errno : EIO;
    if (chunk.prev_offset != 0) {
      auto& prev = *impl.At<ChunkHeader>(chunk.prev_offset);
      if (pmemobj_tx_add_range_direct(&prev.next_offset, 8) != 0) return errno ? errno : EIO;
      prev.next_offset = chunk.next_offset;
    } else {
      heap.head_offset = chunk.next_offset;
    }
    // A damaged list ends the open's walk early, and the last chunk it kept
    // may point on to anything: only a chunk the walk (or AllocChunk) kept
    // is written, never whatever bytes a damaged pointer names.
    if (chunk.next_offset != 0 && impl.chunks.count(chunk.next_offset) != 0) {
      auto& next = *impl.At<ChunkHeader>(chunk.next_offset);
      if (pmemobj_tx_add_range_direct(&next.prev_offset, 8) != 0) return errno ? errno : EIO;
      next.prev_offset = chunk.prev_offset;
    }
    heap.used_bytes -= std::min(heap.used_bytes, ChargedBytes(sizeof(ChunkHeader) + chunk.bytes));
    heap.count -= std::min<std::uint64_t>(heap.count, 1);
    return pmemobj_tx_free(impl.Oid(chunk_id));
  });
  if (!status.ok()) {
    return Status(status.code(), "pool '" + path_ + "': cannot free chunk " +
                                     std::to_string(chunk_id) + ": " + status.message());
  }
  impl.chunks.erase(chunk_id);
  return Status::Ok();
}

std::vector<ChunkInfo> Pool::ListChunks() const {
  std::lock_guard<std::mutex> lock(impl_->chunk_mutex);
  std::vector<ChunkInfo> out;
  out.reserve(impl_->chunks.size());
  for (const auto& [id, info] : impl_->chunks) out.push_back(info);
  std::sort(out.begin(), out.end(),
            [](const ChunkInfo& a, const ChunkInfo& b) { return a.id < b.id; });
  return out;
}

std::uint64_t Pool::chunk_heap_used() const {
  std::lock_guard<std::mutex> lock(impl_->chunk_mutex);
  return impl_->root->chunks.used_bytes;
}

std::span<std::byte> Pool::slot_mapping(int slot) const {
  return {impl_->slot_data(slot), impl_->header().slot_bytes};
}

FileRegions Pool::regions() const {
  const Impl& impl = *impl_;
  const PoolHeader& header = impl.header();
  auto offset_of = [&](const void* p) {
    return static_cast<std::uint64_t>(static_cast<const std::byte*>(p) - impl.base);
  };
  FileRegions regions;
  regions.header = {offset_of(&impl.root->header), sizeof(PoolHeader)};
  regions.chunk_heap_root = {offset_of(&impl.root->chunks), sizeof(detail::ChunkHeapRoot)};
  regions.manifest = {header.manifest_offset, header.manifest_bytes};
  for (int s = 0; s < 2; ++s) {
    regions.record[s] = {header.slot_record_offset[s], header.record_bytes};
    regions.slot_data[s] = {header.slot_data_offset[s], header.slot_bytes};
  }
  return regions;
}

VerifyReport Pool::Verify(bool deep) const {
  VerifyReport report;
  for (int s = 0; s < 2; ++s) {
    report.slots[s].info = slot_info(s);
    report.slots[s].problems = CheckSlot(s, deep);
  }
  std::optional<int> best;
  for (int s = 0; s < 2; ++s) {
    if (report.slots[s].info.state == SlotState::kComplete && report.slots[s].problems.empty() &&
        (!best || report.slots[s].info.epoch > report.slots[*best].info.epoch)) {
      best = s;
    }
  }
  report.recoverable_slot = best;
  if (deep) {
    for (const ChunkInfo& chunk : ListChunks()) {
      if (!chunk.sealed) continue;
      Result<std::span<const std::byte>> payload = ReadChunk(chunk.id);
      if (!payload.ok()) report.chunk_problems.push_back(payload.status().message());
    }
  }
  if (!impl_->chunk_list_problem.empty())
    report.chunk_problems.push_back(impl_->chunk_list_problem);
  return report;
}

}  // namespace pmsnap::layout
