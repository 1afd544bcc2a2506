// Engine: weight-grained checkpointing of a training run into a pmsnap pool.
//
// Register units (a parameter plus its optimizer-state tensors, as raw
// views) once; then call the hooks from the training loop:
//
//   engine->BeginStep(k);               // step boundary; may open epoch for k
//   for each unit u, in update order:
//     engine->BeforeUpdate(u);          // conflict check (may wait)
//     ... optimizer updates u in place ...
//     engine->AfterUpdate(u);           // hands u to the workers if captured
//   engine->EndStep(extra_state);       // units not updated count as updated
//
// An epoch captures every unit's value after the optimizer step of one
// iteration k. Workers (a oneTBB arena) copy units part by part straight into
// the pool slot, persist, and commit the epoch when all are durable; at most
// one epoch is in flight. Worker errors surface as the Status of the next
// BeginStep, BeforeUpdate or EndStep on the training thread, and of every
// one after it (the first error is kept: no further epoch starts). With
// several ranks (EngineOptions::coordinator) BeforeUpdate and EndStep
// return OK and the error surfaces at the next BeginStep, on every rank in
// the same boundary exchange: a rank that stopped mid-step would leave the
// others waiting at that boundary. The whole
// path, hook by hook: docs/ARCHITECTURE.md, "From an optimizer hook to a
// committed epoch".
//
// Thread-safety: hooks, Close and Restore belong to one training thread.
// stats() may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/manifest.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/conflict_strategy.h"
#include "pmsnap/runtime/coordinator.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/encoder.h"
#include "pmsnap/runtime/interval_policy.h"
#include "pmsnap/runtime/stats.h"

