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
// each unit is captured as soon as its update is done (its copy starts then,
// or on the host device at the end of the step when it fits between steps:
// EngineOptions::copy_start). Restore
// copies the newest committed epoch from the pool mapping straight into the
// parameters and state tensors (no deserialization).
//
// Embedding tables (EmbeddingTables): parameters named there are checkpointed
// through a diff::EmbeddingCheckpointer (full, differential, incremental or
// IncrCP 2-D checkpoints, optionally quantized) into the pool's chunk heap,
// in the same epochs as the dense units, split as the Python front end splits
// them (frontend/parameter_units.h: ParameterUnits, MovesRowsWithoutGradient):
//   * unit "<name>" (encoded): the table plus every optimizer-state tensor of
//     the same row count (Adagrad's sum, SGD's momentum buffer, Adam's
//     moments), float32 [rows] or [rows, dim], so each checkpoint writes the
//     same rows of all of them;
//   * unit "<name>#dense" (fixed slots): the rest of its optimizer state,
//     i.e. the one-element int64 "step" tensor (diff/ encodes only float32
//     rows). Both units are hooked around the table's one update, so every
//     epoch captures them together and a restore is consistent.
// Which rows changed comes from RowSource: TrackedEmbedding(Bag) lookups
// (bound automatically by the module overload of Create) or the gradient.
// Optimizers that change rows without a gradient (SGD with momentum or
// weight decay, Adagrad with weight decay, Adam, AdamW, RMSprop: their
// update moves every row) mark every row of the table each step, so the
// checkpoints stay exact but differential policies save nothing; SGD
// (plain) and Adagrad are the optimizers that profit.
//
// Update in backward (UpdateMode::kInBackward): each parameter is updated
// inside loss.backward(), the moment its gradient has been accumulated, so
// its checkpoint copy starts while backward still runs on earlier layers;
// Step then only finishes the iteration. Bitwise the same result as
// backward() then Step() in UpdateMode::kInStep:
//
//   auto opt = hooks::CheckpointedOptimizer::Create(*model, adam, engine, {},
//                                                   hooks::UpdateMode::kInBackward);
//   for (...) {
//     adam.zero_grad(); loss.backward();        // updates the parameters
//     (*opt)->Step(extra_state);                // ends the step
//   }
//
// Create sets a post-accumulate-grad hook on every parameter
// (torch::autograd::impl::set_post_acc_grad_hooks; one per tensor, so a hook
// the parameter had is kept and called before ours). The first hook of an
// iteration does what Step does first (the CheckUnchanged test, the optimizer
// state's initial values, Engine::BeginStep); each hook then marks an
// embedding table's rows and updates its one parameter between its unit's
// BeforeUpdate and AfterUpdate (ParameterStepper::StepOne). Step updates the
// parameters that have a gradient but whose hook did not fire (a gradient set
// by hand, a parameter that does not require grad, no backward at all) and
// calls EndStep. Close and the destructor take the hooks off.
//   * Threads: the hooks run on the autograd thread that accumulates the
//     gradient, which for CPU tensors (the only ones supported) is the thread
//     calling backward(): call it from the training thread that owns this
//     object.
//   * Errors inside backward are not thrown: after a checkpointing error
//     the update still completes (the iteration's later updates run
//     unobserved, as in Step), and Step returns the first error, a libtorch
//     error in an update (e.g. Adam given a sparse gradient) included. If
//     parameters changed since Create (kFailedPrecondition) the hooks update
//     nothing and Step reports it.
//   * A second gradient for a parameter before Step (gradient accumulation
//     over several backward passes) would be applied to an already updated
//     parameter, which changes the result: its hook throws c10::ValueError
//     naming the parameter, and backward() rethrows it (a hook has no other
//     way to stop backward). Updates done before stand; Step still ends the
//     iteration. Call Step after every backward, or use kInStep.
//   * EngineOptions::copy_start kAuto becomes kAfterUpdate: on the host,
//     kAuto holds the step's last captures until EndStep, which now comes
//     after the rest of backward.
//   * Restore must come before the first backward, which counts as a Step.
// ParameterStepper's cache-blocked Adam/AdamW/Adagrad update runs inside the
// hook like any other update (same arithmetic, same scratch block). Each
// hook's update, like each parameter's in Step, hides the other gradients
// for libtorch's step(): a pass over the parameter list per parameter.
//
// Exceptions never leave this API (the one above leaves backward()):
// libtorch's c10::Error becomes a Status that keeps libtorch's message.
//
// Thread-safety: one training thread owns a CheckpointedOptimizer; stats()
// may be called from any thread. The module and optimizer must outlive it.
// A parameter whose data is replaced after Create (set_data) keeps its
// registered memory allocated until this object is destroyed, so the copy of
// a step still in flight reads what the step wrote; the next Step then
// refuses with kFailedPrecondition.
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
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/hooks/module_buffers.h"
#include "pmsnap/hooks/parameter_stepper.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

