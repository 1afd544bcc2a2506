// ConflictStrategy: what happens when the training thread is about to update
// a unit whose value the epoch in flight has not yet copied out (a conflict),
// and what may be prepared right after the update that the epoch captures.
//
// Strategy 2 ("wait for the snapshot, not the persist") lives here; the
// others and the adaptive selector are in conflict/. Overview:
// docs/ARCHITECTURE.md, "Conflicts and the adaptive selector".
//
// Thread-safety: the Engine calls OnCaptured, Resolve, choice and
// OnEpochCommitted on the training thread, never two at once.
// OnEpochCommitted runs when the training thread reaps a committed epoch
// (the next BeginStep, Flush or Close), before the next epoch's first
// OnCaptured; abandoned epochs get no call. fallbacks() is also read from
// any thread (Engine::stats()). Work a strategy queues elsewhere through the
// task (in-device copies on the device stream, parts handed back to the
// workers: UnitTaskExecutor) runs beside these calls: implementations guard
// the state it shares.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/unit_task.h"

namespace pmsnap::runtime {

// What a strategy decided for one unit in one epoch (for stats).
enum class StrategyChoice : std::uint8_t {
  kInDeviceCopy = 1,     // strategy 1
  kWaitSnapshot = 2,     // strategy 2
  kPartsOnConflict = 3,  // strategy 3
  kSplitGroups = 4,      // strategy 4
};

struct UnitProfile {
  std::uint32_t unit = 0;
  std::uint64_t bytes = 0;
  double queue_wait_seconds = 0;  // captured -> first part claimed
  double copy_seconds = 0;        // device -> host, summed over parts
  double persist_seconds = 0;
  double next_update_gap_seconds = -1;  // captured -> next BeforeUpdate (-1: none seen)
  double in_device_copy_seconds = 0;    // copies inside the device, if any
  std::uint64_t in_device_bytes = 0;
  bool conflicted = false;
};

class ConflictStrategy {
 public:
  virtual ~ConflictStrategy() = default;
  virtual std::string name() const = 0;
  // Right after the update that the epoch captures, before workers see the
  // unit. May redirect parts (e.g. copy them inside the device first).
  virtual Status OnCaptured(UnitTask& task) {
    (void)task;
    return Status::Ok();
  }
  // The training thread wants to update task.unit() again while its snapshot
  // is not done. Must return only when updating the live tensor is safe:
  // every part is snapshotted or redirected to a copy.
  virtual Status Resolve(UnitTask& task) = 0;
  // What the strategy chose for this unit this epoch.
  virtual StrategyChoice choice(std::uint32_t unit) const = 0;
  // Per-unit profile once the epoch committed (adaptive strategies learn).
  virtual void OnEpochCommitted(const std::vector<UnitProfile>& profiles) { (void)profiles; }
  // Times an in-device copy was wanted but device memory was short, so the
  // unit fell back to strategy 2.
  virtual std::uint64_t fallbacks() const { return 0; }
};

// Strategy 2: copy device -> PM directly; on conflict wait until the unit's
// snapshot (not its persist) is done. No extra device memory. On a device
// that orders by events the wait is the compute stream's, not the host's
// (UnitTask::OrderUpdateAfterLiveCopies).
class WaitForSnapshotStrategy final : public ConflictStrategy {
 public:
  std::string name() const override { return "wait-snapshot (2)"; }
  Status Resolve(UnitTask& task) override {
    if (task.device().orders_by_events()) {
      return task.OrderUpdateAfterLiveCopies(0, task.part_count());
    }
    task.WaitSnapshotted();
    return Status::Ok();
  }
  StrategyChoice choice(std::uint32_t) const override { return StrategyChoice::kWaitSnapshot; }
};

}  // namespace pmsnap::runtime
