// Engines of several ranks (threads here, each with its own pool and model)
// agreeing through a Coordinator: they capture the same iterations, open and
// fail together, and restore the newest iteration every rank holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/temp_pool.h"
#include "testutil/test_devices.h"
#include "testutil/thread_coordinator.h"
#include "testutil/toy_model.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;

// One pool path and one model per rank.
struct Ranks {
  explicit Ranks(int world, const std::string& name, int units = 3) {
    for (int r = 0; r < world; ++r) {
      paths.push_back(std::make_unique<TempPoolPath>(name + "-rank" + std::to_string(r)));
      models.push_back(std::make_unique<ToyModel>(units, 4000));
    }
  }
  int world() const { return static_cast<int>(paths.size()); }
  const std::string& path(int r) const { return paths[r]->path(); }

  std::vector<std::unique_ptr<TempPoolPath>> paths;
  std::vector<std::unique_ptr<ToyModel>> models;
};

EngineOptions RankOptions(const std::string& path, std::shared_ptr<Coordinator> coordinator,
                          std::shared_ptr<IntervalPolicy> policy) {
  EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 16 << 10;
  options.workers = 1;
  options.print_summary = false;
  options.coordinator = std::move(coordinator);
  options.policy = std::move(policy);
  return options;
}

// Runs body(rank, coordinator) on one thread per rank of a fresh group.
void OnRanks(int world, const std::function<void(int, std::shared_ptr<Coordinator>)>& body) {
  auto group = std::make_shared<testutil::ThreadGroup>(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { body(r, group->Rank(r)); });
  for (auto& t : threads) t.join();
}

// The iterations of a pool's complete slots, newest first.
std::vector<std::uint64_t> SlotIterations(const std::string& path) {
  auto pool = layout::Pool::Open(path);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  std::vector<std::uint64_t> out;
  if (!pool.ok()) return out;
  std::vector<layout::SlotInfo> slots{(*pool)->slot_info(0), (*pool)->slot_info(1)};
  std::sort(slots.begin(), slots.end(), [](auto& a, auto& b) { return a.epoch > b.epoch; });
  for (const auto& s : slots) {
    if (s.state == layout::SlotState::kComplete) out.push_back(s.iteration);
  }
  return out;
}

