// Continuous mode with host-memory staging (EngineOptions::
// dram_staging_buffers): a boundary that finds the previous epoch still
// persisting is captured into host memory and persisted right after that
// epoch commits. Every committed epoch still holds exactly its own step's
// values, a staged epoch commits after the one before it, closing never
// hangs, and configurations staging cannot serve are refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/temp_pool.h"
#include "testutil/toy_model.h"
#include "testutil/toy_model_checks.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::ExpectNewestEpochMatchesHistory;
using pmsnap::testing::ExpectPoolMatchesHistory;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;
using ::testing::HasSubstr;

constexpr int kUnits = 4;
constexpr std::int64_t kFloats = 50000;

// A simulated PM write rate at which one epoch of the toy model outlasts
// about four steps, measured on a probe of the same shape: boundaries then
// find the epoch in flight however fast this machine is (also under a
// sanitizer). Never faster than 0.3 GB/s.
double PmSlowerThanTheSteps() {
  ToyModel probe(kUnits, kFloats);
  constexpr int kSteps = 5;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t k = 1; k <= kSteps; ++k) probe.StepPlain(k);
  const double step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kSteps;
  const double model_bytes = kUnits * 2.0 * sizeof(float) * static_cast<double>(kFloats);
  return std::min(0.3, model_bytes / (4 * step_seconds) / 1e9);
}

EngineOptions StagingOptions(const std::string& path, int buffers) {
  EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 64 << 10;
  options.pool_options.pm_bandwidth.write_gbps = PmSlowerThanTheSteps();
  options.workers = 2;
  options.dram_staging_buffers = buffers;
  options.print_summary = false;
  return options;
}

std::unique_ptr<Engine> OpenOrDie(const EngineOptions& options, ToyModel& model) {
  auto engine = Engine::Open(options, model.Registrations());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(*engine) : nullptr;
}

// Steps from `k` on until a step is captured in host memory (at most 200
// steps); returns that step, or 0 if none was.
std::uint64_t StepUntilStaged(Engine& engine, ToyModel& model, std::uint64_t k) {
  for (const std::uint64_t last = k + 200; k < last; ++k) {
    const std::uint64_t staged_before = engine.stats().epochs_staged;
    if (!model.Step(engine, k).ok()) return 0;
    if (engine.stats().epochs_staged > staged_before) return k;
  }
  return 0;
}

// Trains `steps` steps; every ninth, and at the end, the newest epoch must
// hold its own step's values and be no older than the one checked before
// (Flush first: an epoch in flight could overwrite the slot compared).
void TrainCheckingEveryNinthStep(Engine& engine, ToyModel& model, std::uint64_t steps) {
  std::uint64_t checked = 0;
  for (std::uint64_t k = 1; k <= steps; ++k) {
    ASSERT_TRUE(model.Step(engine, k).ok());
    if (k % 9 == 0 || k == steps) {
      ASSERT_TRUE(engine.Flush().ok());
      ExpectNewestEpochMatchesHistory(engine.pool(), model, checked);
      checked = engine.pool().Latest()->iteration();
    }
  }
}

class StagingTest : public ::testing::TestWithParam<int> {};

TEST_P(StagingTest, EveryCommittedEpochHoldsItsOwnStepsValues) {
  TempPoolPath path("engine-staging");
  ToyModel model(kUnits, kFloats);
  auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
  ASSERT_NE(engine, nullptr);
  TrainCheckingEveryNinthStep(*engine, model, 120);
  const Stats stats = engine->stats();
  EXPECT_GT(stats.epochs_staged, 0u) << stats.Summary();
  EXPECT_GT(stats.epochs_committed, stats.epochs_staged) << stats.Summary();
  EXPECT_EQ(stats.epochs_abandoned, 0u);
  EXPECT_THAT(stats.Summary(), HasSubstr("staged in host memory"));
  ASSERT_TRUE(engine->Close().ok());
}

TEST_P(StagingTest, AStagedStepCommitsLastAndRestoresBitExactAfterLaterUpdates) {
  TempPoolPath path("engine-staging-restore");
  ToyModel model(kUnits, kFloats);
  std::uint64_t staged = 0;
  {
    auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
    ASSERT_NE(engine, nullptr);
    staged = StepUntilStaged(*engine, model, 1);
    ASSERT_NE(staged, 0u) << engine->stats().Summary();
    // The next step's updates must wait for the staged copies, not change
    // what the staged epoch persists.
    ASSERT_TRUE(model.Step(*engine, staged + 1).ok());
    ASSERT_TRUE(engine->Flush().ok());
    ExpectNewestEpochMatchesHistory(engine->pool(), model, staged);
    ASSERT_TRUE(engine->Close().ok());
  }
  ToyModel fresh(kUnits, kFloats);
  fresh.Zero();
  EngineOptions options = StagingOptions(path.path(), GetParam());
  auto engine = OpenOrDie(options, fresh);
  ASSERT_NE(engine, nullptr);
  auto restored = engine->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_GE(restored->iteration, staged);
  EXPECT_EQ(fresh.CompareLive(model, restored->iteration), "");
}

