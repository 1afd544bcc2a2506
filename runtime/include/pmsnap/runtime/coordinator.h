// Coordinator: what the runtime needs from torch.distributed (or c10d) to
// checkpoint many ranks as one whole. pmsnap opens no sockets and runs no
// rendezvous of its own: every exchange is one of these collectives, on a
// group the front end chose (a side group, so that pmsnap's small messages
// never queue behind the training's gradient all-reduces).
//
// Implementations: python/pmsnap (torch.distributed, a pybind11 trampoline),
// hooks/ (c10d::ProcessGroup) and tests/testutil (threads in one process).
//
// Contract for every collective below: all ranks of the group call it in the
// same order with the same element count; it fails (a non-OK Status naming
// this rank) rather than hangs when the group is broken, as far as the
// transport can tell. Thread-safety: one thread per Coordinator at a time
// (the training thread); collectives are not reentrant.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

class Coordinator {
 public:
  virtual ~Coordinator() = default;

  // This process's rank in [0, world_size()) and the group's size (>= 1).
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Starts an element-wise MIN all-reduce of `values` and returns at once;
  // FinishMinAllReduce gives the result. At most one is in flight: starting
  // a second before finishing the first is kFailedPrecondition. `values` is
  // copied before the call returns.
  virtual Status StartMinAllReduce(std::span<const std::int64_t> values) = 0;

  // Waits for the all-reduce started last and returns the element-wise MIN
  // over all ranks (same on every rank). kFailedPrecondition when none is in
  // flight; the transport's error otherwise.
  virtual Result<std::vector<std::int64_t>> FinishMinAllReduce() = 0;

  // Replaces `bytes` on every rank with root's `bytes`; blocks until done.
  // All ranks pass the same size.
  virtual Status Broadcast(std::span<std::byte> bytes, int root) = 0;

  // A blocking MIN all-reduce: Start then Finish.
  Result<std::vector<std::int64_t>> MinAllReduce(std::span<const std::int64_t> values) {
    PMSNAP_RETURN_IF_ERROR(StartMinAllReduce(values));
    return FinishMinAllReduce();
  }
};

}  // namespace pmsnap::runtime
