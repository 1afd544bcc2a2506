#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/epoch_agreement.h"

#include <tbb/global_control.h>
#include <tbb/task_arena.h>
#include <tbb/task_scheduler_observer.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <iostream>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "detail/copy_hold_budget.h"
#include "detail/engine_restore.h"
#include "detail/unit_devices.h"
#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/common/memory_usage.h"
#include "pmsnap/common/page_prefault.h"
#include "pmsnap/pmem_layout/checksum.h"

namespace pmsnap::runtime {
namespace {

using Clock = std::chrono::steady_clock;

// fork() copies only the calling thread. The oneTBB worker threads an
// engine starts, and the scheduler state they belong to, reach the child as
// memory without threads, and an engine opened or used there waits forever
// for workers that do not exist. oneTBB keeps those workers after the
// engines close (a child forked then hung too, 1 run in 3), so a child
// forked from a process that ever opened an engine refuses engines with an
// error instead (runtime_engine_fork_test).
std::atomic<int> g_engines_opened{0};
std::atomic<int> g_open_engines{0};
std::atomic<bool> g_forked_after_engines{false};
std::atomic<int> g_forked_from{0};
std::atomic<int> g_opened_at_fork{0};
std::atomic<int> g_open_at_fork{0};

void NoteForkInChild() {
  const int opened = g_engines_opened.load(std::memory_order_relaxed);
  if (opened > 0) {
    g_opened_at_fork.store(opened, std::memory_order_relaxed);
    g_open_at_fork.store(g_open_engines.load(std::memory_order_relaxed),
                         std::memory_order_relaxed);
    g_forked_from.store(static_cast<int>(getppid()), std::memory_order_relaxed);
    g_forked_after_engines.store(true, std::memory_order_relaxed);
  }
}

void WatchForks() {
  static const int registered = pthread_atfork(nullptr, nullptr, &NoteForkInChild);
  (void)registered;
}

// kFailedPrecondition naming `pool` in a child forked from a process that
// had opened engines; Ok otherwise (one relaxed load: the hooks call it
// every time).
Status RefuseInForkedChild(const std::string& pool) {
  if (!g_forked_after_engines.load(std::memory_order_relaxed)) return Status::Ok();
  return Status(StatusCode::kFailedPrecondition,
                "pmsnap engine for " + pool + ": this process was forked from process " +
                    std::to_string(g_forked_from.load()) + " after it had opened " +
                    std::to_string(g_opened_at_fork.load()) + " pmsnap engine(s) (" +
                    std::to_string(g_open_at_fork.load()) +
                    " still open); the oneTBB worker threads they started do not exist after "
                    "fork(), and an engine here would wait for them forever. Start processes "
                    "with the 'spawn' or 'forkserver' method, or fork before opening engines.");
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr std::size_t kBlockedHistory = 65536;

// Adds to an atomic<double> (no fetch_add for floating point before C++20 libs).
void AtomicAdd(std::atomic<double>& target, double value) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + value, std::memory_order_relaxed)) {
  }
}

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
  std::mutex stage_mutex;  // orders `began` against `copied_parts`
  std::atomic<bool> began{true};
  std::atomic<std::int64_t> began_ns{0};  // since `started`, for stats
  std::vector<std::pair<UnitTask*, std::uint32_t>> copied_parts;
};

// Host memory of the slot's size for staged epochs, one anonymous mapping
// per buffer, faulted in on a background thread from Open on: left to the
// first staged copies, the faults (27K per iteration of the 1.1 GB MLP)
// slowed them into conflicts (bench/RESULTS.md, "Staged epochs"). Not
// MADV_HUGEPAGE: with THP defrag "madvise" (this VM) each huge-page fault
// compacts memory synchronously, and the MLP's slowest iterations doubled.
class StagingBuffers {
 public:
  StagingBuffers() = default;
  StagingBuffers(const StagingBuffers&) = delete;
  StagingBuffers& operator=(const StagingBuffers&) = delete;
  ~StagingBuffers() { Release(); }
  // Unmaps every buffer (Close: none is in use any more).
  void Release() {
    prefaulter_.reset();  // stops touching the buffers before they go
    for (std::byte* buffer : buffers_) munmap(buffer, bytes_);
    buffers_.clear();
    in_use_.clear();
  }
  // kNoSpace naming the pool when the memory is not there.
  Status Allocate(int count, std::uint64_t bytes, const std::string& pool) {
    bytes_ = std::max<std::uint64_t>(bytes, 1);
    for (int i = 0; i < count; ++i) {
      void* mapped =
          mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mapped == MAP_FAILED) {
        return Status(StatusCode::kNoSpace,
                      "EngineOptions::dram_staging_buffers: cannot map " + std::to_string(bytes_) +
                          " bytes of host memory for staging buffer " + std::to_string(i) +
                          " of pool '" + pool + "'");
      }
      buffers_.push_back(static_cast<std::byte*>(mapped));
      in_use_.push_back(false);
    }
    std::vector<PrefaultRange> ranges;
    for (std::byte* buffer : buffers_) ranges.push_back({buffer, bytes_});
    prefaulter_ = std::make_unique<PagePrefaulter>(ranges);
    return Status::Ok();
  }
  // Training thread: a free buffer's index, or -1.
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

}  // namespace

