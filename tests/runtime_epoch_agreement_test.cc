// EpochAgreement: ranks (threads here) open epochs at the same steps, never
// more than one epoch ahead of the global commit, stop together when one
// fails, and agree on the epoch to restore.
#include "pmsnap/runtime/epoch_agreement.h"

#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "testutil/thread_coordinator.h"

namespace pmsnap::runtime {
namespace {

// One rank's engine, reduced to what the agreement sees: an epoch opened at
// step s commits `commit_delay(s)` boundaries later.
struct SimulatedRank {
  std::optional<std::uint64_t> committed;
  std::optional<std::uint64_t> in_flight;
  std::uint64_t commit_at = 0;
  // Per step: the committed iteration reported at that boundary, and whether
  // an epoch opened there.
  std::vector<std::optional<std::uint64_t>> reported;
  std::vector<bool> opened;
  int waits = 0;

  void Advance(std::uint64_t step) {
    if (in_flight && step >= commit_at) {
      committed = in_flight;
      in_flight.reset();
    }
  }
  LocalEpochState State() const { return {committed, true}; }
};

struct RunOptions {
  int world_size = 3;
  std::uint64_t steps = 60;
  bool wait_if_busy = false;
  std::uint64_t every = 1;
  // Boundaries an epoch of `rank` takes to commit, drawn per epoch.
  std::function<std::uint64_t(int rank, std::mt19937&)> commit_delay;
};

std::vector<SimulatedRank> RunRanks(const RunOptions& options) {
  auto group = std::make_shared<testutil::ThreadGroup>(options.world_size);
  std::vector<SimulatedRank> ranks(options.world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < options.world_size; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 rng(1234 + r);
      auto agreement = EpochAgreement::Create(group->Rank(r)).value();
      SimulatedRank& me = ranks[r];
      for (std::uint64_t step = 0; step < options.steps; ++step) {
        me.Advance(step);
        me.reported.push_back(me.committed);
        const bool wants = step % options.every == 0;
        auto wait = [&] {
          me.waits += 1;
          if (me.in_flight) me.Advance(me.commit_at);
          return me.State();
        };
        const Result<bool> open =
            agreement->AtBoundary(step, me.State(), wants, options.wait_if_busy, wait);
        // EXPECT, not ASSERT: a rank that left the loop would leave the
        // others waiting in a collective forever.
        EXPECT_TRUE(open.ok()) << open.status().ToString();
        const bool opened = open.ok() && *open;
        me.opened.push_back(opened);
        if (opened) {
          EXPECT_FALSE(me.in_flight.has_value()) << "rank " << r << " step " << step;
          agreement->OnEpochOpened(step);
          me.in_flight = step;
          me.commit_at = step + options.commit_delay(r, rng);
        }
      }
      EXPECT_TRUE(agreement->Finish().ok());
    });
  }
  for (auto& t : threads) t.join();
  return ranks;
}

// The invariant, checked against every rank's own record: an epoch opens at
// step s only if every rank had committed the previously opened epoch by
// boundary s - 1 (the view that reaches boundary s).
void ExpectSameStepsAndNeverAheadOfGlobalCommit(const std::vector<SimulatedRank>& ranks,
                                                bool waited) {
  std::optional<std::uint64_t> last_opened;
  int epochs = 0;
  for (std::size_t step = 0; step < ranks[0].opened.size(); ++step) {
    for (const auto& r : ranks) ASSERT_EQ(r.opened[step], ranks[0].opened[step]) << step;
    if (!ranks[0].opened[step]) continue;
    epochs += 1;
    if (last_opened && !waited) {
      for (const auto& r : ranks) {
        ASSERT_GE(step, 1u);
        ASSERT_TRUE(r.reported[step - 1].has_value()) << step;
        EXPECT_GE(*r.reported[step - 1], *last_opened) << "opened at " << step;
      }
    }
    last_opened = step;
  }
  EXPECT_GT(epochs, 3);
}

TEST(EpochAgreementTest, ContinuousRanksOpenTheSameStepsOnlyAfterAllCommitted) {
  RunOptions options;
  options.commit_delay = [](int, std::mt19937& rng) {
    return std::uniform_int_distribution<std::uint64_t>(0, 3)(rng);
  };
  const auto ranks = RunRanks(options);
  ExpectSameStepsAndNeverAheadOfGlobalCommit(ranks, false);
}

