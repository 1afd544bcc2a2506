// ReplicaPipeline (replica_pipeline.h): LowDiff+'s hand-over, two-buffer
// copy and replica schedule.
#include "pmsnap/frontend/replica_pipeline.h"

#include <chrono>
#include <utility>

namespace pmsnap::frontend {

ReplicaPipeline::ReplicaPipeline(std::vector<std::string> names, std::string owner,
                                 std::uint64_t iteration)
    : names_(std::move(names)), owner_(std::move(owner)) {
  MutexLock lock(mutex_);  // no other thread yet; for the analysis
  iteration_ = replica_done_ = stats_.replica_iteration = iteration;
  handed_.assign(names_.size(), false);
}

Status ReplicaPipeline::ClosedError() const {
  return Status(StatusCode::kFailedPrecondition, "LowDiffPlus for " + owner_ + " is closed");
}

Result<std::uint64_t> ReplicaPipeline::Claim(std::span<const std::size_t> indices) {
  MutexLock lock(mutex_);
  if (closed_) return ClosedError();
  for (std::size_t at = 0; at < indices.size(); ++at) {
    const std::size_t index = indices[at];
    if (index >= names_.size()) {
      return Status(StatusCode::kInvalidArgument,
                    "LowDiffPlus (" + owner_ + "): gradient index " + std::to_string(index) +
                        " out of range (" + std::to_string(names_.size()) + " parameters)");
    }
    bool twice = handed_[index];
    for (std::size_t before = 0; before < at && !twice; ++before) twice = indices[before] == index;
    if (twice) {
      return Status(StatusCode::kInvalidArgument,
                    "LowDiffPlus (" + owner_ + "): parameter '" + names_[index] +
                        "' got a second gradient before step(); accumulating gradients over "
                        "several backward passes would apply them twice (use DDP's no_sync() on "
                        "all but the last)");
    }
  }
  for (std::size_t index : indices) handed_[index] = true;
  copies_queued_ += indices.size();
  return iteration_ + 1;
}

void ReplicaPipeline::Queue(std::span<const std::size_t> indices, std::uint64_t iteration) {
  MutexLock lock(mutex_);
  for (std::size_t index : indices) copies_.push_back({iteration, index});
  changed_.NotifyAll();
}

Status ReplicaPipeline::CheckHandedOver(const std::vector<bool>& with_gradient) const {
  MutexLock lock(mutex_);
  if (closed_) return ClosedError();
  if (!error_.ok()) return error_;
  std::string missing;
  int named = 0;
  for (std::size_t i = 0; i < with_gradient.size() && i < names_.size() && named < 3; ++i) {
    if (with_gradient[i] && !handed_[i]) {
      missing += (named++ ? ", '" : "'") + names_[i] + "'";
    }
  }
  if (named == 0) return Status::Ok();
  return Status(StatusCode::kInvalidArgument,
                "LowDiffPlus (" + owner_ + "): the gradient of " + missing +
                    " was not handed over in this iteration's backward (a gradient set by hand, "
                    "or a step after a no_sync() backward); the replica would miss it");
}

Result<std::uint64_t> ReplicaPipeline::FinishStep() {
  const auto began = std::chrono::steady_clock::now();
  MutexLock lock(mutex_);
  while (copies_done_ < copies_queued_ && error_.ok()) changed_.Wait(lock);
  stats_.training_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  copies_done_ = copies_queued_ = 0;
  handed_.assign(names_.size(), false);
  if (!error_.ok()) return error_;
  ++stats_.iterations;
  return ++iteration_;
}

void ReplicaPipeline::Release(std::uint64_t iteration) {
  MutexLock lock(mutex_);
  released_.push_back(iteration);
  changed_.NotifyAll();
}

std::optional<std::vector<ReplicaPipeline::Copy>> ReplicaPipeline::NextCopies() {
  MutexLock lock(mutex_);
  while (!stopping_ && copies_.empty()) changed_.Wait(lock);
  // Stopping: a copy not taken by a step is dropped (its buffer may be the
  // one the replica reads).
  if (stopping_) return std::nullopt;
  const std::uint64_t iteration = copies_.front().iteration;
  // Buffer iteration % 2 is free once the replica applied iteration - 2.
  while (!stopping_ && error_.ok() && replica_done_ + 2 < iteration) changed_.Wait(lock);
  if (stopping_) return std::nullopt;
  std::vector<Copy> copies;
  while (!copies_.empty() && copies_.front().iteration == iteration) {
    copies.push_back(copies_.front());
    copies_.pop_front();
  }
  return copies;
}

void ReplicaPipeline::CopiesDone(std::size_t count, std::uint64_t bytes) {
  MutexLock lock(mutex_);
  copies_done_ += count;
  stats_.gradient_bytes_snapshotted += bytes;
  changed_.NotifyAll();
}

std::optional<ReplicaPipeline::Next> ReplicaPipeline::NextIteration() {
  MutexLock lock(mutex_);
  while (!stopping_ && released_.empty()) changed_.Wait(lock);
  if (released_.empty()) return std::nullopt;
  Next next{released_.front(), error_.ok()};
  released_.pop_front();
  return next;
}

void ReplicaPipeline::Applied(std::uint64_t iteration) {
  MutexLock lock(mutex_);
  replica_done_ = stats_.replica_iteration = iteration;
  changed_.NotifyAll();
}

void ReplicaPipeline::RecordError(Status status) {
  MutexLock lock(mutex_);
  if (error_.ok()) error_ = std::move(status);
  changed_.NotifyAll();
}

Status ReplicaPipeline::error() const {
  MutexLock lock(mutex_);
  return error_;
}

Status ReplicaPipeline::WaitForReplica(std::uint64_t iteration) {
  MutexLock lock(mutex_);
  while (replica_done_ < iteration && error_.ok()) changed_.Wait(lock);
  return error_;
}

void ReplicaPipeline::Restored(std::uint64_t iteration) {
  MutexLock lock(mutex_);
  iteration_ = replica_done_ = stats_.replica_iteration = iteration;
}

bool ReplicaPipeline::Close(bool finish, Status* waited) {
  MutexLock lock(mutex_);
  if (closed_) return false;
  if (finish) {
    while (replica_done_ < iteration_ && error_.ok()) changed_.Wait(lock);
    if (waited != nullptr) *waited = error_;
  } else {
    released_.clear();
  }
  closed_ = stopping_ = true;
  changed_.NotifyAll();
  return true;
}

std::uint64_t ReplicaPipeline::iteration() const {
  MutexLock lock(mutex_);
  return iteration_;
}

bool ReplicaPipeline::closed() const {
  MutexLock lock(mutex_);
  return closed_;
}

ReplicaPipelineStats ReplicaPipeline::stats() const {
  MutexLock lock(mutex_);
  return stats_;
}

}  // namespace pmsnap::frontend
