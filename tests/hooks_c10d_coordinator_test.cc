// C10dCoordinator over real gloo process groups (ranks are threads sharing
// one in-memory store): the collectives give every rank the same answer, and
// the epoch agreement runs on them as it does on torch.distributed.
#include "pmsnap/hooks/c10d_coordinator.h"

#include <gtest/gtest.h>

#include <functional>
#include <vector>

#include "hooks_gloo_ranks.h"
#include "pmsnap/runtime/epoch_agreement.h"

namespace pmsnap::hooks {
namespace {

// Runs `body(coordinator)` on `world` threads, each a gloo rank.
void OnGlooRanks(int world, const std::function<void(runtime::Coordinator&)>& body) {
  pmsnap::testing::OnGlooRanks(world, [&](int, c10::intrusive_ptr<c10d::Backend> backend) {
    C10dCoordinator coordinator(backend);
    body(coordinator);
  });
}

TEST(C10dCoordinatorTest, MinAllReduceGivesEveryRankTheElementwiseMinimum) {
  constexpr int kWorld = 3;
  std::vector<std::vector<std::int64_t>> seen(kWorld);
  OnGlooRanks(kWorld, [&](runtime::Coordinator& c) {
    const std::vector<std::int64_t> mine{10 - c.rank(), 100 + c.rank(), -c.rank()};
    ASSERT_TRUE(c.StartMinAllReduce(mine).ok());
    EXPECT_EQ(c.StartMinAllReduce(mine).code(), StatusCode::kFailedPrecondition);
    auto result = c.FinishMinAllReduce();
    ASSERT_TRUE(result.ok()) << result.status().ToString();
    seen[c.rank()] = *result;
  });
  for (const auto& s : seen) EXPECT_EQ(s, (std::vector<std::int64_t>{8, 100, -2}));
}

TEST(C10dCoordinatorTest, BroadcastCopiesTheRootsBytes) {
  constexpr int kWorld = 3;
  std::vector<std::vector<std::byte>> seen(kWorld);
  OnGlooRanks(kWorld, [&](runtime::Coordinator& c) {
    std::vector<std::byte> bytes(1000, std::byte(c.rank()));
    if (c.rank() == 1) {
      for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = std::byte(i * 7);
    }
    ASSERT_TRUE(c.Broadcast(bytes, 1).ok());
    seen[c.rank()] = bytes;
  });
  for (const auto& s : seen) {
    for (std::size_t i = 0; i < s.size(); ++i) ASSERT_EQ(s[i], std::byte(i * 7)) << i;
  }
}

TEST(C10dCoordinatorTest, EpochAgreementOverGlooOpensTheSameStepsOnEveryRank) {
  constexpr int kWorld = 2;
  constexpr std::uint64_t kSteps = 12;
  std::vector<std::vector<bool>> opened(kWorld);
  std::vector<std::uint64_t> restored(kWorld);
  OnGlooRanks(kWorld, [&](runtime::Coordinator& c) {
    // Borrowed, not owned: the coordinator lives on this thread's stack.
    std::shared_ptr<runtime::Coordinator> shared(&c, [](runtime::Coordinator*) {});
    auto agreement = runtime::EpochAgreement::Create(shared).value();
    // Rank 1 lost its newest epoch (iteration 9): both restore 7.
    auto agreed = agreement->AgreeOnRestore(
        {.intact = c.rank() == 0 ? std::vector<std::uint64_t>{7, 9} : std::vector<std::uint64_t>{7}});
    ASSERT_TRUE(agreed.ok()) << agreed.status().ToString();
    restored[c.rank()] = *agreed;
    // Epochs commit one step after they open, on rank 1 three steps after.
    std::optional<std::uint64_t> committed = *agreed, in_flight;
    std::uint64_t commit_at = 0;
    for (std::uint64_t step = 8; step < 8 + kSteps; ++step) {
      if (in_flight && step >= commit_at) committed = std::exchange(in_flight, std::nullopt);
      auto open = agreement->AtBoundary(step, {committed, true}, true, false,
                                        [&] { return runtime::LocalEpochState{committed, true}; });
      ASSERT_TRUE(open.ok()) << open.status().ToString();
      opened[c.rank()].push_back(*open);
      if (*open) {
        agreement->OnEpochOpened(step);
        in_flight = step;
        commit_at = step + (c.rank() == 1 ? 3 : 1);
      }
    }
    EXPECT_TRUE(agreement->Finish().ok());
  });
  EXPECT_EQ(restored, (std::vector<std::uint64_t>{7, 7}));
  EXPECT_EQ(opened[0], opened[1]);
  // Opened at 8, committed by rank 1 at 11, seen at 12; then 16.
  const std::vector<bool> expected{true, false, false, false, true, false,
                                   false, false, true, false, false, false};
  EXPECT_EQ(opened[0], expected);
}

}  // namespace
}  // namespace pmsnap::hooks