Result<CopyStart> ParseCopyStart(std::string_view name) {
  if (name == "auto") return CopyStart::kAuto;
  if (name == "after-update") return CopyStart::kAfterUpdate;
  if (name == "after-step") return CopyStart::kAfterStep;
  return Status(StatusCode::kInvalidArgument, "unknown copy start '" + std::string(name) +
                                                  "' (expected auto, after-update or after-step)");
}

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
  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) return;
    Status pinned = PinCurrentThread(cpus_, "EngineOptions::worker_cpus");
    if (!pinned.ok() && !reported_.exchange(true)) on_error_(pinned);
  }

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
  std::mutex jobs_mutex;
  std::condition_variable jobs_finished;
  std::uint64_t outstanding_jobs = 0;
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
  std::mutex handover_mutex;
  Epoch* pending_start = nullptr;
  StagingBuffers staging;
  // The pool's slots and the staging buffers, registered with the device as
  // copy destinations. Declared after the memory they cover and the device:
  // unregistered before either goes (Close clears them first).
  std::vector<HostRegistration> registrations;

  // What the engine holds in memory now (Stats::memory). Caller holds
  // stats_mutex, which Close takes before releasing any of it.
  MemoryStats MemoryNow() const {
    MemoryStats memory;
    if (pool) {
      const std::span<const std::byte> mapped = pool->mapping();
      memory.pool_mapped_bytes = mapped.size();
      memory.pool_resident_bytes = ResidentBytes(mapped.data(), mapped.size());
    }
    memory.staging_bytes = staging.bytes();
    for (std::size_t i = 0; i < staging.count(); ++i) {
      memory.staging_resident_bytes += ResidentBytes(staging.buffer(i).data(), staging.buffer(i).size());
    }
    for (const HostRegistration& registration : registrations) {
      memory.registered_bytes += registration.bytes();
    }
    return memory;
  }

  std::mutex error_mutex;  // guards first_error
  Status first_error;

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
  mutable std::mutex stats_mutex;
  Stats stats;
  std::deque<double> blocked_history;
  // Set by Close (under stats_mutex) once stats.memory holds the figures at
  // Close: the pool, staging buffers and registrations are going.
  bool memory_taken_at_close = false;
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

  // A step boundary waiting for the epoch in flight (a fixed interval, or
  // the ranks' agreement): counted as boundary wait.
  void WaitEpochIdleAtBoundary() {
    const auto wait_start = Clock::now();
    WaitEpochIdle();
    std::lock_guard<std::mutex> lock(stats_mutex);
    stats.boundary_wait_seconds += SecondsSince(wait_start);
  }

  void RecordError(const Status& status) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (first_error.ok()) first_error = status;
  }
  Status TakeError() {
    std::lock_guard<std::mutex> lock(error_mutex);
    return first_error;
  }
  // A recorded error as BeforeUpdate and EndStep report it. With several
  // ranks it waits for the next BeginStep: there every rank learns of it in
  // the same boundary exchange, whereas a rank that stopped mid-step on it
  // would leave the others waiting at that boundary for an exchange it
  // never joins.
  Status ReportMidStep(Status recorded) const {
    return agreement ? Status::Ok() : recorded;
  }

  void JobQueued(Epoch& epoch) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    outstanding_jobs += 1;
    epoch.jobs += 1;
  }
  // Last touch of a job: the training thread may free `epoch` once its
  // count is zero, and the engine once every count is. Notified under the
  // lock: a waiter that then returns and destroys the engine cannot meet a
  // notify still running on the condition variable.
  void JobFinished(Epoch& epoch) {
    std::lock_guard<std::mutex> lock(jobs_mutex);
    outstanding_jobs -= 1;
    epoch.jobs -= 1;
    jobs_finished.notify_all();
  }
  // Until `epoch`'s jobs (or, with nullptr, every job) finished.
  void WaitForJobs(const Epoch* epoch) {
    std::unique_lock<std::mutex> lock(jobs_mutex);
    jobs_finished.wait(lock, [&] { return (epoch ? epoch->jobs : outstanding_jobs) == 0; });
  }

  void Enqueue(Epoch* epoch, UnitTask* task, std::uint32_t part) {
    JobQueued(*epoch);
    arena->enqueue([this, epoch, task, part] {
      RunPart(*epoch, *task, part);
      JobFinished(*epoch);
    });
  }

  // Runs `job` on the device stream; counted like worker jobs so an epoch is
  // reaped only after it finished.
  void RunOnDeviceStream(Epoch* epoch, std::function<void()> job) {
    JobQueued(*epoch);
    device_stream->enqueue([this, epoch, job = std::move(job)] {
      job();
      JobFinished(*epoch);
    });
  }

  void NoteFirstClaim(Epoch& epoch, const UnitTask& task, Clock::time_point start) {
    std::int64_t none = -1;
    epoch.first_claim_ns[task.unit()].compare_exchange_strong(
        none, std::chrono::duration_cast<std::chrono::nanoseconds>(start - epoch.started).count(),
        std::memory_order_relaxed);
  }

  // Queues part p's copy into its slot after the unit's update event.
  Result<DeviceEventPtr> CopyPartAsync(UnitTask& task, std::uint32_t p) {
    const UnitTask::Part& part = task.part(p);
    PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> dst, pool->PartDestination(*part.pool_part));
    return task.device().CopyToHostAsync(dst.data(), task.source(p), part.bytes,
                                         task.update_event());
  }

  // UnitTaskExecutor::IssueCopy: the training thread queued the copy of a
  // part it claimed; a worker learns from the copy's event that it is done,
  // then persists.
  Result<DeviceEventPtr> IssueCopy(Epoch& epoch, UnitTask& task, std::uint32_t p) {
    const auto start = Clock::now();
    NoteFirstClaim(epoch, task, start);
    Result<DeviceEventPtr> issued = epoch.failed.load(std::memory_order_relaxed)
                                        ? Result<DeviceEventPtr>(DeviceEventPtr())
                                        : CopyPartAsync(task, p);
    DeviceEventPtr copy_done = issued.ok() ? *issued : nullptr;
    task.PublishCopyEvent(p, copy_done);
    Status copy_status = issued.status();
    JobQueued(epoch);
    arena->enqueue([this, &epoch, &task, p, start, copy_done, copy_status] {
      Status status = copy_status;
      if (status.ok() && copy_done) status = task.device().Synchronize(*copy_done);
      FinishPart(epoch, task, p, status, SecondsSince(start));
      JobFinished(epoch);
    });
    return issued;
  }

  void RunPart(Epoch& epoch, UnitTask& task, std::uint32_t p) {
    if (!task.TryClaim(p)) return;  // a strategy took it; it requeues when redirected
    const auto start = Clock::now();
    NoteFirstClaim(epoch, task, start);
    const UnitTask::Part& part = task.part(p);
    Device& device = task.device();
    const bool by_events = UnitDevices::OrdersByEvents(device);
    Status status;
    double copy = 0;
    const bool encoded = !part.pool_part.has_value();
    const bool failed = epoch.failed.load(std::memory_order_relaxed);
    if (!failed) {
      if (encoded) {
        // The encoder reads the live tensor itself: after its update.
        if (by_events && task.update_event()) {
          status = device.Synchronize(*task.update_event());
        }
        if (status.ok()) status = encoder->Encode(task.unit(), epoch.epoch);
      } else if (by_events) {
        // The copy waits for the update's event on this worker's copy
        // stream; the worker learns from the copy's event that it is done.
        const bool from_live = task.source(p) == part.live_source;
        Result<DeviceEventPtr> issued = CopyPartAsync(task, p);
        if (from_live) task.PublishCopyEvent(p, issued.ok() ? *issued : nullptr);
        status = issued.status();
        if (status.ok() && *issued) status = device.Synchronize(**issued);
      } else if (device.cpu_addressable()) {
        // One fused pass copies into PM, checksums and drains.
        status = pool->WritePart(*part.pool_part, task.source(p));
      } else {
        auto dst = pool->PartDestination(*part.pool_part);
        status =
            dst.ok() ? device.CopyToHost(dst->data(), task.source(p), part.bytes) : dst.status();
      }
      copy = SecondsSince(start);
    } else if (by_events && !encoded && task.source(p) == part.live_source) {
      task.PublishCopyEvent(p, nullptr);  // a conflict waits for no copy
    }
    FinishPart(epoch, task, p, status, copy);
  }

  // The part's bytes are out of its source (`status`: how the copy went):
  // persist it, and commit the epoch after its last part.
  void FinishPart(Epoch& epoch, UnitTask& task, std::uint32_t p, Status status, double copy) {
    const UnitTask::Part& part = task.part(p);
    const bool encoded = !part.pool_part.has_value();
    double persist = 0;
    task.MarkSnapshotted(p);
    const auto snapshotted = Clock::now();
    std::int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(snapshotted - epoch.started).count();
    std::int64_t seen = epoch.snapshot_done_ns.load(std::memory_order_relaxed);
    while (ns > seen &&
           !epoch.snapshot_done_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
    }
    if (status.ok() && !epoch.failed.load(std::memory_order_relaxed) && !encoded &&
        !task.device().cpu_addressable()) {
      status = pool->SealPart(*part.pool_part);
      persist = SecondsSince(snapshotted);
    }
    PartPersisted(epoch, task, p, status, copy, persist);
  }

  // The end of part p's work in `epoch` (`status`: how its copy and persist
  // went): the unit's last part releases the unit.
  void PartPersisted(Epoch& epoch, UnitTask& task, std::uint32_t p, const Status& status,
                     double copy, double persist) {
    const bool encoded = !task.part(p).pool_part.has_value();
    if (!status.ok()) {
      RecordError(Status(status.code(), "checkpoint of unit '" + units[task.unit()].name +
                                            "' (epoch " + std::to_string(epoch.epoch) +
                                            ") failed: " + status.message()));
      epoch.failed.store(true, std::memory_order_relaxed);
    }
    AtomicAdd(task.copy_seconds, copy);
    AtomicAdd(task.persist_seconds, persist);
    if (epoch.persist_remaining[task.unit()].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      if (!encoded) bytes_written.fetch_add(task.bytes(), std::memory_order_relaxed);
      ReleaseUnits(epoch, 1);
    }
  }

  // Drops `count` from the epoch's remaining units; the last one commits.
  void ReleaseUnits(Epoch& epoch, std::uint32_t count) {
    if (count == 0) return;
    if (epoch.remaining.fetch_sub(count, std::memory_order_acq_rel) != count) return;
    if (!epoch.failed.load(std::memory_order_acquire)) {
      Status status = pool->Commit(epoch.extra_state);
      if (status.ok()) {
        epoch.committed.store(true, std::memory_order_relaxed);
        epochs_committed.fetch_add(1, std::memory_order_relaxed);
        // Retention: chunks no retained checkpoint needs go now, before the
        // next epoch may start.
        if (encoder) {
          Status collected = encoder->OnCommitted(epoch.epoch);
          if (!collected.ok()) RecordError(collected);
        }
      } else {
        RecordError(status);
        pool->Abandon();
        if (encoder) encoder->OnAbandoned(epoch.epoch);
      }
    } else {
      pool->Abandon();
      if (encoder) encoder->OnAbandoned(epoch.epoch);
    }
    epoch.finished_ns.store(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch.started).count(),
        std::memory_order_relaxed);
    epoch.done.store(true, std::memory_order_release);
    Epoch* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(handover_mutex);
      next = std::exchange(pending_start, nullptr);
      if (next == nullptr) epoch_busy.store(false, std::memory_order_release);
    }
    if (next == nullptr) {
      epoch_busy.notify_all();
    } else {
      BeginStaged(*next);
    }
  }

  // The staged epoch `epoch` becomes the pool's epoch in flight, on the
  // thread that finished the previous one: the PM goes on without waiting
  // for a step boundary. Its parts already copied are queued now, the
  // others as their copies finish.
  void BeginStaged(Epoch& epoch) {
    if (!epoch.failed.load(std::memory_order_acquire) && TakeError().ok()) {
      Result<std::uint64_t> number = pool->BeginEpoch(epoch.iteration);
      if (number.ok()) {
        epoch.epoch = *number;
      } else {
        RecordError(number.status());
        epoch.failed.store(true, std::memory_order_relaxed);
      }
    } else {
      epoch.failed.store(true, std::memory_order_relaxed);
    }
    epoch.began_ns.store(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - epoch.started).count(),
        std::memory_order_relaxed);
    std::vector<std::pair<UnitTask*, std::uint32_t>> copied;
    {
      std::lock_guard<std::mutex> lock(epoch.stage_mutex);
      epoch.began.store(true, std::memory_order_release);
      copied.swap(epoch.copied_parts);
    }
    epoch.began.notify_all();
    for (const auto& [task, part] : copied) EnqueueDrain(epoch, *task, part);
  }

  std::byte* StagedBytes(const Epoch& epoch, const UnitTask::Part& part) const {
    return epoch.staging + pool->layout().parts[*part.pool_part].slot_offset;
  }

  // Device stream: copies part p of a staged epoch's unit into its buffer;
  // that is the unit's snapshot. Persisting waits for the epoch to begin.
  void StagePart(Epoch& epoch, UnitTask& task, std::uint32_t p) {
    (void)task.TryClaim(p);  // no strategy takes a staged part
    const auto start = Clock::now();
    NoteFirstClaim(epoch, task, start);
    const UnitTask::Part& part = task.part(p);
    Status status;
    if (!epoch.failed.load(std::memory_order_relaxed)) {
      Device& device = task.device();
      if (UnitDevices::OrdersByEvents(device) && task.update_event()) {
        status = device.Synchronize(*task.update_event());
      }
      if (status.ok()) {
        status = device.CopyToHost(StagedBytes(epoch, part), task.source(p), part.bytes);
      }
    }
    task.MarkSnapshotted(p);
    AtomicAdd(task.copy_seconds, SecondsSince(start));
    if (!status.ok()) {
      RecordError(Status(status.code(), "staging unit '" + units[task.unit()].name +
                                            "' of the step " + std::to_string(epoch.iteration) +
                                            " capture in host memory failed: " +
                                            status.message()));
      epoch.failed.store(true, std::memory_order_relaxed);
    }
    bool began;
    {
      std::lock_guard<std::mutex> lock(epoch.stage_mutex);
      began = epoch.began.load(std::memory_order_relaxed);
      if (!began) epoch.copied_parts.emplace_back(&task, p);
    }
    if (began) EnqueueDrain(epoch, task, p);
  }

  // Persists a staged part from its buffer into the slot.
  void EnqueueDrain(Epoch& epoch, UnitTask& task, std::uint32_t p) {
    JobQueued(epoch);
    arena->enqueue([this, &epoch, &task, p] {
      const auto start = Clock::now();
      const UnitTask::Part& part = task.part(p);
      const Status status = epoch.failed.load(std::memory_order_relaxed)
                                ? Status::Ok()
                                : pool->WritePart(*part.pool_part, StagedBytes(epoch, part));
      PartPersisted(epoch, task, p, status, 0, SecondsSince(start));
      JobFinished(epoch);
    });
  }

  void WaitEpochIdle() {
    while (epoch_busy.load(std::memory_order_acquire)) {
      epoch_busy.wait(true, std::memory_order_acquire);
    }
    WaitForJobs(nullptr);
  }

  // Training thread: once the epoch in flight is over, fold its profile into
  // stats, the strategy and the policy inputs, and free it; a staged epoch
  // that began in the meantime takes its place.
  void ReapIfDone() {
    for (;;) {
      if (!current && staged && staged->began.load(std::memory_order_acquire)) {
        current = std::move(staged);
      }
      if (!current || !current->done.load(std::memory_order_acquire)) return;
      WaitForJobs(current.get());  // its jobs are past their last access to it
      Reap(*current);
      current.reset();
    }
  }

  void Reap(Epoch& epoch) {
    std::vector<UnitProfile> profiles;
    const bool committed = epoch.committed.load(std::memory_order_relaxed);
    double copied_bytes = 0, copy_seconds = 0;
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      for (std::uint32_t u = 0; u < epoch.tasks.size(); ++u) {
        const UnitTask* task = epoch.tasks[u].get();
        if (task == nullptr) continue;
        if (!units[u].encoded) {
          copied_bytes += static_cast<double>(task->bytes());
          copy_seconds += task->copy_seconds.load();
        }
        UnitProfile profile;
        profile.unit = u;
        profile.bytes = task->bytes();
        const std::int64_t claim = epoch.first_claim_ns[u].load(std::memory_order_relaxed);
        const double captured =
            std::chrono::duration<double>(epoch.captured_at[u] - epoch.started).count();
        profile.queue_wait_seconds = claim < 0 ? 0 : std::max(0.0, claim * 1e-9 - captured);
        profile.copy_seconds = task->copy_seconds.load();
        profile.persist_seconds = task->persist_seconds.load();
        profile.next_update_gap_seconds = epoch.next_update_gap[u];
        profile.in_device_copy_seconds = task->in_device_copy_seconds.load();
        profile.in_device_bytes = task->in_device_bytes.load();
        profile.conflicted = epoch.conflicted[u];
        profiles.push_back(profile);
        if (committed) {
          UnitStats& us = stats.units[u];
          us.snapshots += 1;
          us.last_copy_seconds = profile.copy_seconds;
          us.last_persist_seconds = profile.persist_seconds;
          us.total_copy_seconds += profile.copy_seconds;
          us.total_persist_seconds += profile.persist_seconds;
          if (!epoch.staged) us.strategy_counts[static_cast<int>(strategy->choice(u))] += 1;
        }
      }
      const double finished = epoch.finished_ns.load() * 1e-9;
      const double snapshot = epoch.snapshot_done_ns.load() * 1e-9;
      if (committed) {
        // A staged epoch from its beginning in the pool, not from its capture.
        stats.last_epoch_seconds = finished - epoch.began_ns.load() * 1e-9;
        stats.last_committed_iteration = epoch.iteration;
        committed_iteration = epoch.iteration;
      } else {
        stats.epochs_abandoned += 1;
      }
      // A staged epoch's copies went into host memory, not the PM or across
      // the device link: its timings would mislead the policy, the hold
      // budget and the strategy.
      if (committed && !epoch.staged) {
        policy_inputs.snapshot_seconds = snapshot;
        policy_inputs.persist_seconds = std::max(0.0, finished - snapshot);
        policy_inputs.have_profile = true;
        hold_budget->OnEpochCommitted(
            {.slot_bytes = copied_bytes,
             .copy_seconds = copy_seconds,
             .held_bytes = epoch.held_bytes,
             .held_drain_seconds = finished - epoch.held_released_seconds});
      }
    }
    staging.Give(epoch.staging_buffer);
    if (committed && !epoch.staged) strategy->OnEpochCommitted(profiles);
  }

  // The index in `units` of the front end's unit `unit`; nullopt for a
  // unit that only other ranks write (sharded).
  Result<std::optional<std::uint32_t>> HeldUnit(std::uint32_t unit) const {
    const std::size_t registered = shards ? shards->registered.size() : units.size();
    if (unit >= registered) {
      return Status(StatusCode::kInvalidArgument,
                    "unit " + std::to_string(unit) + " out of range (" +
                        std::to_string(registered) + " registered)");
    }
    if (!shards) return std::optional<std::uint32_t>(unit);
    const std::uint32_t held = shards->held_index[unit];
    if (held == ShardedUnits::kNotHeld) return std::optional<std::uint32_t>();
    return std::optional<std::uint32_t>(held);
  }

  Status Capture(std::uint32_t u) {
    Epoch& epoch = *capturing;
    const layout::SlotLayout& layout = pool->layout();
    const layout::UnitLayout& unit_layout = layout.units[u];
    std::vector<UnitTask::Part> parts;
    // Recorded before anything reads the unit: every copy of it waits for
    // the update queued before this hook (and the encoder too).
    DeviceEventPtr update_event;
    Device& unit_device = devices->of(units[u]);
    if (UnitDevices::OrdersByEvents(unit_device)) {
      Result<DeviceEventPtr> recorded = unit_device.RecordComputeEvent();
      if (recorded.ok()) {
        update_event = std::move(*recorded);
      } else {
        epoch.failed.store(true, std::memory_order_relaxed);
        RecordError(Status(recorded.status().code(),
                           "recording the update event of unit '" + units[u].name +
                               "': " + recorded.status().message()));
      }
    }
    if (units[u].encoded) {
      Status captured = encoder->OnCaptured(u, epoch.epoch, epoch.iteration);
      if (!captured.ok()) {
        epoch.failed.store(true, std::memory_order_relaxed);
        RecordError(captured);
      }
      parts.push_back({static_cast<const std::byte*>(units[u].tensors[0].data),
                       pool->manifest().units[u].bytes(), std::nullopt});
    }
    parts.reserve(unit_layout.part_count);
    for (std::uint32_t p = unit_layout.first_part;
         p < unit_layout.first_part + unit_layout.part_count; ++p) {
      const layout::PartLayout& part = layout.parts[p];
      const auto* base = static_cast<const std::byte*>(units[u].tensors[part.tensor].data);
      parts.push_back({base + part.offset_in_tensor, part.bytes, p});
    }
    // Parts a strategy releases (even before the initial jobs below are
    // queued) go back to the workers; a duplicate job finds the part claimed.
    // A staged epoch's number is written by the thread that begins it.
    auto task = std::make_unique<UnitTask>(u, epoch.staged ? 0 : epoch.epoch, &unit_device,
                                           epoch.executor.get(), std::move(parts));
    UnitTask* raw = task.get();
    raw->SetUpdateEvent(std::move(update_event));
    epoch.persist_remaining[u].store(raw->part_count(), std::memory_order_relaxed);
    epoch.captured_at[u] = Clock::now();
    epoch.tasks[u] = std::move(task);
    epoch.captured_count += 1;
    if (epoch.staged) {
      // The copy into host memory is the snapshot: no strategy, no hold.
      for (std::uint32_t p = 0; p < raw->part_count(); ++p) {
        RunOnDeviceStream(&epoch, [this, &epoch, raw, p] { StagePart(epoch, *raw, p); });
      }
      return Status::Ok();
    }
    const auto prepare_start = Clock::now();
    // Encoded units read their live tensors inside the encoder: no strategy
    // can redirect that read, so their conflicts wait (strategy 2).
    Status prepared = units[u].encoded ? Status::Ok() : strategy->OnCaptured(*raw);
    const double prepare = SecondsSince(prepare_start);
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      stats.in_device_copy_seconds += prepare;
    }
    if (!prepared.ok()) {
      epoch.failed.store(true, std::memory_order_relaxed);
      RecordError(prepared);
    }
    // A guard: every unit has a part (a slot unit one per tensor at least, an
    // encoded unit its one part without a pool part, for the encoder).
    if (raw->part_count() == 0) {
      ReleaseUnits(epoch, 1);
      return prepared;
    }
    // Slot bytes only: an encoded unit's encoder writes far less than its
    // table, so its copy never waits.
    const bool hold =
        !epoch.step_ended && !units[u].encoded && hold_budget->HoldCapture(raw->bytes());
    std::uint64_t held = 0;
    for (std::uint32_t p = 0; p < raw->part_count(); ++p) {
      if (raw->state(p) != PartState::kPending) continue;  // a strategy took it
      if (hold) {
        held_parts.emplace_back(raw, p);
        held += raw->part(p).bytes;
      } else {
        Enqueue(&epoch, raw, p);
      }
    }
    held_bytes.fetch_add(held, std::memory_order_relaxed);
    epoch.held_bytes += held;
    return prepared;
  }

  // Hands the parts `epoch` held for the end of the step to the workers (an
  // abandoned epoch's too: its jobs skip the copy but release the epoch).
  void ReleaseHeldParts(Epoch& epoch) {
    for (const auto& [task, part] : held_parts) Enqueue(&epoch, task, part);
    held_parts.clear();
  }

  // Abandons `epoch` (`current` or `staged`) from the training thread.
  void AbandonEpoch(Epoch& epoch) {
    if (epoch.staged && !epoch.began.load(std::memory_order_acquire)) {
      bool withdrawn = false;
      {
        std::lock_guard<std::mutex> lock(handover_mutex);
        if (pending_start == &epoch) {
          pending_start = nullptr;
          withdrawn = true;
        }
      }
      if (withdrawn) {
        // It never reaches the pool: wait for its copies, then drop it.
        epoch.failed.store(true, std::memory_order_release);
        WaitForJobs(&epoch);
        if (capturing == &epoch) capturing = nullptr;  // staged captures hold no parts
        staging.Give(epoch.staging_buffer);
        {
          std::lock_guard<std::mutex> lock(stats_mutex);
          stats.epochs_abandoned += 1;
        }
        staged.reset();
        return;
      }
      // The thread that finished the previous epoch is beginning it; once
      // it has, the pool has an epoch to abandon like any other.
      while (!epoch.began.load(std::memory_order_acquire)) {
        epoch.began.wait(false, std::memory_order_acquire);
      }
    }
    epoch.failed.store(true, std::memory_order_release);
    std::uint32_t never_captured = static_cast<std::uint32_t>(units.size()) - epoch.captured_count;
    if (!epoch.step_ended) {
      never_captured += 1;
      epoch.step_ended = true;
    }
    epoch.captured_count = static_cast<std::uint32_t>(units.size());
    if (capturing == &epoch) {
      ReleaseHeldParts(epoch);
      capturing = nullptr;
    }
    ReleaseUnits(epoch, never_captured);
  }

  // Begins the epoch capturing step `step` (the pool epoch comes from the
  // caller, or, staged, from BeginStaged).
  std::unique_ptr<Epoch> NewEpoch(std::uint64_t step) {
    auto epoch = std::make_unique<Epoch>();
    const std::size_t n = units.size();
    epoch->iteration = step;
    epoch->started = Clock::now();
    epoch->tasks.resize(n);
    epoch->captured_at.resize(n);
    epoch->persist_remaining = std::make_unique<std::atomic<std::uint32_t>[]>(n);
    epoch->first_claim_ns = std::make_unique<std::atomic<std::int64_t>[]>(n);
    for (std::size_t u = 0; u < n; ++u) epoch->first_claim_ns[u].store(-1);
    epoch->next_update_gap.assign(n, -1.0);
    epoch->conflicted.assign(n, false);
    epoch->remaining.store(static_cast<std::uint32_t>(n + 1), std::memory_order_relaxed);
    epoch->executor = std::make_unique<EpochExecutor>(*this, *epoch);
    return epoch;
  }

  // A boundary that finds an epoch in flight: captures the step into a
  // free staging buffer instead of skipping it. False when there is none,
  // or when the epoch in flight finished meanwhile (the boundary can then
  // open an epoch the usual way).
  bool TryStage(std::uint64_t step) {
    if (!staging.enabled() || staged) return false;
    const int buffer = staging.Take();
    if (buffer < 0) return false;
    std::unique_ptr<Epoch> epoch = NewEpoch(step);
    epoch->staged = true;
    epoch->staging_buffer = buffer;
    epoch->staging = staging.data(buffer);
    epoch->began.store(false, std::memory_order_relaxed);
    bool pending = false;
    {
      std::lock_guard<std::mutex> lock(handover_mutex);
      pending = epoch_busy.load(std::memory_order_acquire);
      if (pending) pending_start = epoch.get();
    }
    if (!pending) {
      staging.Give(buffer);
      return false;
    }
    capturing = epoch.get();
    staged = std::move(epoch);
    return true;
  }

  // Begins the pool epoch for `step` and makes it `current`, capturing.
  Status OpenEpoch(std::uint64_t step) {
    PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t epoch_number, pool->BeginEpoch(step));
    current = NewEpoch(step);
    current->epoch = epoch_number;
    epoch_busy.store(true, std::memory_order_release);
    capturing = current.get();
    return Status::Ok();
  }

  // kCapacityExceeded for extra state over the pool's capacity; the message
  // ends with what happens to `step` ("epoch for step 7 abandoned").
  Status ExtraStateFits(std::span<const std::byte> extra_state, std::string_view before_step,
                        std::uint64_t step, std::string_view after_step) const {
    const std::uint64_t capacity = pool->options().extra_state_capacity;
    if (extra_state.size() <= capacity) return Status::Ok();
    return Status(StatusCode::kCapacityExceeded,
                  "extra state of " + std::to_string(extra_state.size()) +
                      " bytes exceeds the pool's capacity of " + std::to_string(capacity) +
                      " bytes (PoolOptions::extra_state_capacity); " + std::string(before_step) +
                      std::to_string(step) + std::string(after_step));
  }

  // The end of `epoch`'s step: every unit is captured; stores the extra
  // state and hands the epoch's held parts to the workers.
  void EndCapture(Epoch& epoch, std::span<const std::byte> extra_state) {
    epoch.extra_state.assign(extra_state.begin(), extra_state.end());
    epoch.step_ended = true;
    epoch.held_released_seconds = SecondsSince(epoch.started);
    ReleaseHeldParts(epoch);
    capturing = nullptr;
    last_captured_step = epoch.iteration;
    ReleaseUnits(epoch, 1);
  }

  void AddBlocked(double seconds) { blocked_this_step += seconds; }
};

