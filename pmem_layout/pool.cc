// Pool (pool.h): the accessors, the slot readers (ReadPart, VerifyPart,
// CopyPart), the epoch writer (BeginEpoch .. Commit) and Verify. Creation
// is in pool_create.cc, open and recovery in pool_open.cc, the chunk heap in
// chunk_heap.cc.
#include "pmsnap/pmem_layout/pool.h"

#include <libpmem.h>
#include <libpmemobj.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <iostream>

#include "detail/file_system.h"
#include "detail/format.h"
#include "detail/persistence.h"
#include "detail/pool_impl.h"
#include "detail/xxh3_kernels.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::layout {
namespace {

using detail::PoolHeader;
using detail::PrefaultPause;
using detail::RecordChecksum;
using detail::SlotRecordHeader;

Mutex g_warning_mutex;
WarningSink& WarningSinkRef() PMSNAP_REQUIRES(g_warning_mutex) {
  static WarningSink sink = [](const std::string& message) {
    std::cerr << "pmsnap: warning: " << message << std::endl;
  };
  return sink;
}

// kBusy naming pool `path`'s open epoch, if one is open.
Status RefuseWhileEpochOpen(const std::string& path, const std::optional<std::uint64_t>& open) {
  if (!open) return Status::Ok();
  return Status(StatusCode::kBusy, "pool '" + path + "': epoch " + std::to_string(*open) +
                                       " is open; commit or abandon it first");
}

}  // namespace

