// ReplicaPipeline: LowDiff+'s capture/replica schedule (paper 002, section
// VI) below both front ends, so that its rules exist once:
// hooks::LowDiffPlus (libtorch) and pmsnap.LowDiffPlus (Python) supply the
// tensors, the copies and the replica's optimizer step; the pipeline says
// what may run when.
//
//  - Hand-over: each trained parameter hands at most one gradient per
//    iteration (a second would be applied twice: accumulating over several
//    backward passes needs no_sync()), and the step refuses a parameter
//    that has a gradient the hooks did not hand over.
//  - Two host buffers: iteration t's gradients go into buffer t % 2, so the
//    copy of iteration t waits until the replica applied iteration t - 2
//    (it may still read t - 1's buffer).
//  - The training step waits only for its own iteration's copies; the
//    replica applies iterations in order, at most two behind.
//  - The first error of any thread stops every wait and is returned to the
//    training thread; the replica skips the iterations after it.
//
//   // any thread (autograd hook, all-reduce callback), per gradient:
//   auto t = pipeline.Claim({index}); slot[index] = gradient; pipeline.Queue({index}, *t);
//   // snapshot thread:
//   while (auto copies = pipeline.NextCopies()) { copy them; pipeline.CopiesDone(n, bytes); }
//   // training thread, per step:
//   pipeline.CheckHandedOver(with_gradient); optimizer.step();
//   auto t = pipeline.FinishStep(); store t's payload; pipeline.Release(*t);
//   // replica thread:
//   while (auto next = pipeline.NextIteration()) { if (next->apply) apply(...); pipeline.Applied(t); }
//
// Only the thread that claimed a parameter writes its slot, before Queue;
// the snapshot thread reads it after NextCopies returned it, before
// FinishStep(t) returns, and the parameter's next gradient is claimed only
// after that: an adapter keeps one gradient slot per parameter.
//
// Thread-safety: every method is thread-safe; the roles above say which
// thread calls what. Blocking calls say so.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/mutex.h"
#include "pmsnap/common/status.h"
#include "pmsnap/common/thread_annotations.h"

namespace pmsnap::frontend {

struct ReplicaPipelineStats {
  std::uint64_t iterations = 0;                  // steps handed to the replica
  std::uint64_t replica_iteration = 0;           // the last iteration the replica applied
  std::uint64_t gradient_bytes_snapshotted = 0;  // bytes copied off the device, total
  double training_wait_seconds = 0;              // FinishStep's waits for the copies
};

class ReplicaPipeline {
 public:
  // One gradient to copy: parameter `index`'s of `iteration`, into buffer
  // iteration % 2.
  struct Copy {
    std::uint64_t iteration = 0;
    std::size_t index = 0;
  };
  // The next iteration for the replica; apply is false once a thread failed
  // (the replica then only counts it as done).
  struct Next {
    std::uint64_t iteration = 0;
    bool apply = true;
  };

  // `names` of the trained parameters, in the adapters' order (for errors);
  // `owner` names the pool in errors. Training continues after `iteration`.
  ReplicaPipeline(std::vector<std::string> names, std::string owner, std::uint64_t iteration);

  // Claims the gradients of `indices` for the current iteration and returns
  // that iteration; the step waits for their copies from now on. The caller
  // stores them in its slots, then calls Queue. kInvalidArgument naming the
  // parameter for an index out of range or a second gradient before
  // FinishStep (nothing is claimed then); kFailedPrecondition once closed.
  Result<std::uint64_t> Claim(std::span<const std::size_t> indices) PMSNAP_EXCLUDES(mutex_);
  // Hands claimed gradients of `iteration` (Claim's) to the snapshot thread.
  void Queue(std::span<const std::size_t> indices, std::uint64_t iteration)
      PMSNAP_EXCLUDES(mutex_);