TEST(EpochAgreementTest, SlowRankHoldsEveryRankBackInsteadOfLettingThemRunAhead) {
  RunOptions options;
  options.world_size = 4;
  // Rank 2's copies are throttled: its epochs take 5 boundaries.
  options.commit_delay = [](int rank, std::mt19937&) -> std::uint64_t {
    return rank == 2 ? 5 : 0;
  };
  const auto ranks = RunRanks(options);
  ExpectSameStepsAndNeverAheadOfGlobalCommit(ranks, false);
  std::optional<std::size_t> previous;
  for (std::size_t step = 0; step < ranks[0].opened.size(); ++step) {
    if (!ranks[0].opened[step]) continue;
    // Opened at p, rank 2 commits at boundary p + 5, seen at p + 6.
    if (previous) {
      EXPECT_EQ(step - *previous, 6u);
    }
    previous = step;
  }
}

TEST(EpochAgreementTest, ContinuousWithPromptCommitsCheckpointsEverySecondStep) {
  RunOptions options;
  options.commit_delay = [](int, std::mt19937&) -> std::uint64_t { return 1; };
  const auto ranks = RunRanks(options);
  for (std::size_t step = 0; step < ranks[0].opened.size(); ++step) {
    EXPECT_EQ(ranks[0].opened[step], step % 2 == 0) << step;
  }
}

TEST(EpochAgreementTest, EveryKWaitsForAllRanksAndCapturesEachKthStep) {
  RunOptions options;
  options.every = 3;
  options.wait_if_busy = true;
  options.commit_delay = [](int rank, std::mt19937&) -> std::uint64_t {
    return rank == 1 ? 7 : 1;
  };
  const auto ranks = RunRanks(options);
  ExpectSameStepsAndNeverAheadOfGlobalCommit(ranks, true);
  for (std::size_t step = 0; step < ranks[0].opened.size(); ++step) {
    EXPECT_EQ(ranks[0].opened[step], step % 3 == 0) << step;
  }
  EXPECT_GT(ranks[1].waits, 0);
}

TEST(EpochAgreementTest, FailedRankStopsEveryRankNamingIt) {
  constexpr int kWorld = 3;
  constexpr std::uint64_t kFailAt = 5;
  auto group = std::make_shared<testutil::ThreadGroup>(kWorld);
  std::vector<Status> seen(kWorld);
  std::vector<std::uint64_t> stopped_at(kWorld, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      auto agreement = EpochAgreement::Create(group->Rank(r)).value();
      for (std::uint64_t step = 0; step < 20; ++step) {
        LocalEpochState local{step == 0 ? std::nullopt : std::optional<std::uint64_t>(step - 1),
                              !(r == 1 && step >= kFailAt)};
        auto open = agreement->AtBoundary(step, local, true, false, [&] { return local; });
        if (!open.ok()) {
          seen[r] = open.status();
          stopped_at[r] = step;
          break;
        }
        if (*open) agreement->OnEpochOpened(step);
      }
      EXPECT_TRUE(agreement->Finish().ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(seen[r].code(), StatusCode::kAborted) << r;
    EXPECT_NE(seen[r].message().find("rank 1 failed"), std::string::npos) << seen[r].message();
    EXPECT_EQ(stopped_at[r], kFailAt + 1) << r;
  }
}

// Runs AgreeOnRestore on one thread per rank with each rank's holdings.
std::vector<Result<std::uint64_t>> AgreeOnRestore(const std::vector<RankHoldings>& holdings) {
  const int world = static_cast<int>(holdings.size());
  auto group = std::make_shared<testutil::ThreadGroup>(world);
  std::vector<Result<std::uint64_t>> results(world, Status(StatusCode::kInternal, "not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto agreement = EpochAgreement::Create(group->Rank(r)).value();
      results[r] = agreement->AgreeOnRestore(holdings[r]);
      if (results[r].ok()) {
        EXPECT_EQ(agreement->global_committed(), std::optional<std::uint64_t>(*results[r]));
      }
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

// The same with each rank's intact iterations only.
std::vector<Result<std::uint64_t>> AgreeOnRestore(
    const std::vector<std::vector<std::uint64_t>>& intact) {
  std::vector<RankHoldings> holdings;
  for (const auto& iterations : intact) holdings.push_back({.intact = iterations});
  return AgreeOnRestore(holdings);
}

TEST(EpochAgreementTest, RestoreTakesNewestIterationEveryRankHolds) {
  // Rank 1 committed iteration 8 before the crash; the others had not.
  const auto results = AgreeOnRestore({{4, 6}, {6, 8}, {6, 4}});
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, 6u);
  }
}

TEST(EpochAgreementTest, RestoreFallsBackTogetherWhenOneRanksNewestSlotIsDamaged) {
  // Rank 0's slot with iteration 6 failed verification.
  const auto results = AgreeOnRestore({{4}, {4, 6}, {6, 4}});
  for (const auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, 4u);
  }
}

TEST(EpochAgreementTest, RestoreNamesTheRankWithoutTheAgreedIteration) {
  const auto results = AgreeOnRestore({{4, 6}, {6, 8}, {2, 8}});
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find("rank 2: does not hold iteration 6"), std::string::npos)
        << r.status().message();
  }
}