layout::Manifest ManifestFor(const std::vector<UnitRegistration>& units) {
  layout::Manifest manifest;
  for (const UnitRegistration& unit : units) {
    layout::UnitSpec spec;
    spec.name = unit.name;
    spec.flags = unit.encoded ? layout::kUnitFlagEncoded : layout::kUnitFlagNone;
    for (const TensorView& t : unit.tensors) spec.tensors.push_back({t.name, t.dtype, t.shape});
    manifest.units.push_back(std::move(spec));
  }
  return manifest;
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {
  g_engines_opened.fetch_add(1, std::memory_order_relaxed);
  g_open_engines.fetch_add(1, std::memory_order_relaxed);
}

Engine::~Engine() {
  if (impl_ && !impl_->closed && !RefuseInForkedChild(impl_->options.pool_path).ok()) {
    // The parent's engine in a forked child: tearing down its arena would
    // wait for threads that are not here. The process keeps the memory.
    (void)impl_.release();
    return;
  }
  if (impl_ && !impl_->closed) {
    Status status = Close(CloseMode::kFinish);
    if (!status.ok()) std::cerr << "pmsnap: error while closing: " << status.ToString() << "\n";
  }
}

namespace {

// Opens the pool at options.pool_path if it exists, else creates it. With an
// agreement (several ranks) every rank takes part in the same collectives
// whatever happens locally, so that a failure on one rank fails all of them
// instead of leaving the others waiting: first whether every existing pool
// opened, then the run identity (AgreeOnGroup), then whether every new pool
// was created with it.
Result<std::unique_ptr<layout::Pool>> OpenOrCreatePool(const EngineOptions& options,
                                                       const layout::Manifest& manifest,
                                                       const layout::OpenOptions& open_options,
                                                       EpochAgreement* agreement) {
  std::error_code ec;
  const bool exists = std::filesystem::exists(options.pool_path, ec);
  if (agreement == nullptr) {
    return exists ? layout::Pool::Open(options.pool_path, manifest, open_options)
                  : layout::Pool::Create(options.pool_path, manifest, options.pool_options);
  }
  Result<std::unique_ptr<layout::Pool>> pool =
      Status(StatusCode::kInternal, "pool '" + options.pool_path + "' not opened");
  std::optional<layout::RankGroup> existing;
  if (exists) {
    pool = layout::Pool::Open(options.pool_path, manifest, open_options);
    if (pool.ok()) existing = (*pool)->group();
  }
  PMSNAP_RETURN_IF_ERROR(agreement->AgreeOnStatus(exists ? pool.status() : Status::Ok()));
  const std::uint64_t fingerprint =
      options.model_fingerprint != 0 ? options.model_fingerprint : manifest.Signature();
  PMSNAP_ASSIGN_OR_RETURN(const layout::RankGroup group,
                          agreement->AgreeOnGroup(existing, fingerprint, options.pool_path));
  if (!exists) {
    layout::PoolOptions pool_options = options.pool_options;
    pool_options.group = group;
    pool = layout::Pool::Create(options.pool_path, manifest, pool_options);
  }
  // Every rank, also those that opened: a rank whose pool was lost creates
  // it beside ranks that did not.
  PMSNAP_RETURN_IF_ERROR(agreement->AgreeOnStatus(pool.status()));
  return pool;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Open(EngineOptions options,
                                             std::vector<UnitRegistration> units) {
  if (options.pool_path.empty()) {
    return Status(StatusCode::kInvalidArgument, "EngineOptions::pool_path is empty");
  }
  WatchForks();
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(options.pool_path));
  if (units.empty()) {
    return Status(StatusCode::kInvalidArgument, "no units registered for " + options.pool_path);
  }
  if (options.workers < 1) {
    return Status(StatusCode::kInvalidArgument,
                  "EngineOptions::workers must be >= 1, got " + std::to_string(options.workers));
  }
  if (!options.worker_cpus.empty()) {
    PMSNAP_RETURN_IF_ERROR(CheckCpus(options.worker_cpus, "EngineOptions::worker_cpus"));
  }
  // Every registration's manifest; with sharding, the pool's holds this
  // rank's units only (below).
  layout::Manifest manifest = ManifestFor(units);
  PMSNAP_RETURN_IF_ERROR(manifest.Validate());
  for (const UnitRegistration& unit : units) {
    if (unit.on_host && unit.encoded) {
      return Status(StatusCode::kInvalidArgument,
                    "unit '" + unit.name + "' is both encoded and on_host (" + options.pool_path +
                        "): an encoder reads the engine's device");
    }
    for (const TensorView& t : unit.tensors) {
      if (t.data == nullptr && layout::TensorSpec{t.name, t.dtype, t.shape}.bytes() > 0) {
        return Status(StatusCode::kInvalidArgument,
                      "unit '" + unit.name + "' tensor '" + t.name + "' has no data pointer");
      }
      if (t.on_host != unit.on_host) {
        return Status(StatusCode::kInvalidArgument,
                      "unit '" + unit.name + "' tensor '" + t.name + "' is in " +
                          (t.on_host ? "host" : "device") + " memory but the unit is registered " +
                          (unit.on_host ? "on_host" : "on the device") + " (" +
                          options.pool_path + "): frontend::ParameterUnits splits such units");
      }
    }
  }
  const int world_size = options.coordinator ? options.coordinator->world_size() : 1;
  if (options.replicas != 1 && !options.shard_replicated_state) {
    return Status(StatusCode::kInvalidArgument,
                  "EngineOptions::replicas=" + std::to_string(options.replicas) +
                      " needs shard_replicated_state (" + options.pool_path + ")");
  }
  std::optional<ShardedUnits> shards;
  if (options.shard_replicated_state && world_size > 1) {
    // The whole model's identity, with the replica count: a pool holds the
    // units one placement assigned it.
    const std::uint64_t identity[2] = {
        options.model_fingerprint != 0 ? options.model_fingerprint : manifest.Signature(),
        static_cast<std::uint64_t>(options.replicas)};
    options.model_fingerprint = layout::Checksum64(identity, sizeof(identity));
    PMSNAP_ASSIGN_OR_RETURN(shards,
                            ShardUnits(std::move(units), manifest, options.coordinator->rank(),
                                       world_size, options.replicas, options.pool_path));
    units = HeldRegistrations(*shards);
    manifest = ManifestFor(units);
  }

  std::vector<std::uint32_t> encoded_units;
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    if (units[u].encoded) encoded_units.push_back(u);
  }
  if (!encoded_units.empty() && !options.encoder) {
    return Status(StatusCode::kInvalidArgument,
                  "unit '" + units[encoded_units[0]].name +
                      "' is registered as encoded but EngineOptions::encoder is not set");
  }
  if (!encoded_units.empty() && options.pool_options.chunk_heap_bytes == 0) {
    // Room for a baseline plus differential history of every encoded unit.
    std::uint64_t encoded_bytes = 0;
    for (std::uint32_t u : encoded_units) encoded_bytes += manifest.units[u].bytes();
    options.pool_options.chunk_heap_bytes = 4 * encoded_bytes + (16ull << 20);
  }

  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->encoder = options.encoder;
  impl->units = std::move(units);
  impl->shards = std::move(shards);
  if (options.device == nullptr) {
    impl->owned_device = std::make_unique<HostDevice>();
    impl->device = impl->owned_device.get();
  } else {
    impl->device = options.device;
  }
  impl->devices = std::make_unique<UnitDevices>(*impl->device);
  impl->policy = options.policy ? options.policy : std::make_shared<ContinuousPolicy>();
  if (options.coordinator && options.coordinator->world_size() > 1) {
    if (impl->policy->adapts_to_measurements()) {
      return Status(StatusCode::kInvalidArgument,
                    "policy '" + impl->policy->name() + "' decides from this rank's own " +
                        "measurements, so ranks would capture different iterations; with " +
                        std::to_string(options.coordinator->world_size()) +
                        " ranks use continuous or every-k (" + options.pool_path + ")");
    }
    PMSNAP_ASSIGN_OR_RETURN(impl->agreement, EpochAgreement::Create(options.coordinator));
  }
  impl->strategy =
      options.strategy ? options.strategy : std::make_shared<WaitForSnapshotStrategy>();
  if (options.dram_staging_buffers != 0) {
    const std::string why =
        options.dram_staging_buffers < 0 || options.dram_staging_buffers > 2
            ? "must be 0, 1 or 2"
        : !encoded_units.empty()
            ? "stages slot units only, and unit '" + impl->units[encoded_units[0]].name +
                  "' is encoded"
        : world_size > 1 ? "is for a single process, and this engine has " +
                               std::to_string(world_size) + " ranks"
        : impl->policy->wait_if_busy()
            ? "stages boundaries a policy would skip, and policy '" + impl->policy->name() +
                  "' waits for the epoch in flight instead (use continuous)"
            : "";
    if (!why.empty()) {
      return Status(StatusCode::kInvalidArgument,
                    "EngineOptions::dram_staging_buffers=" +
                        std::to_string(options.dram_staging_buffers) + " " + why + " (" +
                        options.pool_path + ")");
    }
  }

  layout::OpenOptions open_options;
  open_options.verify_data = options.verify_on_open;
  // An encoder reads its own state at Attach, from the slot chosen at open.
  // Ranks agree on what to restore from what each verified at open.
  open_options.defer_data_verification = encoded_units.empty() && !impl->agreement;
  open_options.prefault_mapping = options.pool_options.prefault_mapping;
  open_options.prefault_method = options.pool_options.prefault_method;
  open_options.pm_bandwidth = options.pool_options.pm_bandwidth;
  PMSNAP_ASSIGN_OR_RETURN(
      impl->pool, OpenOrCreatePool(options, manifest, open_options, impl->agreement.get()));
  for (const auto& unit : impl->pool->layout().units) impl->model_bytes += unit.bytes;
  if (options.dram_staging_buffers > 0) {
    std::uint64_t slot_bytes = 0;
    for (const layout::PartLayout& part : impl->pool->layout().parts) {
      slot_bytes = std::max(slot_bytes, part.slot_offset + part.bytes);
    }
    PMSNAP_RETURN_IF_ERROR(
        impl->staging.Allocate(options.dram_staging_buffers, slot_bytes, options.pool_path));
  }
  impl->hold_budget.emplace(options.copy_start, impl->device->cpu_addressable(), impl->model_bytes,
                            options.workers);
  if (!impl->device->cpu_addressable()) {
    // DMA straight into the PM slots and the staging buffers; where the
    // device cannot register them it stages through its bounded pinned ring
    // (slower, still correct). A range registered already by someone else
    // is an error: the copies could land in pages that are not this pool.
    std::vector<std::pair<std::string, std::span<std::byte>>> destinations;
    for (int slot = 0; slot < 2; ++slot) {
      destinations.emplace_back("slot " + std::to_string(slot), impl->pool->slot_mapping(slot));
    }
    for (std::size_t i = 0; i < impl->staging.count(); ++i) {
      destinations.emplace_back("staging buffer " + std::to_string(i), impl->staging.buffer(i));
    }
    for (const auto& [what, range] : destinations) {
      std::string not_registered;
      Result<HostRegistration> registered =
          HostRegistration::Register(*impl->device, range.data(), range.size(), &not_registered);
      if (!registered.ok()) {
        return Status(registered.status().code(), "pool '" + options.pool_path + "' " + what +
                                                      ": " + registered.status().message());
      }
      if (!not_registered.empty()) {
        std::cerr << "pmsnap: warning: pool '" << options.pool_path << "' " << what << ": "
                  << not_registered << "\n";
      }
      if (registered->registered()) impl->registrations.push_back(std::move(*registered));
    }
  }

  // No slot reserved for the training thread: it never joins the arena.
  if (impl->encoder) {
    PMSNAP_RETURN_IF_ERROR(impl->encoder->Attach(
        impl->pool->chunk_heap(), impl->pool->manifest(),
        impl->pool->last_committed_epoch().value_or(0), impl->units, encoded_units,
        *impl->device));
  }
  const std::size_t wanted_threads = static_cast<std::size_t>(options.workers) + 2;
  if (tbb::global_control::active_value(tbb::global_control::max_allowed_parallelism) <
      wanted_threads) {
    impl->thread_limit = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, wanted_threads);
  }
  impl->arena = std::make_unique<tbb::task_arena>(options.workers, /*reserved_for_masters=*/0);
  impl->device_stream = std::make_unique<tbb::task_arena>(1, /*reserved_for_masters=*/0);
  if (!impl->options.worker_cpus.empty()) {
    for (tbb::task_arena* arena : {impl->arena.get(), impl->device_stream.get()}) {
      arena->initialize();
      Impl* raw = impl.get();
      impl->pinning.push_back(std::make_unique<WorkerPinning>(
          *arena, impl->options.worker_cpus,
          [raw](const Status& status) { raw->RecordError(status); }));
    }
  }
  impl->stats.device = impl->device->name();
  impl->stats.pm = impl->pool->pm_bandwidth().Label();
  impl->stats.strategy = impl->strategy->name();
  impl->stats.policy = impl->policy->name();
  for (std::size_t u = 0; u < impl->units.size(); ++u) {
    UnitStats us;
    us.name = impl->units[u].name;
    us.bytes = impl->pool->layout().units[u].bytes;
    impl->stats.units.push_back(us);
  }
  impl->policy_inputs.model_bytes = impl->model_bytes;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::BeginStep(std::uint64_t step) {
  Impl& impl = *impl_;
  if (impl.closed) return Status(StatusCode::kFailedPrecondition, "engine is closed");
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (Status failed = impl.TakeError(); !failed.ok()) {
    // The other ranks learn of it at this boundary's exchange.
    if (impl.agreement) {
      (void)impl.agreement->AtBoundary(step, {impl.committed_iteration, false}, false, false,
                                       [&] { return LocalEpochState{}; });
    }
    return failed;
  }
  if (impl.in_step) {
    return Status(StatusCode::kFailedPrecondition, "BeginStep(" + std::to_string(step) +
                                                       ") before EndStep of step " +
                                                       std::to_string(impl.step));
  }
  const auto start = Clock::now();
  if (impl.started_training) {
    impl.policy_inputs.iteration_seconds =
        std::chrono::duration<double>(start - impl.last_step_begin).count();
  } else {
    // Estimated at the first step, not at Open: a host device measures its
    // memcpy bandwidth on first use, which a restore need not wait for.
    impl.policy_inputs.in_device_seconds =
        impl.device->EstimateInDeviceCopySeconds(impl.model_bytes);
  }
  impl.started_training = true;
  impl.last_step_begin = start;
  impl.in_step = true;
  impl.step = step;
  impl.saw_update_in_step = false;
  impl.blocked_this_step = 0;
  impl.ReapIfDone();
  impl.hold_budget->OnStepBegin(start);

  impl.policy_inputs.device_free_bytes = impl.device->free_bytes();
  bool open_epoch = impl.policy->ShouldCheckpoint(step, impl.policy_inputs);
  if (impl.agreement) {
    Result<bool> agreed = impl.agreement->AtBoundary(
        step, {impl.committed_iteration, true}, open_epoch, impl.policy->wait_if_busy(), [&] {
          impl.WaitEpochIdleAtBoundary();
          impl.ReapIfDone();
          return LocalEpochState{impl.committed_iteration, impl.TakeError().ok()};
        });
    if (!agreed.ok()) {
      impl.RecordError(agreed.status());
      impl.AddBlocked(SecondsSince(start));
      return agreed.status();
    }
    open_epoch = *agreed;
  }
  if (open_epoch) {
    if (impl.epoch_busy.load(std::memory_order_acquire) && impl.policy->wait_if_busy()) {
      impl.WaitEpochIdleAtBoundary();
    }
    impl.ReapIfDone();
    PMSNAP_RETURN_IF_ERROR(impl.TakeError());
    bool staged = false;
    if (impl.epoch_busy.load(std::memory_order_acquire)) staged = impl.TryStage(step);
    if (!staged && !impl.epoch_busy.load(std::memory_order_acquire)) {
      // The epoch in flight may have finished since the reap above (its
      // last job may still be running): reap it, and a staged one it
      // began, before `current` takes the new epoch.
      impl.ReapIfDone();
      PMSNAP_RETURN_IF_ERROR(impl.OpenEpoch(step));
    }
    if (impl.capturing != nullptr) {
      impl.policy->OnEpochStarted(step);
      if (impl.agreement) impl.agreement->OnEpochOpened(step);
      std::lock_guard<std::mutex> lock(impl.stats_mutex);
      impl.stats.epochs_started += 1;
      if (staged) impl.stats.epochs_staged += 1;
    }
  }
  impl.AddBlocked(SecondsSince(start));
  return Status::Ok();
}

Status Engine::BeforeUpdate(std::uint32_t registered_unit) {
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  PMSNAP_ASSIGN_OR_RETURN(const std::optional<std::uint32_t> held,
                          impl.HeldUnit(registered_unit));
  const auto start = Clock::now();
  if (!impl.saw_update_in_step) {
    impl.saw_update_in_step = true;
    impl.first_update_in_step = start;
  }
  const Status worker_error = impl.TakeError();
  if (!held) return impl.ReportMidStep(worker_error);  // another rank writes it
  const std::uint32_t unit = *held;
  Status result = worker_error;
  // The epoch in flight, and a staged one behind it: each may have
  // captured the unit in an earlier step and not copied it yet.
  for (Epoch* in_flight : {impl.current.get(), impl.staged.get()}) {
    if (!result.ok() || in_flight == nullptr) continue;
    Epoch& epoch = *in_flight;
    UnitTask* task = epoch.tasks[unit].get();
    // A captured unit from an earlier step: its next update would overwrite
    // the value the epoch is still copying.
    if (task != nullptr && !(impl.capturing == &epoch && !epoch.step_ended)) {
      if (epoch.next_update_gap[unit] < 0) {
        epoch.next_update_gap[unit] =
            std::chrono::duration<double>(start - epoch.captured_at[unit]).count();
      }
      if (!task->snapshotted()) {
        epoch.conflicted[unit] = true;
        if (impl.units[unit].encoded || epoch.staged) {
          // A staged copy runs on the device stream, ahead of nothing.
          task->WaitSnapshotted();
        } else {
          result = impl.strategy->Resolve(*task);
        }
        if (!result.ok()) {
          // The live tensor may still be read: this epoch cannot commit.
          epoch.failed.store(true, std::memory_order_relaxed);
          impl.RecordError(result);
        }
        const double waited = SecondsSince(start);
        std::lock_guard<std::mutex> lock(impl.stats_mutex);
        impl.stats.conflicts += 1;
        impl.stats.conflict_wait_seconds += waited;
        impl.stats.units[unit].conflicts += 1;
        impl.stats.units[unit].conflict_wait_seconds += waited;
      }
    }
  }
  impl.AddBlocked(SecondsSince(start));
  return impl.ReportMidStep(result);
}

Status Engine::AfterUpdate(std::uint32_t registered_unit) {
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  PMSNAP_ASSIGN_OR_RETURN(const std::optional<std::uint32_t> held,
                          impl.HeldUnit(registered_unit));
  if (!held) return Status::Ok();  // another rank writes it
  const std::uint32_t unit = *held;
  const auto start = Clock::now();
  Status result = Status::Ok();
  if (impl.capturing && impl.capturing->tasks[unit] == nullptr) result = impl.Capture(unit);
  impl.AddBlocked(SecondsSince(start));
  return result;
}

Status Engine::EndStep(std::span<const std::byte> extra_state) {
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (!impl.in_step) {
    return Status(StatusCode::kFailedPrecondition, "EndStep without BeginStep");
  }
  const auto start = Clock::now();
  Status result = Status::Ok();
  if (impl.saw_update_in_step) {
    impl.policy_inputs.update_seconds =
        std::chrono::duration<double>(start - impl.first_update_in_step).count();
  }
  if (impl.capturing) {
    Epoch& epoch = *impl.capturing;
    result = impl.ExtraStateFits(extra_state, "epoch for step ", epoch.iteration, " abandoned");
    if (!result.ok()) {
      impl.AbandonEpoch(epoch);
    } else {
      // Units without an update this step hold their post-step value now.
      // Every one is captured even after an error (the epoch then fails),
      // or the epoch would wait for them forever.
      for (std::uint32_t u = 0; u < impl.units.size(); ++u) {
        if (epoch.tasks[u] != nullptr) continue;
        Status captured = impl.Capture(u);
        if (result.ok()) result = captured;
      }
      impl.EndCapture(epoch, extra_state);
    }
    impl.capturing = nullptr;
  }
  impl.in_step = false;
  impl.hold_budget->OnStepEnd(Clock::now());
  impl.AddBlocked(SecondsSince(start));
  {
    std::lock_guard<std::mutex> lock(impl.stats_mutex);
    impl.stats.steps += 1;
    impl.stats.blocked_seconds += impl.blocked_this_step;
    impl.blocked_history.push_back(impl.blocked_this_step);
    if (impl.blocked_history.size() > kBlockedHistory) impl.blocked_history.pop_front();
  }
  if (!result.ok()) return result;
  return impl.ReportMidStep(impl.TakeError());
}

Status Engine::CheckpointLastStep(std::span<const std::byte> extra_state) {
  Impl& impl = *impl_;
  if (impl.closed) return Status(StatusCode::kFailedPrecondition, "engine is closed");
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (impl.in_step) {
    return Status(StatusCode::kFailedPrecondition,
                  "CheckpointLastStep inside step " + std::to_string(impl.step) +
                      " (call EndStep first)");
  }
  if (impl.agreement) {
    return Status(StatusCode::kFailedPrecondition,
                  "CheckpointLastStep with several ranks: their epochs open at agreed step "
                  "boundaries only (pool '" + impl.options.pool_path + "')");
  }
  if (!impl.started_training || impl.last_captured_step == impl.step) return Status::Ok();
  for (const UnitRegistration& unit : impl.units) {
    if (unit.encoded) {
      return Status(StatusCode::kFailedPrecondition,
                    "CheckpointLastStep with encoded unit '" + unit.name +
                        "': its rows are captured at step boundaries only");
    }
  }
  const auto start = Clock::now();
  impl.WaitEpochIdle();
  impl.ReapIfDone();
  PMSNAP_RETURN_IF_ERROR(impl.TakeError());
  PMSNAP_RETURN_IF_ERROR(
      impl.ExtraStateFits(extra_state, "last step ", impl.step, " not checkpointed"));
  PMSNAP_RETURN_IF_ERROR(impl.OpenEpoch(impl.step));
  {
    std::lock_guard<std::mutex> lock(impl.stats_mutex);
    impl.stats.epochs_started += 1;
  }
  // Nothing updates the units any more: each is copied as it is, and none
  // is held for a step end that already came.
  Epoch& epoch = *impl.current;
  epoch.step_ended = true;
  Status result = Status::Ok();
  for (std::uint32_t u = 0; u < impl.units.size(); ++u) {
    Status captured = impl.Capture(u);
    if (result.ok()) result = captured;
  }
  impl.EndCapture(epoch, extra_state);
  impl.WaitEpochIdle();
  impl.ReapIfDone();
  {
    std::lock_guard<std::mutex> lock(impl.stats_mutex);
    impl.stats.blocked_seconds += SecondsSince(start);
  }
  if (!result.ok()) return result;
  return impl.TakeError();
}

bool Engine::CapturesThisStep() const {
  return impl_->in_step && impl_->capturing != nullptr;
}

bool Engine::EpochInFlight() const { return impl_->epoch_busy.load(std::memory_order_acquire); }

Status Engine::Flush() {
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (impl.capturing != nullptr) {
    return Status(StatusCode::kFailedPrecondition, "Flush inside a step (call EndStep first)");
  }
  impl.WaitEpochIdle();
  impl.ReapIfDone();
  return impl.TakeError();
}

Status Engine::Close(CloseMode mode) {
  Impl& impl = *impl_;
  if (impl.closed) return impl.TakeError();
  // In a forked child the parent's engine stays as it is: the parent owns
  // its pool and epoch.
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  // The staged epoch first: abandoning the epoch in flight would begin it.
  if (impl.staged && (mode == CloseMode::kAbandon || !impl.staged->step_ended)) {
    impl.AbandonEpoch(*impl.staged);
  }
  if (impl.current && (mode == CloseMode::kAbandon || !impl.current->step_ended)) {
    impl.AbandonEpoch(*impl.current);
  }
  impl.WaitEpochIdle();
  impl.ReapIfDone();
  if (impl.agreement) {
    // Every rank finishes the exchange it started, whatever it then reports.
    if (Status finished = impl.agreement->Finish(); !finished.ok()) impl.RecordError(finished);
  }
  impl.closed = true;
  impl.pinning.clear();
  impl.arena->terminate();
  impl.device_stream->terminate();
  {
    std::lock_guard<std::mutex> lock(impl.stats_mutex);
    impl.stats.memory = impl.MemoryNow();
    impl.memory_taken_at_close = true;
  }
  // Before the memory they cover goes (Device::RegisterHostDestination).
  for (HostRegistration& registration : impl.registrations) {
    if (Status released = registration.Release(); !released.ok()) impl.RecordError(released);
  }
  impl.registrations.clear();
  impl.staging.Release();
  g_open_engines.fetch_sub(1, std::memory_order_relaxed);
  if (impl.options.print_summary) std::cerr << stats().Summary() << "\n";
  impl.pool.reset();
  return impl.TakeError();
}

Result<RestoreResult> Engine::Restore() {
  Impl& impl = *impl_;
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (impl.started_training) {
    return Status(StatusCode::kFailedPrecondition,
                  "Restore after training started (call it before the first BeginStep)");
  }
  if (impl.closed) return Status(StatusCode::kFailedPrecondition, "engine is closed");
  if (!impl.agreement) {
    PMSNAP_ASSIGN_OR_RETURN(RestoreResult restored,
                            RestoreNewestIntactEpoch(*impl.pool, *impl.devices, impl.units,
                                                     impl.encoder.get(), impl.options.workers));
    impl.committed_iteration = restored.iteration;
    return restored;
  }
  if (impl.shards) {
    PMSNAP_ASSIGN_OR_RETURN(RestoreResult restored,
                            RestoreShardedEpoch(*impl.pool, *impl.devices, impl.units, *impl.shards,
                                                impl.encoder.get(), impl.options.workers,
                                                *impl.agreement));
    impl.committed_iteration = restored.iteration;
    return restored;
  }
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t agreed,
                          impl.agreement->AgreeOnRestore(IntactIterations(*impl.pool)));
  Result<RestoreResult> restored =
      RestoreAgreedEpoch(*impl.pool, *impl.devices, impl.units, impl.encoder.get(),
                         impl.options.workers, agreed);
  PMSNAP_RETURN_IF_ERROR(impl.agreement->AgreeOnStatus(restored.status()));
  impl.committed_iteration = agreed;
  return restored;
}

