// UnitTask: one unit's snapshot within the epoch in flight, shared by the
// workers that copy its parts and the training thread that may need to
// update it again before the copy is done (a conflict).
//
// Each part moves kPending -> kCopying -> kSnapshotted (bytes are out of the
// live tensor) and is then persisted. A part is copied from its live tensor,
// or from a device buffer after a conflict strategy redirected it there. A
// worker or a strategy owns a part only after TryClaim succeeded.
//
// Thread-safety: all methods may be called concurrently; the memory-order
// notes on each atomic name what they pair with.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "pmsnap/common/mutex.h"
#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

class Device;
class DeviceEvent;
class UnitTask;

// Where a UnitTask's work runs, provided by whoever runs the epoch (the
// Engine, one per epoch): parts a conflict strategy released go back to the
// workers, and copies inside the device run on one device-stream thread (a
// GPU stream's model). Thread-safety: both methods may be called from any
// thread while the epoch's tasks live.
class UnitTaskExecutor {
 public:
  virtual ~UnitTaskExecutor() = default;
  // Queues part `part` of `task` for a worker again (UnitTask::
  // RedirectAndRelease). A worker job that finds the part no longer pending
  // does nothing, so a part may be queued more than once.
  virtual void RequeuePart(UnitTask& task, std::uint32_t part) = 0;
  // Queues `job` for the device-stream thread and returns at once. The
  // epoch is not over (reaped, its tasks freed) until `job` has run.
  virtual void RunOnDeviceStream(std::function<void()> job) = 0;
  // Devices that order by events (Device::orders_by_events): for part `part`
  // of `task`, which the caller claimed, queues its device -> host copy after
  // the unit's update event, publishes the copy's event on the task
  // (PublishCopyEvent) and has a worker persist the part once that event
  // completed. Returns the copy's event (nullptr: nothing was copied because
  // the epoch already failed). Returns without waiting for the copy.
  virtual Result<std::shared_ptr<DeviceEvent>> IssueCopy(UnitTask& task, std::uint32_t part) = 0;
  // A copy of `task` failed after the live tensor may have changed: the
  // epoch cannot commit (the engine records `status` for the training
  // thread).
  virtual void FailEpoch(const Status& status) = 0;
};

enum class PartState : std::uint8_t { kPending = 0, kCopying = 1, kSnapshotted = 2 };

class UnitTask {
 public:
  struct Part {
    const std::byte* live_source = nullptr;  // in the registered tensor
    std::uint64_t bytes = 0;
    // Index into the pool layout's parts, where a worker writes the bytes;
    // none for the one part of an encoded unit, which the Encoder takes.
    std::optional<std::uint32_t> pool_part;
  };

  // `device` holds the live tensors; `executor` runs requeued parts and
  // in-device copies. Neither is owned; both must outlive the task.
  UnitTask(std::uint32_t unit, std::uint64_t epoch, Device* device, UnitTaskExecutor* executor,
           std::vector<Part> parts);
  ~UnitTask();
  UnitTask(const UnitTask&) = delete;
  UnitTask& operator=(const UnitTask&) = delete;

  std::uint32_t unit() const { return unit_; }
  std::uint64_t epoch() const { return epoch_; }
  Device& device() const { return *device_; }
  std::uint32_t part_count() const { return static_cast<std::uint32_t>(parts_.size()); }
  const Part& part(std::uint32_t p) const { return parts_[p]; }
  std::uint64_t bytes() const { return bytes_; }

  PartState state(std::uint32_t p) const {
    // Acquire pairs with the release in MarkSnapshotted: bytes are out.
    return static_cast<PartState>(states_[p].load(std::memory_order_acquire));
  }
  // The bytes a worker should copy for part p: live tensor or redirect buffer.
  const std::byte* source(std::uint32_t p) const {
    return sources_[p].load(std::memory_order_acquire);
  }
  // kPending -> kCopying; true if the caller now owns the part.
  bool TryClaim(std::uint32_t p);
  // For a part the caller claimed: copy it from `copy` from now on (a device
  // buffer holding the same bytes), back to kPending, and requeue it
  // (UnitTaskExecutor::RequeuePart).
  void RedirectAndRelease(std::uint32_t p, const std::byte* copy);
  // Worker: the part's bytes are out of the source.
  void MarkSnapshotted(std::uint32_t p);