namespace pmsnap::runtime {

// A tensor the runtime reads (checkpoint) and writes (restore) in place.
struct TensorView {
  std::string name;  // role in the unit: "param", "exp_avg", ...
  void* data = nullptr;
  layout::DType dtype = layout::DType::kFloat32;
  std::vector<std::int64_t> shape;
  // In host memory while EngineOptions::device is another device: scalar
  // optimizer state PyTorch keeps on the CPU beside GPU parameters (Adam's
  // `step` unless capturable or fused). frontend::ParameterUnits moves such
  // tensors into a unit of their own (UnitRegistration::on_host).
  bool on_host = false;
};

struct UnitRegistration {
  std::string name;  // e.g. "fc1.weight"
  std::vector<TensorView> tensors;
  // Checkpointed through EngineOptions::encoder into the chunk heap instead
  // of the fixed slots (embedding tables).
  bool encoded = false;
  // Every tensor lives in host memory (each TensorView::on_host) whatever
  // EngineOptions::device is: the engine copies, checks conflicts on and
  // restores this unit with the CPU, in the same epochs as the others. Its
  // updates must be done when AfterUpdate is called (the host's are). Not
  // with `encoded`.
  bool on_host = false;
};

// When the parts of a captured unit go to the workers.
enum class CopyStart {
  // On the host device, the step's last captures wait for EndStep, as many
  // as the workers copied in the time between the last two steps (forward
  // and backward) at the rate they drained such copies before (80% of it);
  // the first captures, whose units the next step updates first, are copied
  // right away. kAfterUpdate until an epoch measured the rate, and on any
  // other device.
  kAuto,
  // Right after the unit's update: the most time before its next update.
  kAfterUpdate,
  // Every capture waits for EndStep. An optimizer step streams every
  // parameter and its state through memory; host-memory copies running
  // beside it compete for the same bandwidth and slow it, while forward and
  // backward, which come next, leave more of it free. The copies then have
  // one step less to finish before the units' next updates: a wait at the
  // next checkpoint or update if they do not.
  kAfterStep,
};

// "auto", "after-update" or "after-step" (command lines, the Python binding).
// kInvalidArgument names the accepted spellings.
Result<CopyStart> ParseCopyStart(std::string_view name);

struct EngineOptions {
  std::string pool_path;
  // Used when the pool is created (an existing pool keeps its own), except
  // prefault_mapping / prefault_method and pm_bandwidth (simulated PM),
  // which apply at every open.
  layout::PoolOptions pool_options;
  // Verify every data checksum of the recovered slot. Without an encoder the
  // check runs inside Restore's copy (one read of the slot, not two) or, if
  // training starts without a restore, before the first checkpoint; with an
  // encoder, when the pool is opened.
  bool verify_on_open = true;
  // Worker threads copying and persisting parts.
  int workers = 2;
  // CPUs the worker threads (and the device-stream thread) run on; empty:
  // wherever the OS puts them. On a machine with few cores, give them CPUs of
  // their own and pin the training thread to the others
  // (pmsnap/common/cpu_affinity.h): the scheduler otherwise tends to run a
  // worker on the training thread's core right after the training thread
  // woke it. kInvalidArgument from Open for a CPU the machine does not have;
  // a CPU outside the process's cpuset surfaces at the next hook. oneTBB's
  // worker threads that ran engine work stay on these CPUs.
  std::vector<int> worker_cpus;
  // Where the registered tensors live. Not owned; nullptr: a HostDevice.
  Device* device = nullptr;
  // When epochs start. nullptr: continuous.
  std::shared_ptr<IntervalPolicy> policy;
  // What a conflict does. nullptr: strategy 2 (wait for the snapshot).
  std::shared_ptr<ConflictStrategy> strategy;
  // When captured units' copies start (see CopyStart).
  CopyStart copy_start = CopyStart::kAuto;
  // Handles units registered with `encoded`; required if there are any.
  std::shared_ptr<Encoder> encoder;
  // Print the one-line stats summary (stderr) at Close.
  bool print_summary = true;
  // Many ranks (docs/ARCHITECTURE.md, "Many ranks"): the collectives this
  // rank's engine agrees with the other ranks' engines through. nullptr or
  // a world size of 1: a single process. With more ranks every rank must
  // open, restore (or not), step and close its engine together, and the
  // pool records its rank group (pool_options.group is set by Open).
  std::shared_ptr<Coordinator> coordinator;
  // With a coordinator: the whole model's identity, the same on every rank
  // (front ends hash every parameter's name, dtype and shape before
  // sharding); 0: this rank's manifest signature (right when every rank
  // registers the same units).
  std::uint64_t model_fingerprint = 0;
  // With a coordinator of several ranks that all hold the same state (DDP):
  // each unit gets an owner rank (PlanShards, balanced by bytes) and only
  // its holders write it, so each rank writes about replicas/N of the model
  // and its pool holds only those units. Every rank registers the same units
  // in the same order and numbers them alike in the hooks; the hooks of a
  // unit this rank does not write return at once. Encoded units (embedding
  // tables) are each rank's own and always written by it. Restore reads each
  // unit on one holder and broadcasts it to all ranks (RestoreResult's epoch
  // is then 0 on a rank that received everything). Stats list the units this
  // rank writes. Ignored for a single process.
  bool shard_replicated_state = false;
  // With shard_replicated_state: each unit is also written by the
  // replicas - 1 ranks after its owner (Gemini's peer replicas), so the
  // pools of any replicas - 1 ranks may be lost (a replaced node, a deleted
  // file) and Restore still recovers bit-exact from the others. A rank that
  // lost its pool takes the lowest surviving rank's extra state (the same
  // data position under DDP). 1 <= replicas <= world size; the pools record
  // it, and reopening with another value is kModelMismatch.
  int replicas = 1;
  // Host-memory staging for a policy that skips busy boundaries (continuous
  // mode): a boundary that finds the previous epoch still persisting no
  // longer goes uncaptured. Its step is captured into one of this many
  // buffers of the slot's size (copies on the device-stream thread, right
  // after each unit's update; a unit's next update waits for its copy), and
  // that epoch begins persisting from the buffer the moment the epoch in
  // flight commits, on the committing thread. The PM then never idles
  // between epochs when an epoch takes longer than an iteration, which is
  // where a capture that can only start at a step boundary would leave it
  // idle for up to an iteration. 0: off (the default); 1: every other epoch
  // is staged; 2: back to back. Costs this many times the model's slot
  // bytes of host memory, allocated at Open (faulted in by the first
  // staging copies). Single process, slot units only: kInvalidArgument from
  // Open with an encoder, several ranks, or a policy that waits when busy.
  int dram_staging_buffers = 0;
};

enum class CloseMode {
  kFinish,   // wait for the epoch in flight to commit (if its step ended)
  kAbandon,  // drop the epoch in flight; the pool keeps its last commit
};

struct RestoreResult {
  std::uint64_t iteration = 0;
  std::uint64_t epoch = 0;
  std::vector<std::byte> extra_state;
  // False where this rank's pool did not hold the restored iteration (a
  // replaced node under EngineOptions::shard_replicated_state): its units
  // came from other ranks, and extra_state is the lowest holding rank's,
  // which is right for state every rank shares (a DDP data position) and
  // wrong for per-rank state (RNG, a per-rank sampler): the front end then
  // takes this rank's own from the replica its peers keep.
  bool extra_state_is_own = true;
};

class Engine {
 public:
  // Opens the pool at options.pool_path if it exists (kModelMismatch if it
  // was made for other units, naming the first that differs) or creates it.
  // Every tensor must be non-null and match its dtype/shape registration.
  // With a coordinator of several ranks, every rank opens together and they
  // fail together (EpochAgreement::AgreeOnGroup): a pool of another run,
  // rank, world size or model is an error naming the failing rank's file,
  // and so is a failed open on any rank. kInvalidArgument for a policy that
  // adapts to per-rank measurements (CheckFreq): ranks must decide alike.
  static Result<std::unique_ptr<Engine>> Open(EngineOptions options,
                                              std::vector<UnitRegistration> units);
  ~Engine();  // Close(kFinish) if not closed
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // --- training-loop hooks (training thread) ---
  Status BeginStep(std::uint64_t step);
  Status BeforeUpdate(std::uint32_t unit);
  Status AfterUpdate(std::uint32_t unit);
  // `extra_state` is stored with the epoch captured in this step (data-loader
  // position, RNG state...); kCapacityExceeded if over the pool's capacity.
  Status EndStep(std::span<const std::byte> extra_state = {});

