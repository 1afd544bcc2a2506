// Which ranks write which units when every rank holds the same state, and
// which checkpoint the ranks restore together.
//
// Under data parallelism (DDP) every rank holds the same parameters and
// optimizer state. Writing all of it on every rank multiplies the bytes by
// the world size for nothing: instead each unit gets one owner rank, chosen
// so that every rank writes about 1/N of the bytes, and only its holders
// write it. With `replicas` R > 1 the unit is also written by the R-1 ranks
// after its owner (mod N), so that the loss of any R-1 ranks' pools leaves
// every unit in some pool (Gemini's placement of checkpoint replicas on
// peers).
//
// The assignment is a pure function of the units' sizes, the world size and
// R: every rank computes the same one without exchanging anything, as long
// as all ranks list the same units in the same order (the pools' identity
// check guarantees it).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

struct ShardPlan {
  // holders[u]: the ranks that write unit u, owner first, then its replicas.
  std::vector<std::vector<int>> holders;
  // bytes_per_rank[r]: bytes rank r writes per checkpoint (replicas included).
  std::vector<std::uint64_t> bytes_per_rank;

  int owner(std::size_t unit) const { return holders[unit].front(); }
  // Units rank `rank` writes (as owner or replica), in unit order.
  std::vector<std::uint32_t> UnitsHeldBy(int rank) const;
};

// Longest-processing-time greedy: units by size, largest first (ties: lower
// index first), each to the rank that has the fewest bytes so far (ties:
// lowest rank); the largest rank's load is at most 4/3 of the optimum.
// kInvalidArgument unless 1 <= replicas <= world_size.
Result<ShardPlan> PlanShards(const std::vector<std::uint64_t>& unit_bytes, int world_size,
                             int replicas = 1);

// What one rank can restore, as the sharded recovery sees it.
struct RankHoldings {
  // Iterations of this rank's verified committed epochs (any order).
  std::vector<std::uint64_t> intact;
  // This rank also checkpoints state no other rank holds (its embedding
  // tables): without one of `intact` that state is lost.
  bool has_unreplicated_state = false;
  // The pool never committed an epoch and was created with the run's other
  // pools, not as a lost pool's replacement (RankGroup::
  // created_beside_checkpoints): proof that no epoch was ever committed by
  // every rank, since each rank commits every epoch.
  bool never_committed = false;
  // Both slots hold committed epochs, verified or not: the rank committed a
  // second epoch, which opens only after every rank committed the first.
  bool committed_twice = false;
};

// When `holdings` (one per rank) prove that no epoch was ever committed by
// every rank, why, for the kNotFound of a fresh start; nullopt when they do
// not. kCorruption, naming both ranks, when one rank never committed while
// another committed twice, which the epoch agreement never allows (a pool
// of another run, or a damaged commit word).
Result<std::optional<std::string>> WhyNoRunWideCommit(const std::vector<RankHoldings>& holdings);

// The unsharded recovery every rank computes alike from every rank's
// holdings: the newest iteration every rank holds intact (the MIN over
// ranks of each one's newest). kNotFound (a fresh start) when no rank
// holds a checkpoint or WhyNoRunWideCommit says none was committed by every
// rank; kCorruption naming the first rank without a checkpoint beside ranks
// that hold one (a lost pool: the run must not start over silently), or
// the first rank that lacks the chosen iteration.
Result<std::uint64_t> ChooseRestore(const std::vector<RankHoldings>& holdings);

// The sharded recovery every rank computes alike from every rank's holdings.
struct ShardedRestoreChoice {
  std::uint64_t iteration = 0;
  // serving_rank[u]: the first of unit u's holders that holds `iteration`;
  // after restoring, it broadcasts the unit to every other rank.
  std::vector<int> serving_rank;
  // holds_iteration[r]: rank r restores `iteration` from its own pool; the
  // others (a lost or damaged pool) receive every unit from its server.
  std::vector<bool> holds_iteration;
};

// The newest iteration from which every unit can be restored: some holder
// of each unit holds it intact, and every rank with unreplicated state holds
// it itself. kNotFound when no rank holds any checkpoint, or when none
// covers every unit and WhyNoRunWideCommit says no epoch was committed by
// every rank (a fresh start); kCorruption otherwise, naming the first unit
// (from `unit_names`) or rank that no candidate iteration covers.
// `holdings` has one entry per rank.
Result<ShardedRestoreChoice> ChooseShardedRestore(const ShardPlan& plan,
                                                  const std::vector<RankHoldings>& holdings,
                                                  std::span<const std::string> unit_names);

}  // namespace pmsnap::runtime