  bool snapshotted() const { return snapshot_remaining_.load(std::memory_order_acquire) == 0; }
  // Blocks until every part is snapshotted (not necessarily persisted).
  void WaitSnapshotted() const;
  // Blocks until part p is snapshotted.
  void WaitPartSnapshotted(std::uint32_t p) const;

  // For parts the caller claimed: copies each inside the device into
  // `buffer` (consecutively) on the executor's device stream, then redirects
  // and releases it. Returns at once; WaitInDeviceCopies waits for
  // completion. On a device that orders by events the copies are queued on
  // the caller's copy stream at once, after the update event, and each
  // part's copy event is published (PublishCopyEvent): a conflict then makes
  // the compute stream wait for them instead of the host.
  void CopyInDeviceAsync(std::vector<std::uint32_t> parts, std::byte* buffer);
  // The first error of this task's in-device copies so far, without
  // waiting for those still running.
  Status InDeviceCopyError() const;
  // Blocks until every CopyInDeviceAsync of this task finished; returns the
  // first copy error.
  Status WaitInDeviceCopies() const;

  // A device buffer the task frees once every part is snapshotted.
  void AdoptDeviceBuffer(void* ptr, std::size_t bytes);

  // --- ordering by events (Device::orders_by_events) ---
  // The event recorded on the compute stream after the captured update; set
  // once by the engine before any copy of the task is queued. Every copy out
  // of the live tensor waits for it.
  void SetUpdateEvent(std::shared_ptr<DeviceEvent> event) { update_event_ = std::move(event); }
  const std::shared_ptr<DeviceEvent>& update_event() const { return update_event_; }
  // Whoever claimed part p and queued (or skipped) a copy of it out of the
  // live tensor publishes that copy's event (nullptr if it copied nothing),
  // once: later copies from a device buffer do not read the live tensor.
  void PublishCopyEvent(std::uint32_t p, std::shared_ptr<DeviceEvent> event);
  // Makes the next update of the live tensor safe for the parts in
  // [first, last) that still read it (not redirected to a device copy). On a
  // device that orders by events the compute stream waits for their copies'
  // events (Device::ComputeWaitFor; a pending part's copy is queued now
  // through UnitTaskExecutor::IssueCopy) and the host waits only until a
  // claimed part's copy was queued; elsewhere the host blocks until each is
  // snapshotted. Training thread.
  Status OrderUpdateAfterLiveCopies(std::uint32_t first, std::uint32_t last);

  // Profile of this snapshot (seconds), filled by the workers and the
  // device stream.
  std::atomic<double> copy_seconds{0};
  std::atomic<double> persist_seconds{0};
  std::atomic<double> in_device_copy_seconds{0};
  std::atomic<std::uint64_t> in_device_bytes{0};

 private:
  void ReleaseBuffersLocked() PMSNAP_REQUIRES(buffers_mutex_);
  void CopyInDeviceOrdered(std::vector<std::uint32_t> parts, std::byte* buffer);
  void FinishInDeviceCopies(std::chrono::steady_clock::time_point start, std::uint64_t bytes);
  std::uint32_t unit_;
  std::uint64_t epoch_;
  Device* device_;
  UnitTaskExecutor* executor_;
  std::vector<Part> parts_;
  std::uint64_t bytes_ = 0;
  mutable std::atomic<std::uint32_t> in_device_pending_{0};
  mutable Mutex device_error_mutex_;
  Status device_error_ PMSNAP_GUARDED_BY(device_error_mutex_);
  std::unique_ptr<std::atomic<std::uint8_t>[]> states_;
  std::unique_ptr<std::atomic<const std::byte*>[]> sources_;
  std::atomic<std::uint32_t> snapshot_remaining_;
  Mutex buffers_mutex_;
  std::vector<std::pair<void*, std::size_t>> buffers_ PMSNAP_GUARDED_BY(buffers_mutex_);
  std::shared_ptr<DeviceEvent> update_event_;
  // Per part (only where the device orders by events): the event of its copy
  // out of the live tensor, valid once copy_published_[p] is 1 (release in
  // PublishCopyEvent, acquire in OrderUpdateAfterLiveCopies).
  Mutex copy_events_mutex_;
  std::vector<std::shared_ptr<DeviceEvent>> copy_events_ PMSNAP_GUARDED_BY(copy_events_mutex_);
  std::unique_ptr<std::atomic<std::uint8_t>[]> copy_published_;
};

}  // namespace pmsnap::runtime
