// The workers' side of the engine: jobs on the arenas, each part's copy and
// persist, and the commit after an epoch's last unit (Engine::Impl; the
// layout of the engine's files is in detail/engine_impl.h).
#include <algorithm>
#include <chrono>

#include "detail/engine_impl.h"

namespace pmsnap::runtime {

void Engine::Impl::RecordError(const Status& status) {
  MutexLock lock(error_mutex);
  if (first_error.ok()) first_error = status;
}

Status Engine::Impl::TakeError() {
  MutexLock lock(error_mutex);
  return first_error;
}

Status Engine::Impl::ReportMidStep(Status recorded) const {
  return agreement ? Status::Ok() : recorded;
}

void Engine::Impl::JobQueued(Epoch& epoch) {
  MutexLock lock(jobs_mutex);
  outstanding_jobs += 1;
  epoch.jobs += 1;
}

void Engine::Impl::JobFinished(Epoch& epoch) {
  MutexLock lock(jobs_mutex);
  outstanding_jobs -= 1;
  epoch.jobs -= 1;
  jobs_finished.NotifyAll();
}

void Engine::Impl::WaitForJobs(const Epoch* epoch) {
  MutexLock lock(jobs_mutex);
  while ((epoch ? epoch->jobs : outstanding_jobs) != 0) jobs_finished.Wait(lock);
}

void Engine::Impl::Enqueue(Epoch* epoch, UnitTask* task, std::uint32_t part) {
  JobQueued(*epoch);
  arena->enqueue([this, epoch, task, part] {
    RunPart(*epoch, *task, part);
    JobFinished(*epoch);
  });
}

void Engine::Impl::RunOnDeviceStream(Epoch* epoch, std::function<void()> job) {
  JobQueued(*epoch);
  device_stream->enqueue([this, epoch, job = std::move(job)] {
    job();
    JobFinished(*epoch);
  });
}

void Engine::Impl::NoteFirstClaim(Epoch& epoch, const UnitTask& task, Clock::time_point start) {
  std::int64_t none = -1;
  epoch.first_claim_ns[task.unit()].compare_exchange_strong(
      none, std::chrono::duration_cast<std::chrono::nanoseconds>(start - epoch.started).count(),
      std::memory_order_relaxed);
}

Result<DeviceEventPtr> Engine::Impl::CopyPartAsync(UnitTask& task, std::uint32_t p) {
  const UnitTask::Part& part = task.part(p);
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> dst, pool->PartDestination(*part.pool_part));
  return task.device().CopyToHostAsync(dst.data(), task.source(p), part.bytes,
                                       task.update_event());
}

Result<DeviceEventPtr> Engine::Impl::IssueCopy(Epoch& epoch, UnitTask& task, std::uint32_t p) {
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

void Engine::Impl::RunPart(Epoch& epoch, UnitTask& task, std::uint32_t p) {
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

void Engine::Impl::FinishPart(Epoch& epoch, UnitTask& task, std::uint32_t p, Status status, double copy) {
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

void Engine::Impl::PartPersisted(Epoch& epoch, UnitTask& task, std::uint32_t p, const Status& status,
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

void Engine::Impl::ReleaseUnits(Epoch& epoch, std::uint32_t count) {
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
    MutexLock lock(handover_mutex);
    next = std::exchange(pending_start, nullptr);
    if (next == nullptr) epoch_busy.store(false, std::memory_order_release);
  }
  if (next == nullptr) {
    epoch_busy.notify_all();
  } else {
    BeginStaged(*next);
  }
}

void Engine::Impl::WaitEpochIdle() {
  while (epoch_busy.load(std::memory_order_acquire)) {
    epoch_busy.wait(true, std::memory_order_acquire);
  }
  WaitForJobs(nullptr);
}

}  // namespace pmsnap::runtime
