#include "pmsnap/conflict/strategies.h"

#include <algorithm>

#include "pmsnap/runtime/device.h"

namespace pmsnap::conflict {

StrategyChoice StrategyBase::choice(std::uint32_t unit) const {
  MutexLock lock(choices_mutex_);
  return unit < choices_.size() ? choices_[unit] : StrategyChoice::kWaitSnapshot;
}

void StrategyBase::SetChoice(std::uint32_t unit, StrategyChoice choice) {
  MutexLock lock(choices_mutex_);
  if (choices_.size() <= unit) choices_.resize(unit + 1, StrategyChoice::kWaitSnapshot);
  choices_[unit] = choice;
}

void StrategyBase::OnEpochCommitted(const std::vector<UnitProfile>& profiles) {
  for (const UnitProfile& profile : profiles) {
    if (profiles_.size() <= profile.unit) profiles_.resize(profile.unit + 1);
    profiles_[profile.unit] = profile;
  }
}

const UnitProfile* StrategyBase::LastProfile(std::uint32_t unit) const {
  if (unit >= profiles_.size() || profiles_[unit].bytes == 0) return nullptr;
  return &profiles_[unit];
}

std::byte* StrategyBase::AllocateFor(UnitTask& task, std::uint64_t bytes) {
  runtime::Device& device = task.device();
  if (bytes == 0) return nullptr;
  if (device.free_bytes() < options_.reserve_bytes + bytes) return nullptr;
  auto buffer = device.Allocate(bytes);
  if (!buffer.ok()) return nullptr;
  task.AdoptDeviceBuffer(*buffer, bytes);
  return static_cast<std::byte*>(*buffer);
}

bool StrategyBase::CopyLivePartsInDevice(UnitTask& task, std::uint32_t first, std::uint32_t last) {
  // A part already redirected by an earlier call reads its copy; copying it
  // again would take the live tensor, which has been updated since.
  auto still_live = [&task](std::uint32_t p) { return task.source(p) == task.part(p).live_source; };
  std::uint64_t pending_bytes = 0;
  for (std::uint32_t p = first; p < last; ++p) {
    if (task.state(p) == runtime::PartState::kPending && still_live(p)) {
      pending_bytes += task.part(p).bytes;
    }
  }
  if (pending_bytes == 0) return true;
  std::byte* buffer = AllocateFor(task, pending_bytes);
  if (buffer == nullptr) return false;
  // Only the training thread releases parts back to kPending, so the parts
  // claimed here are a subset of those counted above and fit the buffer.
  std::vector<std::uint32_t> claimed;
  for (std::uint32_t p = first; p < last; ++p) {
    if (still_live(p) && task.TryClaim(p)) claimed.push_back(p);  // else a worker has it
  }
  task.CopyInDeviceAsync(std::move(claimed), buffer);
  return true;
}

// Strategy 2's wait, for units a strategy could not give a device copy: the
// host waits for the whole snapshot, or, on a device that orders by events,
// the compute stream waits for the copies.
Status StrategyBase::WaitForLiveCopies(UnitTask& task, std::uint32_t first, std::uint32_t last) {
  if (task.device().orders_by_events()) return task.OrderUpdateAfterLiveCopies(first, last);
  task.WaitSnapshotted();
  return Status::Ok();
}

// On a device that orders by events: the compute stream waits for every
// copy still reading the live tensor, in-device ones included (their events
// were published when they were queued); an in-device copy that could not
// even be queued is reported here, one that fails later fails the epoch.
Status StrategyBase::OrderUpdateAfterCopies(UnitTask& task) {
  Status ordered = task.OrderUpdateAfterLiveCopies(0, task.part_count());
  Status queued = task.InDeviceCopyError();
  return queued.ok() ? ordered : queued;
}

// --- strategy 1 ---

Status InDeviceCopyStrategy::OnCaptured(UnitTask& task) {
  if (CopyLivePartsInDevice(task, 0, task.part_count())) {
    SetChoice(task.unit(), StrategyChoice::kInDeviceCopy);
  } else {
    CountFallback();
    SetChoice(task.unit(), StrategyChoice::kWaitSnapshot);
  }
  return Status::Ok();
}

Status InDeviceCopyStrategy::Resolve(UnitTask& task) {
  // Every part reads from the device copy once it exists, unless memory was
  // short; the copy was queued on the device stream at capture.
  if (choice(task.unit()) != StrategyChoice::kInDeviceCopy) {
    return WaitForLiveCopies(task, 0, task.part_count());
  }
  if (!task.device().orders_by_events()) return task.WaitInDeviceCopies();
  return OrderUpdateAfterCopies(task);
}

// --- strategy 3 ---

Status PartsOnConflictStrategy::OnCaptured(UnitTask& task) {
  SetChoice(task.unit(), StrategyChoice::kPartsOnConflict);
  return Status::Ok();
}

Status PartsOnConflictStrategy::Resolve(UnitTask& task) {
  if (!CopyLivePartsInDevice(task, 0, task.part_count())) {
    CountFallback();
    return WaitForLiveCopies(task, 0, task.part_count());
  }
  if (task.device().orders_by_events()) return OrderUpdateAfterCopies(task);
  Status status = task.WaitInDeviceCopies();
  // Parts a worker was already copying from the live tensor must finish.
  Status ordered = task.OrderUpdateAfterLiveCopies(0, task.part_count());
  return status.ok() ? ordered : status;
}

// --- strategy 4 ---

std::uint32_t SplitGroupsStrategy::DirectParts(const UnitTask& task) const {
  const std::uint32_t n = task.part_count();
  const UnitProfile* last = LastProfile(task.unit());
  if (last == nullptr || last->next_update_gap_seconds < 0 || last->copy_seconds <= 0) {
    return n / 2;
  }
  const double link_bytes_per_second = last->bytes / last->copy_seconds;
  const double budget = last->next_update_gap_seconds - last->queue_wait_seconds;
  const double direct_bytes = std::max(0.0, budget) * link_bytes_per_second;
  std::uint64_t cumulative = 0;
  std::uint32_t direct = 0;
  while (direct < n && cumulative + task.part(direct).bytes <= direct_bytes) {
    cumulative += task.part(direct).bytes;
    ++direct;
  }
  return direct;
}

Status SplitGroupsStrategy::OnCaptured(UnitTask& task) {
  const std::uint32_t n = task.part_count();
  std::uint32_t direct = DirectParts(task);
  if (direct < n && !CopyLivePartsInDevice(task, direct, n)) {
    CountFallback();
    direct = n;  // everything direct: a conflict waits for the whole unit
  }
  SetChoice(task.unit(), direct < n ? StrategyChoice::kSplitGroups : StrategyChoice::kWaitSnapshot);
  MutexLock lock(split_mutex_);
  if (direct_parts_.size() <= task.unit()) direct_parts_.resize(task.unit() + 1, 0);
  direct_parts_[task.unit()] = direct;
  return Status::Ok();
}

Status SplitGroupsStrategy::Resolve(UnitTask& task) {
  std::uint32_t direct = task.part_count();
  {
    MutexLock lock(split_mutex_);
    if (task.unit() < direct_parts_.size()) direct = direct_parts_[task.unit()];
  }
  if (!task.device().orders_by_events()) {
    for (std::uint32_t p = 0; p < direct; ++p) task.WaitPartSnapshotted(p);
    return task.WaitInDeviceCopies();
  }
  return OrderUpdateAfterCopies(task);
}

// --- adaptive ---

AdaptiveStrategy::AdaptiveStrategy(ConflictOptions options)
    : StrategyBase(options), in_device_(options), parts_(options), split_(options) {}

StrategyChoice AdaptiveStrategy::Decide(const DecisionInputs& in) {
  // Where a copy inside the device is no faster than the direct copy (the
  // host device: both are memcpy), strategies 1, 3 and 4 only add a copy.
  if (!in.in_device_copies_pay) return StrategyChoice::kWaitSnapshot;
  const bool memory = in.usable_device_bytes >= in.unit_bytes;
  const UnitProfile* last = in.last;
  // No profile yet (first epoch): strategy 3, which costs nothing unless a
  // conflict actually happens (an in-device copy of every unit up front can
  // itself outlast an iteration).
  if (last == nullptr) return StrategyChoice::kPartsOnConflict;
  const bool gap_known = last->next_update_gap_seconds >= 0;
  // The profile is one epoch's; queue waits depend on what the other units
  // do. A margin on the prediction, and a few calm epochs before a unit that
  // conflicted goes back to waiting, keep one quiet epoch from costing a
  // stall in the next.
  const double predicted = kPredictionMargin * (last->queue_wait_seconds + last->copy_seconds);
  const bool conflict_expected = last->conflicted ||
                                 (gap_known && predicted > last->next_update_gap_seconds) ||
                                 in.calm_epochs < in.calm_needed;
  if (!conflict_expected) return StrategyChoice::kWaitSnapshot;
  const bool in_device_too_slow =
      gap_known && in.in_device_copy_seconds >= 0 &&
      kPredictionMargin * in.in_device_copy_seconds > last->next_update_gap_seconds;
  if (memory && !in_device_too_slow) return StrategyChoice::kInDeviceCopy;
  return gap_known ? StrategyChoice::kSplitGroups : StrategyChoice::kPartsOnConflict;
}

std::uint32_t AdaptiveStrategy::calm_epochs_needed(std::uint32_t unit) const {
  MutexLock lock(decisions_mutex_);
  return unit < calm_needed_.size() ? calm_needed_[unit] : kCalmEpochsBeforeWaiting;
}

StrategyChoice AdaptiveStrategy::Decision(std::uint32_t unit) const {
  MutexLock lock(decisions_mutex_);
  return unit < decisions_.size() ? decisions_[unit] : StrategyChoice::kWaitSnapshot;
}

runtime::ConflictStrategy& AdaptiveStrategy::For(std::uint32_t unit) {
  switch (Decision(unit)) {
    case StrategyChoice::kInDeviceCopy:
      return in_device_;
    case StrategyChoice::kPartsOnConflict:
      return parts_;
    case StrategyChoice::kSplitGroups:
      return split_;
    case StrategyChoice::kWaitSnapshot:
      break;
  }
  return wait_;
}

Status AdaptiveStrategy::OnCaptured(UnitTask& task) {
  const std::uint64_t free = task.device().free_bytes();
  const std::uint64_t usable = free > options_.reserve_bytes ? free - options_.reserve_bytes : 0;
  const runtime::Device& device = task.device();
  {
    MutexLock lock(decisions_mutex_);
    const std::uint32_t unit = task.unit();
    DecisionInputs in;
    in.last = LastProfile(unit);
    in.unit_bytes = task.bytes();
    in.usable_device_bytes = usable;
    // Measured against measured, or estimate against estimate: the two kinds
    // differ under load, and mixing them flips the answer.
    double in_device = device.EstimateInDeviceCopySeconds(task.bytes());
    double direct = device.EstimateCopyToHostSeconds(task.bytes());
    if (in_device_bytes_per_second_ > 0) {
      in.in_device_copy_seconds = task.bytes() / in_device_bytes_per_second_;
      if (in.last != nullptr && in.last->copy_seconds > 0) {
        in_device = in.in_device_copy_seconds;
        direct = in.last->copy_seconds;
      }
    }
    in.in_device_copies_pay = 2 * in_device <= direct;
    in.calm_epochs = unit < calm_epochs_.size() ? calm_epochs_[unit] : kNeverConflicted;
    in.calm_needed = unit < calm_needed_.size() ? calm_needed_[unit] : kCalmEpochsBeforeWaiting;
    const StrategyChoice decision = Decide(in);
    if (decisions_.size() <= task.unit()) {
      decisions_.resize(task.unit() + 1, StrategyChoice::kWaitSnapshot);
    }
    decisions_[task.unit()] = decision;
  }
  return For(task.unit()).OnCaptured(task);
}

Status AdaptiveStrategy::Resolve(UnitTask& task) { return For(task.unit()).Resolve(task); }

StrategyChoice AdaptiveStrategy::choice(std::uint32_t unit) const {
  switch (Decision(unit)) {
    case StrategyChoice::kInDeviceCopy:
      return in_device_.choice(unit);
    case StrategyChoice::kPartsOnConflict:
      return parts_.choice(unit);
    case StrategyChoice::kSplitGroups:
      return split_.choice(unit);
    case StrategyChoice::kWaitSnapshot:
      break;
  }
  return StrategyChoice::kWaitSnapshot;
}

std::uint64_t AdaptiveStrategy::fallbacks() const {
  return in_device_.fallbacks() + parts_.fallbacks() + split_.fallbacks();
}

void AdaptiveStrategy::OnEpochCommitted(const std::vector<UnitProfile>& profiles) {
  {
    MutexLock lock(decisions_mutex_);
    double in_device_seconds = 0;
    std::uint64_t in_device_bytes = 0;
    for (const UnitProfile& profile : profiles) {
      in_device_seconds += profile.in_device_copy_seconds;
      in_device_bytes += profile.in_device_bytes;
    }
    if (in_device_bytes > 0 && in_device_seconds > 0) {
      in_device_bytes_per_second_ = in_device_bytes / in_device_seconds;
    }
    for (const UnitProfile& profile : profiles) {
      if (calm_epochs_.size() <= profile.unit) {
        calm_epochs_.resize(profile.unit + 1, kNeverConflicted);
        calm_needed_.resize(profile.unit + 1, kCalmEpochsBeforeWaiting);
      }
      std::uint32_t& calm = calm_epochs_[profile.unit];
      std::uint32_t& needed = calm_needed_[profile.unit];
      if (profile.conflicted && calm != kNeverConflicted && calm >= needed) {
        needed = std::min(2 * needed, kMaxCalmEpochsBeforeWaiting);  // it flapped
      }
      calm = profile.conflicted ? 0 : (calm == kNeverConflicted ? calm : calm + 1);
    }
  }
  StrategyBase::OnEpochCommitted(profiles);
  split_.OnEpochCommitted(profiles);
}

std::shared_ptr<runtime::ConflictStrategy> MakeStrategy(const std::string& name,
                                                        ConflictOptions options) {
  if (name == "1") return std::make_shared<InDeviceCopyStrategy>(options);
  if (name == "2") return std::make_shared<runtime::WaitForSnapshotStrategy>();
  if (name == "3") return std::make_shared<PartsOnConflictStrategy>(options);
  if (name == "4") return std::make_shared<SplitGroupsStrategy>(options);
  if (name == "adaptive") return std::make_shared<AdaptiveStrategy>(options);
  return nullptr;
}

}  // namespace pmsnap::conflict
