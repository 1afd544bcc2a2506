#include "pmsnap/runtime/unit_task.h"

#include <chrono>

#include "pmsnap/runtime/device.h"

namespace pmsnap::runtime {

UnitTask::UnitTask(std::uint32_t unit, std::uint64_t epoch, Device* device,
                   UnitTaskExecutor* executor, std::vector<Part> parts)
    : unit_(unit),
      epoch_(epoch),
      device_(device),
      executor_(executor),
      parts_(std::move(parts)),
      states_(std::make_unique<std::atomic<std::uint8_t>[]>(parts_.size())),
      sources_(std::make_unique<std::atomic<const std::byte*>[]>(parts_.size())),
      snapshot_remaining_(static_cast<std::uint32_t>(parts_.size())) {
  // Copy events only where copies are ordered by them: the host device's
  // captures allocate nothing more than before.
  if (device_ != nullptr && device_->orders_by_events()) {
    copy_events_.resize(parts_.size());
    copy_published_ = std::make_unique<std::atomic<std::uint8_t>[]>(parts_.size());
    for (std::size_t p = 0; p < parts_.size(); ++p) {
      copy_published_[p].store(0, std::memory_order_relaxed);
    }
  }
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    states_[p].store(static_cast<std::uint8_t>(PartState::kPending), std::memory_order_relaxed);
    sources_[p].store(parts_[p].live_source, std::memory_order_relaxed);
    bytes_ += parts_[p].bytes;
  }
}

UnitTask::~UnitTask() {
  MutexLock lock(buffers_mutex_);
  ReleaseBuffersLocked();
}

bool UnitTask::TryClaim(std::uint32_t p) {
  auto expected = static_cast<std::uint8_t>(PartState::kPending);
  // Acquire: the claimer sees the source a strategy redirected (release in
  // RedirectAndRelease).
  return states_[p].compare_exchange_strong(
      expected, static_cast<std::uint8_t>(PartState::kCopying), std::memory_order_acq_rel);
}

void UnitTask::RedirectAndRelease(std::uint32_t p, const std::byte* copy) {
  sources_[p].store(copy, std::memory_order_release);
  states_[p].store(static_cast<std::uint8_t>(PartState::kPending), std::memory_order_release);
  executor_->RequeuePart(*this, p);
}

void UnitTask::MarkSnapshotted(std::uint32_t p) {
  // Release pairs with the acquire loads in state()/WaitSnapshotted: once a
  // waiter sees the part snapshotted, the copy out of the source is complete.
  states_[p].store(static_cast<std::uint8_t>(PartState::kSnapshotted), std::memory_order_release);
  states_[p].notify_all();
  if (snapshot_remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    {
      MutexLock lock(buffers_mutex_);
      ReleaseBuffersLocked();
    }
    snapshot_remaining_.notify_all();
  }
}

void UnitTask::WaitSnapshotted() const {
  std::uint32_t remaining = snapshot_remaining_.load(std::memory_order_acquire);
  while (remaining != 0) {
    snapshot_remaining_.wait(remaining, std::memory_order_acquire);
    remaining = snapshot_remaining_.load(std::memory_order_acquire);
  }
}

void UnitTask::WaitPartSnapshotted(std::uint32_t p) const {
  std::uint8_t state = states_[p].load(std::memory_order_acquire);
  while (state != static_cast<std::uint8_t>(PartState::kSnapshotted)) {
    states_[p].wait(state, std::memory_order_acquire);
    state = states_[p].load(std::memory_order_acquire);
  }
}

void UnitTask::CopyInDeviceAsync(std::vector<std::uint32_t> parts, std::byte* buffer) {
  if (parts.empty()) return;
  in_device_pending_.fetch_add(1, std::memory_order_relaxed);
  if (device_->orders_by_events()) {
    CopyInDeviceOrdered(std::move(parts), buffer);
    return;
  }
  auto job = [this, parts = std::move(parts), buffer] {
    const auto start = std::chrono::steady_clock::now();
    std::uint64_t offset = 0;
    for (std::uint32_t p : parts) {
      Status status =
          device_->CopyInDevice(buffer + offset, parts_[p].live_source, parts_[p].bytes);
      if (!status.ok()) {
        MutexLock lock(device_error_mutex_);
        if (device_error_.ok()) device_error_ = status;
      }
      // On failure the part goes back to the workers from the live tensor;
      // the error reaches the training thread through WaitInDeviceCopies.
      RedirectAndRelease(p, status.ok() ? buffer + offset : parts_[p].live_source);
      offset += parts_[p].bytes;
    }
    FinishInDeviceCopies(start, offset);
  };
  executor_->RunOnDeviceStream(std::move(job));
}

