// EpochAgreement: the rule that makes many ranks' checkpoints one whole.
//
// Every rank has its own pool and engine. For their epochs to form one
// consistent checkpoint, all ranks must capture the same iterations, and no
// rank may overwrite the slot that holds the newest epoch every rank has
// committed (the newest *globally committed* epoch). The engine asks this
// class at every step boundary whether it may open an epoch:
//
//   * Each boundary finishes the MIN all-reduce of committed iterations that
//     the previous boundary started, and starts the next one. All ranks thus
//     see the same global view at the same boundary, and the exchange runs
//     while the step computes (it is tiny: three integers).
//   * An epoch opens only when the global view says every rank committed the
//     epoch opened last. Since every rank decides from the same view and the
//     same interval policy (continuous and every-k are the same on every
//     rank), all ranks open epochs at the same steps, and a rank is never more
//     than one epoch ahead of the global commit: its other slot holds the
//     globally committed epoch.
//   * Continuous mode skips a boundary whose view is not there yet, so with
//     more than one rank it checkpoints at most every second step (the view
//     of epoch s reaches the ranks one step after s). A fixed interval
//     (every-k) waits instead: each rank finishes its epoch, then one blocking
//     all-reduce confirms all did.
//   * A rank whose engine failed still takes part in the exchange, reporting
//     the failure; every rank then stops opening epochs at that same boundary
//     with an error naming the lowest failed rank, so no rank waits forever
//     in a collective the failed rank never calls.
//
// Recovery: AgreeOnRestore picks the newest iteration that every rank holds
// intact (the MIN over ranks of their newest verified epoch) and checks that
// each rank still holds it; a rank whose newest slot is damaged thus pulls
// every rank back to the previous epoch together. A rank that never
// committed an epoch proves that none was committed by every rank: the
// ranks then start afresh, even if some committed their first epoch alone.
//
// Thread-safety: the training thread only (the Coordinator's contract).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/coordinator.h"
#include "pmsnap/runtime/sharding.h"

namespace pmsnap::runtime {

// What one rank knows about its own engine at a step boundary.
struct LocalEpochState {
  std::optional<std::uint64_t> committed_iteration;  // newest committed here
  bool healthy = true;  // false once the engine holds an error
};

class EpochAgreement {
 public:
  // `coordinator` must outlive this object's last call. Fails with
  // kInvalidArgument for a null coordinator or world size < 1.
  static Result<std::unique_ptr<EpochAgreement>> Create(std::shared_ptr<Coordinator> coordinator);

  // Call at every step boundary on every rank, in step order. `wants_epoch`
  // is the interval policy's answer for this step (the same on every rank);
  // `wait_if_busy` says whether the policy waits for a busy epoch (every-k)
  // or skips the boundary (continuous). `wait_for_local_epoch` blocks until
  // this rank's epoch in flight has committed or failed and returns the new
  // local state; it is called only when waiting.
  //
  // Returns true when this boundary opens an epoch on every rank; the caller
  // must then open one and call OnEpochOpened. kAborted, on every rank at the
  // same boundary, when some rank reported a failure (the message names the
  // lowest such rank); the agreement then issues no further collectives. The
  // coordinator's error when a collective fails.
  Result<bool> AtBoundary(std::uint64_t step, const LocalEpochState& local, bool wants_epoch,
                          bool wait_if_busy,
                          const std::function<LocalEpochState()>& wait_for_local_epoch);

  // Records that an epoch for `step` opened (after AtBoundary said so).
  void OnEpochOpened(std::uint64_t step);

  // Recovery, on every rank together before the first boundary. `mine` is
  // what this rank's pool holds (HoldingsOf); the ranks gather every rank's
  // holdings in one all-reduce and each computes the same ChooseRestore:
  // the newest iteration every rank holds, which every rank then restores,
  // or the same error on every rank (kNotFound: a fresh start).
  Result<std::uint64_t> AgreeOnRestore(const RankHoldings& mine);

  // Recovery of state sharded across ranks (sharding.h), instead of
  // AgreeOnRestore: as it, but each rank computes the same
  // ChooseShardedRestore: the same choice, or the same error, on every
  // rank. A rank without the chosen iteration (a lost pool) then receives
  // its units from their serving ranks.
  Result<ShardedRestoreChoice> AgreeOnShardedRestore(const RankHoldings& mine,
                                                     const ShardPlan& plan,
                                                     std::span<const std::string> unit_names);

  // At open, on every rank together, before any rank creates its pool:
  // agrees on the run's identity and checks every existing pool against it.
  // `existing` is the group stored in this rank's pool (nullopt: the pool is
  // created now; a pool with world size 0 was made by a single process);
  // `holds_checkpoint` says whether that pool holds a committed epoch;
  // `model_fingerprint` identifies the whole model. Returns the group a new
  // pool is created with: the run id of the lowest rank with an existing
  // pool, else a fresh one from rank 0, and created_beside_checkpoints when
  // some existing pool holds a committed epoch (the new pool replaces a lost
  // one). Fails on every rank with the lowest
  // failing rank's error, naming its pool: kFailedPrecondition for a pool of
  // another run, rank or world size (restoring with a different world size
  // is not supported), kModelMismatch for another model.
  Result<layout::RankGroup> AgreeOnGroup(const std::optional<layout::RankGroup>& existing,
                                         bool holds_checkpoint, std::uint64_t model_fingerprint,
                                         const std::string& pool_path);

  // Every rank passes its own result; if any failed, every rank returns the
  // lowest failing rank's error (its code, and its message prefixed with its
  // rank), else OK. Used after a restore, so that ranks fail together rather
  // than some of them training on.
  Status AgreeOnStatus(const Status& local);

  // Broadcasts `bytes` (any size; all ranks pass `root`'s size, which they
  // learn first) from `root`: every rank returns root's bytes.
  Result<std::vector<std::byte>> BroadcastBytes(std::vector<std::byte> bytes, int root);

  // Finishes the exchange in flight, if any, so that all ranks have issued
  // the same collectives when their engines close. Idempotent.
  Status Finish();

  // The newest iteration every rank is known to have committed.
  std::optional<std::uint64_t> global_committed() const { return global_committed_; }
  int rank() const { return rank_; }
  Coordinator& coordinator() const { return *coordinator_; }
  int world_size() const { return world_size_; }

 private:
  explicit EpochAgreement(std::shared_ptr<Coordinator> coordinator);
  // The all-reduce payload: MIN of (committed + 1), MIN of (healthy ? world : rank).
  std::vector<std::int64_t> Payload(const LocalEpochState& local) const;
  // Reads a finished payload into global_committed_; kAborted if a rank failed.
  Status Absorb(const std::vector<std::int64_t>& reduced);
  bool EveryRankCommittedLastOpened() const;
  // kFailedPrecondition once a boundary ran: recovery comes first.
  Status RefuseRestoreAfterBoundary() const;
  // Every rank's holdings, in rank order, on every rank (one all-reduce).
  Result<std::vector<RankHoldings>> GatherHoldings(const RankHoldings& mine);

  std::shared_ptr<Coordinator> coordinator_;
  int rank_ = 0;
  int world_size_ = 1;
  bool exchange_in_flight_ = false;
  bool stopped_ = false;
  std::optional<std::uint64_t> last_opened_;
  std::optional<std::uint64_t> global_committed_;
};

}  // namespace pmsnap::runtime