  // Whether the step begun by the last BeginStep is captured by an epoch
  // (the extra state given to its EndStep is stored); false between steps.
  // Training thread. Front ends skip building extra state for other steps.
  bool CapturesThisStep() const;
  // Whether an epoch is still copying or persisting: its units' next
  // updates may have to wait for their copies (BeforeUpdate). Any thread;
  // the answer may be stale by the time it is used, but only from true to
  // false.
  bool EpochInFlight() const;

  // Waits until no epoch is in flight (committed or failed) and returns the
  // first worker error, if any.
  Status Flush();
  // Between steps: if no epoch captured the last step that ended (continuous
  // mode skips a boundary that finds an epoch in flight), waits for the
  // epoch in flight, then captures every unit as it is now as that step's
  // epoch with `extra_state`, and waits until it committed. The units must
  // hold the last step's values (nothing updated them since EndStep). OK and
  // nothing written when that step was captured or no step ran. Errors:
  // kFailedPrecondition inside a step, after Close, with several ranks
  // (their epochs open at agreed boundaries only) or with encoded units;
  // kCapacityExceeded for extra state over the pool's capacity (nothing
  // written); a worker's error. Training thread; blocks (counted as blocked
  // time).
  Status CheckpointLastStep(std::span<const std::byte> extra_state = {});
  // Finishes or abandons the epoch in flight and stops the workers. Never
  // hangs: an epoch whose step never ended is abandoned. Idempotent.
  Status Close(CloseMode mode = CloseMode::kFinish);

  // Copies the newest committed epoch into the registered tensors (through
  // the device, parts in parallel on the workers and the calling thread) and
  // returns its iteration and extra state. If a part fails its checksum the
  // older checkpoint is restored instead, with a pool warning; kCorruption
  // when neither verifies. kNotFound if the pool has no committed epoch.
  // Only before the first BeginStep.
  // With several ranks, every rank calls it together: they restore the
  // newest iteration every rank holds intact (a rank one epoch ahead rolls
  // its pool back to it; EpochAgreement::AgreeOnRestore), and if any rank
  // fails, all return that rank's error. kNotFound on every rank when no
  // epoch was committed by every rank: the pools then forget the epochs
  // some ranks committed alone (Pool::ForgetEpochs).
  Result<RestoreResult> Restore();

  std::optional<std::uint32_t> FindUnit(const std::string& name) const;
  std::uint32_t unit_count() const;
  // The engine's pool. Precondition: not closed (Close releases the pool;
  // calling this afterwards aborts the process with a message saying so).
  const layout::Pool& pool() const;
  // The same pool, for a writer of its chunk heap beside the engine
  // (diff::DifferentialLog: LowDiff's differentials between full
  // checkpoints). The slots and commit records stay the engine's alone.
  // Precondition as above.
  layout::Pool& pool();
  Device& device() const;
  const ConflictStrategy& strategy() const;
  const IntervalPolicy& policy() const;

  Stats stats() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Builds the pool manifest for a set of registrations (names, dtypes, shapes).
layout::Manifest ManifestFor(const std::vector<UnitRegistration>& units);

}  // namespace pmsnap::runtime
