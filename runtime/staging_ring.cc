#include "detail/staging_ring.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

namespace pmsnap::runtime {

Result<std::unique_ptr<StagingRing>> StagingRing::Create(std::uint64_t capacity_bytes,
                                                         std::uint64_t chunk_bytes,
                                                         Allocator allocator) {
  if (capacity_bytes == 0 || chunk_bytes == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "staging ring of " + std::to_string(capacity_bytes) + " bytes in chunks of " +
                      std::to_string(chunk_bytes) + " bytes: both must be > 0");
  }
  chunk_bytes = std::min(chunk_bytes, capacity_bytes);
  return std::unique_ptr<StagingRing>(
      new StagingRing(capacity_bytes / chunk_bytes, chunk_bytes, std::move(allocator)));
}

StagingRing::StagingRing(std::uint64_t buffer_count, std::uint64_t chunk_bytes,
                         Allocator allocator)
    : buffer_count_(buffer_count), chunk_bytes_(chunk_bytes), allocator_(std::move(allocator)) {}

StagingRing::~StagingRing() {
  for (std::byte* buffer : all_) allocator_.free(buffer);
}

std::uint64_t StagingRing::peak_bytes() const {
  MutexLock lock(mutex_);
  return all_.size() * chunk_bytes_;
}

Result<std::byte*> StagingRing::Acquire() {
  MutexLock lock(mutex_);
  while (free_.empty()) {
    if (all_.size() < buffer_count_) {
      auto* buffer = static_cast<std::byte*>(allocator_.allocate(chunk_bytes_));
      if (buffer != nullptr) {
        all_.push_back(buffer);
        return buffer;
      }
      if (all_.empty()) {
        return Status(StatusCode::kNoSpace, "staging ring: cannot allocate one pinned buffer of " +
                                                std::to_string(chunk_bytes_) + " bytes");
      }
    }
    // Every buffer the bound (or the allocator) allows is in use.
    freed_.Wait(lock);
  }
  std::byte* buffer = free_.back();
  free_.pop_back();
  return buffer;
}

void StagingRing::Release(std::byte* buffer) {
  {
    MutexLock lock(mutex_);
    free_.push_back(buffer);
  }
  freed_.NotifyOne();
}

Status StagingRing::Transfer(std::byte* dst, std::uint64_t bytes, const Fill& fill) {
  if (bytes == 0) return Status::Ok();
  PMSNAP_ASSIGN_OR_RETURN(std::byte* buffer, Acquire());
  Status status;
  for (std::uint64_t offset = 0; offset < bytes && status.ok(); offset += chunk_bytes_) {
    const std::uint64_t n = std::min(chunk_bytes_, bytes - offset);
    status = fill(buffer, offset, n);
    if (status.ok()) std::memcpy(dst + offset, buffer, n);
  }
  Release(buffer);
  return status;
}

}  // namespace pmsnap::runtime