void UnitTask::CopyInDeviceOrdered(std::vector<std::uint32_t> parts, std::byte* buffer) {
  const auto start = std::chrono::steady_clock::now();
  Status failure;
  std::shared_ptr<DeviceEvent> last;
  std::vector<bool> queued(parts.size(), false);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::uint32_t p = parts[i];
    Result<std::shared_ptr<DeviceEvent>> copied =
        failure.ok() ? device_->CopyInDeviceAsync(buffer + offset, parts_[p].live_source,
                                                  parts_[p].bytes, update_event_)
                     : Result<std::shared_ptr<DeviceEvent>>(failure);
    if (copied.ok()) {
      queued[i] = true;
      last = *copied;
      PublishCopyEvent(p, *copied);
    } else if (failure.ok()) {
      failure = copied.status();
    }
    offset += parts_[p].bytes;
  }
  if (!failure.ok()) {
    {
      MutexLock lock(device_error_mutex_);
      if (device_error_.ok()) device_error_ = failure;
    }
    // A part whose copy was never queued goes back to the workers from the
    // live tensor now, before the caller lets any update change it.
    for (std::size_t i = 0; i < parts.size(); ++i) {
      if (!queued[i]) RedirectAndRelease(parts[i], parts_[parts[i]].live_source);
    }
  }
  // The device stream learns from the last copy's event (one copy stream:
  // in order) that the buffer holds every part, then hands them to the
  // workers.
  auto job = [this, parts = std::move(parts), queued = std::move(queued), buffer, last, start,
              bytes = offset] {
    Status done = last ? device_->Synchronize(*last) : Status::Ok();
    if (!done.ok()) {
      // The live tensor may have been updated since: the epoch fails.
      executor_->FailEpoch(done);
      MutexLock lock(device_error_mutex_);
      if (device_error_.ok()) device_error_ = done;
    }
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const std::uint32_t p = parts[i];
      if (queued[i]) RedirectAndRelease(p, buffer + at);
      at += parts_[p].bytes;
    }
    FinishInDeviceCopies(start, bytes);
  };
  executor_->RunOnDeviceStream(std::move(job));
}

void UnitTask::FinishInDeviceCopies(std::chrono::steady_clock::time_point start,
                                    std::uint64_t bytes) {
  in_device_copy_seconds.fetch_add(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  in_device_bytes.fetch_add(bytes);
  // Release pairs with the acquire in WaitInDeviceCopies.
  if (in_device_pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    in_device_pending_.notify_all();
  }
}

Status UnitTask::InDeviceCopyError() const {
  MutexLock lock(device_error_mutex_);
  return device_error_;
}

Status UnitTask::WaitInDeviceCopies() const {
  std::uint32_t pending = in_device_pending_.load(std::memory_order_acquire);
  while (pending != 0) {
    in_device_pending_.wait(pending, std::memory_order_acquire);
    pending = in_device_pending_.load(std::memory_order_acquire);
  }
  MutexLock lock(device_error_mutex_);
  return device_error_;
}

void UnitTask::AdoptDeviceBuffer(void* ptr, std::size_t bytes) {
  MutexLock lock(buffers_mutex_);
  buffers_.emplace_back(ptr, bytes);
}

void UnitTask::PublishCopyEvent(std::uint32_t p, std::shared_ptr<DeviceEvent> event) {
  {
    MutexLock lock(copy_events_mutex_);
    copy_events_[p] = std::move(event);
  }
  copy_published_[p].store(1, std::memory_order_release);
  copy_published_[p].notify_all();
}

Status UnitTask::OrderUpdateAfterLiveCopies(std::uint32_t first, std::uint32_t last) {
  auto reads_live = [this](std::uint32_t p) { return source(p) == parts_[p].live_source; };
  if (!device_->orders_by_events()) {
    for (std::uint32_t p = first; p < last; ++p) {
      if (reads_live(p)) WaitPartSnapshotted(p);
    }
    return Status::Ok();
  }
  Status result;
  for (std::uint32_t p = first; p < last; ++p) {
    if (!reads_live(p) || state(p) == PartState::kSnapshotted) continue;
    std::shared_ptr<DeviceEvent> copy_done;
    if (TryClaim(p)) {
      // Pending: queue its copy now instead of waiting for a worker.
      Result<std::shared_ptr<DeviceEvent>> issued = executor_->IssueCopy(*this, p);
      if (!issued.ok()) {
        if (result.ok()) result = issued.status();
        continue;
      }
      copy_done = *issued;
    } else {
      // A worker claimed it: its copy is queued (or skipped) right after.
      while (copy_published_[p].load(std::memory_order_acquire) == 0) {
        copy_published_[p].wait(0, std::memory_order_acquire);
      }
      MutexLock lock(copy_events_mutex_);
      copy_done = copy_events_[p];
    }
    if (copy_done == nullptr) continue;
    Status waited = device_->ComputeWaitFor(std::move(copy_done));
    if (!waited.ok() && result.ok()) result = waited;
  }
  return result;
}

void UnitTask::ReleaseBuffersLocked() {
  for (auto& [ptr, bytes] : buffers_) device_->Free(ptr, bytes);
  buffers_.clear();
}

}  // namespace pmsnap::runtime