// Trains `steps` steps from `first` on every rank with `policy_for(rank)`;
// rank `slow_rank` copies through a slow simulated link.
void Train(Ranks& ranks, std::uint64_t first, std::uint64_t steps,
           const std::function<std::shared_ptr<IntervalPolicy>()>& policy, int slow_rank = -1,
           bool restore = false) {
  OnRanks(ranks.world(), [&](int r, std::shared_ptr<Coordinator> c) {
    SimulatedDeviceOptions slow;
    slow.copy_bandwidth_gbps = 0.05;  // 48 KiB per unit: ~1 ms a copy
    SimulatedDevice slow_device(slow);
    EngineOptions options = RankOptions(ranks.path(r), c, policy());
    if (r == slow_rank) options.device = &slow_device;
    auto engine = Engine::Open(options, ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    if (restore) {
      auto restored = (*engine)->Restore();
      ASSERT_TRUE(restored.ok()) << restored.status().ToString();
      EXPECT_EQ(restored->iteration, first - 1);
    }
    for (std::uint64_t k = first; k < first + steps; ++k) {
      ASSERT_TRUE(ranks.models[r]->Step(**engine, k).ok()) << "rank " << r << " step " << k;
    }
    ASSERT_TRUE((*engine)->Close().ok());
  });
}

TEST(EngineRanksTest, RanksCaptureTheSameIterationsUnderASlowRank) {
  Ranks ranks(3, "ranks-same");
  Train(ranks, 1, 40, [] { return std::make_shared<ContinuousPolicy>(); }, /*slow_rank=*/1);
  const auto reference = SlotIterations(ranks.path(0));
  ASSERT_EQ(reference.size(), 2u);
  for (int r = 0; r < ranks.world(); ++r) {
    EXPECT_EQ(SlotIterations(ranks.path(r)), reference) << "rank " << r;
    auto pool = layout::Pool::Open(ranks.path(r));
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ(ranks.models[r]->CompareWithHistory(*(*pool)->Latest()), "") << r;
    EXPECT_EQ((*pool)->group().world_size, 3u);
    EXPECT_EQ((*pool)->group().rank, static_cast<std::uint32_t>(r));
  }
}

TEST(EngineRanksTest, EveryStepPolicyCapturesEveryIterationOnEveryRank) {
  Ranks ranks(2, "ranks-every");
  Train(ranks, 1, 12, [] { return std::make_shared<EveryKPolicy>(1); }, /*slow_rank=*/0);
  for (int r = 0; r < ranks.world(); ++r) {
    EXPECT_EQ(SlotIterations(ranks.path(r)), (std::vector<std::uint64_t>{12, 11})) << r;
  }
}

// Rank `rank` alone commits iteration `step`, as a rank does that is one
// epoch ahead of the others when the job dies.
void CommitOneMoreAlone(Ranks& ranks, int rank, std::uint64_t step) {
  EngineOptions alone = RankOptions(ranks.path(rank), nullptr, std::make_shared<EveryKPolicy>(1));
  auto engine = Engine::Open(alone, ranks.models[rank]->Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE(ranks.models[rank]->Step(**engine, step).ok());
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(EngineRanksTest, RestoreRollsBackTheRankThatIsOneEpochAhead) {
  Ranks ranks(2, "ranks-ahead");
  Train(ranks, 1, 10, [] { return std::make_shared<EveryKPolicy>(1); });
  // Rank 1 committed iteration 11 before the job died; rank 0 did not.
  CommitOneMoreAlone(ranks, 1, 11);
  ASSERT_EQ(SlotIterations(ranks.path(1)), (std::vector<std::uint64_t>{11, 10}));
  // Fresh models: everything they hold after the restore came from the pools.
  Ranks restarted(2, "unused");
  for (int r = 0; r < 2; ++r) restarted.paths[r] = std::move(ranks.paths[r]);
  Train(restarted, 11, 3, [] { return std::make_shared<EveryKPolicy>(1); }, -1, /*restore=*/true);
  // Rank 1's iteration 11 was overwritten by the new 11, then by 13; every
  // rank's pool holds the same iterations again.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(SlotIterations(restarted.path(r)), (std::vector<std::uint64_t>{13, 12})) << r;
  }
}

TEST(EngineRanksTest, RestoreAfterRollbackContinuesBitExact) {
  Ranks ranks(2, "ranks-exact");
  Train(ranks, 1, 6, [] { return std::make_shared<EveryKPolicy>(1); });
  CommitOneMoreAlone(ranks, 1, 7);
  // An uninterrupted reference for both ranks: restore of 6, then steps 7, 8.
  ToyModel reference(3, 4000);
  for (std::uint64_t k = 1; k <= 8; ++k) reference.StepPlain(k);
  Ranks restarted(2, "unused");
  for (int r = 0; r < 2; ++r) restarted.paths[r] = std::move(ranks.paths[r]);
  Train(restarted, 7, 2, [] { return std::make_shared<EveryKPolicy>(1); }, -1, /*restore=*/true);
  for (int r = 0; r < 2; ++r) {
    auto pool = layout::Pool::Open(restarted.path(r));
    ASSERT_TRUE(pool.ok());
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(latest->iteration(), 8u);
    EXPECT_EQ(reference.CompareWithHistory(*latest), "") << "rank " << r;
  }
}

TEST(EngineRanksTest, AForeignPoolFailsEveryRankNamingIt) {
  Ranks ranks(2, "ranks-foreign");
  Ranks other(2, "ranks-other");
  Train(ranks, 1, 3, [] { return std::make_shared<EveryKPolicy>(1); });
  Train(other, 1, 3, [] { return std::make_shared<EveryKPolicy>(1); });
  std::filesystem::copy_file(other.path(1), ranks.path(1),
                             std::filesystem::copy_options::overwrite_existing);
  std::vector<Status> seen(2);
  OnRanks(2, [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(RankOptions(ranks.path(r), c, nullptr),
                               ranks.models[r]->Registrations());
    seen[r] = engine.status();
  });
  for (const Status& s : seen) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
    EXPECT_NE(s.message().find("rank 1: pool '" + ranks.path(1) + "' belongs to run"),
              std::string::npos)
        << s.message();
  }
}

TEST(EngineRanksTest, AFailingRankStopsEveryRankAtTheSameStep) {
  Ranks ranks(3, "ranks-fail");
  std::vector<std::uint64_t> failed_at(3, 0);
  std::vector<Status> seen(3);
  OnRanks(3, [&](int r, std::shared_ptr<Coordinator> c) {
    pmsnap::testing::FailingDevice failing(/*successes=*/10);
    EngineOptions options = RankOptions(ranks.path(r), c, std::make_shared<EveryKPolicy>(1));
    if (r == 2) options.device = &failing;
    auto engine = Engine::Open(options, ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    for (std::uint64_t k = 1; k <= 40; ++k) {
      Status s = ranks.models[r]->Step(**engine, k);
      if (!s.ok()) {
        failed_at[r] = k;
        seen[r] = s;
        break;
      }
    }
    (void)(*engine)->Close(CloseMode::kAbandon);
  });
  EXPECT_NE(seen[2].code(), StatusCode::kOk);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(seen[r].code(), StatusCode::kAborted) << seen[r].ToString();
    EXPECT_NE(seen[r].message().find("rank 2 failed"), std::string::npos) << seen[r].message();
  }
  // Ranks 0 and 1 hear of it at the boundary after the one where rank 2 did.
  EXPECT_GT(failed_at[2], 0u);
  EXPECT_EQ(failed_at[0], failed_at[1]);
  EXPECT_LE(failed_at[0], failed_at[2] + 1);
}

// The copies of the epoch that captures step `failing_step` fail, and each
// returns its failure only once the training thread has asked the policy
// about the next step, which BeginStep does after its check for errors
// recorded earlier. So the rank learns of its failure where every-k waits
// for its epoch inside the ranks' exchange, on every run; a failure recorded
// before that check would be reported by the check itself.
class FailingEpochGate {
 public:
  explicit FailingEpochGate(std::uint64_t failing_step) : failing_step_(failing_step) {}
  void Asked(std::uint64_t step) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      asked_ = step;
    }
    asked_changed_.notify_all();
  }
  void Opened(std::uint64_t step) {
    std::lock_guard<std::mutex> lock(mutex_);
    opened_ = step;
  }
  // Whether a copy starting now fails; a failing one first waits for the
  // next step's boundary.
  bool FailCopy() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (opened_ < failing_step_) return false;
    asked_changed_.wait(lock, [&] { return asked_ > failing_step_; });
    return true;
  }

 private:
  const std::uint64_t failing_step_;
  std::mutex mutex_;
  std::condition_variable asked_changed_;
  std::uint64_t asked_ = 0;
  std::uint64_t opened_ = 0;
};