TEST(EpochAgreementTest, ALostPoolBesideCheckpointedRanksIsCorruptionNamingItsRank) {
  // Not kNotFound: front ends read that as a fresh start, and the run would
  // silently begin again while the other ranks hold iteration 6.
  const auto results = AgreeOnRestore({{4, 6}, {}, {6}});
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption);
    EXPECT_NE(r.status().message().find("rank 1: its pool holds no intact checkpoint while "
                                        "other ranks' pools do"),
              std::string::npos)
        << r.status().message();
  }
}

TEST(EpochAgreementTest, ARankThatNeverCommittedMakesTheOthersLoneFirstEpochsAFreshStart) {
  // The job died after ranks 0 and 2 committed their first epoch, before
  // rank 1 did: no epoch was committed by every rank, so none is lost.
  const auto results = AgreeOnRestore(std::vector<RankHoldings>{
      {.intact = {3}}, {.intact = {}, .never_committed = true}, {.intact = {3}}});
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
    EXPECT_NE(r.status().message().find("rank 1's pool never committed one"), std::string::npos)
        << r.status().message();
  }
}

TEST(EpochAgreementTest, ARankThatCommittedTwiceBesideOneThatNeverCommittedIsCorruption) {
  // A second epoch opens only after every rank committed the first.
  const auto results = AgreeOnRestore(std::vector<RankHoldings>{
      {.intact = {}, .never_committed = true}, {.intact = {5, 3}, .committed_twice = true}});
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find("rank 1's pool holds two committed epochs while rank 0's "
                                        "pool never committed one"),
              std::string::npos)
        << r.status().message();
  }
}

TEST(EpochAgreementTest, NoCheckpointOnAnyRankIsAFreshStartOnEveryRank) {
  const auto results = AgreeOnRestore(std::vector<std::vector<std::uint64_t>>{{}, {}, {}});
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  }
}

