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
      // Which strategy wins depends on the copy and update times the
      // selector measures, i.e. on this machine's speed and load (the
      // selector's own tests fix those times); with memory free, an
      // in-device copy it picks never falls back for lack of memory.
      EXPECT_EQ(stats.in_device_fallbacks, 0u) << stats.Summary();
      if (in_device > 0) {
        EXPECT_GT(stats.peak_device_extra_bytes, 0u);
      }
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

// The rule for a 1000-byte unit.
StrategyChoice DecideFor(const UnitProfile* last, std::uint64_t usable, bool pays,
                         std::uint32_t calm_epochs = AdaptiveStrategy::kNeverConflicted,
                         std::uint32_t calm_needed = AdaptiveStrategy::kCalmEpochsBeforeWaiting,
                         double in_device_copy_seconds = -1) {
  AdaptiveStrategy::DecisionInputs in;
  in.last = last;
  in.unit_bytes = 1000;
  in.usable_device_bytes = usable;
  in.in_device_copies_pay = pays;
  in.calm_epochs = calm_epochs;
  in.calm_needed = calm_needed;
  in.in_device_copy_seconds = in_device_copy_seconds;
  return AdaptiveStrategy::Decide(in);
}

TEST(AdaptiveDecisionTest, FollowsTheSlidesRule) {
  UnitProfile calm;
  calm.bytes = 1000;
  calm.copy_seconds = 0.001;
  calm.next_update_gap_seconds = 0.1;
  EXPECT_EQ(DecideFor(&calm, 1 << 20, true), StrategyChoice::kWaitSnapshot);
  UnitProfile busy = calm;
  busy.copy_seconds = 0.5;
  EXPECT_EQ(DecideFor(&busy, 1 << 20, true), StrategyChoice::kInDeviceCopy);
  EXPECT_EQ(DecideFor(&busy, 10, true), StrategyChoice::kSplitGroups);
  busy.next_update_gap_seconds = -1;
  busy.conflicted = true;
  EXPECT_EQ(DecideFor(&busy, 10, true), StrategyChoice::kPartsOnConflict);
  EXPECT_EQ(DecideFor(nullptr, 1 << 20, true), StrategyChoice::kPartsOnConflict);
  EXPECT_EQ(DecideFor(nullptr, 10, true), StrategyChoice::kPartsOnConflict);
  // A unit that conflicted two epochs ago is not trusted to stay calm yet.
  EXPECT_EQ(DecideFor(&calm, 1 << 20, true, 2), StrategyChoice::kInDeviceCopy);
  EXPECT_EQ(DecideFor(&calm, 1 << 20, true, 3), StrategyChoice::kWaitSnapshot);
  // With memory, but an in-device copy of the whole unit (0.2 s) would outlast
  // the 0.1 s to the next update: only what the link cannot move goes inside.
  EXPECT_EQ(DecideFor(&calm, 1 << 20, true, 0, 3, 0.2), StrategyChoice::kSplitGroups);
  EXPECT_EQ(DecideFor(&calm, 1 << 20, true, 0, 3, 0.01), StrategyChoice::kInDeviceCopy);
  // Host-like device: in-device copies cost as much as direct ones.
  busy.conflicted = true;
  EXPECT_EQ(DecideFor(&busy, 1 << 20, false), StrategyChoice::kWaitSnapshot);
  EXPECT_EQ(DecideFor(nullptr, 1 << 20, false), StrategyChoice::kWaitSnapshot);
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
  EXPECT_EQ(DecideFor(&profile, 1 << 20, true, 5, 6), StrategyChoice::kInDeviceCopy);
  profile.conflicted = false;
  profile.copy_seconds = 0.001;
  profile.next_update_gap_seconds = 0.1;
  EXPECT_EQ(DecideFor(&profile, 1 << 20, true, 6, 6), StrategyChoice::kWaitSnapshot);
}

// Strategy 1 that keeps the profiles the engine hands it.
class RecordingInDeviceStrategy final : public runtime::ConflictStrategy {
 public:
  std::string name() const override { return "recording " + inner_.name(); }
  Status OnCaptured(UnitTask& task) override { return inner_.OnCaptured(task); }
  Status Resolve(UnitTask& task) override { return inner_.Resolve(task); }
  StrategyChoice choice(std::uint32_t unit) const override { return inner_.choice(unit); }
  void OnEpochCommitted(const std::vector<UnitProfile>& profiles) override {
    seen.insert(seen.end(), profiles.begin(), profiles.end());
  }
  std::vector<UnitProfile> seen;

 private:
  InDeviceCopyStrategy inner_;
};

TEST(UnitProfileTest, InDeviceCopiesAreTimedIntoTheProfile) {
  TempPoolPath path("profile-in-device");
  ToyModel model(3, 200000);  // 1.6 MB units: 0.8 ms each inside the device
  runtime::SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 1;
  sim.in_device_bandwidth_gbps = 2;
  sim.memory_bytes = 64 << 20;
  runtime::SimulatedDevice device(sim);
  auto strategy = std::make_shared<RecordingInDeviceStrategy>();
  runtime::EngineOptions options;
  options.pool_path = path.path();
  options.device = &device;
  options.strategy = strategy;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  auto engine = runtime::Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 4; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  ASSERT_FALSE(strategy->seen.empty());
  for (const UnitProfile& profile : strategy->seen) {
    EXPECT_EQ(profile.in_device_bytes, profile.bytes) << "unit " << profile.unit;
    // 2 GB/s simulated: bytes / 2e9 seconds, less the early return of a
    // copy that ends under 100 us ahead of the modelled time.
    EXPECT_GE(profile.in_device_copy_seconds, profile.bytes / 2e9 - 100e-6)
        << "unit " << profile.unit;
  }
}

TEST(MakeStrategyTest, KnowsEveryNameAndRejectsOthers) {
  for (const char* name : {"1", "2", "3", "4", "adaptive"}) EXPECT_NE(MakeStrategy(name), nullptr);
  EXPECT_EQ(MakeStrategy("5"), nullptr);
}

}  // namespace
}  // namespace pmsnap::conflict