class GatedEveryStepPolicy final : public IntervalPolicy {
 public:
  explicit GatedEveryStepPolicy(FailingEpochGate& gate) : gate_(gate) {}
  std::string name() const override { return "every-1"; }
  bool ShouldCheckpoint(std::uint64_t step, const PolicyInputs&) override {
    gate_.Asked(step);
    return true;
  }
  bool wait_if_busy() const override { return true; }
  void OnEpochStarted(std::uint64_t step) override { gate_.Opened(step); }

 private:
  FailingEpochGate& gate_;
};

class GatedFailingDevice final : public pmsnap::testing::MemcpyDevice {
 public:
  explicit GatedFailingDevice(FailingEpochGate& gate) : MemcpyDevice(1 << 20), gate_(gate) {}
  std::string name() const override { return "gated-failing"; }
  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override {
    if (gate_.FailCopy()) return Status(StatusCode::kIOError, "injected copy failure");
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }

 private:
  FailingEpochGate& gate_;
};

TEST(EngineRanksTest, TheFailingRankReportsItsOwnErrorAndTheOthersNameIt) {
  Ranks ranks(3, "ranks-own-error");
  std::vector<Status> seen(3);
  OnRanks(3, [&](int r, std::shared_ptr<Coordinator> c) {
    FailingEpochGate gate(/*failing_step=*/4);
    GatedFailingDevice failing(gate);
    EngineOptions options = RankOptions(ranks.path(r), c, std::make_shared<EveryKPolicy>(1));
    if (r == 2) {
      options.device = &failing;
      options.policy = std::make_shared<GatedEveryStepPolicy>(gate);
    }
    auto engine = Engine::Open(options, ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    for (std::uint64_t k = 1; k <= 40 && seen[r].ok(); ++k) {
      seen[r] = ranks.models[r]->Step(**engine, k);
    }
    (void)(*engine)->Close(CloseMode::kAbandon);
  });
  // The cause, with the rank and pool it happened in; not only "rank 2
  // failed its checkpoint".
  EXPECT_EQ(seen[2].code(), StatusCode::kIOError) << seen[2].ToString();
  EXPECT_NE(seen[2].message().find("injected copy failure"), std::string::npos)
      << seen[2].message();
  EXPECT_NE(seen[2].message().find("rank 2, pool '" + ranks.path(2) + "'"), std::string::npos)
      << seen[2].message();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(seen[r].code(), StatusCode::kAborted) << seen[r].ToString();
    EXPECT_NE(seen[r].message().find("rank 2 failed"), std::string::npos) << seen[r].message();
  }
}

