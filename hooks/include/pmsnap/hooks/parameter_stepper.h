// ParameterStepper: runs a libtorch optimizer one parameter at a time, in
// backward order, with every optimizer-state tensor at a stable address that
// the caller can register for checkpointing.
//
// pmsnap checkpoints weight by weight while training runs, so it must see
// each parameter's update as its own event (docs/ARCHITECTURE.md,
// "From an optimizer hook to a committed epoch").
// libtorch's optimizers update all parameters inside one step() and skip the
// ones whose gradient is undefined. The stepper exploits exactly that: it
// hides every gradient, then for each parameter (last registered first, the
// order backward produces gradients) shows only that parameter's gradient
// and calls the wrapped optimizer's own step(). The arithmetic is the
// optimizer's own code, so results are bitwise identical to one plain step()
// (tests/hooks_optimizer_equivalence_test.cc checks 50 steps per optimizer).
//
// State that libtorch creates lazily on the first update is created eagerly
// here, with the values libtorch would give it (zeros; Adagrad's
// initial_accumulator_value), in tensors the stepper owns, so it is
// checkpointed from its creation. SGD's momentum buffer is the exception:
// libtorch sets it to a clone of the first gradient, so the stepper
// preallocates the buffer, lets libtorch create its clone during the
// parameter's first update and copies it into the preallocated buffer before
// the update's after-hook (a bitwise copy; no other arithmetic changes).
// Adam, AdamW and Adagrad (dense gradients) are the exception to "the
// optimizer's own code": their update of a large parameter is several passes
// over parameter, gradient and state (plus temporaries the size of the
// parameter), each pass streaming from DRAM. The stepper runs the same ATen
// operations, in the same order and with the same scalars, on cache-sized
// blocks of the flattened tensors (block_bytes), so each block's passes hit
// the cache and no temporary is larger than a block. Every element goes
// through the same kernels as in libtorch's step, so the result is bitwise
// the same (the equivalence tests check it with blocks small enough to split
// the test model's tensors); on the 92M-parameter MLP of bench/stall/ (64
// MiB weights) it makes a training iteration 18-38% shorter. Other
// optimizers, and parameters under 32 MiB (kDefaultMinBlockedBytes) or no
// larger than one block, use the optimizer's own step().
// libtorch keeps optimizer step counts as int64 fields, not tensors: each
// parameter gets a one-element int64 "step" tensor mirroring that field
// (for SGD, the number of updates, which says whether the momentum buffer
// holds data), written back into libtorch's state by SyncFromSlots after a
// restore.
//
// Thread-safety: not thread-safe; one training thread owns a stepper. The
// wrapped optimizer must outlive it and must not gain or lose parameters.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap {
class PagePrefaulter;
}  // namespace pmsnap

namespace pmsnap::hooks {

class StateArena;

enum class OptimizerKind : std::uint8_t { kSgd, kAdam, kAdamW, kAdagrad, kRmsprop };

// "SGD", "Adam", "AdamW", "Adagrad", "RMSprop".
const char* OptimizerKindName(OptimizerKind kind);

// One parameter and the optimizer-state tensors the stepper keeps at stable
// addresses (contiguous, same device as the parameter).
struct ParameterSlot {
  std::string name;     // from the module ("fc1.weight") or "group0.param3"
  torch::Tensor param;  // the live parameter (shares storage with the module's)
  // Role -> tensor, in a fixed order per optimizer kind, e.g. for Adam:
  // exp_avg, exp_avg_sq, [max_exp_avg_sq], step (int64, one element).
  std::vector<std::pair<std::string, torch::Tensor>> state;
};

// Called around each parameter's update. `index` is the slot index.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual Status BeforeUpdate(std::size_t index) = 0;
  virtual Status AfterUpdate(std::size_t index) = 0;
};

