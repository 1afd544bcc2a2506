// Staged epochs (EngineOptions::dram_staging_buffers): a step boundary that
// finds an epoch in flight captures into host memory instead of skipping,
// and the thread that commits the epoch in flight begins the staged one.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>

#include "detail/engine_impl.h"

namespace pmsnap::runtime {

void StagingBuffers::Release() {
  prefaulter_.reset();  // stops touching the buffers before they go
  for (std::byte* buffer : buffers_) munmap(buffer, bytes_);
  buffers_.clear();
  in_use_.clear();
}

Status StagingBuffers::Allocate(int count, std::uint64_t bytes, const std::string& pool) {
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

void Engine::Impl::BeginStaged(Epoch& epoch) {
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
    MutexLock lock(epoch.stage_mutex);
    epoch.began.store(true, std::memory_order_release);
    copied.swap(epoch.copied_parts);
  }
  epoch.began.notify_all();
  for (const auto& [task, part] : copied) EnqueueDrain(epoch, *task, part);
}

std::byte* Engine::Impl::StagedBytes(const Epoch& epoch, const UnitTask::Part& part) const {
  return epoch.staging + pool->layout().parts[*part.pool_part].slot_offset;
}

void Engine::Impl::StagePart(Epoch& epoch, UnitTask& task, std::uint32_t p) {
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
    MutexLock lock(epoch.stage_mutex);
    began = epoch.began.load(std::memory_order_relaxed);
    if (!began) epoch.copied_parts.emplace_back(&task, p);
  }
  if (began) EnqueueDrain(epoch, task, p);
}

void Engine::Impl::EnqueueDrain(Epoch& epoch, UnitTask& task, std::uint32_t p) {
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

bool Engine::Impl::TryStage(std::uint64_t step) {
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
    MutexLock lock(handover_mutex);
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

}  // namespace pmsnap::runtime