  // Before the training update: a thread's earlier error, or
  // kInvalidArgument naming up to three parameters that have a gradient
  // (`with_gradient`, the adapters' order) not handed over this iteration;
  // kFailedPrecondition once closed.
  Status CheckHandedOver(const std::vector<bool>& with_gradient) const PMSNAP_EXCLUDES(mutex_);

  // After the training update: blocks until this iteration's copies are
  // done, then counts the iteration and returns its number (the adapter
  // stores what the replica needs of it, then calls Release). A thread's
  // error instead, after the wait.
  Result<std::uint64_t> FinishStep() PMSNAP_EXCLUDES(mutex_);
  // Hands iteration `iteration` (FinishStep's) to the replica thread.
  void Release(std::uint64_t iteration) PMSNAP_EXCLUDES(mutex_);

  // Snapshot thread: blocks until gradients are queued and their buffer is
  // free (the replica applied iteration - 2), and returns them (one
  // iteration's); nullopt once stopping.
  std::optional<std::vector<Copy>> NextCopies() PMSNAP_EXCLUDES(mutex_);
  // `count` copies done (also those an adapter skipped), `bytes` copied.
  void CopiesDone(std::size_t count, std::uint64_t bytes) PMSNAP_EXCLUDES(mutex_);

  // Replica thread: blocks for the next released iteration; nullopt once
  // stopping and none is left.
  std::optional<Next> NextIteration() PMSNAP_EXCLUDES(mutex_);
  void Applied(std::uint64_t iteration) PMSNAP_EXCLUDES(mutex_);

  // Any thread: the first error wins; every wait ends.
  void RecordError(Status status) PMSNAP_EXCLUDES(mutex_);
  Status error() const PMSNAP_EXCLUDES(mutex_);

  // Blocks until the replica applied `iteration` or a thread failed; the
  // error then.
  Status WaitForReplica(std::uint64_t iteration) PMSNAP_EXCLUDES(mutex_);

  // A restore set both the training and the replica to `iteration`.
  void Restored(std::uint64_t iteration) PMSNAP_EXCLUDES(mutex_);

  // Closing: later hand-overs and steps fail; `finish` waits for the
  // replica to apply every released iteration first (its error returned),
  // otherwise the iterations not taken yet are dropped. Then the threads'
  // Next* calls return nullopt (the replica's once its queue is empty).
  // False if already closed.
  bool Close(bool finish, Status* waited) PMSNAP_EXCLUDES(mutex_);

  std::uint64_t iteration() const PMSNAP_EXCLUDES(mutex_);
  bool closed() const PMSNAP_EXCLUDES(mutex_);
  ReplicaPipelineStats stats() const PMSNAP_EXCLUDES(mutex_);

 private:
  Status ClosedError() const;

  const std::vector<std::string> names_;
  const std::string owner_;
  mutable Mutex mutex_;
  CondVar changed_;
  std::uint64_t iteration_ PMSNAP_GUARDED_BY(mutex_);     // steps done (training's count)
  std::uint64_t replica_done_ PMSNAP_GUARDED_BY(mutex_);  // last iteration the replica applied
  std::vector<bool> handed_ PMSNAP_GUARDED_BY(mutex_);    // this iteration's hand-overs
  std::uint64_t copies_queued_ PMSNAP_GUARDED_BY(mutex_) = 0;
  std::uint64_t copies_done_ PMSNAP_GUARDED_BY(mutex_) = 0;
  std::deque<Copy> copies_ PMSNAP_GUARDED_BY(mutex_);
  std::deque<std::uint64_t> released_ PMSNAP_GUARDED_BY(mutex_);
  Status error_ PMSNAP_GUARDED_BY(mutex_);
  bool closed_ PMSNAP_GUARDED_BY(mutex_) = false;
  bool stopping_ PMSNAP_GUARDED_BY(mutex_) = false;
  ReplicaPipelineStats stats_ PMSNAP_GUARDED_BY(mutex_);
};

}  // namespace pmsnap::frontend
