// Conflict strategies 1, 3 and 4 and the adaptive per-unit selector
// (slides "Handle Conflict" and "Adaptive Strategy Determination"); strategy
// 2 is runtime::WaitForSnapshotStrategy.
//
//   1 InDeviceCopyStrategy     copy the unit inside device memory right after
//                              the captured update; workers persist from the
//                              copy; a conflict never waits.
//   3 PartsOnConflictStrategy  parts are copied device -> PM concurrently; on
//                              conflict the parts not yet started are copied
//                              inside the device, and only parts already in
//                              flight are waited for.
//   4 SplitGroupsStrategy      parts split into a direct group and an
//                              in-device group sized so both finish when the
//                              next update arrives; a conflict waits for the
//                              direct group.
//   AdaptiveStrategy           per unit, from the last epoch's profile and the
//                              device's free memory: no conflict expected -> 2;
//                              conflict and memory -> 1 (4 if the in-device
//                              copy itself would outlast the gap); conflict and
//                              short of memory -> 4 (split tuned) or 3. Before
//                              the first profile: 3. On a device whose
//                              in-device copies are not at least twice as fast
//                              as its direct copies (host): always 2. See
//                              Decide, and docs/ARCHITECTURE.md, "Conflicts
//                              and the adaptive selector".
//
// Device memory: in-device copies never take more than the device's free
// memory minus `reserve_bytes`; when a copy cannot be had the unit falls back
// to strategy 2 and the fallback is counted (fallbacks()).
//
// Thread-safety: as runtime::ConflictStrategy (training thread for
// OnCaptured/Resolve; OnEpochCommitted is called on the training thread too).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pmsnap/common/mutex.h"
#include "pmsnap/runtime/conflict_strategy.h"

namespace pmsnap::conflict {

using runtime::StrategyChoice;
using runtime::UnitProfile;
using runtime::UnitTask;

struct ConflictOptions {
  // Device memory never used by in-device copies.
  std::uint64_t reserve_bytes = 0;
};

// Shared machinery: device-memory accounting, per-unit choice and profiles.
class StrategyBase : public runtime::ConflictStrategy {
 public:
  explicit StrategyBase(ConflictOptions options) : options_(options) {}
  StrategyChoice choice(std::uint32_t unit) const override;
  std::uint64_t fallbacks() const override { return fallbacks_.load(); }
  void OnEpochCommitted(const std::vector<UnitProfile>& profiles) override;

 protected:
  // Device memory for `bytes` respecting the reserve, adopted by the task;
  // nullptr when short (the caller falls back and counts it).
  std::byte* AllocateFor(UnitTask& task, std::uint64_t bytes);
  // Claims every pending part in [first, last) still reading the live
  // tensor and copies them into one device buffer on the device stream
  // (UnitTask::CopyInDeviceAsync; the copied parts go back to the workers
  // through the task's runtime::UnitTaskExecutor). False if device memory
  // was short (nothing changed then).
  bool CopyLivePartsInDevice(UnitTask& task, std::uint32_t first, std::uint32_t last);
  // Strategy 2's wait for parts [first, last) reading the live tensor (all of
  // the unit's on a host-ordered device).
  static Status WaitForLiveCopies(UnitTask& task, std::uint32_t first, std::uint32_t last);
  // A conflict's resolution on a device that orders by events (strategies
  // 1, 3 and 4 after their in-device copies were queued): no host wait.
  static Status OrderUpdateAfterCopies(UnitTask& task);
  void SetChoice(std::uint32_t unit, StrategyChoice choice);
  void CountFallback() { fallbacks_.fetch_add(1); }
  const UnitProfile* LastProfile(std::uint32_t unit) const;  // training thread

  ConflictOptions options_;

 private:
  mutable Mutex choices_mutex_;
  std::vector<StrategyChoice> choices_ PMSNAP_GUARDED_BY(choices_mutex_);
  std::vector<UnitProfile> profiles_;  // indexed by unit; bytes == 0: none yet
  std::atomic<std::uint64_t> fallbacks_{0};
};

class InDeviceCopyStrategy final : public StrategyBase {
 public:
  explicit InDeviceCopyStrategy(ConflictOptions options = {}) : StrategyBase(options) {}
  std::string name() const override { return "in-device-copy (1)"; }
  Status OnCaptured(UnitTask& task) override;
  Status Resolve(UnitTask& task) override;
};

class PartsOnConflictStrategy final : public StrategyBase {
 public:
  explicit PartsOnConflictStrategy(ConflictOptions options = {}) : StrategyBase(options) {}
  std::string name() const override { return "parts-on-conflict (3)"; }
  Status OnCaptured(UnitTask& task) override;
  Status Resolve(UnitTask& task) override;
};

class SplitGroupsStrategy final : public StrategyBase {
 public:
  explicit SplitGroupsStrategy(ConflictOptions options = {}) : StrategyBase(options) {}
  std::string name() const override { return "split-groups (4)"; }
  Status OnCaptured(UnitTask& task) override;
  Status Resolve(UnitTask& task) override;