class ParameterStepper {
 public:
  // Wraps `optimizer` (SGD, Adam, AdamW, Adagrad or RMSprop; not owned).
  // `named_parameters` names parameters (e.g. module.named_parameters());
  // optimizer parameters missing from it are named "group<g>.param<i>".
  // Existing optimizer state (e.g. loaded from a state dict, or made by
  // Adagrad's constructor) is taken over where it is a contiguous tensor
  // owning its storage, else copied into the stepper's tensors. Errors: kInvalidArgument for
  // another optimizer type, a parameter registered twice, a non-contiguous or non-CPU parameter;
  // libtorch errors keep their message. With NewState::kDeferred the state tensors the stepper
  // creates (not copied from libtorch's state) are allocated but not filled until
  // InitializeDeferredState or the first Step: a restore that overwrites
  // them anyway then skips a pass over memory the size of the state.
  enum class NewState { kInitialized, kDeferred };
  static Result<std::unique_ptr<ParameterStepper>> Create(
      torch::optim::Optimizer& optimizer,
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      NewState new_state = NewState::kInitialized);

  // Fills state created under NewState::kDeferred with its initial values
  // (zeros; Adagrad's initial_accumulator_value). Idempotent.
  Status InitializeDeferredState();
  // Forgets the pending fills after every slot tensor was overwritten (a
  // restore).
  void DiscardDeferredState();
  // Starts faulting in the pages of the state created under
  // NewState::kDeferred on a thread of its own (a PagePrefaulter touching
  // each page, common/page_prefault.h), for a caller with other work to do first, such as
  // opening the pool: the kernel's zeroing of fresh pages then happens beside
  // that work instead of inside the restore's copy or the fill. Changes no
  // value. A second call before FinishPrefault does nothing.
  void StartPrefault();
  // Helps the prefault finish and waits for it. InitializeDeferredState,
  // DiscardDeferredState, Step and the destructor call it before touching
  // the state: a caller that writes the state otherwise (a restore) calls
  // it before.
  void FinishPrefault();

  // One optimizer step over every parameter with a defined gradient, last
  // slot first, calling observer->BeforeUpdate(i) / AfterUpdate(i) around
  // slot i's update (observer may be null). The optimizer step always
  // completes for every parameter: if an observer call fails, the remaining
  // parameters are updated without observer calls and the first error is
  // returned. Gradients are left as they were. kFailedPrecondition (nothing
  // updated) if the optimizer's parameters changed since Create
  // (CheckUnchanged).
  Status Step(StepObserver* observer);
  // As Step, but slots whose `skip` entry is true are left alone (e.g. those
  // StepOne already updated in this iteration). kInvalidArgument (nothing
  // updated) unless `skip` has one entry per slot.
  Status Step(StepObserver* observer, const std::vector<bool>& skip);
  // Updates slot `index` alone with its current gradient, between
  // observer->BeforeUpdate(index) and AfterUpdate(index) (observer may be
  // null), bitwise as Step updates it: a caller that gives each slot one
  // StepOne per iteration, in any order, gets Step's result. Nothing happens
  // (Ok) if the slot's gradient is undefined. The update completes even if
  // the observer fails (its error is returned; no AfterUpdate follows a
  // failed BeforeUpdate). Every gradient is left as it was. Unlike Step it
  // does not call CheckUnchanged, a pass over every parameter: call that
  // once per iteration before the first StepOne. Fills deferred state first
  // (InitializeDeferredState). kInvalidArgument for an index out of range.
  Status StepOne(std::size_t index, StepObserver* observer);

  // kFailedPrecondition naming the problem if the optimizer gained or lost
  // parameters (e.g. add_param_group after registration) or a parameter's
  // storage moved (e.g. module.to(dtype)) since Create.
  Status CheckUnchanged() const;

  // After the slots' bytes were overwritten (a restore): copies each "step"
  // tensor back into libtorch's int64 state fields, and for SGD drops the
  // momentum state of parameters never updated (libtorch will clone their
  // first gradient, as it would have).
  Status SyncFromSlots();

