#include "pmsnap/runtime/sharding.h"

#include <algorithm>
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

}  // namespace pmsnap::runtime