TEST_P(StagingTest, CloseAbandonWithAStagedEpochKeepsTheLastCommitAndNeverHangs) {
  TempPoolPath path("engine-staging-abandon");
  ToyModel model(kUnits, kFloats);
  auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
  ASSERT_NE(engine, nullptr);
  // One committed epoch to keep; abandoning drops everything after it.
  ASSERT_TRUE(model.Step(*engine, 1).ok());
  ASSERT_TRUE(engine->Flush().ok());
  ASSERT_NE(StepUntilStaged(*engine, model, 2), 0u);
  ASSERT_TRUE(engine->Close(CloseMode::kAbandon).ok());
  EXPECT_GE(engine->stats().epochs_abandoned, 1u) << engine->stats().Summary();
  ExpectPoolMatchesHistory(path.path(), model, 1);
}

TEST_P(StagingTest, CloseInsideAStagedStepAbandonsItAndFinishesTheEpochBefore) {
  TempPoolPath path("engine-staging-mid-step");
  ToyModel model(kUnits, kFloats);
  auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
  ASSERT_NE(engine, nullptr);
  // Steps until a boundary stages; that step then "throws" after one update.
  std::uint64_t k = 1;
  for (; k <= 200; ++k) {
    const std::uint64_t staged_before = engine->stats().epochs_staged;
    ASSERT_TRUE(engine->BeginStep(k).ok());
    if (engine->stats().epochs_staged > staged_before) break;
    for (std::uint32_t u = 0; u < kUnits; ++u) {
      ASSERT_TRUE(engine->BeforeUpdate(u).ok());
      model.Update(u, k);
      ASSERT_TRUE(engine->AfterUpdate(u).ok());
    }
    ASSERT_TRUE(engine->EndStep().ok());
  }
  ASSERT_LE(k, 200u) << engine->stats().Summary();
  ASSERT_TRUE(engine->CapturesThisStep());
  ASSERT_TRUE(engine->BeforeUpdate(0).ok());
  model.Update(0, k);
  ASSERT_TRUE(engine->AfterUpdate(0).ok());
  ASSERT_TRUE(engine->Close().ok());
  const Stats stats = engine->stats();
  EXPECT_EQ(stats.epochs_abandoned, 1u) << stats.Summary();
  EXPECT_EQ(stats.epochs_committed + 1, stats.epochs_started) << stats.Summary();
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_LT(latest->iteration(), k);
}

// Behind a device link (simulated), the staged copies cross the link into
// host memory on the device-stream thread, as slowly as the link allows:
// the next update of a unit waits for its copy there.
TEST(StagingDeviceTest, OnASimulatedDeviceStagedEpochsHoldTheirOwnStepsValues) {
  TempPoolPath path("engine-staging-simulated");
  ToyModel model(kUnits, kFloats);
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 0.3;
  SimulatedDevice device(sim);
  EngineOptions options = StagingOptions(path.path(), 2);
  options.device = &device;
  auto engine = OpenOrDie(options, model);
  ASSERT_NE(engine, nullptr);
  TrainCheckingEveryNinthStep(*engine, model, 60);
  const Stats stats = engine->stats();
  EXPECT_GT(stats.epochs_staged, 0u) << stats.Summary();
  EXPECT_THAT(stats.Summary(), HasSubstr("simulated"));
  ASSERT_TRUE(engine->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Buffers, StagingTest, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Buffers";
                         });

// Continuous mode skips a boundary that finds the epochs in flight, so the
// last step trained can be without an epoch (the H200 benchmark and
// TrainingState met that at close): CheckpointLastStep gives it one, bit-exact,
// with the extra state given, and does nothing more when called again. With
// 0, 1 and 2 staging buffers.
class LastStepTest : public ::testing::TestWithParam<int> {};

