// Engine::Impl, the engine's state and the pieces of its pipeline, shared by
// the files that implement it (private to pmsnap_runtime):
//   engine.cc           the step API: BeginStep ... EndStep, Flush, Restore, stats
//   engine_open.cc      Open and Close, the fork guard, worker pinning
//   engine_epochs.cc    the epoch lifecycle on the training thread
//   engine_pipeline.cc  the workers: copy, persist, commit; errors and job counts
//   engine_staging.cc   staged epochs in host memory (dram_staging_buffers)
//
// Thread-safety: as each member says. The training thread owns everything
// not marked otherwise; workers reach an Epoch through the jobs they run.
#pragma once

#include <tbb/global_control.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "copy_hold_budget.h"
#include "engine_restore.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/common/page_prefault.h"
#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/epoch_agreement.h"
#include "pmsnap/runtime/sharding.h"
#include "pmsnap/runtime/unit_task.h"
#include "unit_devices.h"

namespace pmsnap::runtime {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Adds to an atomic<double> (no fetch_add for floating point before C++20 libs).
inline void AtomicAdd(std::atomic<double>& target, double value) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + value, std::memory_order_relaxed)) {
  }
}

// kFailedPrecondition naming `pool` in a child forked from a process that
// had opened engines; Ok otherwise (one relaxed load: the hooks call it
// every time). engine_open.cc keeps the fork guard.
Status RefuseInForkedChild(const std::string& pool);

// Epoch in flight. Created and destroyed by the training thread; workers
// reach it through the jobs they run, and the training thread destroys it
// only after every one of its jobs finished (`jobs` == 0).
struct Epoch {
  std::uint64_t epoch = 0;
  std::uint64_t iteration = 0;
  Clock::time_point started;
  std::vector<std::unique_ptr<UnitTask>> tasks;  // null until captured
  std::vector<Clock::time_point> captured_at;
  std::unique_ptr<std::atomic<std::uint32_t>[]> persist_remaining;  // parts per unit
  std::unique_ptr<std::atomic<std::int64_t>[]> first_claim_ns;      // since `started`, -1 none
  std::vector<double> next_update_gap;                              // training thread
  std::vector<bool> conflicted;                                     // training thread
  // Units not yet persisted, plus one released by EndStep.
  std::atomic<std::uint32_t> remaining{0};
  std::uint32_t captured_count = 0;    // training thread
  bool step_ended = false;             // training thread
  std::vector<std::byte> extra_state;  // written by EndStep before the release
  std::atomic<bool> failed{false};
  std::atomic<bool> committed{false};
  std::atomic<std::int64_t> snapshot_done_ns{0};  // latest part snapshot, since `started`
  std::atomic<std::int64_t> finished_ns{0};
  // Copies held for EndStep (CopyStart): bytes, and when EndStep released
  // them (since `started`).
  std::uint64_t held_bytes = 0;
  double held_released_seconds = 0;
  // Requeues and device-stream jobs of this epoch's tasks (Engine::Impl).
  std::unique_ptr<UnitTaskExecutor> executor;
  // Jobs queued for this epoch and not yet finished (Impl::jobs_mutex).
  std::uint64_t jobs = 0;
  // Committed or abandoned: the training thread may reap it once its jobs
  // finished (release by the finishing thread, acquire by the reaper).
  std::atomic<bool> done{false};

  // Staged in host memory (EngineOptions::dram_staging_buffers): captured
  // into `staging` while the previous epoch persisted. It has no pool epoch
  // (`epoch` is 0) until the thread that commits the previous one begins it
  // (`began`); parts copied before that wait in `copied_parts`.
  bool staged = false;
  int staging_buffer = -1;
  std::byte* staging = nullptr;
  Mutex stage_mutex;  // orders `began` against `copied_parts`
  std::atomic<bool> began{true};
  std::atomic<std::int64_t> began_ns{0};  // since `started`, for stats
  std::vector<std::pair<UnitTask*, std::uint32_t>> copied_parts PMSNAP_GUARDED_BY(stage_mutex);
};
// Host memory of the slot's size for staged epochs, one anonymous mapping
// per buffer, faulted in on a background thread from Open on: left to the
// first staged copies, the faults (27K per iteration of the 1.1 GB MLP)
// slowed them into conflicts (bench/RESULTS.md, "Staged epochs"). Not
// MADV_HUGEPAGE: with THP defrag "madvise" (this VM) each huge-page fault
// compacts memory synchronously, and the MLP's slowest iterations doubled.
// Take and Give: the training thread only.
class StagingBuffers {
 public:
  StagingBuffers() = default;
  StagingBuffers(const StagingBuffers&) = delete;
  StagingBuffers& operator=(const StagingBuffers&) = delete;
  ~StagingBuffers() { Release(); }
  // Unmaps every buffer (Close: none is in use any more).
  void Release();
  // Maps `count` buffers of `bytes` each and starts faulting them in;
  // kNoSpace naming the pool when the memory is not there.
  Status Allocate(int count, std::uint64_t bytes, const std::string& pool);
  // A free buffer's index, or -1.
  int Take() {
    for (std::size_t i = 0; i < in_use_.size(); ++i) {
      if (!in_use_[i]) {
        in_use_[i] = true;
        return static_cast<int>(i);
      }
    }
    return -1;
  }
  void Give(int index) {
    if (index >= 0) in_use_[static_cast<std::size_t>(index)] = false;
  }
  std::byte* data(int index) const { return buffers_[static_cast<std::size_t>(index)]; }
  bool enabled() const { return !buffers_.empty(); }
  std::size_t count() const { return buffers_.size(); }
  std::span<std::byte> buffer(std::size_t index) const { return {buffers_[index], bytes_}; }
  std::uint64_t bytes() const { return bytes_ * buffers_.size(); }

