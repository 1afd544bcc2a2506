// LowDiff: compressed gradients reused as differential checkpoints (paper
// 002, section V), the libtorch counterpart of Python's pmsnap.LowDiff
// (python/pmsnap/lowdiff.py has the design notes; docs/ARCHITECTURE.md,
// "LowDiff").
//
//   torch::optim::Adam adam(model->parameters(), options);
//   runtime::EngineOptions engine;
//   engine.pool_path = "/mnt/pmem/run.pool";
//   engine.coordinator = coordinator;            // C10dCoordinator, several ranks
//   hooks::LowDiffOptions lowdiff;
//   lowdiff.topk_ratio = 0.01;
//   lowdiff.gradient_group = gloo_backend;       // the group gradients are averaged over
//   auto ld = hooks::LowDiff::Create(*model, adam, engine, lowdiff);
//   auto restored = (*ld)->Restore();            // kNotFound on a fresh pool
//   for (...) {
//     adam.zero_grad(); loss.backward();
//     (*ld)->SynchronizeGradients();             // instead of an all-reduce
//     (*ld)->Step(extra_state);                  // instead of adam.step()
//   }
//
// SynchronizeGradients is the C++ form of the Python TopK communication
// hook: each parameter's gradient (plus its error-feedback residual) keeps
// its k = ceil(ratio * numel) largest magnitudes, every rank's (values,
// indices) are all-gathered over `gradient_group` and averaged into the
// gradient, and what was not sent becomes the residual. The gathered values
// and indices, exactly what the optimizer then applies, are this iteration's
// differential: Step hands them to a diff::DifferentialLog by reference (its
// worker copies them and writes b differentials as one chunk of the pool's
// chunk heap) and waits at its end until they were copied. A full
// checkpoint is taken every full_every steps through CheckpointedOptimizer
// (the weight-grained path); f and b follow Eq. 10 from the measured write
// bandwidth, checkpoint bytes, merge and iteration times unless fixed.
//
// When full checkpoints come, what the log frees, the Eq. 10 retuning and
// the ranks' agreement on it are diff::LowDiffController's, which the
// Python front end follows too; this class supplies the tensors and the
// gradient group (whose ranks agree through a C10dCoordinator).
//
// Restore: the newest full checkpoint (every rank the same), then each
// retained differential in order, decompressed and stepped through the same
// CheckpointedOptimizer::Step that training ran, with the learning rate of
// every param group that step had (a schedule between full checkpoints
// replays right): bit-exact. Ranks replay to the newest iteration all of
// them hold. A crash loses at most b-1 differentials.
//
// Not restored: the error-feedback residuals. They are per rank, as large as
// the model and change every step; persisting them would cost what
// compression saves. The resumed run's residuals start from zero, so its
// later gradients differ from an uninterrupted run's (not its restored
// state). Param-group options other than the learning rate are taken as
// configured (a C++ pool does not hold them; CheckpointedOptimizer).
//
// Errors carry the pool path or the parameter; exceptions never leave this
// API (libtorch's errors become Statuses).
//
// Thread-safety: one training thread calls every method.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/diff/differential_log.h"
#include "pmsnap/diff/lowdiff_controller.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

// The full-checkpoint interval and batch (fixed, or tuned by Eq. 10 within
// the chunk heap), their initial values and M are diff::LowDiffController's
// options (diff/lowdiff_controller.h); world_size is the gradient group's.
struct LowDiffOptions : diff::LowDiffControllerOptions {
  // Fraction of each gradient's elements a rank sends, in (0, 1].
  double topk_ratio = 0.01;
  // Add what was not sent to the next step's gradient.
  bool error_feedback = true;
  // The group gradients are averaged over (gloo on CPU tensors); nullptr:
  // one process, the compressed gradient is applied as it is.
  c10::intrusive_ptr<c10d::Backend> gradient_group;
  // The chunk heap budget of a pool this object creates, when
  // EngineOptions::pool_options leaves it at 0.
  std::uint64_t chunk_heap_bytes = 256ull << 20;
};

struct LowDiffRestoreInfo {
  std::uint64_t iteration = 0;       // the state restored (resume at +1)
  std::uint64_t full_iteration = 0;  // the full checkpoint it started from
  std::uint64_t replayed = 0;        // differentials stepped on top of it
  double replay_seconds = 0;
  std::vector<std::byte> extra_state;  // of `iteration`, as passed to Step
};

