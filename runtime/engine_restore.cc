// Engine::Restore's copy of a committed epoch into the tensors
// (detail/engine_restore.h).
#include "detail/engine_restore.h"

#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "pmsnap/common/mutex.h"

namespace pmsnap::runtime {
namespace {

// Copies every part of `view` into the registered tensors on `workers`
// threads and the calling thread, checking the checksums if the pool's data
// verification is still pending (fused into the copy when the CPU addresses
// the tensors). Returns a part that failed its checksum, if any.
Result<std::optional<std::uint32_t>> RestoreParts(layout::Pool& pool, const UnitDevices& devices,
                                                  const std::vector<UnitRegistration>& units,
                                                  int workers, const layout::SnapshotView& view) {
  const std::vector<layout::PartLayout>& parts = pool.layout().parts;
  const bool verify = pool.data_verification_pending();
  constexpr std::uint32_t kNone = ~0u;
  std::atomic<std::uint32_t> damaged{kNone};
  Mutex failure_mutex;  // guards failure
  Status failure;
  auto restore_part = [&](std::uint32_t p) {
    const layout::PartLayout& part = parts[p];
    std::byte* dst =
        static_cast<std::byte*>(units[part.unit].tensors[part.tensor].data) + part.offset_in_tensor;
    Device& device = devices.of(units[part.unit]);
    Status status;
    // The pool copies straight into CPU-addressable tensors; a device gets
    // the part across its link after the check.
    if (device.cpu_addressable()) {
      status = verify ? pool.ReadPart(view, p, dst) : pool.CopyPart(view, p, dst);
    } else {
      if (!verify) pool.PrefaultPart(view, p);
      status = verify ? pool.VerifyPart(view, p) : Status::Ok();
      if (status.ok()) {
        status = device.CopyFromHost(
            dst, view.tensor(part.unit, part.tensor).data() + part.offset_in_tensor, part.bytes);
      }
    }
    if (status.code() == StatusCode::kCorruption) {
      std::uint32_t expected = kNone;
      damaged.compare_exchange_strong(expected, p);
    } else if (!status.ok()) {
      MutexLock lock(failure_mutex);
      if (failure.ok()) failure = status;
    }
  };
  // The caller joins the workers. A device copy waits on its link while
  // the CPU could check the next part: one more thread keeps both busy.
  tbb::task_arena restore_arena(workers + (devices.engine_device().cpu_addressable() ? 1 : 2));
  restore_arena.execute([&] {
    tbb::parallel_for(std::uint32_t{0}, static_cast<std::uint32_t>(parts.size()),
                      [&](std::uint32_t p) {
                        if (damaged.load(std::memory_order_relaxed) == kNone) restore_part(p);
                      });
  });
  if (!failure.ok()) return failure;
  if (damaged.load() == kNone) return std::optional<std::uint32_t>();
  return std::optional<std::uint32_t>(damaged.load());
}

}  // namespace

Result<RestoreResult> RestoreNewestIntactEpoch(layout::Pool& pool, const UnitDevices& devices,
                                               const std::vector<UnitRegistration>& units,
                                               Encoder* encoder, int workers) {
  PMSNAP_ASSIGN_OR_RETURN(layout::SnapshotView view, pool.Latest());
  while (true) {
    PMSNAP_ASSIGN_OR_RETURN(std::optional<std::uint32_t> damaged,
                            RestoreParts(pool, devices, units, workers, view));
    if (!damaged) break;
    // The newest checkpoint is damaged: restore the older one over it (it was
    // verified in full when the pool switched to it).
    PMSNAP_RETURN_IF_ERROR(pool.RejectLatest(*damaged));
    PMSNAP_ASSIGN_OR_RETURN(view, pool.Latest());
  }
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    if (units[u].encoded) PMSNAP_RETURN_IF_ERROR(encoder->Restore(u, view.epoch()));
  }
  RestoreResult result;
  result.iteration = view.iteration();
  result.epoch = view.epoch();
  result.extra_state.assign(view.extra_state().begin(), view.extra_state().end());
  return result;
}