struct RestoreInfo {
  std::uint64_t iteration = 0;  // steps done by the restored state (resume at +1)
  std::uint64_t epoch = 0;
  std::vector<std::byte> extra_state;  // as passed to Step (see extra_state.h)
};

// Which rows of an embedding table a step may have changed.
enum class RowSource : std::uint8_t {
  // The rows its TrackedEmbedding / TrackedEmbeddingBag module looked up.
  kLookups,
  // The rows with a non-zero gradient (a dense gradient's non-zero rows, a
  // sparse gradient's indices), found by Step before the update; for plain
  // torch::nn::Embedding(Bag) modules. Costs one pass over the gradient.
  kGradients,
};

// Parameters checkpointed as embedding tables (see the file comment).
struct EmbeddingTables {
  // Parameter names (as the module names them, e.g. "emb.0.weight"); each
  // must be a float32 [rows, dim] parameter. Empty: no embedding tables.
  std::vector<std::string> names;
  // Policy, retention and quantization, shared by all the tables.
  diff::EmbeddingOptions options;
  RowSource rows = RowSource::kLookups;
};

// Whether the module overload of Create checkpoints the module's buffers
// (BatchNorm's running statistics, every registered buffer) with each step.
enum class BufferMode : std::uint8_t {
  kCheckpoint,  // default: restored by Restore, in every export of the pool
  kSkip,        // the pool holds parameters and optimizer state only (pools
                // written before pmsnap saved buffers)
};

// When CheckpointedOptimizer updates the parameters (file comment).
enum class UpdateMode : std::uint8_t {
  kInStep,      // Step updates every parameter that has a gradient
  kInBackward,  // each parameter inside backward(), as its gradient is accumulated
};

class CheckpointedOptimizer {
 public:
  // Registers every parameter of `optimizer` (named after `module`'s
  // parameters) with its optimizer state as one unit each, then opens the
  // pool at options.pool_path, or creates it if missing. Register every
  // parameter group before this call. While the pool opens, a second thread
  // faults in the pages of the optimizer state this object allocates (the
  // kernel zeroes fresh pages on first touch), so a restart's Restore copies
  // into mapped memory; it has finished when Create returns.
  // Errors: kModelMismatch if the pool was made for another model, naming
  // the first unit that differs (e.g. a parameter whose shape or dtype
  // changed); kNoSpace if the file system cannot hold a new pool;
  // kInvalidArgument for an unsupported optimizer or parameter
  // (ParameterStepper::Create); the Engine's errors otherwise.
  // With `embeddings`: the named parameters become embedding-table units
  // (file comment) checkpointed by a new diff::EmbeddingCheckpointer, and
  // with RowSource::kLookups every TrackedEmbedding(Bag) of `module` whose
  // weight is one of them is bound to its table's RowTracker.
  // kInvalidArgument naming the table for a name that is not a parameter,
  // a table that is not float32 [rows, dim], a table whose module uses
  // max_norm (it rewrites rows in the forward pass), a kLookups table
  // without a tracked module, or options.encoder already set.
  // With UpdateMode::kInBackward: hooks on every parameter update it inside
  // backward() (file comment); kAuto copy_start becomes kAfterUpdate.
  // `module`'s buffers (module_buffers.h) are checkpointed with every step
  // unless `buffers` is kSkip: copied at the step boundary, restored by
  // Restore. kInvalidArgument naming a buffer that is not a CPU tensor.
  static Result<std::unique_ptr<CheckpointedOptimizer>> Create(
      const torch::nn::Module& module, torch::optim::Optimizer& optimizer,
      runtime::EngineOptions options, EmbeddingTables embeddings = {},
      UpdateMode update_mode = UpdateMode::kInStep, BufferMode buffers = BufferMode::kCheckpoint);
  // As above with explicit names (e.g. several modules, or none; no module
  // buffers are checkpointed). With
  // RowSource::kLookups nothing is bound: call TrackEmbeddings(module) or
  // mark embedding_checkpointer()->tracker(name) before the first Step
  // (rows changed but not marked are missing from differential checkpoints).
  static Result<std::unique_ptr<CheckpointedOptimizer>> Create(
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      torch::optim::Optimizer& optimizer, runtime::EngineOptions options,
      EmbeddingTables embeddings = {}, UpdateMode update_mode = UpdateMode::kInStep);

