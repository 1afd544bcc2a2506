// Engine::Restore's work: copies a pool's newest intact committed epoch back
// into the registered tensors.
//
// Thread-safety: one call at a time per pool, and none beside a checkpoint
// of the same pool (the Engine calls it before the first BeginStep). It runs
// the copies on a oneTBB arena of its own and the calling thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/encoder.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/epoch_agreement.h"
#include "pmsnap/runtime/sharding.h"
#include "unit_devices.h"

namespace pmsnap::runtime {

// Copies every part of the pool's newest committed epoch into `units`'
// tensors, through each unit's device (`devices`), on `workers` threads plus the caller, checking
// each part's checksum in the same pass while the pool's data verification
// is pending. A damaged part makes the pool reject that epoch
// (Pool::RejectLatest, with its warning) and the older one is restored over
// it. Encoded units are restored by `encoder` (needed, and not null, when
// any unit is encoded). Returns the restored epoch's iteration and extra
// state; kNotFound when the pool has no committed epoch, kCorruption when
// neither epoch verifies, and the first copy error otherwise (the tensors
// then hold a mix of old and restored bytes).
Result<RestoreResult> RestoreNewestIntactEpoch(layout::Pool& pool, const UnitDevices& devices,
                                               const std::vector<UnitRegistration>& units,
                                               Encoder* encoder, int workers);

// What this rank's pool holds, for the ranks' recovery (RankHoldings): the
// iterations it can restore (the recovered, newest verified slot, and the
// other slot if it holds an older complete epoch whose record verifies; a
// newer slot that failed verification at open is not among them), and
// whether it never committed an epoch or committed two.
// has_unreplicated_state is left to the caller.
RankHoldings HoldingsOf(const layout::Pool& pool);

// Many ranks, after the ranks agreed on a fresh start (`fresh`, kNotFound):
// forgets the epochs this rank's pool committed alone (Pool::ForgetEpochs),
// so that none can pose as one of the new run's, and returns `fresh` on
// every rank, or the lowest failing rank's error.
Status StartAfresh(layout::Pool& pool, EpochAgreement& agreement, const Status& fresh);

// Many ranks: restores `agreed`, the iteration every rank agreed on. A rank
// one epoch ahead first drops its newest slot (Pool::RollBackLatest), so that
// restore reads the agreed one and the next epoch overwrites the dropped
// one. kCorruption naming the pool if `agreed` then fails verification.
Result<RestoreResult> RestoreAgreedEpoch(layout::Pool& pool, const UnitDevices& devices,
                                         const std::vector<UnitRegistration>& units,
                                         Encoder* encoder, int workers, std::uint64_t agreed);

// How an engine shards state that every rank holds alike
// (EngineOptions::shard_replicated_state).
struct ShardedUnits {
  static constexpr std::uint32_t kNotHeld = ~0u;
  // Every unit as the front end registered (and numbers) them.
  std::vector<UnitRegistration> registered;
  // Registration indices of the units every rank holds alike (not encoded),
  // in registration order; `plan` numbers them in this order.
  std::vector<std::uint32_t> replicated;
  ShardPlan plan;
  // Registration index -> index among the units this rank writes, kNotHeld
  // for units only other ranks write.
  std::vector<std::uint32_t> held_index;
};

// Plans which units this rank (of `world_size`) writes: the non-encoded
// units of `units` (`manifest` is ManifestFor(units), giving their sizes)
// are sharded by PlanShards with `replicas`; encoded units are always this
// rank's own. kInvalidArgument, the same on every rank,
// when some rank would write no unit (more ranks than units). `pool_path`
// names this rank's pool in errors.
Result<ShardedUnits> ShardUnits(std::vector<UnitRegistration> units,
                                const layout::Manifest& manifest, int rank, int world_size,
                                int replicas, const std::string& pool_path);

// The registrations `shards` says this rank writes, in registration order.
std::vector<UnitRegistration> HeldRegistrations(const ShardedUnits& shards);

// Sharded restore, on every rank together: agrees on the newest iteration
// from which every unit can be restored (EpochAgreement::AgreeOnShardedRestore),
// restores it from this rank's pool if the pool holds it (else drops any
// newer slot of its pool), then broadcasts every replicated unit from its
// serving rank into all ranks' tensors, and the extra state of the lowest
// rank holding the iteration to ranks that lack it. Errors are the same on
// every rank when the ranks' holdings or local restores fail (kNotFound: no
// rank holds a checkpoint); a broadcast failure is the transport's error.
// `held_units` are the registrations this rank writes (Impl::units).
Result<RestoreResult> RestoreShardedEpoch(layout::Pool& pool, const UnitDevices& devices,
                                          const std::vector<UnitRegistration>& held_units,
                                          const ShardedUnits& shards, Encoder* encoder,
                                          int workers, EpochAgreement& agreement);

}  // namespace pmsnap::runtime