RankHoldings HoldingsOf(const layout::Pool& pool) {
  RankHoldings mine;
  const int committed = pool.committed_slots();
  mine.never_committed = committed == 0 && !pool.group().created_beside_checkpoints;
  mine.committed_twice = committed == 2;
  Result<layout::SnapshotView> latest = pool.Latest();
  if (!latest.ok()) return mine;
  mine.intact.push_back(latest->iteration());
  const layout::SlotInfo other = pool.slot_info(1 - latest->slot());
  if (other.state == layout::SlotState::kComplete && other.record_valid &&
      other.epoch < latest->epoch()) {
    mine.intact.push_back(other.iteration);
  }
  return mine;
}

Status StartAfresh(layout::Pool& pool, EpochAgreement& agreement, const Status& fresh) {
  PMSNAP_RETURN_IF_ERROR(agreement.AgreeOnStatus(pool.ForgetEpochs(fresh.message()).status()));
  return fresh;
}

namespace {

std::string AheadReason(std::uint64_t newer, std::uint64_t agreed) {
  return "iteration " + std::to_string(newer) + " is newer than iteration " +
         std::to_string(agreed) + ", the newest the ranks restore together";
}

// Broadcasts every tensor of `unit` from `root` into every rank's tensor, in
// place where the CPU addresses it, else through a host buffer.
Status BroadcastUnit(const UnitRegistration& unit, int root, int rank, const UnitDevices& devices,
                     Coordinator& coordinator) {
  Device& device = devices.of(unit);
  std::vector<std::byte> staging;
  for (const TensorView& t : unit.tensors) {
    const std::size_t bytes = layout::TensorSpec{t.name, t.dtype, t.shape}.bytes();
    if (bytes == 0) continue;
    if (device.cpu_addressable()) {
      PMSNAP_RETURN_IF_ERROR(
          coordinator.Broadcast(std::span<std::byte>(static_cast<std::byte*>(t.data), bytes), root));
      continue;
    }
    staging.resize(bytes);
    if (rank == root) PMSNAP_RETURN_IF_ERROR(device.CopyToHost(staging.data(), t.data, bytes));
    PMSNAP_RETURN_IF_ERROR(coordinator.Broadcast(staging, root));
    if (rank != root) PMSNAP_RETURN_IF_ERROR(device.CopyFromHost(t.data, staging.data(), bytes));
  }
  return Status::Ok();
}

}  // namespace

Result<ShardedUnits> ShardUnits(std::vector<UnitRegistration> units,
                                const layout::Manifest& manifest, int rank, int world_size,
                                int replicas, const std::string& pool_path) {
  ShardedUnits shards;
  std::vector<std::uint64_t> unit_bytes;
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    if (units[u].encoded) continue;
    shards.replicated.push_back(u);
    unit_bytes.push_back(manifest.units[u].bytes());
  }
  PMSNAP_ASSIGN_OR_RETURN(shards.plan, PlanShards(unit_bytes, world_size, replicas));
  for (int r = 0; r < world_size; ++r) {
    if (shards.plan.UnitsHeldBy(r).empty()) {
      return Status(StatusCode::kInvalidArgument,
                    "sharding " + std::to_string(shards.replicated.size()) + " units over " +
                        std::to_string(world_size) + " ranks with replicas=" +
                        std::to_string(replicas) + " leaves rank " + std::to_string(r) +
                        " no unit to write; use replicas=" + std::to_string(world_size) +
                        " or no sharding (" + pool_path + ")");
    }
  }
  std::vector<bool> held(units.size(), false);
  for (std::uint32_t u = 0; u < units.size(); ++u) held[u] = units[u].encoded;
  for (const std::uint32_t k : shards.plan.UnitsHeldBy(rank)) held[shards.replicated[k]] = true;
  std::uint32_t next = 0;
  for (std::uint32_t u = 0; u < units.size(); ++u) {
    shards.held_index.push_back(held[u] ? next++ : ShardedUnits::kNotHeld);
  }
  shards.registered = std::move(units);
  return shards;
}

std::vector<UnitRegistration> HeldRegistrations(const ShardedUnits& shards) {
  std::vector<UnitRegistration> held;
  for (std::uint32_t u = 0; u < shards.registered.size(); ++u) {
    if (shards.held_index[u] != ShardedUnits::kNotHeld) held.push_back(shards.registered[u]);
  }
  return held;
}