  // Size of the blocks Adam, AdamW and Adagrad update at a time (file comment);
  // rounded down to a multiple of 64 elements, so that the vectorized and
  // scalar paths of ATen's kernels split every block as they split the whole
  // tensor. 0: the optimizer's own step() for every parameter.
  static constexpr std::size_t kDefaultBlockBytes = std::size_t{256} << 10;
  // Parameters smaller than this keep the optimizer's own step. Measured
  // (bench/RESULTS.md, stall): below it an unblocked update's working set
  // stays in the cache and blocks only add per-operation overhead; from 32
  // MiB on, glibc maps every weight-sized temporary afresh each step (its
  // mmap threshold never exceeds 32 MiB) and the unblocked update pays the
  // page faults, which blocks avoid (Adagrad on 32 MiB: 19 ms -> 6.5 ms).
  static constexpr std::size_t kDefaultMinBlockedBytes = std::size_t{32} << 20;
  void set_block_bytes(std::size_t bytes,
                       std::size_t min_parameter_bytes = kDefaultMinBlockedBytes) {
    block_bytes_ = bytes;
    min_blocked_bytes_ = min_parameter_bytes;
  }
  std::size_t block_bytes() const { return block_bytes_; }
  // Parameter updates done block by block so far.
  std::uint64_t blocked_updates() const { return blocked_updates_; }

  OptimizerKind kind() const { return kind_; }
  // The slots, in registration order. The memory of each slot tensor as
  // registered (what slots()[i].param.data_ptr() and the state tensors'
  // data_ptr() returned after Create) stays allocated until the stepper is
  // destroyed, even if the user replaces a parameter's data meanwhile
  // (set_data): a checkpoint that copies from those addresses in the
  // background never reads freed memory. Such a replacement is then refused
  // by CheckUnchanged.
  const std::vector<ParameterSlot>& slots() const { return slots_; }
  torch::optim::Optimizer& optimizer() const { return optimizer_; }

  ~ParameterStepper();
  ParameterStepper(const ParameterStepper&) = delete;
  ParameterStepper& operator=(const ParameterStepper&) = delete;

 private:
  ParameterStepper(torch::optim::Optimizer& optimizer, OptimizerKind kind);
  Status AdoptOrCreateState(std::size_t index, const torch::optim::OptimizerOptions& options);
  void AfterOptimizerStep(std::size_t index);
  // Step and StepOne after their checks: updates the slots `indices` lists
  // that have a gradient, in that order.
  Status UpdateSlots(StepObserver* observer, const std::vector<std::size_t>& indices);
  Status StepLocked(StepObserver* observer, const std::vector<torch::Tensor>& grads,
                    const std::vector<std::size_t>& indices);
  // Whether slot `index` is updated by BlockedStep (file comment).
  bool UsesBlockedStep(std::size_t index, const torch::Tensor& grad) const;
  void BlockedStep(std::size_t index, const torch::Tensor& grad);

  torch::optim::Optimizer& optimizer_;
  OptimizerKind kind_;
  std::vector<ParameterSlot> slots_;
  // libtorch's state key per slot: the parameter's TensorImpl address.
  std::vector<void*> state_keys_;
  // Each parameter's storage at registration: the pool was laid out for it
  // (slot.param shares the TensorImpl, so it would follow a set_data).
  std::vector<const void*> registered_data_;
  // The storage of every slot tensor (parameter and state) at registration,
  // held for the stepper's lifetime (see slots()).
  std::vector<c10::Storage> held_storage_;
  // The parameter group of each slot (its options: learning rate, betas...).
  std::vector<std::size_t> group_of_slot_;
  std::size_t block_bytes_ = kDefaultBlockBytes;
  std::size_t min_blocked_bytes_ = kDefaultMinBlockedBytes;
  // Room for BlockedStep's per-block temporaries (reused across steps).
  torch::Tensor block_scratch_;
  std::uint64_t blocked_updates_ = 0;
  // Whether SGD keeps a momentum buffer for the slot (its group's momentum != 0).
  std::vector<bool> has_momentum_;
  bool defer_new_state_ = false;
  // Created state tensors still to be filled, with their initial value.
  std::vector<std::pair<torch::Tensor, double>> deferred_fills_;
  // Where created state tensors live (huge-page backed, see state_arena.h).
  std::unique_ptr<StateArena> state_arena_;
  std::unique_ptr<PagePrefaulter> prefault_;  // while StartPrefault's work runs
};

}  // namespace pmsnap::hooks