  // Binds every TrackedEmbedding(Bag) in `module` (a submodule named "emb"
  // whose weight is table "emb.weight", or the module itself for table
  // "weight") to its table's RowTracker, and returns the tables bound.
  // Modules whose weight is not a table are left alone. The bindings keep
  // the checkpointer alive; the destructor unbinds the modules a shared_ptr
  // owns (every registered submodule; a root module on the stack stays
  // bound to this checkpointer's trackers, which nothing reads any more).
  Result<std::vector<std::string>> TrackEmbeddings(torch::nn::Module& module);

  // Replaces optimizer.step() for iteration iteration() + 1. `extra_state`
  // (data position, RNG... see extra_state.h) is stored with the epoch that
  // captures this step. The optimizer step always completes, bitwise as
  // optimizer.step() would; a non-OK status means checkpointing failed (a
  // worker I/O error, kCapacityExceeded extra state...) and the pool keeps
  // its last committed epoch. kFailedPrecondition, with nothing updated, if
  // parameters were added, removed or reallocated since Create.
  // With UpdateMode::kInBackward: updates only the parameters with a
  // gradient that backward did not update, then ends the step; returns the
  // first error of this iteration's hooks (file comment). Parameters
  // reallocated between backward and Step: kFailedPrecondition, the
  // backward's updates done, iteration() advanced and the step not
  // checkpointed (the pool keeps its last epoch).
  Status Step(std::span<const std::byte> extra_state = {});

  // Loads the newest committed epoch into the parameters and optimizer state
  // and sets iteration() to its iteration. Only before the first Step.
  // kFailedPrecondition, with nothing loaded, if a parameter was replaced or
  // reallocated since Create (ParameterStepper::CheckUnchanged).
  // kNotFound if the pool holds no committed epoch (a fresh run). A newest
  // epoch that fails its checksums is replaced by the older one (a pool
  // warning); kCorruption if neither verifies, and then the parameters may
  // hold part of a checkpoint. On a pool that holds a checkpoint, the
  // optimizer state this object creates keeps no values until Restore
  // overwrites it or the first Step gives it its initial ones: filling it
  // first would double a restore's memory traffic.
  Result<RestoreInfo> Restore();

  // Waits for the epoch in flight; returns the first worker error.
  Status Flush();
  // Finishes (or abandons) the epoch in flight and releases the pool.
  // Idempotent; the destructor calls Close(kFinish). Takes the backward hooks
  // off (kInBackward): a later backward() updates nothing, and Step updates
  // unobserved and returns the closed engine's error, as in kInStep.
  Status Close(runtime::CloseMode mode = runtime::CloseMode::kFinish);

  // Steps done: 0 on a fresh run, the restored iteration after Restore.
  std::uint64_t iteration() const { return iteration_; }
  UpdateMode update_mode() const { return update_mode_; }
  runtime::Engine& engine() { return *engine_; }
  runtime::Stats stats() const { return engine_->stats(); }
  const ParameterStepper& stepper() const { return *stepper_; }
  // Block size of the cache-blocked Adam, AdamW and Adagrad update, and the
  // smallest parameter it applies to; 0 turns it off
  // (ParameterStepper::set_block_bytes).
  void set_optimizer_block_bytes(std::size_t bytes, std::size_t min_parameter_bytes =
                                                        ParameterStepper::kDefaultMinBlockedBytes) {
    stepper_->set_block_bytes(bytes, min_parameter_bytes);
  }
  // The embedding checkpointer (null without EmbeddingTables): its
  // tracker(name), last_checkpoint(name) and options().
  diff::EmbeddingCheckpointer* embedding_checkpointer() const { return embeddings_.get(); }
  // Whether Step marks every row of table slot `name` (its optimizer changes
  // rows without a gradient); false for unknown names.
  bool MarksAllRows(const std::string& name) const;