Result<RestoreResult> RestoreAgreedEpoch(layout::Pool& pool, const UnitDevices& devices,
                                         const std::vector<UnitRegistration>& units,
                                         Encoder* encoder, int workers, std::uint64_t agreed) {
  PMSNAP_ASSIGN_OR_RETURN(const layout::SnapshotView latest, pool.Latest());
  if (latest.iteration() != agreed) {
    PMSNAP_RETURN_IF_ERROR(pool.RollBackLatest(AheadReason(latest.iteration(), agreed)));
  }
  PMSNAP_ASSIGN_OR_RETURN(RestoreResult restored,
                          RestoreNewestIntactEpoch(pool, devices, units, encoder, workers));
  if (restored.iteration != agreed) {
    return Status(StatusCode::kCorruption,
                  "pool '" + pool.path() + "': iteration " + std::to_string(agreed) +
                      ", the newest every rank holds, failed verification while restoring");
  }
  return restored;
}

Result<RestoreResult> RestoreShardedEpoch(layout::Pool& pool, const UnitDevices& devices,
                                          const std::vector<UnitRegistration>& held_units,
                                          const ShardedUnits& shards, Encoder* encoder,
                                          int workers, EpochAgreement& agreement) {
  RankHoldings mine = HoldingsOf(pool);
  for (const UnitRegistration& unit : held_units) mine.has_unreplicated_state |= unit.encoded;
  std::vector<std::string> names;
  for (const std::uint32_t r : shards.replicated) names.push_back(shards.registered[r].name);
  Result<ShardedRestoreChoice> agreed = agreement.AgreeOnShardedRestore(mine, shards.plan, names);
  if (agreed.status().code() == StatusCode::kNotFound) {
    return StartAfresh(pool, agreement, agreed.status());
  }
  PMSNAP_ASSIGN_OR_RETURN(const ShardedRestoreChoice choice, std::move(agreed));
  const int rank = agreement.rank();
  auto restore_local = [&]() -> Result<RestoreResult> {
    if (choice.holds_iteration[rank]) {
      return RestoreAgreedEpoch(pool, devices, held_units, encoder, workers, choice.iteration);
    }
    // A lost or damaged pool: its units come from the peers. A slot newer
    // than the agreed iteration must not survive to a later recovery, where
    // it could pose as an iteration the ranks write again.
    for (Result<layout::SnapshotView> latest = pool.Latest();
         latest.ok() && latest->iteration() > choice.iteration; latest = pool.Latest()) {
      Status dropped = pool.RollBackLatest(AheadReason(latest->iteration(), choice.iteration));
      if (dropped.code() == StatusCode::kCorruption) break;  // no older slot verifies
      PMSNAP_RETURN_IF_ERROR(dropped);
    }
    RestoreResult received;
    received.iteration = choice.iteration;
    return received;
  };
  Result<RestoreResult> restored = restore_local();
  PMSNAP_RETURN_IF_ERROR(agreement.AgreeOnStatus(restored.status()));
  Coordinator& coordinator = agreement.coordinator();
  for (std::size_t k = 0; k < shards.replicated.size(); ++k) {
    PMSNAP_RETURN_IF_ERROR(BroadcastUnit(shards.registered[shards.replicated[k]],
                                         choice.serving_rank[k], rank, devices, coordinator));
  }
  const auto holder =
      std::find(choice.holds_iteration.begin(), choice.holds_iteration.end(), true);
  const bool some_rank_lacks =
      std::find(choice.holds_iteration.begin(), choice.holds_iteration.end(), false) !=
      choice.holds_iteration.end();
  if (some_rank_lacks) {
    // A rank that lost its pool takes the lowest holding rank's extra state,
    // marked as not its own (RestoreResult::extra_state_is_own).
    const int root = static_cast<int>(holder - choice.holds_iteration.begin());
    PMSNAP_ASSIGN_OR_RETURN(std::vector<std::byte> extra,
                            agreement.BroadcastBytes(restored->extra_state, root));
    if (!choice.holds_iteration[rank]) {
      restored->extra_state = std::move(extra);
      restored->extra_state_is_own = false;
    }
  }
  return restored;
}

}  // namespace pmsnap::runtime
