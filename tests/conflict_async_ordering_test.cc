// The engine on a simulated GPU queue (SimulatedDeviceOptions::asynchronous):
// updates are queued kernels that run after the hooks returned, so every
// copy must wait for its unit's update event, and a conflict must make the
// compute stream wait for the copy instead of blocking the training thread
// (docs/ARCHITECTURE.md, "GPU ordering"). For strategies 1-4 and the
// adaptive selector: checkpoints and resumes are bit-exact, conflicts never
// block the host, and without conflicts the compute stream never waits for a
// copy. Ordering is forced with latches, not timing.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "pmsnap/conflict/strategies.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/latch.h"
#include "testutil/temp_pool.h"
#include "testutil/toy_model.h"

namespace pmsnap::conflict {
namespace {

using pmsnap::testing::Latch;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;
using runtime::SimulatedDevice;
using runtime::SimulatedDeviceOptions;

constexpr int kUnits = 4;
constexpr std::int64_t kFloats = 6000;
constexpr auto kHangGuard = std::chrono::seconds(60);

SimulatedDeviceOptions AsyncQueues() {
  SimulatedDeviceOptions sim;
  sim.asynchronous = true;
  sim.copy_bandwidth_gbps = 0.2;  // slow enough that copies are still in flight
  sim.in_device_bandwidth_gbps = 20;
  sim.memory_bytes = 64ull << 20;
  return sim;
}

runtime::EngineOptions Options(const std::string& path, SimulatedDevice& device,
                               const std::string& strategy) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 16 << 10;
  options.device = &device;
  options.strategy = MakeStrategy(strategy);
  options.print_summary = false;
  return options;
}

// A kernel that takes its time, as an optimizer step on a GPU does, so that
// the host runs ahead of the compute stream.
std::function<void()> Slow(std::function<void()> update) {
  return [update = std::move(update)] {
    std::this_thread::sleep_for(std::chrono::microseconds(300));
    update();
  };
}

class AsyncOrderingTest : public ::testing::TestWithParam<std::string> {};

TEST_P(AsyncOrderingTest, ConflictsWaitOnTheComputeStreamAndCheckpointsAndResumeStayBitExact) {
  TempPoolPath path("async-order-" + GetParam());
  ToyModel model(kUnits, kFloats), reference(kUnits, kFloats);
  SimulatedDevice device(AsyncQueues());
  auto engine = runtime::Engine::Open(Options(path.path(), device, GetParam()),
                                      model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();

  // Step 1 opens an epoch; its update kernels are held on the compute stream,
  // so none of its copies can start. Step 2 then conflicts on every unit: the
  // training thread must queue waits on the compute stream, not block (were
  // it to block, only the hang guard would open the latch).
  Latch step1_kernels;
  ASSERT_TRUE(model
                  .StepLaunched(**engine, 1,
                                [&](std::size_t, std::function<void()> update) {
                                  device.LaunchKernel([&step1_kernels, update] {
                                    step1_kernels.Wait();
                                    update();
                                  });
                                })
                  .ok());
  reference.StepPlain(1);
  step1_kernels.OpenAfter(kHangGuard);
  auto launch = [&](std::size_t, std::function<void()> update) {
    device.LaunchKernel(Slow(std::move(update)));
  };
  ASSERT_TRUE(model.StepLaunched(**engine, 2, launch).ok());
  reference.StepPlain(2);
  EXPECT_FALSE(step1_kernels.is_open()) << "step 2's conflicts blocked the training thread";
  step1_kernels.Open();
  ASSERT_TRUE((*engine)->Flush().ok());
  {
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(latest->iteration(), 1u);
    EXPECT_EQ(reference.CompareWithHistory(*latest), "");
    const runtime::Stats stats = (*engine)->stats();
    EXPECT_EQ(stats.conflicts, static_cast<std::uint64_t>(kUnits));
    EXPECT_GE(stats.device_queues.compute_waits_on_copies, stats.conflicts);
  }

  // Free-running: the compute stream lags the host, conflicts come and go.
  constexpr std::uint64_t kSteps = 24;
  for (std::uint64_t k = 3; k <= kSteps; ++k) {
    ASSERT_TRUE(model.StepLaunched(**engine, k, launch).ok());
    reference.StepPlain(k);
    if (k % 7 == 0) {
      ASSERT_TRUE((*engine)->Flush().ok());
      auto latest = (*engine)->pool().Latest();
      ASSERT_TRUE(latest.ok());
      EXPECT_EQ(reference.CompareWithHistory(*latest), "") << "after step " << k;
    }
  }
  ASSERT_TRUE((*engine)->Close().ok());
  device.SynchronizeCompute();
  // The waits conflicts queued kept every update in order.
  EXPECT_EQ(model.CompareLive(reference, kSteps), "");

  ToyModel restored(kUnits, kFloats);
  restored.Zero();
  auto reopened = runtime::Engine::Open(Options(path.path(), device, GetParam()),
                                        restored.Registrations());
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  auto result = (*reopened)->Restore();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_GE(result->iteration, 1u);
  EXPECT_EQ(restored.CompareLive(reference, result->iteration), "");
  ASSERT_TRUE((*reopened)->Close().ok());
}

// The first GPU run refused torch's default Adam: its `step` lives on the
// CPU beside GPU tensors. Such state is a host unit (UnitRegistration::
// on_host) copied by the CPU in the same epochs, while the GPU tensors go
// through the queued device; conflicts on both resolve, checkpoints and the
// restore are bit-exact, each tensor restored where it lives.
TEST_P(AsyncOrderingTest, HostStateBesideQueuedDeviceTensorsIsCheckpointedInTheSameEpoch) {
  TempPoolPath path("async-host-state-" + GetParam());
  ToyModel model(kUnits, kFloats), reference(kUnits, kFloats);
  SimulatedDevice device(AsyncQueues());
  auto engine = runtime::Engine::Open(Options(path.path(), device, GetParam()),
                                      model.RegistrationsWithHostSteps());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto launch = [&](std::size_t, std::function<void()> update) {
    device.LaunchKernel(Slow(std::move(update)));
  };
  constexpr std::uint64_t kSteps = 16;
  for (std::uint64_t k = 1; k <= kSteps; ++k) {
    ASSERT_TRUE(model.StepLaunchedWithHostSteps(**engine, k, launch).ok());
    reference.StepPlain(k);
    if (k % 5 == 0) {
      ASSERT_TRUE((*engine)->Flush().ok());
      auto latest = (*engine)->pool().Latest();
      ASSERT_TRUE(latest.ok());
      EXPECT_EQ(reference.CompareWithHistoryOfHostSteps(*latest), "") << "after step " << k;
    }
  }
  ASSERT_TRUE((*engine)->Close().ok());
  device.SynchronizeCompute();
  EXPECT_EQ(model.CompareLive(reference, kSteps), "");

  ToyModel restored(kUnits, kFloats);
  restored.Zero();
  auto reopened = runtime::Engine::Open(Options(path.path(), device, GetParam()),
                                        restored.RegistrationsWithHostSteps());
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  auto result = (*reopened)->Restore();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(restored.CompareLive(reference, result->iteration), "");
  ASSERT_TRUE((*reopened)->Close().ok());
}

TEST_P(AsyncOrderingTest, WithoutConflictsTheComputeStreamNeverWaitsForACopy) {
  TempPoolPath path("async-calm-" + GetParam());
  ToyModel model(kUnits, kFloats), reference(kUnits, kFloats);
  SimulatedDevice device(AsyncQueues());
  auto options = Options(path.path(), device, GetParam());
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  auto engine = runtime::Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 8; ++k) {
    ASSERT_TRUE(model
                    .StepLaunched(**engine, k,
                                  [&](std::size_t, std::function<void()> update) {
                                    device.LaunchKernel(Slow(std::move(update)));
                                  })
                    .ok());
    reference.StepPlain(k);
    // Every copy done before the next update: no conflict can arise.
    ASSERT_TRUE((*engine)->Flush().ok());
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    ASSERT_EQ(latest->iteration(), k);
    EXPECT_EQ(reference.CompareWithHistory(*latest), "") << "step " << k;
  }
  const runtime::Stats stats = (*engine)->stats();
  EXPECT_EQ(stats.conflicts, 0u);
  EXPECT_EQ(stats.epochs_committed, 8u);
  EXPECT_EQ(stats.device_queues.compute_waits_on_copies, 0u);
  EXPECT_EQ(stats.device_queues.compute_stalls, 0u);
  ASSERT_TRUE((*engine)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Strategies, AsyncOrderingTest,
                         ::testing::Values("1", "2", "3", "4", "adaptive"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return "strategy_" + info.param;
                         });

// Checkpoints every step of a one-unit model whose update kernel runs only
// once a copy of the step has settled (blocked on the update's event, or
// done without waiting for it). Returns per step "" or what differed from
// the model at rest.
std::vector<std::string> CheckpointWhileUpdatesAreQueued(bool copies_ignore_events) {
  TempPoolPath path(copies_ignore_events ? "async-bite-broken" : "async-bite");
  ToyModel model(1, kFloats), reference(1, kFloats);
  SimulatedDeviceOptions sim = AsyncQueues();
  sim.testing_copies_ignore_events = copies_ignore_events;
  SimulatedDevice device(sim);
  auto options = Options(path.path(), device, "2");
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  auto engine = runtime::Engine::Open(options, model.Registrations());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  std::vector<std::string> mismatches;
  if (!engine.ok()) return mismatches;
  for (std::uint64_t k = 1; k <= 4; ++k) {
    Status stepped = model.StepLaunched(
        **engine, k, [&](std::size_t, std::function<void()> update) {
          const std::uint64_t settled = device.copies_settled();
          device.LaunchKernel([&device, settled, update] {
            while (device.copies_settled() == settled) {
              std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
            update();
          });
        });
    EXPECT_TRUE(stepped.ok()) << stepped.ToString();
    reference.StepPlain(k);
    EXPECT_TRUE((*engine)->Flush().ok());
    auto latest = (*engine)->pool().Latest();
    EXPECT_TRUE(latest.ok());
    if (latest.ok()) mismatches.push_back(reference.CompareWithHistory(*latest));
  }
  EXPECT_TRUE((*engine)->Close().ok());
  return mismatches;
}

TEST(AsyncOrderingBiteTest, CheckpointsHoldTheUpdatedValuesWhenCopiesWaitForTheUpdateEvent) {
  for (const std::string& mismatch : CheckpointWhileUpdatesAreQueued(false)) {
    EXPECT_EQ(mismatch, "");
  }
}

// Proves the checks above bite: with the copies' wait for the update event
// removed, the same run checkpoints values from before the update.
TEST(AsyncOrderingBiteTest, RemovingTheCopysWaitForTheUpdateEventIsCaught) {
  const std::vector<std::string> mismatches = CheckpointWhileUpdatesAreQueued(true);
  ASSERT_FALSE(mismatches.empty());
  for (const std::string& mismatch : mismatches) EXPECT_NE(mismatch, "");
}

}  // namespace
}  // namespace pmsnap::conflict
