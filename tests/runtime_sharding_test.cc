// PlanShards: owners balanced by bytes, replicas on the following ranks, the
// same plan on every rank.
#include "pmsnap/runtime/sharding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace pmsnap::runtime {
namespace {

TEST(ShardingTest, EveryUnitHasOneOwnerAndLoadsAreBalanced) {
  std::mt19937 rng(7);
  std::vector<std::uint64_t> bytes(120);
  for (auto& b : bytes) b = std::uniform_int_distribution<std::uint64_t>(1, 1 << 20)(rng);
  const std::uint64_t total = std::accumulate(bytes.begin(), bytes.end(), std::uint64_t{0});
  const std::uint64_t largest = *std::max_element(bytes.begin(), bytes.end());
  for (int world : {1, 2, 3, 4, 8}) {
    const ShardPlan plan = PlanShards(bytes, world).value();
    ASSERT_EQ(plan.holders.size(), bytes.size());
    std::uint64_t sum = 0;
    for (const auto& h : plan.holders) ASSERT_EQ(h.size(), 1u);
    for (auto b : plan.bytes_per_rank) sum += b;
    EXPECT_EQ(sum, total);
    // Greedy by size: no rank exceeds the mean by more than one unit.
    for (auto b : plan.bytes_per_rank) EXPECT_LE(b, total / world + largest) << world;
  }
}

TEST(ShardingTest, ReplicasGoToDistinctFollowingRanks) {
  const std::vector<std::uint64_t> bytes{100, 90, 80, 70, 60, 50, 40};
  const ShardPlan plan = PlanShards(bytes, 4, 2).value();
  std::uint64_t sum = 0;
  for (const auto& h : plan.holders) {
    ASSERT_EQ(h.size(), 2u);
    EXPECT_EQ(h[1], (h[0] + 1) % 4);
  }
  for (auto b : plan.bytes_per_rank) sum += b;
  EXPECT_EQ(sum, 2u * 490u);
  // Losing any one rank leaves every unit somewhere.
  for (int lost = 0; lost < 4; ++lost) {
    for (const auto& h : plan.holders) {
      EXPECT_TRUE(std::any_of(h.begin(), h.end(), [&](int r) { return r != lost; }));
    }
  }
}

TEST(ShardingTest, UnitsHeldByListsOwnedAndReplicatedUnits) {
  const ShardPlan plan = PlanShards({10, 10, 10}, 3, 2).value();
  std::multiset<std::uint32_t> all;
  for (int r = 0; r < 3; ++r) {
    for (auto u : plan.UnitsHeldBy(r)) all.insert(u);
  }
  for (std::uint32_t u = 0; u < 3; ++u) EXPECT_EQ(all.count(u), 2u);
}

TEST(ShardingTest, SamePlanForSameInputs) {
  const std::vector<std::uint64_t> bytes{5, 5, 5, 9, 1, 5};
  EXPECT_EQ(PlanShards(bytes, 3, 2).value().holders, PlanShards(bytes, 3, 2).value().holders);
  // Ties go to the lower index and the lower rank.
  EXPECT_EQ(PlanShards({5, 5}, 2).value().holders, (std::vector<std::vector<int>>{{0}, {1}}));
}

TEST(ShardingTest, RejectsMoreReplicasThanRanks) {
  EXPECT_EQ(PlanShards({1}, 2, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanShards({1}, 2, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::runtime