 private:
  std::vector<std::byte*> buffers_;
  std::vector<bool> in_use_;
  std::uint64_t bytes_ = 0;
  std::unique_ptr<PagePrefaulter> prefaulter_;
};

// Pins every worker thread that enters `arena` to `cpus`; `on_error` gets a
// refusal (CPUs outside the process's cpuset), once per observer. oneTBB's
// worker threads serve every arena of the process, and one that left stays
// pinned: given its former CPUs back (often the training thread's, inherited
// from whoever created it) it would spin there while idle.
class WorkerPinning final : public tbb::task_scheduler_observer {
 public:
  WorkerPinning(tbb::task_arena& arena, std::vector<int> cpus,
                std::function<void(const Status&)> on_error)
      : tbb::task_scheduler_observer(arena),
        cpus_(std::move(cpus)),
        on_error_(std::move(on_error)) {
    observe(true);
  }
  ~WorkerPinning() override { observe(false); }
  void on_scheduler_entry(bool is_worker) override;

 private:
  std::vector<int> cpus_;
  std::function<void(const Status&)> on_error_;
  std::atomic<bool> reported_{false};
};

struct Engine::Impl {
  EngineOptions options;
  std::vector<UnitRegistration> units;
  std::unique_ptr<layout::Pool> pool;
  std::unique_ptr<Device> owned_device;
  Device* device = nullptr;
  // Each unit's device: `device`, or the host for on_host units. Where a
  // device's updates are queued and ordered by events
  // (UnitDevices::OrdersByEvents), copies wait for each unit's update
  // event and conflicts make the compute stream wait for copies.
  std::unique_ptr<UnitDevices> devices;
  std::shared_ptr<IntervalPolicy> policy;
  std::shared_ptr<ConflictStrategy> strategy;
  std::shared_ptr<Encoder> encoder;
  // oneTBB caps its worker threads at the core count minus one; the engine's
  // workers mostly wait on copies and persists, so it asks for its own.
  std::unique_ptr<tbb::global_control> thread_limit;
  std::unique_ptr<tbb::task_arena> arena;
  // One thread: device-side copies in order, like a GPU stream.
  std::unique_ptr<tbb::task_arena> device_stream;
  // Declared after the arenas: stops observing before they go.
  std::vector<std::unique_ptr<WorkerPinning>> pinning;
  std::uint64_t model_bytes = 0;

  // Jobs queued on the arenas and not yet finished, all epochs together
  // (each epoch counts its own too); guarded by jobs_mutex.
  Mutex jobs_mutex;
  CondVar jobs_finished;
  std::uint64_t outstanding_jobs PMSNAP_GUARDED_BY(jobs_mutex) = 0;
  // True from BeginEpoch until the epoch committed or was abandoned, and on
  // through a staged epoch that the committing thread began right after it.
  // The release store in FinishEpoch pairs with the acquire loads that allow
  // the training thread to start the next epoch.
  std::atomic<bool> epoch_busy{false};
  std::unique_ptr<Epoch> current;  // training thread
  // Training thread: a staged epoch, until `current` is reaped after it began.
  std::unique_ptr<Epoch> staged;
  // The staged epoch waiting for the epoch in flight to finish; whoever
  // finishes that one begins it. Guarded by handover_mutex, which also
  // orders it against epoch_busy going false.
  Mutex handover_mutex;
  Epoch* pending_start PMSNAP_GUARDED_BY(handover_mutex) = nullptr;
  StagingBuffers staging;
  // The pool's slots and the staging buffers, registered with the device as
  // copy destinations. Declared after the memory they cover and the device:
  // unregistered before either goes (Close clears them first).
  std::vector<HostRegistration> registrations;