TEST_P(LastStepTest, CheckpointLastStepCommitsASkippedLastStepBitExact) {
  TempPoolPath path("engine-last-step");
  ToyModel model(kUnits, kFloats);
  std::uint64_t skipped = 0;
  const std::string extra = "the last step's extra state";
  const auto extra_bytes = std::as_bytes(std::span(extra.data(), extra.size()));
  {
    auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
    ASSERT_NE(engine, nullptr);
    // Nothing ran yet: nothing to checkpoint.
    ASSERT_TRUE(engine->CheckpointLastStep(extra_bytes).ok());
    EXPECT_EQ(engine->stats().epochs_started, 0u);
    for (std::uint64_t k = 1; k <= 200 && skipped == 0; ++k) {
      const std::uint64_t started_before = engine->stats().epochs_started;
      ASSERT_TRUE(model.Step(*engine, k).ok());
      if (engine->stats().epochs_started == started_before) skipped = k;
    }
    ASSERT_NE(skipped, 0u) << engine->stats().Summary();
    ASSERT_TRUE(engine->CheckpointLastStep(extra_bytes).ok());
    const std::uint64_t started = engine->stats().epochs_started;
    auto latest = engine->pool().Latest();
    ASSERT_TRUE(latest.ok()) << latest.status().ToString();
    EXPECT_EQ(latest->iteration(), skipped);
    EXPECT_EQ(model.CompareWithHistory(*latest), "");
    const auto stored = latest->extra_state();
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(stored.data()), stored.size()), extra);
    // The last step has its epoch now: a second call adds none.
    ASSERT_TRUE(engine->CheckpointLastStep(extra_bytes).ok());
    EXPECT_EQ(engine->stats().epochs_started, started);
    ASSERT_TRUE(engine->Close().ok());
    EXPECT_EQ(engine->stats().epochs_abandoned, 0u) << engine->stats().Summary();
  }
  ToyModel fresh(kUnits, kFloats);
  fresh.Zero();
  auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), fresh);
  ASSERT_NE(engine, nullptr);
  auto restored = engine->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, skipped);
  EXPECT_EQ(fresh.CompareLive(model, skipped), "");
}

TEST_P(LastStepTest, CheckpointLastStepInsideAStepOrAfterCloseIsRefused) {
  TempPoolPath path("engine-last-step-misuse");
  ToyModel model(kUnits, kFloats);
  auto engine = OpenOrDie(StagingOptions(path.path(), GetParam()), model);
  ASSERT_NE(engine, nullptr);
  ASSERT_TRUE(model.Step(*engine, 1).ok());
  ASSERT_TRUE(engine->BeginStep(2).ok());
  const Status inside = engine->CheckpointLastStep();
  EXPECT_EQ(inside.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(inside.message(), HasSubstr("inside step 2"));
  ASSERT_TRUE(engine->EndStep().ok());
  ASSERT_TRUE(engine->Close().ok());
  EXPECT_EQ(engine->CheckpointLastStep().code(), StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Buffers, LastStepTest, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "Buffers";
                         });

// An encoder that is never reached: Open refuses first.
class UnusedEncoder final : public Encoder {
 public:
  Status Attach(layout::ChunkHeap&, const layout::Manifest&, std::uint64_t,
                const std::vector<UnitRegistration>&, const std::vector<std::uint32_t>&,
                Device&) override {
    return Status::Ok();
  }
  Status OnCaptured(std::uint32_t, std::uint64_t, std::uint64_t) override { return Status::Ok(); }
  Status Encode(std::uint32_t, std::uint64_t) override { return Status::Ok(); }
  Status OnCommitted(std::uint64_t) override { return Status::Ok(); }
  void OnAbandoned(std::uint64_t) override {}
  Status Restore(std::uint32_t, std::uint64_t) override { return Status::Ok(); }
  std::uint64_t bytes_written() const override { return 0; }
};

TEST(StagingConfigurationTest, WhatStagingCannotServeIsRefusedByName) {
  TempPoolPath path("engine-staging-bad");
  ToyModel model(2, 1000);
  struct Case {
    std::string what;
    std::function<void(EngineOptions&, std::vector<UnitRegistration>&)> change;
    std::string expected;
  };
  const Case cases[] = {
      {"three buffers", [](EngineOptions& o, auto&) { o.dram_staging_buffers = 3; },
       "must be 0, 1 or 2"},
      {"negative", [](EngineOptions& o, auto&) { o.dram_staging_buffers = -1; },
       "must be 0, 1 or 2"},
      {"every-k",
       [](EngineOptions& o, auto&) { o.policy = std::make_shared<EveryKPolicy>(1); },
       "policy 'every-1' waits"},
      {"encoded unit",
       [](EngineOptions& o, std::vector<UnitRegistration>& units) {
         units[1].encoded = true;
         o.encoder = std::make_shared<UnusedEncoder>();
       },
       "unit 'block1.weight' is encoded"},
  };
  for (const Case& c : cases) {
    EngineOptions options;
    options.pool_path = path.path();
    options.dram_staging_buffers = 2;
    std::vector<UnitRegistration> units = model.Registrations();
    c.change(options, units);
    auto engine = Engine::Open(options, units);
    ASSERT_FALSE(engine.ok()) << c.what;
    EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(engine.status().message(), HasSubstr(c.expected)) << c.what;
    EXPECT_THAT(engine.status().message(), HasSubstr(path.path())) << c.what;
  }
}

}  // namespace
}  // namespace pmsnap::runtime
