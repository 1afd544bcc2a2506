// Conflict strategies 1-4 and the adaptive selector on a simulated device slow
// enough that conflicts really happen: every committed epoch must equal the
// model at rest at that iteration, with ample device memory and under
// memory pressure.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "pmsnap/conflict/strategies.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/temp_pool.h"
#include "testutil/toy_model.h"

namespace pmsnap::conflict {
namespace {

using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;
using runtime::Stats;

struct Case {
  std::string strategy;
  std::uint64_t device_memory;
};

// Runs 30 continuous-mode steps; after random steps flushes and checks the
// newest epoch against the model history. Returns the final stats.
Stats RunAndCheck(const Case& c, ToyModel& model, const std::string& pool_path) {
  runtime::SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 0.4;
  sim.in_device_bandwidth_gbps = 50;
  sim.memory_bytes = c.device_memory;
  runtime::SimulatedDevice device(sim);
  runtime::EngineOptions options;
  options.pool_path = pool_path;
  options.pool_options.part_bytes = 16 << 10;
  options.device = &device;
  options.strategy = MakeStrategy(c.strategy);
  EXPECT_NE(options.strategy, nullptr);
  auto engine = runtime::Engine::Open(options, model.Registrations());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  std::mt19937 rng(11);
  int checks = 0;
  for (std::uint64_t k = 1; k <= 30; ++k) {
    Status status = model.Step(**engine, k);
    EXPECT_TRUE(status.ok()) << status.ToString();
    if (rng() % 5 == 0) {
      EXPECT_TRUE((*engine)->Flush().ok());
      auto latest = (*engine)->pool().Latest();
      EXPECT_TRUE(latest.ok());
      if (latest.ok()) {
        EXPECT_EQ(model.CompareWithHistory(*latest), "") << c.strategy << " after step " << k;
        ++checks;
      }
    }
  }
  EXPECT_TRUE((*engine)->Close().ok());
  EXPECT_GT(checks, 2);
  Stats stats = (*engine)->stats();
  EXPECT_EQ(device.free_bytes(), c.device_memory) << "device buffers leaked";
  return stats;
}

std::uint64_t Count(const Stats& stats, StrategyChoice choice) {
  std::uint64_t total = 0;
  for (const auto& unit : stats.units) total += unit.strategy_counts[static_cast<int>(choice)];
  return total;
}

class StrategyCorrectnessTest : public ::testing::TestWithParam<Case> {};

TEST_P(StrategyCorrectnessTest, EveryCommittedEpochEqualsTheModelAtRest) {
  TempPoolPath path("conflict");
  ToyModel model(5, 30000);
  const Case& c = GetParam();
  Stats stats = RunAndCheck(c, model, path.path());
  EXPECT_GT(stats.conflicts, 0u) << stats.Summary();
  EXPECT_GE(stats.epochs_committed, 2u) << stats.Summary();
  const bool ample = c.device_memory >= (8u << 20);
  if (c.strategy == "1" && ample) {
    EXPECT_GT(Count(stats, StrategyChoice::kInDeviceCopy), 0u);
    EXPECT_EQ(stats.in_device_fallbacks, 0u);
    EXPECT_GT(stats.peak_device_extra_bytes, 0u);
  }
  if (c.strategy == "1" && !ample) {
    EXPECT_GT(stats.in_device_fallbacks, 0u) << stats.Summary();
    EXPECT_GT(Count(stats, StrategyChoice::kWaitSnapshot), 0u);
  }
  if (c.strategy == "2") {
    EXPECT_EQ(stats.peak_device_extra_bytes, 0u);
  }
  if (c.strategy == "3") {
    EXPECT_GT(Count(stats, StrategyChoice::kPartsOnConflict), 0u);
  }
  if (c.strategy == "4" && ample) {
    EXPECT_GT(Count(stats, StrategyChoice::kSplitGroups), 0u);
  }
  if (c.strategy == "adaptive") {
    const std::uint64_t in_device = Count(stats, StrategyChoice::kInDeviceCopy);
    const std::uint64_t split =
        Count(stats, StrategyChoice::kSplitGroups) + Count(stats, StrategyChoice::kPartsOnConflict);
    if (ample) {
      EXPECT_GT(in_device, 0u) << "conflicts seen and memory free: strategy 1 expected";
    } else {
      EXPECT_GT(split, 0u) << "conflicts seen, memory short: strategy 3 or 4 expected";
    }
  }
  EXPECT_LE(stats.peak_device_extra_bytes, c.device_memory);
}

INSTANTIATE_TEST_SUITE_P(AllStrategies, StrategyCorrectnessTest,
                         ::testing::Values(Case{"1", 64u << 20}, Case{"2", 64u << 20},
                                           Case{"3", 64u << 20}, Case{"4", 64u << 20},
                                           Case{"adaptive", 64u << 20},
                                           // Memory pressure: less than the largest unit (~240 KB).
                                           Case{"1", 100u << 10}, Case{"3", 100u << 10},
                                           Case{"4", 100u << 10}, Case{"adaptive", 100u << 10}),
                         [](const auto& info) {
                           return (info.param.strategy == "adaptive"
                                       ? std::string("adaptive")
                                       : "strategy" + info.param.strategy) +
                                  (info.param.device_memory >= (8u << 20) ? "_ample" : "_pressure");
                         });

TEST(AdaptiveDecisionTest, FollowsTheSlidesRule) {
  UnitProfile calm;
  calm.bytes = 1000;
  calm.copy_seconds = 0.001;
  calm.next_update_gap_seconds = 0.1;
  EXPECT_EQ(AdaptiveStrategy::Decide(&calm, 1000, 1 << 20, true), StrategyChoice::kWaitSnapshot);
  UnitProfile busy = calm;
  busy.copy_seconds = 0.5;
  EXPECT_EQ(AdaptiveStrategy::Decide(&busy, 1000, 1 << 20, true), StrategyChoice::kInDeviceCopy);
  EXPECT_EQ(AdaptiveStrategy::Decide(&busy, 1000, 10, true), StrategyChoice::kSplitGroups);
  busy.next_update_gap_seconds = -1;
  busy.conflicted = true;
  EXPECT_EQ(AdaptiveStrategy::Decide(&busy, 1000, 10, true), StrategyChoice::kPartsOnConflict);
  EXPECT_EQ(AdaptiveStrategy::Decide(nullptr, 1000, 1 << 20, true), StrategyChoice::kInDeviceCopy);
  EXPECT_EQ(AdaptiveStrategy::Decide(nullptr, 1000, 10, true), StrategyChoice::kPartsOnConflict);
  // A unit that conflicted two epochs ago is not trusted to stay calm yet.
  EXPECT_EQ(AdaptiveStrategy::Decide(&calm, 1000, 1 << 20, true, 2), StrategyChoice::kInDeviceCopy);
  EXPECT_EQ(AdaptiveStrategy::Decide(&calm, 1000, 1 << 20, true, 3), StrategyChoice::kWaitSnapshot);
  // Host-like device: in-device copies cost as much as direct ones.
  busy.conflicted = true;
  EXPECT_EQ(AdaptiveStrategy::Decide(&busy, 1000, 1 << 20, false), StrategyChoice::kWaitSnapshot);
  EXPECT_EQ(AdaptiveStrategy::Decide(nullptr, 1000, 1 << 20, false), StrategyChoice::kWaitSnapshot);
}

TEST(AdaptiveDecisionTest, AUnitThatConflictsAgainAfterCalmingDownWaitsLongerNextTime) {
  AdaptiveStrategy adaptive;
  UnitProfile profile;
  profile.unit = 0;
  profile.bytes = 1000;
  auto commit = [&](bool conflicted) {
    profile.conflicted = conflicted;
    adaptive.OnEpochCommitted({profile});
  };
  EXPECT_EQ(adaptive.calm_epochs_needed(0), AdaptiveStrategy::kCalmEpochsBeforeWaiting);
  commit(true);  // the first conflict: not a flap
  commit(true);  // still on the conflict path
  EXPECT_EQ(adaptive.calm_epochs_needed(0), 3u);
  for (int i = 0; i < 3; ++i) commit(false);  // calm long enough to wait again
  commit(true);                               // and conflicts: a flap
  EXPECT_EQ(adaptive.calm_epochs_needed(0), 6u);
  for (int flap = 0; flap < 6; ++flap) {
    for (std::uint32_t i = 0; i < adaptive.calm_epochs_needed(0); ++i) commit(false);
    commit(true);
  }
  EXPECT_EQ(adaptive.calm_epochs_needed(0), AdaptiveStrategy::kMaxCalmEpochsBeforeWaiting);
  EXPECT_EQ(AdaptiveStrategy::Decide(&profile, 1000, 1 << 20, true, 5, 6),
            StrategyChoice::kInDeviceCopy);
  profile.conflicted = false;
  profile.copy_seconds = 0.001;
  profile.next_update_gap_seconds = 0.1;
  EXPECT_EQ(AdaptiveStrategy::Decide(&profile, 1000, 1 << 20, true, 6, 6),
            StrategyChoice::kWaitSnapshot);
}

TEST(MakeStrategyTest, KnowsEveryNameAndRejectsOthers) {
  for (const char* name : {"1", "2", "3", "4", "adaptive"}) EXPECT_NE(MakeStrategy(name), nullptr);
  EXPECT_EQ(MakeStrategy("5"), nullptr);
}

}  // namespace
}  // namespace pmsnap::conflict