TEST(EngineRanksTest, ALostPoolIsCorruptionOnEveryRankNotAFreshStart) {
  Ranks ranks(2, "ranks-lost");
  Train(ranks, 1, 3, [] { return std::make_shared<EveryKPolicy>(1); });
  std::filesystem::remove(ranks.path(0));
  std::vector<Status> seen(2);
  OnRanks(2, [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(RankOptions(ranks.path(r), c, nullptr),
                               ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    seen[r] = (*engine)->Restore().status();
  });
  for (const Status& s : seen) {
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find("rank 0: its pool holds no intact checkpoint while other ranks'"),
              std::string::npos)
        << s.message();
  }
}

// Every rank's Restore() status, each on an engine opened on its pool.
std::vector<Status> RestoreOnEveryRank(Ranks& ranks) {
  std::vector<Status> seen(ranks.world());
  OnRanks(ranks.world(), [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(RankOptions(ranks.path(r), c, nullptr),
                               ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    seen[r] = (*engine)->Restore().status();
    ASSERT_TRUE((*engine)->Close().ok());
  });
  return seen;
}

TEST(EngineRanksTest, AKillBeforeOneRanksFirstCommitIsAFreshStartThatForgetsTheLoneEpoch) {
  Ranks ranks(2, "ranks-first");
  // The job creates every rank's pool, then dies after rank 0 committed
  // iteration 1 and before rank 1 did: no epoch was committed by both.
  for (const Status& s : RestoreOnEveryRank(ranks)) EXPECT_EQ(s.code(), StatusCode::kNotFound);
  CommitOneMoreAlone(ranks, 0, 1);
  ASSERT_EQ(SlotIterations(ranks.path(0)), (std::vector<std::uint64_t>{1}));
  Ranks restarted(2, "unused");
  for (int r = 0; r < 2; ++r) restarted.paths[r] = std::move(ranks.paths[r]);
  for (const Status& s : RestoreOnEveryRank(restarted)) {
    EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
    EXPECT_NE(s.message().find("rank 1's pool never committed one"), std::string::npos)
        << s.message();
  }
  // Forgotten, so that it cannot pose as an iteration of the new start.
  EXPECT_EQ(SlotIterations(restarted.path(0)), (std::vector<std::uint64_t>{}));
  // The new start checkpoints and restores as any run does.
  Train(restarted, 1, 3, [] { return std::make_shared<EveryKPolicy>(1); });
  Ranks resumed(2, "unused");
  for (int r = 0; r < 2; ++r) resumed.paths[r] = std::move(restarted.paths[r]);
  Train(resumed, 4, 2, [] { return std::make_shared<EveryKPolicy>(1); }, -1, /*restore=*/true);
  ToyModel reference(3, 4000);
  for (std::uint64_t k = 1; k <= 5; ++k) reference.StepPlain(k);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(SlotIterations(resumed.path(r)), (std::vector<std::uint64_t>{5, 4})) << r;
    auto pool = layout::Pool::Open(resumed.path(r));
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ(reference.CompareWithHistory(*(*pool)->Latest()), "") << "rank " << r;
  }
}