// The controller's (full_every, batch, Eq. 10's f*, b* and inputs, the heap
// bound, bytes handed) and:
struct LowDiffStats : diff::LowDiffControllerStats {
  std::uint32_t max_loss = 0;    // b - 1
  std::uint32_t world_size = 1;  // N
  diff::DifferentialLogStats log;
};

class LowDiff {
 public:
  // Creates the CheckpointedOptimizer of `module` + `optimizer` on `options`
  // (its policy is replaced: LowDiff decides the full-checkpoint steps).
  // kInvalidArgument for a ratio outside (0, 1], a max_batch of 0, a
  // gradient group whose size is not the coordinator's; the
  // CheckpointedOptimizer's errors otherwise (pool, optimizer, parameters).
  static Result<std::unique_ptr<LowDiff>> Create(const torch::nn::Module& module,
                                                 torch::optim::Optimizer& optimizer,
                                                 runtime::EngineOptions options,
                                                 LowDiffOptions lowdiff = {});

  // Compresses and synchronizes every parameter that has a gradient (see the
  // file comment), writing the averaged decompressed gradient into it. Every
  // rank of the group calls it with the same parameters having gradients.
  // kFailedPrecondition if called twice before Step, or once closed; a
  // collective's error, naming the parameter.
  Status SynchronizeGradients();

  // The optimizer step on the synchronized gradients (CheckpointedOptimizer::Step,
  // whose full checkpoints store `extra_state`); this iteration's
  // differential (with `extra_state`) goes to the log. kFailedPrecondition,
  // with nothing updated, without a SynchronizeGradients since the last
  // Step; otherwise the update happens and the first checkpointing error is
  // returned.
  Status Step(std::span<const std::byte> extra_state = {});

  // Restores the newest full checkpoint and replays the differentials after
  // it (file comment). Only before the first Step. kNotFound if the pool
  // holds no full checkpoint (a fresh run); kCorruption naming the pool and
  // chunk for a damaged sealed differential; CheckpointedOptimizer::Restore's
  // errors.
  Result<LowDiffRestoreInfo> Restore();

  // Writes every differential appended so far (the partial batch too) and
  // waits for the full checkpoint in flight.
  Status Flush();
  // kFinish: Flush, then close the pool. kAbandon: drop what is buffered and
  // in flight (what a crash does). Idempotent; the destructor calls
  // Close(kFinish).
  Status Close(runtime::CloseMode mode = runtime::CloseMode::kFinish);

  std::uint64_t iteration() const { return checkpointed_->iteration(); }
  CheckpointedOptimizer& checkpointed() { return *checkpointed_; }
  LowDiffStats stats() const;

  ~LowDiff();
  LowDiff(const LowDiff&) = delete;
  LowDiff& operator=(const LowDiff&) = delete;

 private:
  struct Gathered;  // one parameter's synchronized compressed gradient
  LowDiff(std::unique_ptr<CheckpointedOptimizer> checkpointed,
          std::shared_ptr<runtime::EveryKPolicy> policy,
          std::unique_ptr<diff::LowDiffController> controller, torch::optim::Optimizer& optimizer,
          std::shared_ptr<runtime::Coordinator> coordinator, std::string pool_path,
          LowDiffOptions options);
  // Opens the differential log after the first step, or after a restore
  // that replayed to `resume_after` from `full_iteration`.
  Status OpenLog(std::optional<std::uint64_t> resume_after,
                 std::optional<std::uint64_t> full_iteration);
  // Hands the step's measurements to the controller (retire, retune).
  Status Observe(double step_seconds);
  Status ReplayOne(const diff::Differential& differential, std::vector<std::byte>* extra_state);

  std::unique_ptr<CheckpointedOptimizer> checkpointed_;
  std::shared_ptr<runtime::EveryKPolicy> policy_;
  // Full-checkpoint steps, retirement, Eq. 10 and the ranks' agreement;
  // holds the differential log once open.
  std::unique_ptr<diff::LowDiffController> controller_;
  torch::optim::Optimizer& optimizer_;
  std::shared_ptr<runtime::Coordinator> coordinator_;
  std::string pool_path_;  // for errors (the engine's pool is gone once closed)
  LowDiffOptions options_;
  std::vector<torch::Tensor> params_;     // in the optimizer's order
  std::vector<torch::Tensor> residuals_;  // error feedback, per parameter
  std::vector<Gathered> gathered_;        // this iteration's, until its copy
  bool synchronized_ = false;
  bool closed_ = false;
  int world_ = 1;
};

}  // namespace pmsnap::hooks
