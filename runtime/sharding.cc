#include "pmsnap/runtime/sharding.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

namespace pmsnap::runtime {

std::vector<std::uint32_t> ShardPlan::UnitsHeldBy(int rank) const {
  std::vector<std::uint32_t> units;
  for (std::uint32_t u = 0; u < holders.size(); ++u) {
    if (std::find(holders[u].begin(), holders[u].end(), rank) != holders[u].end()) {
      units.push_back(u);
    }
  }
  return units;
}

Result<ShardPlan> PlanShards(const std::vector<std::uint64_t>& unit_bytes, int world_size,
                             int replicas) {
  if (world_size < 1 || replicas < 1 || replicas > world_size) {
    return Status(StatusCode::kInvalidArgument,
                  "sharding needs 1 <= replicas <= world size; got replicas " +
                      std::to_string(replicas) + " for world size " + std::to_string(world_size));
  }
  std::vector<std::uint32_t> order(unit_bytes.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return unit_bytes[a] > unit_bytes[b];
  });
  ShardPlan plan;
  plan.holders.resize(unit_bytes.size());
  plan.bytes_per_rank.assign(world_size, 0);
  std::vector<std::uint64_t> owned(world_size, 0);
  for (const std::uint32_t u : order) {
    const int owner =
        static_cast<int>(std::min_element(owned.begin(), owned.end()) - owned.begin());
    owned[owner] += unit_bytes[u];
    for (int j = 0; j < replicas; ++j) {
      const int rank = (owner + j) % world_size;
      plan.holders[u].push_back(rank);
      plan.bytes_per_rank[rank] += unit_bytes[u];
    }
  }
  return plan;
}

namespace {

bool Holds(const RankHoldings& rank, std::uint64_t iteration) {
  return std::find(rank.intact.begin(), rank.intact.end(), iteration) != rank.intact.end();
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == ranks.size() ? " and " : ", ") + std::to_string(ranks[i]);
  }
  return out;
}

}  // namespace

Result<std::optional<std::string>> WhyNoRunWideCommit(const std::vector<RankHoldings>& holdings) {
  const auto never = std::find_if(holdings.begin(), holdings.end(),
                                  [](const RankHoldings& r) { return r.never_committed; });
  if (never == holdings.end()) return std::optional<std::string>();
  const std::string never_rank = std::to_string(never - holdings.begin());
  const auto twice = std::find_if(holdings.begin(), holdings.end(),
                                  [](const RankHoldings& r) { return r.committed_twice; });
  if (twice != holdings.end()) {
    return Status(StatusCode::kCorruption,
                  "rank " + std::to_string(twice - holdings.begin()) +
                      "'s pool holds two committed epochs while rank " + never_rank +
                      "'s pool never committed one, which the ranks' epoch agreement never "
                      "allows (a pool of another run, or a damaged commit word)");
  }
  return std::optional<std::string>(
      "no epoch was committed by every rank: rank " + never_rank +
      "'s pool never committed one; the ranks start afresh and forget the epochs that some "
      "committed alone");
}

Result<std::uint64_t> ChooseRestore(const std::vector<RankHoldings>& holdings) {
  const auto lacks = [](const RankHoldings& r) { return r.intact.empty(); };
  if (std::all_of(holdings.begin(), holdings.end(), lacks)) {
    return Status(StatusCode::kNotFound, "no rank's pool holds an intact checkpoint");
  }
  PMSNAP_ASSIGN_OR_RETURN(const std::optional<std::string> fresh, WhyNoRunWideCommit(holdings));
  if (fresh) return Status(StatusCode::kNotFound, *fresh);
  const auto lacking = std::find_if(holdings.begin(), holdings.end(), lacks);
  if (lacking != holdings.end()) {
    return Status(StatusCode::kCorruption,
                  "rank " + std::to_string(lacking - holdings.begin()) +
                      ": its pool holds no intact checkpoint while other ranks' pools do (a lost "
                      "or replaced pool); without replicas (sharded state with replicas >= 2) "
                      "no iteration is held by every rank");
  }
  std::uint64_t agreed = std::numeric_limits<std::uint64_t>::max();
  for (const RankHoldings& rank : holdings) {
    agreed = std::min(agreed, *std::max_element(rank.intact.begin(), rank.intact.end()));
  }
  for (std::size_t r = 0; r < holdings.size(); ++r) {
    if (!Holds(holdings[r], agreed)) {
      return Status(StatusCode::kCorruption,
                    "rank " + std::to_string(r) + ": does not hold iteration " +
                        std::to_string(agreed) +
                        " intact, the newest iteration every other rank can restore");
    }
  }
  return agreed;
}

Result<ShardedRestoreChoice> ChooseShardedRestore(const ShardPlan& plan,
                                                  const std::vector<RankHoldings>& holdings,
                                                  std::span<const std::string> unit_names) {
  std::vector<std::uint64_t> candidates;
  for (const RankHoldings& rank : holdings) {
    candidates.insert(candidates.end(), rank.intact.begin(), rank.intact.end());
  }
  if (candidates.empty()) {
    return Status(StatusCode::kNotFound, "no rank's pool holds an intact checkpoint");
  }
  std::sort(candidates.begin(), candidates.end(), std::greater<>());
  candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
  // Why the oldest candidate failed: the newest one's reason would blame a
  // rank that is merely ahead.
  std::string gap;
  for (const std::uint64_t iteration : candidates) {
    ShardedRestoreChoice choice;
    choice.iteration = iteration;
    for (const RankHoldings& rank : holdings) choice.holds_iteration.push_back(Holds(rank, iteration));
    gap.clear();
    for (std::size_t r = 0; r < holdings.size() && gap.empty(); ++r) {
      if (holdings[r].has_unreplicated_state && !choice.holds_iteration[r]) {
        gap = "rank " + std::to_string(r) +
              " does not hold it and also holds state no other rank has (its embedding tables)";
      }
    }
    for (std::size_t u = 0; u < plan.holders.size() && gap.empty(); ++u) {
      const std::vector<int>& holders = plan.holders[u];
      const auto server = std::find_if(holders.begin(), holders.end(), [&](int r) {
        return r < static_cast<int>(holdings.size()) && choice.holds_iteration[r];
      });
      if (server == holders.end()) {
        const std::string name = u < unit_names.size() ? unit_names[u] : std::to_string(u);
        gap = "unit '" + name + "' is written by " +
              (holders.size() > 1 ? "ranks " + RankList(holders) + ", none of which holds it"
                                  : "rank " + RankList(holders) + " alone, which does not hold it");
      } else {
        choice.serving_rank.push_back(*server);
      }
    }
    if (gap.empty()) return choice;
  }
  PMSNAP_ASSIGN_OR_RETURN(const std::optional<std::string> fresh, WhyNoRunWideCommit(holdings));
  if (fresh) return Status(StatusCode::kNotFound, *fresh);
  return Status(StatusCode::kCorruption,
                "no checkpoint can be restored from the ranks' pools: for iteration " +
                    std::to_string(candidates.back()) + ", the oldest any rank holds, " + gap +
                    " (with replicas=R the pools of any R-1 ranks may be lost)");
}

}  // namespace pmsnap::runtime