TEST(EngineRanksTest, APoolReplacedBesideFirstEpochsStaysCorruptionOnEveryRetry) {
  Ranks ranks(2, "ranks-replaced");
  Train(ranks, 1, 1, [] { return std::make_shared<EveryKPolicy>(1); });
  ASSERT_EQ(SlotIterations(ranks.path(1)), (std::vector<std::uint64_t>{1}));
  std::filesystem::remove(ranks.path(1));
  // The first restart creates rank 1's pool beside rank 0's checkpoint; the
  // next finds it without one, and must not take it for a rank that never
  // committed.
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (const Status& s : RestoreOnEveryRank(ranks)) {
      EXPECT_EQ(s.code(), StatusCode::kCorruption) << "attempt " << attempt << ": " << s.ToString();
      EXPECT_NE(s.message().find("rank 1: its pool holds no intact checkpoint"), std::string::npos)
          << s.message();
    }
  }
  auto replaced = layout::Pool::Open(ranks.path(1));
  ASSERT_TRUE(replaced.ok());
  EXPECT_TRUE((*replaced)->group().created_beside_checkpoints);
  EXPECT_EQ(SlotIterations(ranks.path(0)), (std::vector<std::uint64_t>{1}));
}

TEST(EngineRanksTest, CheckFreqIsRefusedWithSeveralRanks) {
  Ranks ranks(2, "ranks-checkfreq");
  std::vector<Status> seen(2);
  OnRanks(2, [&](int r, std::shared_ptr<Coordinator> c) {
    seen[r] = Engine::Open(RankOptions(ranks.path(r), c, std::make_shared<CheckFreqPolicy>()),
                           ranks.models[r]->Registrations())
                  .status();
  });
  for (const Status& s : seen) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("continuous or every-k"), std::string::npos) << s.message();
  }
}

// --- sharded replicated state (EngineOptions::shard_replicated_state) ---

EngineOptions ShardedOptions(const std::string& path, std::shared_ptr<Coordinator> coordinator,
                             int replicas) {
  EngineOptions options = RankOptions(path, std::move(coordinator), std::make_shared<EveryKPolicy>(1));
  options.shard_replicated_state = true;
  options.replicas = replicas;
  return options;
}

