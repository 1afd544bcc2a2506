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
  for (std::size_t p = 0; p < parts_.size(); ++p) {
    states_[p].store(static_cast<std::uint8_t>(PartState::kPending), std::memory_order_relaxed);
    sources_[p].store(parts_[p].live_source, std::memory_order_relaxed);
    bytes_ += parts_[p].bytes;
  }
}

UnitTask::~UnitTask() {
  std::lock_guard<std::mutex> lock(buffers_mutex_);
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
      std::lock_guard<std::mutex> lock(buffers_mutex_);
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
  auto job = [this, parts = std::move(parts), buffer] {
    const auto start = std::chrono::steady_clock::now();
    std::uint64_t offset = 0;
    for (std::uint32_t p : parts) {
      Status status =
          device_->CopyInDevice(buffer + offset, parts_[p].live_source, parts_[p].bytes);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(device_error_mutex_);
        if (device_error_.ok()) device_error_ = status;
      }
      // On failure the part goes back to the workers from the live tensor;
      // the error reaches the training thread through WaitInDeviceCopies.
      RedirectAndRelease(p, status.ok() ? buffer + offset : parts_[p].live_source);
      offset += parts_[p].bytes;
    }
    in_device_copy_seconds.fetch_add(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    in_device_bytes.fetch_add(offset);
    // Release pairs with the acquire in WaitInDeviceCopies.
    if (in_device_pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      in_device_pending_.notify_all();
    }
  };
  executor_->RunOnDeviceStream(std::move(job));
}

Status UnitTask::WaitInDeviceCopies() const {
  std::uint32_t pending = in_device_pending_.load(std::memory_order_acquire);
  while (pending != 0) {
    in_device_pending_.wait(pending, std::memory_order_acquire);
    pending = in_device_pending_.load(std::memory_order_acquire);
  }
  std::lock_guard<std::mutex> lock(device_error_mutex_);
  return device_error_;
}

void UnitTask::AdoptDeviceBuffer(void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(buffers_mutex_);
  buffers_.emplace_back(ptr, bytes);
}

void UnitTask::ReleaseBuffersLocked() {
  for (auto& [ptr, bytes] : buffers_) device_->Free(ptr, bytes);
  buffers_.clear();
}

}  // namespace pmsnap::runtime