// Runs `body(rank, agreement)` on one thread per rank; returns its results.
template <typename T>
std::vector<Result<T>> OnRanks(int world,
                               const std::function<Result<T>(int, EpochAgreement&)>& body) {
  auto group = std::make_shared<testutil::ThreadGroup>(world);
  std::vector<Result<T>> results(world, Status(StatusCode::kInternal, "not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto agreement = EpochAgreement::Create(group->Rank(r)).value();
      results[r] = body(r, *agreement);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

std::string PoolOf(int rank) { return "/pm/run." + std::to_string(rank) + ".pool"; }

TEST(EpochAgreementTest, NewPoolsShareOneFreshRunIdAndKeepTheirRanks) {
  const auto groups = OnRanks<layout::RankGroup>(3, [](int r, EpochAgreement& a) {
    return a.AgreeOnGroup(std::nullopt, false, 77, PoolOf(r));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(groups[r].ok()) << groups[r].status().ToString();
    EXPECT_NE(groups[r]->run_id, 0u);
    EXPECT_EQ(groups[r]->run_id, groups[0]->run_id);
    EXPECT_EQ(groups[r]->rank, static_cast<std::uint32_t>(r));
    EXPECT_EQ(groups[r]->world_size, 3u);
    EXPECT_EQ(groups[r]->model_fingerprint, 77u);
  }
}

TEST(EpochAgreementTest, ExistingPoolsKeepTheirRunAndARecreatedPoolJoinsIt) {
  // Rank 0's pool was lost and is created again.
  for (const bool others_hold_checkpoints : {false, true}) {
    const auto groups = OnRanks<layout::RankGroup>(3, [&](int r, EpochAgreement& a) {
      std::optional<layout::RankGroup> existing;
      if (r != 0) existing = layout::RankGroup{42, static_cast<std::uint32_t>(r), 3, 77};
      return a.AgreeOnGroup(existing, others_hold_checkpoints && r == 2, 77, PoolOf(r));
    });
    for (const auto& g : groups) {
      ASSERT_TRUE(g.ok()) << g.status().ToString();
      EXPECT_EQ(g->run_id, 42u);
    }
    // Beside a checkpoint the new pool is a lost pool's replacement, and
    // will not pass for a rank that never committed.
    EXPECT_EQ(groups[0]->created_beside_checkpoints, others_hold_checkpoints);
  }
}

// Every rank fails with the same message, naming the failing rank's pool.
template <typename T>
void ExpectAllFailWith(const std::vector<Result<T>>& results, StatusCode code,
                       const std::string& text) {
  for (const auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status().ToString();
    EXPECT_NE(r.status().message().find(text), std::string::npos) << r.status().message();
  }
}

TEST(EpochAgreementTest, ForeignPoolIsNamedOnEveryRank) {
  const auto groups = OnRanks<layout::RankGroup>(3, [](int r, EpochAgreement& a) {
    const std::uint64_t run = r == 2 ? 99 : 42;
    return a.AgreeOnGroup(layout::RankGroup{run, static_cast<std::uint32_t>(r), 3, 77}, false, 77,
                          PoolOf(r));
  });
  ExpectAllFailWith(groups, StatusCode::kFailedPrecondition,
                    "rank 2: pool '/pm/run.2.pool' belongs to run 0000000000000063");
}

TEST(EpochAgreementTest, OtherWorldSizeIsAClearError) {
  const auto groups = OnRanks<layout::RankGroup>(2, [](int r, EpochAgreement& a) {
    return a.AgreeOnGroup(layout::RankGroup{42, static_cast<std::uint32_t>(r), 4, 77}, false, 77,
                          PoolOf(r));
  });
  ExpectAllFailWith(groups, StatusCode::kFailedPrecondition,
                    "rank 0: pool '/pm/run.0.pool' was written by 4 ranks, this job has 2");
}

TEST(EpochAgreementTest, SwappedPoolsAreNamed) {
  const auto groups = OnRanks<layout::RankGroup>(2, [](int r, EpochAgreement& a) {
    return a.AgreeOnGroup(layout::RankGroup{42, static_cast<std::uint32_t>(1 - r), 2, 77}, false, 77,
                          PoolOf(r));
  });
  ExpectAllFailWith(groups, StatusCode::kFailedPrecondition,
                    "rank 0: pool '/pm/run.0.pool' belongs to rank 1, not rank 0");
}

TEST(EpochAgreementTest, ARankWithAnotherModelIsAModelMismatch) {
  const auto groups = OnRanks<layout::RankGroup>(3, [](int r, EpochAgreement& a) {
    return a.AgreeOnGroup(std::nullopt, false, r == 1 ? 5 : 77, PoolOf(r));
  });
  ExpectAllFailWith(groups, StatusCode::kModelMismatch, "rank 1: pool '/pm/run.1.pool'");
}

TEST(EpochAgreementTest, ASingleProcessPoolCannotJoinAGroup) {
  const auto groups = OnRanks<layout::RankGroup>(2, [](int r, EpochAgreement& a) {
    return a.AgreeOnGroup(layout::RankGroup{}, false, 77, PoolOf(r));
  });
  ExpectAllFailWith(groups, StatusCode::kFailedPrecondition, "made by a single process");
}

TEST(EpochAgreementTest, AgreeOnStatusGivesEveryRankTheLowestFailure) {
  const auto results = OnRanks<int>(4, [](int r, EpochAgreement& a) -> Result<int> {
    Status local = Status::Ok();
    if (r == 2) local = Status(StatusCode::kCorruption, "slot 1 unit fc.weight damaged");
    if (r == 3) local = Status(StatusCode::kIOError, "disk gone");
    PMSNAP_RETURN_IF_ERROR(a.AgreeOnStatus(local));
    return r;
  });
  ExpectAllFailWith(results, StatusCode::kCorruption, "rank 2: slot 1 unit fc.weight damaged");
  const auto fine = OnRanks<int>(2, [](int r, EpochAgreement& a) -> Result<int> {
    PMSNAP_RETURN_IF_ERROR(a.AgreeOnStatus(Status::Ok()));
    return r;
  });
  for (const auto& f : fine) EXPECT_TRUE(f.ok());
}

TEST(EpochAgreementTest, CreateRejectsAMissingCoordinator) {
  auto agreement = EpochAgreement::Create(nullptr);
  ASSERT_FALSE(agreement.ok());
  EXPECT_EQ(agreement.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::runtime