// Steps [first, first + steps) on every rank of a sharded run, each step's
// extra state naming the step; restores first if `restore` (checking the
// iteration and extra state) and leaves each rank's model in `ranks`.
void TrainSharded(Ranks& ranks, int replicas, std::uint64_t first, std::uint64_t steps,
                  bool restore, std::vector<Stats>* stats = nullptr) {
  if (stats) stats->assign(ranks.world(), Stats{});
  OnRanks(ranks.world(), [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(ShardedOptions(ranks.path(r), c, replicas),
                               ranks.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    EXPECT_EQ((*engine)->unit_count(), ranks.models[r]->unit_count());
    if (restore) {
      auto restored = (*engine)->Restore();
      ASSERT_TRUE(restored.ok()) << "rank " << r << ": " << restored.status().ToString();
      EXPECT_EQ(restored->iteration, first - 1);
      const std::string extra(reinterpret_cast<const char*>(restored->extra_state.data()),
                              restored->extra_state.size());
      EXPECT_EQ(extra, "step " + std::to_string(first - 1)) << "rank " << r;
    }
    for (std::uint64_t k = first; k < first + steps; ++k) {
      ASSERT_TRUE(ranks.models[r]->Step(**engine, k, -1, "step " + std::to_string(k)).ok())
          << "rank " << r << " step " << k;
    }
    ASSERT_TRUE((*engine)->Flush().ok());
    if (stats) (*stats)[r] = (*engine)->stats();
    ASSERT_TRUE((*engine)->Close().ok());
  });
}

// The unit names a pool holds.
std::vector<std::string> PoolUnits(const std::string& path) {
  auto pool = layout::Pool::Open(path);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  std::vector<std::string> names;
  if (pool.ok()) {
    for (const auto& unit : (*pool)->manifest().units) names.push_back(unit.name);
  }
  return names;
}

// Moves `ranks`' pools to ranks with fresh, zeroed models: after a restore
// they hold only what came from the pools and the broadcasts.
Ranks Restarted(Ranks& ranks, int units) {
  Ranks restarted(ranks.world(), "unused", units);
  for (int r = 0; r < ranks.world(); ++r) {
    restarted.paths[r] = std::move(ranks.paths[r]);
    restarted.models[r]->Zero();
  }
  return restarted;
}

TEST(EngineShardedRanksTest, EachUnitIsWrittenByItsOwnerOnly) {
  constexpr int kUnits = 6;
  Ranks ranks(2, "sharded-owners", kUnits);
  std::vector<Stats> stats;
  TrainSharded(ranks, /*replicas=*/1, 1, 5, false, &stats);
  const auto units0 = PoolUnits(ranks.path(0));
  const auto units1 = PoolUnits(ranks.path(1));
  EXPECT_FALSE(units0.empty());
  EXPECT_FALSE(units1.empty());
  EXPECT_EQ(units0.size() + units1.size(), static_cast<std::size_t>(kUnits));
  for (const auto& name : units0) {
    EXPECT_EQ(std::find(units1.begin(), units1.end(), name), units1.end()) << name;
  }
  // Each rank wrote its share of the model per checkpoint, not all of it.
  std::uint64_t model_bytes = 0;
  for (std::size_t u = 0; u < kUnits; ++u) model_bytes += (4000 + u * 17) * 2 * 4 + 8;
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(stats[r].epochs_committed, 5u) << r;
    EXPECT_LT(stats[r].bytes_written, 5 * model_bytes * 2 / 3) << r;
  }
  EXPECT_EQ(stats[0].bytes_written + stats[1].bytes_written, 5 * model_bytes);
}

