#include "pmsnap/runtime/engine.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "detail/engine_impl.h"

namespace pmsnap::runtime {
namespace {

constexpr std::size_t kBlockedHistory = 65536;

// An error this rank recorded, as it reports it with several ranks: the
// exchange tells the other ranks only which rank failed, so the failing rank
// reports the cause, naming itself and its pool.
Status OwnFailure(const Status& local, const EpochAgreement& agreement, const std::string& pool) {
  return Status(local.code(), "rank " + std::to_string(agreement.rank()) + ", pool '" + pool +
                                  "': " + local.message());
}

}  // namespace

Status Engine::BeginStep(std::uint64_t step) {
  Impl& impl = *impl_;
  if (impl.closed) return Status(StatusCode::kFailedPrecondition, "engine is closed");
  PMSNAP_RETURN_IF_ERROR(RefuseInForkedChild(impl.options.pool_path));
  if (Status failed = impl.TakeError(); !failed.ok()) {
    // The other ranks learn of it at this boundary's exchange.
    if (impl.agreement) {
      (void)impl.agreement->AtBoundary(step, {impl.committed_iteration, false}, false, false,
                                       [&] { return LocalEpochState{}; });
      return OwnFailure(failed, *impl.agreement, impl.options.pool_path);
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
    Status local_error;
    Result<bool> agreed = impl.agreement->AtBoundary(
        step, {impl.committed_iteration, true}, open_epoch, impl.policy->wait_if_busy(), [&] {
          impl.WaitEpochIdleAtBoundary();
          impl.ReapIfDone();
          local_error = impl.TakeError();
          return LocalEpochState{impl.committed_iteration, local_error.ok()};
        });
    if (!agreed.ok()) {
      impl.RecordError(agreed.status());
      impl.AddBlocked(SecondsSince(start));
      // Found while waiting for this rank's epoch: its cause, not the
      // exchange's "rank r failed", is what this rank reports.
      if (!local_error.ok()) return OwnFailure(local_error, *impl.agreement, impl.options.pool_path);
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
      MutexLock lock(impl.stats_mutex);
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
        MutexLock lock(impl.stats_mutex);
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
    MutexLock lock(impl.stats_mutex);
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
    MutexLock lock(impl.stats_mutex);
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
    MutexLock lock(impl.stats_mutex);
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
  Result<std::uint64_t> agreement = impl.agreement->AgreeOnRestore(HoldingsOf(*impl.pool));
  if (agreement.status().code() == StatusCode::kNotFound) {
    return StartAfresh(*impl.pool, *impl.agreement, agreement.status());
  }
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t agreed, std::move(agreement));
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
  MutexLock lock(impl.stats_mutex);
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
