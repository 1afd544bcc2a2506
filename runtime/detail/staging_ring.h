// StagingRing: a bounded set of pinned staging buffers for device -> host
// copies whose destination the device cannot write directly (CUDA: the PM
// mapping could not be registered with cudaHostRegister). A copy of any size
// moves through it chunk by chunk, so the ring never holds more than its
// capacity, however large the model: memory spikes during asynchronous
// saves are what users most often report against other checkpointers.
//
// Plain host code (buffers come from the Allocator given), used by
// cuda_device.cu and tested on the host with ordinary memory.
//
// Thread-safety: Transfer may be called from many threads at once; each
// holds one buffer at a time and waits for a free one when all are in use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "pmsnap/common/mutex.h"
#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

class StagingRing {
 public:
  struct Allocator {
    // Returns nullptr when the memory cannot be had.
    std::function<void*(std::size_t bytes)> allocate;
    std::function<void(void* ptr)> free;
  };
  // Writes `n` bytes of the transfer, starting at `offset`, into `buffer`
  // and returns once they are there (CUDA: a copy into the pinned buffer and
  // a wait for its event).
  using Fill = std::function<Status(std::byte* buffer, std::uint64_t offset, std::uint64_t n)>;

  // At most capacity_bytes / chunk_bytes buffers of chunk_bytes (a chunk
  // larger than the capacity is cut to it; at least one buffer), allocated
  // on first need and kept until destruction. kInvalidArgument for a zero
  // capacity or chunk.
  static Result<std::unique_ptr<StagingRing>> Create(std::uint64_t capacity_bytes,
                                                     std::uint64_t chunk_bytes,
                                                     Allocator allocator);
  // Frees every buffer. No Transfer may be running.
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Moves `bytes` into `dst` through the ring: per chunk, `fill` puts the
  // bytes in a buffer, then they are copied to dst + offset. Returns the
  // first error of `fill`, or kNoSpace if not even one buffer could be
  // allocated; dst is then partly written.
  Status Transfer(std::byte* dst, std::uint64_t bytes, const Fill& fill);

  std::uint64_t capacity_bytes() const { return buffer_count_ * chunk_bytes_; }
  std::uint64_t chunk_bytes() const { return chunk_bytes_; }
  // Most bytes of buffers ever allocated at once (never above the capacity).
  std::uint64_t peak_bytes() const PMSNAP_EXCLUDES(mutex_);

 private:
  StagingRing(std::uint64_t buffer_count, std::uint64_t chunk_bytes, Allocator allocator);
  // A free buffer, allocating one while under the bound; waits otherwise.
  Result<std::byte*> Acquire() PMSNAP_EXCLUDES(mutex_);
  void Release(std::byte* buffer) PMSNAP_EXCLUDES(mutex_);

  const std::uint64_t buffer_count_;
  const std::uint64_t chunk_bytes_;
  Allocator allocator_;
  mutable Mutex mutex_;
  CondVar freed_;
  std::vector<std::byte*> all_ PMSNAP_GUARDED_BY(mutex_);   // every allocated buffer
  std::vector<std::byte*> free_ PMSNAP_GUARDED_BY(mutex_);  // those not in use
};

}  // namespace pmsnap::runtime
