// LowDiffPlus: per-iteration checkpoints from the gradients alone (LowDiff+,
// paper 002 section VI), the libtorch counterpart of Python's
// pmsnap.LowDiffPlus (python/pmsnap/lowdiff_plus.py has the design notes).
//
//   torch::optim::Adam adam(model->parameters(), options);
//   runtime::EngineOptions engine;
//   engine.pool_path = "/mnt/pmem/run.pool";
//   auto plus = hooks::LowDiffPlus::Create(model->named_parameters().pairs(), adam, engine);
//   auto restored = (*plus)->Restore();            // kNotFound on a fresh pool
//   for (...) {
//     adam.zero_grad(); loss.backward();
//     // once a parameter's gradient is final (after its all-reduce):
//     for (i ...) (*plus)->HandGradient(i, params[i].grad());
//     (*plus)->Step(extra_state);                  // instead of adam.step()
//   }
//
// The training thread only hands gradients over (a reference is queued) and
// runs its own optimizer. A snapshot thread copies each handed gradient into
// one of two host buffers (iteration t: buffer t % 2), the only bytes that
// leave the device; a replica thread applies a second optimizer of the same
// kind, with every param group's options copied at each Step (an LR
// schedule is followed), to a host replica of the parameters, through a
// CheckpointedOptimizer on the replica: each replica weight is checkpointed
// as soon as it is updated and the iteration commits as an epoch of an
// ordinary pool (units named after the parameters, their optimizer state).
// On the CPU the replica equals the trained model bitwise (the same libtorch
// kernels on the same values); with gradients from another device it would
// match within float tolerance.
//
// The schedule (one gradient per parameter and iteration, the two buffers,
// the replica's lag, the first error) is frontend::ReplicaPipeline's, which
// the Python front end follows too; this class supplies the tensors.
//
// A crash of the training process leaves the pool's newest commit as the
// recovery point (no replay); Restore copies it into the model and the
// training optimizer. The replica runs at most two iterations behind: the
// snapshot of iteration t waits until the replica applied t - 2, and Step
// waits for its iteration's copies.
//
// Errors from the threads are returned by the next Step, Flush or Close.
// Exceptions never leave this API; libtorch's errors become Statuses.
//
// Thread-safety: one training thread owns a LowDiffPlus and calls Step,
// Restore, Flush, Close; HandGradient may be called from any thread (an
// all-reduce's completion callback, an autograd hook). The trained
// parameters and optimizer must outlive it.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/frontend/replica_pipeline.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

// The pipeline's (iterations handed to the replica, the last one it
// applied, gradient bytes copied off the device, Step's waits for the
// copies) and:
struct LowDiffPlusStats : frontend::ReplicaPipelineStats {
  std::uint64_t gradient_bytes_per_iteration = 0;
};

class LowDiffPlus {
 public:
  // Builds the host replica (a copy of every parameter of `optimizer`, named
  // after `named_parameters`), an optimizer of the same kind on it with the
  // same param groups and options, and the replica's CheckpointedOptimizer
  // on `options` (its pool; created if missing). `optimizer` is SGD, Adam,
  // AdamW, Adagrad or RMSprop; the replica starts from its state as it is
  // (a copy; none before the first step), or from a Restore.
  // Errors: kInvalidArgument for another optimizer type, a parameter of the
  // optimizer missing from `named_parameters`, a sparse parameter;
  // CheckpointedOptimizer::Create's errors for the pool.
  static Result<std::unique_ptr<LowDiffPlus>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      torch::optim::Optimizer& optimizer, runtime::EngineOptions options);

  // Hands parameter `index`'s (in the optimizer's order) gradient of the
  // current iteration to the snapshot thread: non-blocking; the tensor must
  // keep its values until Step returns. kInvalidArgument for an index out of
  // range, a shape or dtype that is not the parameter's, or a second
  // gradient for the same parameter before Step (accumulating over several
  // backward passes would be applied twice); kFailedPrecondition once closed.
  Status HandGradient(std::size_t index, const torch::Tensor& gradient);

  // Runs optimizer.step() (the training update), waits until this
  // iteration's handed gradients are copied, and hands the iteration (which
  // parameters had a gradient, every group's options, `extra_state`) to the
  // replica. kInvalidArgument, before the update, if a parameter has a
  // gradient that was not handed over; a thread's earlier error otherwise
  // (the training update has then happened).
  Status Step(std::span<const std::byte> extra_state = {});

  // Loads the pool's newest committed replica into the replica, the trained
  // parameters and the training optimizer's state, and returns it (with the
  // caller's extra state). Param-group options are not in a C++ pool: a
  // learning-rate schedule sets its value after Restore, as with
  // CheckpointedOptimizer. Only before the first Step. kNotFound if the pool
  // holds no checkpoint (training may then start from the beginning).
  Result<RestoreInfo> Restore();

  // Waits until the replica applied every Step and its epoch committed.
  Status Flush();
  // Finishes (kFinish) or drops (kAbandon) the replica's pending iterations,
  // stops the threads and closes the pool. Idempotent; the destructor
  // calls Close(kFinish).
  Status Close(runtime::CloseMode mode = runtime::CloseMode::kFinish);

  std::uint64_t iteration() const;
  // The replica's parameters (read them after Flush) and optimizer.
  const std::vector<torch::Tensor>& replica_parameters() const;
  torch::optim::Optimizer& replica_optimizer();
  LowDiffPlusStats stats() const;
  // The replica's checkpoint stats (its blocked time is the replica thread's).
  runtime::Stats checkpoint_stats() const;

  ~LowDiffPlus();
  LowDiffPlus(const LowDiffPlus&) = delete;
  LowDiffPlus& operator=(const LowDiffPlus&) = delete;

 private:
  struct State;
  explicit LowDiffPlus(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace pmsnap::hooks