TEST(EngineShardedRanksTest, RestoreBroadcastsEveryUnitAndContinuesBitExact) {
  constexpr int kUnits = 5;
  Ranks ranks(3, "sharded-restore", kUnits);
  TrainSharded(ranks, 1, 1, 6, false);
  ToyModel reference(kUnits, 4000);
  for (std::uint64_t k = 1; k <= 9; ++k) reference.StepPlain(k);
  Ranks restarted = Restarted(ranks, kUnits);
  // Restore 6 (every rank's models equal the reference's step 6), then 7-9.
  OnRanks(3, [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(ShardedOptions(restarted.path(r), c, 1),
                               restarted.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto restored = (*engine)->Restore();
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    EXPECT_EQ(restored->iteration, 6u);
    EXPECT_EQ(restarted.models[r]->CompareLive(reference, 6), "") << "rank " << r;
    for (std::uint64_t k = 7; k <= 9; ++k) {
      ASSERT_TRUE(restarted.models[r]->Step(**engine, k).ok());
    }
    ASSERT_TRUE((*engine)->Close().ok());
    EXPECT_EQ(restarted.models[r]->CompareLive(reference, 9), "") << "rank " << r;
  });
}

TEST(EngineShardedRanksTest, WithTwoReplicasAnyDeletedPoolStillRestoresBitExact) {
  constexpr int kUnits = 6;
  for (int lost = 0; lost < 3; ++lost) {
    SCOPED_TRACE("lost pool of rank " + std::to_string(lost));
    Ranks ranks(3, "sharded-replicas", kUnits);
    TrainSharded(ranks, /*replicas=*/2, 1, 4, false);
    std::filesystem::remove(ranks.path(lost));
    ToyModel reference(kUnits, 4000);
    for (std::uint64_t k = 1; k <= 6; ++k) reference.StepPlain(k);
    Ranks restarted = Restarted(ranks, kUnits);
    // Restores 4 with extra state "step 4" on every rank (the lost one gets
    // a peer's), then trains 5 and 6.
    TrainSharded(restarted, 2, 5, 2, /*restore=*/true);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(restarted.models[r]->CompareLive(reference, 6), "") << "rank " << r;
    }
    // The replaced pool holds its units again: a second restore needs no peer for them.
    EXPECT_EQ(SlotIterations(restarted.path(lost)), (std::vector<std::uint64_t>{6, 5}));
  }
}

TEST(EngineShardedRanksTest, ALostPoolWithoutReplicasFailsEveryRankNamingAUnit) {
  Ranks ranks(2, "sharded-lost", 4);
  TrainSharded(ranks, 1, 1, 3, false);
  std::filesystem::remove(ranks.path(1));
  Ranks restarted = Restarted(ranks, 4);
  std::vector<Status> seen(2);
  OnRanks(2, [&](int r, std::shared_ptr<Coordinator> c) {
    auto engine = Engine::Open(ShardedOptions(restarted.path(r), c, 1),
                               restarted.models[r]->Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    seen[r] = (*engine)->Restore().status();
  });
  for (const Status& s : seen) {
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_NE(s.message().find("is written by rank 1 alone, which does not hold it"),
              std::string::npos)
        << s.message();
  }
}

TEST(EngineShardedRanksTest, AnotherReplicaCountIsRefusedOnEveryRank) {
  Ranks ranks(2, "sharded-replica-change", 4);
  TrainSharded(ranks, 1, 1, 2, false);
  std::vector<Status> seen(2);
  OnRanks(2, [&](int r, std::shared_ptr<Coordinator> c) {
    seen[r] = Engine::Open(ShardedOptions(ranks.path(r), c, 2), ranks.models[r]->Registrations())
                  .status();
  });
  for (const Status& s : seen) EXPECT_EQ(s.code(), StatusCode::kModelMismatch) << s.ToString();
}

TEST(EngineShardedRanksTest, MoreRanksThanUnitsIsRefusedOnEveryRank) {
  Ranks ranks(3, "sharded-few-units", 2);
  std::vector<Status> seen(3);
  OnRanks(3, [&](int r, std::shared_ptr<Coordinator> c) {
    seen[r] = Engine::Open(ShardedOptions(ranks.path(r), c, 1), ranks.models[r]->Registrations())
                  .status();
  });
  for (const Status& s : seen) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("leaves rank 2 no unit to write"), std::string::npos)
        << s.message();
  }
}

}  // namespace
}  // namespace pmsnap::runtime
