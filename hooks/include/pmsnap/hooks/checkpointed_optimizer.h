// CheckpointedOptimizer: a libtorch optimizer whose every step is
// checkpointed into a pmsnap pool, weight by weight, while training runs.
//
//   torch::optim::Adam adam(model->parameters(), options);
//   runtime::EngineOptions engine;
//   engine.pool_path = "/dev/shm/run.pool";
//   auto opt = hooks::CheckpointedOptimizer::Create(*model, adam, engine);
//   auto restored = (*opt)->Restore();          // kNotFound on a fresh pool
//   for (...) {
//     adam.zero_grad(); loss.backward();
//     (*opt)->Step(extra_state);                // instead of adam.step()
//   }
//
// Each parameter plus its optimizer state tensors is one pmsnap unit, named
// after the parameter. Step runs the optimizer one parameter at a time
// (ParameterStepper: bitwise identical to adam.step()) and calls the
// Engine's BeginStep / BeforeUpdate / AfterUpdate / EndStep around it, so
// the workers copy each unit out as soon as its update is done. Restore
// copies the newest committed epoch from the pool mapping straight into the
// parameters and state tensors (no deserialization).
//
// Exceptions never leave this API: libtorch's c10::Error becomes a Status
// that keeps libtorch's message.
//
// Thread-safety: one training thread owns a CheckpointedOptimizer; stats()
// may be called from any thread. The module and optimizer must outlive it.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/hooks/parameter_stepper.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

struct RestoreInfo {
  std::uint64_t iteration = 0;  // steps done by the restored state (resume at +1)
  std::uint64_t epoch = 0;
  std::vector<std::byte> extra_state;  // as passed to Step (see extra_state.h)
};

class CheckpointedOptimizer {
 public:
  // Registers every parameter of `optimizer` (named after `module`'s
  // parameters) with its optimizer state as one unit each, then opens the
  // pool at options.pool_path, or creates it if missing. Register every
  // parameter group before this call.
  // Errors: kModelMismatch if the pool was made for another model, naming
  // the first unit that differs (e.g. a parameter whose shape or dtype
  // changed); kNoSpace if the file system cannot hold a new pool;
  // kInvalidArgument for an unsupported optimizer or parameter
  // (ParameterStepper::Create); the Engine's errors otherwise.
  static Result<std::unique_ptr<CheckpointedOptimizer>> Create(const torch::nn::Module& module,
                                                               torch::optim::Optimizer& optimizer,
                                                               runtime::EngineOptions options);
  // As above with explicit names (e.g. several modules, or none).
  static Result<std::unique_ptr<CheckpointedOptimizer>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      torch::optim::Optimizer& optimizer, runtime::EngineOptions options);

  // Replaces optimizer.step() for iteration iteration() + 1. `extra_state`
  // (data position, RNG... see extra_state.h) is stored with the epoch that
  // captures this step. The optimizer step always completes, bitwise as
  // optimizer.step() would; a non-OK status means checkpointing failed (a
  // worker I/O error, kCapacityExceeded extra state...) and the pool keeps
  // its last committed epoch. kFailedPrecondition, with nothing updated, if
  // parameters were added, removed or reallocated since Create.
  Status Step(std::span<const std::byte> extra_state = {});

  // Loads the newest committed epoch into the parameters and optimizer state
  // and sets iteration() to its iteration. Only before the first Step.
  // kNotFound if the pool holds no committed epoch (a fresh run).
  Result<RestoreInfo> Restore();

  // Waits for the epoch in flight; returns the first worker error.
  Status Flush();
  // Finishes (or abandons) the epoch in flight and releases the pool.
  // Idempotent; the destructor calls Close(kFinish).
  Status Close(runtime::CloseMode mode = runtime::CloseMode::kFinish);

  // Steps done: 0 on a fresh run, the restored iteration after Restore.
  std::uint64_t iteration() const { return iteration_; }
  runtime::Engine& engine() { return *engine_; }
  runtime::Stats stats() const { return engine_->stats(); }
  const ParameterStepper& stepper() const { return *stepper_; }

  ~CheckpointedOptimizer();
  CheckpointedOptimizer(const CheckpointedOptimizer&) = delete;
  CheckpointedOptimizer& operator=(const CheckpointedOptimizer&) = delete;

 private:
  class EngineObserver;
  CheckpointedOptimizer(std::unique_ptr<ParameterStepper> stepper,
                        std::unique_ptr<runtime::Engine> engine);

  std::unique_ptr<ParameterStepper> stepper_;
  std::unique_ptr<runtime::Engine> engine_;
  // slot index -> engine unit id
  std::vector<std::uint32_t> unit_of_slot_;
  std::uint64_t iteration_ = 0;
  bool stepped_ = false;
};

// Opens an existing pool for `module` + `optimizer`, restores the newest
// committed epoch into them and closes the pool (e.g. for evaluation).
// kNotFound if options.pool_path does not exist or holds no commit.
Result<RestoreInfo> RestoreFromPool(const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    runtime::EngineOptions options);

}  // namespace pmsnap::hooks
