// PlanShards: owners balanced by bytes, replicas on the following ranks, the
// same plan on every rank.
#include "pmsnap/runtime/sharding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

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

// Three ranks, four equal units: unit u's owner and replica come from the
// plan, so the tests read them from it rather than assume a placement.
struct ThreeRanks {
  explicit ThreeRanks(int replicas) : plan(PlanShards({100, 100, 100, 100}, 3, replicas).value()) {}
  ShardPlan plan;
  std::vector<std::string> names{"a", "b", "c", "d"};
};

TEST(ShardedRestoreTest, EveryRankHoldingTheNewestRestoresItFromEachOwner) {
  ThreeRanks three(1);
  const auto choice = ChooseShardedRestore(three.plan, {{{8, 6}}, {{6, 8}}, {{8}}}, three.names);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->iteration, 8u);
  EXPECT_EQ(choice->holds_iteration, (std::vector<bool>{true, true, true}));
  for (std::size_t u = 0; u < 4; ++u) EXPECT_EQ(choice->serving_rank[u], three.plan.owner(u));
}

TEST(ShardedRestoreTest, ARankAheadDoesNotPullTheOthersForward) {
  ThreeRanks three(1);
  // Rank 2 alone committed 10; every unit is restorable only at 8.
  const auto choice = ChooseShardedRestore(three.plan, {{{8, 6}}, {{8, 6}}, {{10, 8}}}, three.names);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->iteration, 8u);
}

TEST(ShardedRestoreTest, ALostPoolIsServedByTheReplicas) {
  ThreeRanks three(2);
  const auto choice = ChooseShardedRestore(three.plan, {{{8, 6}}, {}, {{8, 6}}}, three.names);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->iteration, 8u);
  EXPECT_EQ(choice->holds_iteration, (std::vector<bool>{true, false, true}));
  for (std::size_t u = 0; u < 4; ++u) {
    const int server = choice->serving_rank[u];
    EXPECT_NE(server, 1) << u;
    const auto& holders = three.plan.holders[u];
    EXPECT_NE(std::find(holders.begin(), holders.end(), server), holders.end()) << u;
  }
}

TEST(ShardedRestoreTest, ALostPoolWithoutReplicasNamesAUnitNoRankHolds) {
  ThreeRanks three(1);
  const auto choice = ChooseShardedRestore(three.plan, {{{8, 6}}, {}, {{8, 6}}}, three.names);
  ASSERT_FALSE(choice.ok());
  EXPECT_EQ(choice.status().code(), StatusCode::kCorruption);
  EXPECT_NE(choice.status().message().find("is written by rank 1 alone, which does not hold it"),
            std::string::npos)
      << choice.status().message();
}

TEST(ShardedRestoreTest, ARankWithItsOwnTablesMustHoldTheIterationItself) {
  ThreeRanks three(2);
  std::vector<RankHoldings> holdings{{{8, 6}}, {{}, /*has_unreplicated_state=*/true}, {{8, 6}}};
  const auto choice = ChooseShardedRestore(three.plan, holdings, three.names);
  ASSERT_FALSE(choice.ok());
  EXPECT_NE(choice.status().message().find("rank 1 does not hold it and also holds state no "
                                           "other rank has"),
            std::string::npos)
      << choice.status().message();
}

TEST(ShardedRestoreTest, NoCoveringIterationBesideARankThatNeverCommittedIsAFreshStart) {
  ThreeRanks three(1);
  const std::vector<RankHoldings> holdings{
      {.intact = {3}}, {.intact = {}, .never_committed = true}, {.intact = {3}}};
  const auto choice = ChooseShardedRestore(three.plan, holdings, three.names);
  EXPECT_EQ(choice.status().code(), StatusCode::kNotFound) << choice.status().ToString();
  EXPECT_NE(choice.status().message().find("rank 1's pool never committed one"),
            std::string::npos)
      << choice.status().message();
}

TEST(ShardedRestoreTest, ACoveringIterationIsRestoredEvenBesideARankThatNeverCommitted) {
  ThreeRanks three(2);
  const std::vector<RankHoldings> holdings{
      {.intact = {3}}, {.intact = {}, .never_committed = true}, {.intact = {3}}};
  const auto choice = ChooseShardedRestore(three.plan, holdings, three.names);
  ASSERT_TRUE(choice.ok()) << choice.status().ToString();
  EXPECT_EQ(choice->iteration, 3u);
  EXPECT_EQ(choice->holds_iteration, (std::vector<bool>{true, false, true}));
}

TEST(ShardedRestoreTest, NoCheckpointAnywhereIsNotFound) {
  ThreeRanks three(2);
  const auto choice = ChooseShardedRestore(three.plan, {{}, {}, {}}, three.names);
  EXPECT_EQ(choice.status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace pmsnap::runtime