namespace detail {

void Warn(std::vector<std::string>* into, const std::string& message) {
  into->push_back(message);
  MutexLock lock(g_warning_mutex);
  if (WarningSinkRef()) WarningSinkRef()(message);
}

std::uint64_t NowUnixNs() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

Status PoolFileError(int err, const std::string& what, const std::string& cause,
                     const std::string& figures) {
  const PoolOsError meaning = ClassifyPoolOsError(err);
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

}  // namespace detail

void SetWarningSink(WarningSink sink) {
  MutexLock lock(g_warning_mutex);
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
  return {data_.at(t.slot_offset), t.bytes};
}

Pool::Pool() : impl_(std::make_unique<Impl>()) {}
Pool::~Pool() = default;

const PmBandwidth& Pool::pm_bandwidth() const { return impl_->pm_bandwidth; }

std::string PmBandwidth::Label() const {
  if (!simulated()) return "";
  const auto rate = [](double gbps) {
    if (gbps <= 0) return std::string("machine speed");
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3g GB/s", gbps);
    return std::string(buf);
  };
  return "simulated PM (" + rate(write_gbps) + " write, " + rate(read_gbps) + " read)";
}

Result<PmBandwidth> ResolvePmBandwidth(const PmBandwidth& requested) {
  PmBandwidth resolved = requested;
  const auto fill = [](double* gbps, const char* option, const char* variable) -> Status {
    if (*gbps < 0 || !std::isfinite(*gbps)) {
      return Status(StatusCode::kInvalidArgument,
                    std::string("PmBandwidth::") + option + " is " + std::to_string(*gbps) +
                        ", expected a rate in GB/s > 0, or 0 for the machine's speed");
    }
    const char* text = std::getenv(variable);
    if (*gbps > 0 || text == nullptr || *text == '\0') return Status::Ok();
    char* end = nullptr;
    const double value = std::strtod(text, &end);
    if (end == text || *end != '\0' || !(value > 0) || !std::isfinite(value)) {
      return Status(StatusCode::kInvalidArgument,
                    std::string(variable) + "='" + text +
                        "': expected a PM bandwidth in GB/s greater than 0 (e.g. 2.3)");
    }
    *gbps = value;
    return Status::Ok();
  };
  PMSNAP_RETURN_IF_ERROR(fill(&resolved.write_gbps, "write_gbps", "PMSNAP_PM_WRITE_GBPS"));
  PMSNAP_RETURN_IF_ERROR(fill(&resolved.read_gbps, "read_gbps", "PMSNAP_PM_READ_GBPS"));
  return resolved;
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

int Pool::committed_slots() const {
  return (slot_info(0).state == SlotState::kComplete ? 1 : 0) +
         (slot_info(1).state == SlotState::kComplete ? 1 : 0);
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
  const auto started = detail::seam::PaceStart(impl_->pm.read);
  // Not PMEM_F_MEM_NODRAIN: the streaming stores are fenced before return.
  pmem_memcpy(dst, src, layout_.parts[part].bytes, PMEM_F_MEM_NONTEMPORAL);
  detail::seam::PaceRead(impl_->pm, layout_.parts[part].bytes, started);
  return Status::Ok();
}

Result<const std::byte*> Pool::PartSource(const SnapshotView& view, std::uint32_t part) const {
  if (part >= layout_.parts.size() || view.layout_ != &layout_) {
    return Status(StatusCode::kInvalidArgument,
                  "pool '" + path_ + "': no part " + std::to_string(part) + " in this pool's view");
  }
  return view.data_.at(layout_.parts[part].slot_offset);
}

Status Pool::VerifyPart(const SnapshotView& view, std::uint32_t part) const {
  return CopyAndVerifyPart(view, part, nullptr);
}

void Pool::PrefaultPart(const SnapshotView& view, std::uint32_t part) const {
  if (part >= layout_.parts.size() || view.layout_ != &layout_) return;
#ifdef MADV_POPULATE_READ
  const PartLayout& p = layout_.parts[part];
  const auto start = reinterpret_cast<std::uintptr_t>(view.data_.at(p.slot_offset));
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
  const auto started = detail::seam::PaceStart(impl_->pm.read);
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
  detail::seam::PaceRead(impl_->pm, p.bytes, started);
  if (digest != impl_->part_checksums(view.slot())[part]) {
    return Status(StatusCode::kCorruption,
                  "pool '" + path_ + "' slot " + std::to_string(view.slot()) + " (epoch " +
                      std::to_string(view.epoch()) + "): " + PartProblem(part));
  }
  NotePartVerified(view.slot(), part);
  return Status::Ok();
}

Result<SnapshotView> Pool::MakeView(int slot) const {
  SnapshotView view;
  view.info_ = slot_info(slot);
  view.data_ = impl_->slot_addressing(slot);
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

Status Pool::RefuseReadOnly(const char* what) const {
  if (!impl_->read_only) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                "pool '" + path_ + "' is open read-only: cannot " + what);
}

Result<std::uint64_t> Pool::BeginEpoch(std::uint64_t iteration) {
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("begin an epoch"));
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
    if (!problems.empty()) PMSNAP_RETURN_IF_ERROR(RejectRecovered(problems.front(), kDamagedFallback));
  }
  const std::uint64_t epoch = impl.last_committed ? *impl.last_committed + 1 : 1;
  const int slot = static_cast<int>(epoch % 2);
  impl.PersistCommitWord(slot, epoch, SlotState::kWriting);
  SlotRecordHeader& record = impl.record(slot);
  if (!impl.orphans_swept) {
    // After the slot is marked: the slot may hold a complete epoch newer
    // than last_committed (rolled back by RollBackLatest, or damaged), whose
    // chunks this frees; a power cut in between must not leave it complete
    // without them.
    PMSNAP_RETURN_IF_ERROR(impl.chunk_heap->FreeNewerThan(impl.last_committed.value_or(0)));
    impl.orphans_swept = true;
  }
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
  const auto started = detail::seam::PaceStart(impl.pm.write);
  const auto* in = static_cast<const std::byte*>(src);
  std::uint64_t digest = 0;
  std::size_t streamed = 0;
  if (reinterpret_cast<std::uintptr_t>(dst.data()) % 64 == 0) {
    // Bulk of the part: one pass that streams to PM and hashes the same loads.
    streamed = detail::seam::StreamAndHash(dst.data(), in, dst.size(), &digest);
  }
  if (streamed == 0) {
    digest = Checksum64(in, dst.size());
  }
  if (streamed < dst.size()) {
    detail::seam::CopyNonTemporal(impl.pop, dst.data() + streamed, in + streamed,
                                  dst.size() - streamed);
  }
  if (streamed > 0 && !impl.is_pmem) {
    // msync path: stores are in the page cache
    detail::seam::Persist(impl.pop, dst.data(), streamed);
  }
  detail::seam::Drain(impl.pop);
  detail::seam::PaceWrite(impl.pm, dst.size(), started);
  const int slot = static_cast<int>(*impl.open_epoch % 2);
  std::uint64_t* stored = &impl.part_checksums(slot)[part];
  *stored = digest;
  detail::seam::Persist(impl.pop, stored, sizeof(*stored));
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
  return std::span<std::byte>(impl.slot_addressing(slot).at(p.slot_offset), p.bytes);
}