std::optional<std::uint32_t> Engine::FindUnit(const std::string& name) const {
  if (!impl_->shards) return impl_->pool ? impl_->pool->FindUnit(name) : std::nullopt;
  const std::vector<UnitRegistration>& registered = impl_->shards->registered;
  for (std::uint32_t u = 0; u < registered.size(); ++u) {
    if (registered[u].name == name) return u;
  }
  return std::nullopt;
}
std::uint32_t Engine::unit_count() const {
  return static_cast<std::uint32_t>(impl_->shards ? impl_->shards->registered.size()
                                                  : impl_->units.size());
}
namespace {

// Engine::pool()'s precondition: a broken contract is a message and an
// abort, not a null dereference.
layout::Pool& OpenPool(const std::unique_ptr<layout::Pool>& pool, const std::string& path) {
  if (pool == nullptr) {
    std::fprintf(stderr,
                 "pmsnap: Engine::pool() called after Close for pool '%s' (Close releases the "
                 "pool)\n",
                 path.c_str());
    std::abort();
  }
  return *pool;
}

}  // namespace

const layout::Pool& Engine::pool() const { return OpenPool(impl_->pool, impl_->options.pool_path); }
layout::Pool& Engine::pool() { return OpenPool(impl_->pool, impl_->options.pool_path); }
Device& Engine::device() const { return *impl_->device; }
const ConflictStrategy& Engine::strategy() const { return *impl_->strategy; }
const IntervalPolicy& Engine::policy() const { return *impl_->policy; }

Stats Engine::stats() const {
  const Impl& impl = *impl_;
  std::lock_guard<std::mutex> lock(impl.stats_mutex);
  Stats out = impl.stats;
  out.policy = impl.policy->name();
  out.epochs_committed = impl.epochs_committed.load(std::memory_order_relaxed);
  out.bytes_written = impl.bytes_written.load(std::memory_order_relaxed);
  out.held_bytes = impl.held_bytes.load(std::memory_order_relaxed);
  if (impl.encoder) out.encoded_bytes_written = impl.encoder->bytes_written();
  out.peak_device_extra_bytes = impl.device->peak_allocated_bytes();
  out.device_queues = impl.device->queue_stats();
  out.in_device_fallbacks = impl.strategy->fallbacks();
  out.wall_seconds = SecondsSince(impl.opened_at);
  out.blocked_per_step.assign(impl.blocked_history.begin(), impl.blocked_history.end());
  if (!impl.memory_taken_at_close) out.memory = impl.MemoryNow();
  return out;
}

}  // namespace pmsnap::runtime