  // What the engine holds in memory now (Stats::memory). Caller holds
  // stats_mutex, which Close takes before releasing any of it.
  MemoryStats MemoryNow() const PMSNAP_REQUIRES(stats_mutex);

  Mutex error_mutex;
  Status first_error PMSNAP_GUARDED_BY(error_mutex);

  // Training-thread state.
  bool closed = false;
  bool in_step = false;
  bool started_training = false;
  // The epoch capturing the current step (`current`, or `staged`); null
  // between steps and in steps no epoch captures.
  Epoch* capturing = nullptr;
  // Which captures wait for EndStep (EngineOptions::copy_start); set once
  // the pool, and so the model's size, is open.
  std::optional<CopyHoldBudget> hold_budget;
  // Parts of units captured in this step, held for EndStep.
  std::vector<std::pair<UnitTask*, std::uint32_t>> held_parts;
  std::uint64_t step = 0;
  // The newest step an epoch captured (it commits, fails or is abandoned
  // later): CheckpointLastStep has nothing to add while it is `step`.
  std::optional<std::uint64_t> last_captured_step;
  Clock::time_point last_step_begin{};
  Clock::time_point first_update_in_step{};
  bool saw_update_in_step = false;
  double blocked_this_step = 0;
  PolicyInputs policy_inputs;

  // Stats, guarded by stats_mutex (stats() may be called from any thread).
  mutable Mutex stats_mutex;
  Stats stats PMSNAP_GUARDED_BY(stats_mutex);
  std::deque<double> blocked_history PMSNAP_GUARDED_BY(stats_mutex);
  // Set by Close (under stats_mutex) once stats.memory holds the figures at
  // Close: the pool, staging buffers and registrations are going.
  bool memory_taken_at_close PMSNAP_GUARDED_BY(stats_mutex) = false;
  Clock::time_point opened_at = Clock::now();
  std::atomic<std::uint64_t> bytes_written{0};
  std::atomic<std::uint64_t> held_bytes{0};
  std::atomic<std::uint64_t> epochs_committed{0};
  // Training thread: the newest iteration this rank committed (or restored).
  std::optional<std::uint64_t> committed_iteration;
  // Several ranks: the agreement on which steps open epochs (null alone).
  std::unique_ptr<EpochAgreement> agreement;
  // Sharded replicated state (EngineOptions::shard_replicated_state): the
  // front end's unit numbering; `units` then holds the units this rank writes.
  std::optional<ShardedUnits> shards;

  ~Impl() = default;

  // Runs one epoch's task work on this engine: released parts go back to
  // the workers for that epoch, in-device copies to the device stream.
  class EpochExecutor final : public UnitTaskExecutor {
   public:
    EpochExecutor(Impl& engine, Epoch& epoch) : engine_(engine), epoch_(epoch) {}
    void RequeuePart(UnitTask& task, std::uint32_t part) override {
      engine_.Enqueue(&epoch_, &task, part);
    }
    void RunOnDeviceStream(std::function<void()> job) override {
      engine_.RunOnDeviceStream(&epoch_, std::move(job));
    }
    Result<DeviceEventPtr> IssueCopy(UnitTask& task, std::uint32_t part) override {
      return engine_.IssueCopy(epoch_, task, part);
    }
    void FailEpoch(const Status& status) override {
      engine_.RecordError(status);
      epoch_.failed.store(true, std::memory_order_relaxed);
    }

   private:
    Impl& engine_;
    Epoch& epoch_;
  };


