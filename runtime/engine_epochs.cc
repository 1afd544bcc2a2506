// The epoch lifecycle on the training thread: an epoch opens at a step
// boundary, captures each unit after its update, ends with the step (or is
// abandoned), and is reaped into the stats once its workers committed it.
#include <algorithm>
#include <chrono>

#include "detail/engine_impl.h"
#include "pmsnap/common/memory_usage.h"

namespace pmsnap::runtime {

MemoryStats Engine::Impl::MemoryNow() const {
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

void Engine::Impl::WaitEpochIdleAtBoundary() {
  const auto wait_start = Clock::now();
  WaitEpochIdle();
  MutexLock lock(stats_mutex);
  stats.boundary_wait_seconds += SecondsSince(wait_start);
}

void Engine::Impl::ReapIfDone() {
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

void Engine::Impl::Reap(Epoch& epoch) {
  std::vector<UnitProfile> profiles;
  const bool committed = epoch.committed.load(std::memory_order_relaxed);
  double copied_bytes = 0, copy_seconds = 0;
  {
    MutexLock lock(stats_mutex);
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

Result<std::optional<std::uint32_t>> Engine::Impl::HeldUnit(std::uint32_t unit) const {
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

Status Engine::Impl::Capture(std::uint32_t u) {
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
    MutexLock lock(stats_mutex);
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

void Engine::Impl::ReleaseHeldParts(Epoch& epoch) {
  for (const auto& [task, part] : held_parts) Enqueue(&epoch, task, part);
  held_parts.clear();
}

void Engine::Impl::AbandonEpoch(Epoch& epoch) {
  if (epoch.staged && !epoch.began.load(std::memory_order_acquire)) {
    bool withdrawn = false;
    {
      MutexLock lock(handover_mutex);
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
        MutexLock lock(stats_mutex);
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

std::unique_ptr<Epoch> Engine::Impl::NewEpoch(std::uint64_t step) {
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

Status Engine::Impl::OpenEpoch(std::uint64_t step) {
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t epoch_number, pool->BeginEpoch(step));
  current = NewEpoch(step);
  current->epoch = epoch_number;
  epoch_busy.store(true, std::memory_order_release);
  capturing = current.get();
  return Status::Ok();
}

Status Engine::Impl::ExtraStateFits(std::span<const std::byte> extra_state, std::string_view before_step,
                      std::uint64_t step, std::string_view after_step) const {
  const std::uint64_t capacity = pool->options().extra_state_capacity;
  if (extra_state.size() <= capacity) return Status::Ok();
  return Status(StatusCode::kCapacityExceeded,
                "extra state of " + std::to_string(extra_state.size()) +
                    " bytes exceeds the pool's capacity of " + std::to_string(capacity) +
                    " bytes (PoolOptions::extra_state_capacity); " + std::string(before_step) +
                    std::to_string(step) + std::string(after_step));
}

void Engine::Impl::EndCapture(Epoch& epoch, std::span<const std::byte> extra_state) {
  epoch.extra_state.assign(extra_state.begin(), extra_state.end());
  epoch.step_ended = true;
  epoch.held_released_seconds = SecondsSince(epoch.started);
  ReleaseHeldParts(epoch);
  capturing = nullptr;
  last_captured_step = epoch.iteration;
  ReleaseUnits(epoch, 1);
}

}  // namespace pmsnap::runtime