Status Pool::SealPart(std::uint32_t part) {
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> dst, PartDestination(part));
  Impl& impl = *impl_;
  // The caller (a device's copy) wrote the part before SealPart: its PM
  // time is charged from here.
  const auto started = detail::seam::PaceStart(impl.pm.write);
  detail::seam::Persist(impl.pop, dst.data(), dst.size());
  detail::seam::PaceWrite(impl.pm, dst.size(), started);
  const int slot = static_cast<int>(*impl.open_epoch % 2);
  std::uint64_t* stored = &impl.part_checksums(slot)[part];
  *stored = Checksum64(dst.data(), dst.size());
  detail::seam::Persist(impl.pop, stored, sizeof(*stored));
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
    const auto started = detail::seam::PaceStart(impl.pm.write);
    detail::seam::CopyPersist(impl.pop, impl.extra_state(slot), extra_state.data(),
                              extra_state.size());
    detail::seam::PaceWrite(impl.pm, extra_state.size(), started);
  }
  record.commit_time_unix_ns = detail::NowUnixNs();
  record.extra_bytes = extra_state.size();
  record.extra_checksum = Checksum64(extra_state.data(), extra_state.size());
  record.parts_checksum = Checksum64(impl.part_checksums(slot), 8 * layout_.parts.size());
  record.record_checksum = RecordChecksum(epoch, record);
  detail::seam::Flush(impl.pop, &record.iteration,
                      sizeof(SlotRecordHeader) - sizeof(record.commit_word));
  // The record must be durable before the commit word says COMPLETE. (The
  // power-loss tests can drop this drain on purpose to show they catch it.)
  if (!detail::CommitRecordDrainDropped()) [[likely]] detail::seam::Drain(impl.pop);
  // The commit point: one 8-byte atomic store, then persist.
  impl.PersistCommitWord(slot, epoch, SlotState::kComplete);
  impl.last_committed = epoch;
  impl.open_epoch.reset();
  recovered_slot_ = slot;
  return Status::Ok();
}

void Pool::Abandon() { impl_->open_epoch.reset(); }

Result<std::optional<std::uint64_t>> Pool::DiscardOlderEpoch() {
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("discard an epoch"));
  Impl& impl = *impl_;
  if (!recovered_slot_) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool '" + path_ + "': no recovered checkpoint, nothing to keep");
  }
  PMSNAP_RETURN_IF_ERROR(RefuseWhileEpochOpen(path_, impl.open_epoch));
  const int older = 1 - *recovered_slot_;
  const SlotInfo info = slot_info(older);
  if (info.state != SlotState::kComplete || info.epoch >= slot_info(*recovered_slot_).epoch) {
    return std::optional<std::uint64_t>();
  }
  // The state a slot has before its first epoch: readers and recovery skip
  // it, and the next epoch (recovered + 1) is written there as usual.
  impl.PersistCommitWord(older, 0, SlotState::kEmpty);
  return std::optional<std::uint64_t>(info.epoch);
}

Result<int> Pool::ForgetEpochs(const std::string& reason) {
  PMSNAP_RETURN_IF_ERROR(RefuseReadOnly("forget its epochs"));
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseWhileEpochOpen(path_, impl.open_epoch));
  const int forgotten = committed_slots();
  for (int s = 0; s < 2; ++s) {
    if (slot_info(s).state != SlotState::kEmpty) impl.PersistCommitWord(s, 0, SlotState::kEmpty);
  }
  impl.unverified_slot.store(-1);
  recovered_slot_.reset();
  impl.last_committed.reset();
  impl.orphans_swept = false;  // the next BeginEpoch frees every older chunk
  if (forgotten > 0) {
    detail::Warn(&warnings_, "pool '" + path_ + "': " + reason + ": forgot " +
                                 std::to_string(forgotten) + " committed epoch" +
                                 (forgotten > 1 ? "s" : ""));
  }
  return forgotten;
}

ChunkHeap& Pool::chunk_heap() { return *impl_->chunk_heap; }
const ChunkHeap& Pool::chunk_heap() const { return *impl_->chunk_heap; }

std::vector<std::span<std::byte>> Pool::slot_extents(int slot) const {
  const Impl& impl = *impl_;
  std::vector<std::span<std::byte>> extents;
  for (std::size_t i = 0; i < impl.extent_data[slot].size(); ++i) {
    extents.emplace_back(impl.extent_data[slot][i], layout_.extent_used[i]);
  }
  return extents;
}

std::uint64_t Pool::SlotFileOffset(int slot, std::uint64_t slot_offset) const {
  return static_cast<std::uint64_t>(impl_->slot_addressing(slot).at(slot_offset) - impl_->base);
}

std::span<const std::byte> Pool::mapping() const { return {impl_->base, file_bytes_}; }

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
    for (const std::span<std::byte> extent : slot_extents(s)) {
      regions.slot_extents[s].push_back({offset_of(extent.data()), extent.size()});
    }
    regions.slot_data[s] = regions.slot_extents[s].front();
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
  report.chunk_problems = impl_->chunk_heap->Verify(deep);
  return report;
}

}  // namespace pmsnap::layout