  // Parts of `task` that go device -> PM directly (the rest is copied in
  // the device first), from the unit's last profile: the direct group holds
  // what the link moves before the next update arrives.
  std::uint32_t DirectParts(const UnitTask& task) const;

 private:
  Mutex split_mutex_;
  std::vector<std::uint32_t> direct_parts_ PMSNAP_GUARDED_BY(split_mutex_);  // per unit, this epoch
};

class AdaptiveStrategy final : public StrategyBase {
 public:
  explicit AdaptiveStrategy(ConflictOptions options = {});
  std::string name() const override { return "adaptive"; }
  Status OnCaptured(UnitTask& task) override;
  Status Resolve(UnitTask& task) override;
  StrategyChoice choice(std::uint32_t unit) const override;
  std::uint64_t fallbacks() const override;
  void OnEpochCommitted(const std::vector<UnitProfile>& profiles) override;

  static constexpr std::uint32_t kNeverConflicted = ~0u;
  static constexpr std::uint32_t kCalmEpochsBeforeWaiting = 3;

  struct DecisionInputs {
    const UnitProfile* last = nullptr;  // the unit's last profile; null: none yet
    std::uint64_t unit_bytes = 0;
    std::uint64_t usable_device_bytes = 0;  // free device memory minus the reserve
    // Whether an in-device copy is at least twice as fast as the direct copy
    // (measured once copies ran, else the device's estimates).
    bool in_device_copies_pay = true;
    // Predicted time of an in-device copy of the whole unit, from measured
    // in-device copies; < 0 while none ran.
    double in_device_copy_seconds = -1;
    // Committed epochs since the unit last conflicted (kNeverConflicted if
    // it never did); it goes back to waiting only after `calm_needed`.
    std::uint32_t calm_epochs = kNeverConflicted;
    std::uint32_t calm_needed = kCalmEpochsBeforeWaiting;
  };
  // The decision rule: no profile yet -> 3; no conflict expected -> 2; a conflict, with memory ->
  // 1, unless copying the whole unit inside the device would itself outlast
  // the time to the next update (then 4: only what the link cannot move in
  // time is copied inside); short of memory -> 4 with the split tuned (3
  // while the time to the next update is unknown). Where in-device copies do
  // not pay, always 2.
  static StrategyChoice Decide(const DecisionInputs& in);
  // A unit that conflicts again after it went back to waiting doubles its
  // calm epochs needed, up to this: each such flap costs a stall.
  static constexpr std::uint32_t kMaxCalmEpochsBeforeWaiting = 24;
  static constexpr double kPredictionMargin = 1.25;

  // Calm epochs `unit` needs now before it goes back to waiting.
  std::uint32_t calm_epochs_needed(std::uint32_t unit) const;

 private:
  StrategyChoice Decision(std::uint32_t unit) const;
  runtime::ConflictStrategy& For(std::uint32_t unit);
  InDeviceCopyStrategy in_device_;
  runtime::WaitForSnapshotStrategy wait_;
  PartsOnConflictStrategy parts_;
  SplitGroupsStrategy split_;
  mutable Mutex decisions_mutex_;
  std::vector<StrategyChoice> decisions_ PMSNAP_GUARDED_BY(decisions_mutex_);
  std::vector<std::uint32_t> calm_epochs_ PMSNAP_GUARDED_BY(decisions_mutex_);
  std::vector<std::uint32_t> calm_needed_ PMSNAP_GUARDED_BY(decisions_mutex_);
  // Measured speed of in-device copies (bytes/s; 0 until one ran), from the
  // last epoch that made any.
  double in_device_bytes_per_second_ = 0;
};

// "1", "2", "3", "4" or "adaptive" (as in flags and benchmark tables).
std::shared_ptr<runtime::ConflictStrategy> MakeStrategy(const std::string& name,
                                                        ConflictOptions options = {});

}  // namespace pmsnap::conflict