  // ---- Errors, jobs, and the workers' pipeline: copy, persist, commit
  // (engine_pipeline.cc). Called from worker threads and the training thread.
  void RecordError(const Status& status) PMSNAP_EXCLUDES(error_mutex);
  Status TakeError() PMSNAP_EXCLUDES(error_mutex);
  // A recorded error as BeforeUpdate and EndStep report it. With several
  // ranks it waits for the next BeginStep: there every rank learns of it in
  // the same boundary exchange, whereas a rank that stopped mid-step on it
  // would leave the others waiting at that boundary for an exchange it
  // never joins.
  Status ReportMidStep(Status recorded) const;
  void JobQueued(Epoch& epoch) PMSNAP_EXCLUDES(jobs_mutex);
  // Last touch of a job: the training thread may free `epoch` once its
  // count is zero, and the engine once every count is. Notified under the
  // lock: a waiter that then returns and destroys the engine cannot meet a
  // notify still running on the condition variable.
  void JobFinished(Epoch& epoch) PMSNAP_EXCLUDES(jobs_mutex);
  // Until `epoch`'s jobs (or, with nullptr, every job) finished.
  void WaitForJobs(const Epoch* epoch) PMSNAP_EXCLUDES(jobs_mutex);
  void Enqueue(Epoch* epoch, UnitTask* task, std::uint32_t part);
  // Runs `job` on the device stream; counted like worker jobs so an epoch is
  // reaped only after it finished.
  void RunOnDeviceStream(Epoch* epoch, std::function<void()> job);
  void NoteFirstClaim(Epoch& epoch, const UnitTask& task, Clock::time_point start);
  // Queues part p's copy into its slot after the unit's update event.
  Result<DeviceEventPtr> CopyPartAsync(UnitTask& task, std::uint32_t p);
  // UnitTaskExecutor::IssueCopy: the training thread queued the copy of a
  // part it claimed; a worker learns from the copy's event that it is done,
  // then persists.
  Result<DeviceEventPtr> IssueCopy(Epoch& epoch, UnitTask& task, std::uint32_t p);
  void RunPart(Epoch& epoch, UnitTask& task, std::uint32_t p);
  // The part's bytes are out of its source (`status`: how the copy went):
  // persist it, and commit the epoch after its last part.
  void FinishPart(Epoch& epoch, UnitTask& task, std::uint32_t p, Status status, double copy);
  // The end of part p's work in `epoch` (`status`: how its copy and persist
  // went): the unit's last part releases the unit.
  void PartPersisted(Epoch& epoch, UnitTask& task, std::uint32_t p, const Status& status,
                     double copy, double persist);
  // Drops `count` from the epoch's remaining units; the last one commits.
  void ReleaseUnits(Epoch& epoch, std::uint32_t count);
  void WaitEpochIdle();

  // ---- Staged epochs in host memory (engine_staging.cc).
  // A boundary that finds an epoch in flight: captures the step into a
  // free staging buffer instead of skipping it. False when there is none,
  // or when the epoch in flight finished meanwhile (the boundary can then
  // open an epoch the usual way).
  bool TryStage(std::uint64_t step);
  // The staged epoch `epoch` becomes the pool's epoch in flight, on the
  // thread that finished the previous one: the PM goes on without waiting
  // for a step boundary. Its parts already copied are queued now, the
  // others as their copies finish.
  void BeginStaged(Epoch& epoch);
  std::byte* StagedBytes(const Epoch& epoch, const UnitTask::Part& part) const;
  // Device stream: copies part p of a staged epoch's unit into its buffer;
  // that is the unit's snapshot. Persisting waits for the epoch to begin.
  void StagePart(Epoch& epoch, UnitTask& task, std::uint32_t p);
  // Persists a staged part from its buffer into the slot.
  void EnqueueDrain(Epoch& epoch, UnitTask& task, std::uint32_t p);

  // ---- The epoch lifecycle on the training thread: open, capture, end,
  // abandon, reap (engine_epochs.cc).
  // A step boundary waiting for the epoch in flight (a fixed interval, or
  // the ranks' agreement): counted as boundary wait.
  void WaitEpochIdleAtBoundary();
  // Begins the epoch capturing step `step` (the pool epoch comes from the
  // caller, or, staged, from BeginStaged).
  std::unique_ptr<Epoch> NewEpoch(std::uint64_t step);
  // Begins the pool epoch for `step` and makes it `current`, capturing.
  Status OpenEpoch(std::uint64_t step);
  // The index in `units` of the front end's unit `unit`; nullopt for a
  // unit that only other ranks write (sharded).
  Result<std::optional<std::uint32_t>> HeldUnit(std::uint32_t unit) const;
  Status Capture(std::uint32_t u);
  // kCapacityExceeded for extra state over the pool's capacity; the message
  // ends with what happens to `step` ("epoch for step 7 abandoned").
  Status ExtraStateFits(std::span<const std::byte> extra_state, std::string_view before_step,
                        std::uint64_t step, std::string_view after_step) const;
  // The end of `epoch`'s step: every unit is captured; stores the extra
  // state and hands the epoch's held parts to the workers.
  void EndCapture(Epoch& epoch, std::span<const std::byte> extra_state);
  // Hands the parts `epoch` held for the end of the step to the workers (an
  // abandoned epoch's too: its jobs skip the copy but release the epoch).
  void ReleaseHeldParts(Epoch& epoch);
  // Abandons `epoch` (`current` or `staged`) from the training thread.
  void AbandonEpoch(Epoch& epoch);
  // Training thread: once the epoch in flight is over, fold its profile into
  // stats, the strategy and the policy inputs, and free it; a staged epoch
  // that began in the meantime takes its place.
  void ReapIfDone();
  void Reap(Epoch& epoch) PMSNAP_EXCLUDES(stats_mutex);

  void AddBlocked(double seconds) { blocked_this_step += seconds; }
};

}  // namespace pmsnap::runtime