  ~CheckpointedOptimizer();
  CheckpointedOptimizer(const CheckpointedOptimizer&) = delete;
  CheckpointedOptimizer& operator=(const CheckpointedOptimizer&) = delete;

 private:
  class EngineObserver;
  class BackwardHook;
  struct HookLink;
  static constexpr std::uint32_t kNoUnit = 0xffffffffu;
  static Result<std::unique_ptr<CheckpointedOptimizer>> CreateImpl(
      const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
      torch::optim::Optimizer& optimizer, runtime::EngineOptions options,
      EmbeddingTables embeddings, torch::nn::Module* module, UpdateMode update_mode,
      ModuleBuffers buffers);
  CheckpointedOptimizer(std::unique_ptr<ParameterStepper> stepper,
                        std::unique_ptr<runtime::Engine> engine);

  // An embedding table's slot: its units and how its rows get marked.
  struct TableSlot {
    std::size_t slot = 0;
    diff::RowTracker* tracker = nullptr;
    bool mark_all = false;       // the optimizer moves rows without gradient
    bool from_gradient = false;  // RowSource::kGradients
  };
  // Marks the rows of the tables that have a gradient, all but those `skip`
  // (slot index -> true) names; the first error (every row is then marked).
  Status MarkTableRows(const std::vector<bool>* skip = nullptr);
  Status MarkTableRows(const TableSlot& table);

  // kInBackward: the hooks' state between two Steps.
  struct BackwardStep {
    bool begun = false;         // a hook fired since the last Step
    bool refused = false;       // the first hook's checks failed: nothing updated
    bool observed = false;      // the engine sees the updates (BeginStep ok, no error since)
    Status begin;               // BeginStep's
    Status error;               // the first failed update or engine hook
    Status marked;              // the first failed table marking
    std::vector<bool> updated;  // slot index -> updated in backward
  };
  // Copies the module's buffers into their shadows between the buffer
  // units' hooks (`observed`: the engine's step has begun; else unhooked).
  Status CaptureBuffers(bool observed);
  Status InstallBackwardHooks();
  void RemoveBackwardHooks();
  // The hook of slot `index`; throws c10::ValueError on a second gradient.
  void UpdateInBackward(std::size_t index);
  // Step after hooks began the iteration.
  Status FinishBackwardStep(std::span<const std::byte> extra_state);

  std::unique_ptr<ParameterStepper> stepper_;
  std::unique_ptr<runtime::Engine> engine_;
  std::shared_ptr<diff::EmbeddingCheckpointer> embeddings_;
  // slot index -> engine unit id
  std::vector<std::uint32_t> unit_of_slot_;
  // slot index -> the table's "#dense" unit, or kNoUnit
  std::vector<std::uint32_t> dense_unit_of_slot_;
  std::vector<TableSlot> tables_;
  // The module's buffers and their units (none with BufferMode::kSkip).
  ModuleBuffers buffers_;
  std::vector<std::uint32_t> buffer_units_;
  // Tracked modules bound by TrackEmbeddings (unbound by the destructor).
  std::vector<std::weak_ptr<torch::nn::Module>> bound_modules_;
  std::uint64_t iteration_ = 0;
  bool stepped_ = false;
  UpdateMode update_mode_ = UpdateMode::kInStep;
  // Shared with the installed hooks; cleared when they are taken off.
  std::shared_ptr<HookLink> hook_link_;
  BackwardStep backward_;
};

// Opens an existing pool for `module` + `optimizer`, restores the newest
// committed epoch into them and closes the pool (e.g. for evaluation).
// kNotFound if options.pool_path does not exist or holds no commit.
Result<RestoreInfo> RestoreFromPool(const torch::nn::Module& module,
                                    torch::optim::Optimizer& optimizer,
                                    runtime::EngineOptions options,
                                    EmbeddingTables embeddings = {},
                                    BufferMode buffers = BufferMode::kCheckpoint);

}  // namespace pmsnap::hooks
