// Engine behaviour on raw buffers: epochs capture post-step values, conflicts
// wait for snapshots, errors surface on the training thread, close never
// hangs, restore is bit-exact.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/temp_pool.h"
#include "testutil/test_devices.h"
#include "testutil/toy_model.h"
#include "testutil/toy_model_checks.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::ExpectPoolMatchesHistory;
using pmsnap::testing::FailingDevice;
using pmsnap::testing::MemcpyDevice;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;
using ::testing::HasSubstr;

EngineOptions Options(const std::string& path) {
  EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 16 << 10;
  options.workers = 2;
  return options;
}

// Options(path) with a checkpoint at every step.
EngineOptions EveryStepOptions(const std::string& path) {
  EngineOptions options = Options(path);
  options.policy = std::make_shared<EveryKPolicy>(1);
  return options;
}

// A simulated device link slow enough that one unit's copy outlasts four
// steps' worth of updates on this machine, measured on a probe model of the
// same shape: the next step's update then finds the copy still in flight
// however fast the machine is, also under a sanitizer that slows every
// update 5-20x. Never faster than 0.3 GB/s.
double LinkSlowerThanTheSteps(int units, std::int64_t floats_per_unit) {
  ToyModel probe(units, floats_per_unit);
  constexpr int kSteps = 5;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t k = 1; k <= kSteps; ++k) {
    for (std::size_t u = 0; u < probe.unit_count(); ++u) probe.Update(u, k);
  }
  const double step_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kSteps;
  const double unit_bytes = 2.0 * sizeof(float) * static_cast<double>(floats_per_unit);
  return std::min(0.3, unit_bytes / (4 * step_seconds) / 1e9);
}

TEST(EngineTest, EveryStepWithFlushCommitsExactlyThePostStepValues) {
  TempPoolPath path("engine-every");
  ToyModel model(4, 20000);
  auto options = EveryStepOptions(path.path());
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 20; ++k) {
    ASSERT_TRUE(model.Step(**engine, k, k % 5 == 0 ? 2 : -1, "pos=" + std::to_string(k)).ok());
    ASSERT_TRUE((*engine)->Flush().ok());
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    ASSERT_EQ(latest->iteration(), k);
    ASSERT_EQ(model.CompareWithHistory(*latest), "") << "step " << k;
    std::string extra(reinterpret_cast<const char*>(latest->extra_state().data()),
                      latest->extra_state().size());
    ASSERT_EQ(extra, "pos=" + std::to_string(k));
  }
  Stats stats = (*engine)->stats();
  EXPECT_EQ(stats.epochs_committed, 20u);
  EXPECT_EQ(stats.steps, 20u);
  EXPECT_EQ(stats.blocked_per_step.size(), 20u);
  EXPECT_GT(stats.bytes_written, 20u * 4 * 20000 * 8);
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(EngineTest, ContinuousModeOnSlowDeviceConflictsAndStaysBitExact) {
  TempPoolPath path("engine-conflict");
  ToyModel model(6, 30000);
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = LinkSlowerThanTheSteps(6, 30000);  // the next update arrives first
  SimulatedDevice device(sim);
  auto options = Options(path.path());
  options.device = &device;
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  std::mt19937 rng(3);
  for (std::uint64_t k = 1; k <= 40; ++k) {
    ASSERT_TRUE(model.Step(**engine, k).ok());
    if (rng() % 8 == 0) {
      ASSERT_TRUE((*engine)->Flush().ok());
      auto latest = (*engine)->pool().Latest();
      ASSERT_TRUE(latest.ok());
      ASSERT_EQ(model.CompareWithHistory(*latest), "") << "after step " << k;
    }
  }
  ASSERT_TRUE((*engine)->Close().ok());
  Stats stats = (*engine)->stats();
  EXPECT_GT(stats.conflicts, 0u) << stats.Summary();
  EXPECT_GT(stats.conflict_wait_seconds, 0.0);
  EXPECT_GE(stats.epochs_committed, 3u);
  EXPECT_LT(stats.epochs_committed, 40u);  // continuous: skipped busy boundaries
  EXPECT_THAT(stats.Summary(), HasSubstr("simulated"));
  ExpectPoolMatchesHistory(path.path(), model, 1);
}

TEST(EngineTest, EveryKPolicyCapturesOnlyMultiplesOfK) {
  TempPoolPath path("engine-everyk");
  ToyModel model(3, 1000);
  auto options = Options(path.path());
  options.policy = std::make_shared<EveryKPolicy>(4);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  for (std::uint64_t k = 1; k <= 13; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ((*engine)->stats().epochs_committed, 3u);
  EXPECT_EQ((*engine)->stats().last_committed_iteration, 12u);
  ExpectPoolMatchesHistory(path.path(), model, 12);
}

TEST(EngineTest, RestoreCopiesTheNewestEpochIntoTheTensors) {
  TempPoolPath path("engine-restore");
  ToyModel model(3, 5000);
  {
    auto options = EveryStepOptions(path.path());
    auto engine = Engine::Open(options, model.Registrations());
    ASSERT_TRUE(engine.ok());
    for (std::uint64_t k = 1; k <= 7; ++k) ASSERT_TRUE(model.Step(**engine, k, -1, "rng").ok());
  }
  ToyModel fresh(3, 5000);
  fresh.Zero();
  auto engine = Engine::Open(Options(path.path()), fresh.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto restored = (*engine)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 7u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(restored->extra_state.data()),
                        restored->extra_state.size()),
            "rng");
  // Training continues from the restored values exactly like the original.
  fresh.StepPlain(8);
  model.StepPlain(8);
  EXPECT_EQ(fresh.CompareLive(8), model.CompareLive(8));
  EXPECT_EQ(fresh.CompareLive(8), "");
}

// Where unit `unit`'s first tensor lies in the file, per slot.
struct UnitInFile {
  std::uint64_t offset[2] = {0, 0};
};

// Trains `steps` iterations with a checkpoint every step and closes; returns
// where `unit` lies, for fault injection.
UnitInFile TrainAndCommitEveryStep(const std::string& path, ToyModel& model, int steps,
                                   std::uint32_t unit) {
  auto options = Options(path);
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return {};
  for (int k = 1; k <= steps; ++k) EXPECT_TRUE(model.Step(**engine, k).ok());
  const layout::FileRegions regions = (*engine)->pool().regions();
  const std::uint64_t in_slot = (*engine)->pool().layout().units[unit].tensors[0].slot_offset;
  EXPECT_TRUE((*engine)->Close().ok());
  return {{regions.slot_data[0].offset + in_slot, regions.slot_data[1].offset + in_slot}};
}

class RestoreDeviceTest : public ::testing::TestWithParam<const char*> {};

// On the host the checksums are computed inside the copy; other devices check
// the source, then copy.
TEST_P(RestoreDeviceTest, RestoreOfADamagedNewestEpochRestoresTheOlderOneBitwise) {
  auto device = MakeDevice(GetParam());
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  TempPoolPath path("engine-restore-damaged");
  ToyModel model(3, 5000);
  const UnitInFile unit2 = TrainAndCommitEveryStep(path.path(), model, 6, 2);
  // Epoch 6 (slot 0) loses a bit in its last unit; epoch 5 (slot 1) is intact.
  pmsnap::testing::FlipBit(path.path(), unit2.offset[0] + 100);
  std::vector<std::string> warnings;
  layout::SetWarningSink([&](const std::string& w) { warnings.push_back(w); });
  ToyModel fresh(3, 5000);
  fresh.Zero();
  EngineOptions options = Options(path.path());
  options.device = device->get();
  auto engine = Engine::Open(options, fresh.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_TRUE(warnings.empty()) << "data is verified in the restore's copy, not at open";
  auto restored = (*engine)->Restore();
  layout::SetWarningSink(nullptr);
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 5u);
  EXPECT_EQ(fresh.CompareLive(model, 5), "");
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_THAT(warnings[0], HasSubstr("falling back"));
  EXPECT_THAT(warnings[0], HasSubstr("block2.weight"));
  // Training goes on from there and its next checkpoint replaces the damaged one.
  ASSERT_TRUE(fresh.Step(**engine, 6).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  ExpectPoolMatchesHistory(path.path(), fresh, 6);
}

TEST_P(RestoreDeviceTest, RestoreWithoutVerificationCopiesTheNewestEpochBitwise) {
  auto device = MakeDevice(GetParam());
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  TempPoolPath path("engine-restore-unverified");
  ToyModel model(3, 5000);
  TrainAndCommitEveryStep(path.path(), model, 6, 0);
  ToyModel fresh(3, 5000);
  fresh.Zero();
  EngineOptions options = Options(path.path());
  options.device = device->get();
  options.verify_on_open = false;
  auto engine = Engine::Open(options, fresh.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_FALSE((*engine)->pool().data_verification_pending()) << "the unverified copy is tested";
  auto restored = (*engine)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 6u);
  EXPECT_EQ(fresh.CompareLive(model, 6), "");
  ASSERT_TRUE((*engine)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(Devices, RestoreDeviceTest, ::testing::Values("host", "simulated:50:64"),
                         [](const auto& info) {
                           return std::string(info.param).substr(0, info.param[0] == 'h' ? 4 : 9);
                         });

TEST(EngineTest, RestoreWithBothEpochsDamagedIsCorruption) {
  TempPoolPath path("engine-restore-both-damaged");
  ToyModel model(2, 5000);
  const UnitInFile unit1 = TrainAndCommitEveryStep(path.path(), model, 4, 1);
  pmsnap::testing::FlipBit(path.path(), unit1.offset[0] + 100);
  pmsnap::testing::FlipBit(path.path(), unit1.offset[1] + 100);
  layout::SetWarningSink([](const std::string&) {});
  ToyModel fresh(2, 5000);
  auto engine = Engine::Open(Options(path.path()), fresh.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto restored = (*engine)->Restore();
  layout::SetWarningSink(nullptr);
  EXPECT_EQ(restored.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(restored.status().message(), HasSubstr("no committed slot verifies"));
  EXPECT_EQ((*engine)->Restore().status().code(), StatusCode::kNotFound);
}

TEST(EngineTest, TrainingWithoutRestoreStillKeepsTheIntactEpochOfADamagedPool) {
  TempPoolPath path("engine-no-restore-damaged");
  ToyModel model(2, 5000);
  const UnitInFile unit0 = TrainAndCommitEveryStep(path.path(), model, 4, 0);
  pmsnap::testing::FlipBit(path.path(), unit0.offset[0] + 100);  // epoch 4
  layout::SetWarningSink([](const std::string&) {});
  {
    // A fresh start over the pool: its first epoch must go into the damaged
    // slot, never over epoch 3, the only intact one. Killed before committing.
    ToyModel restart(2, 5000);
    auto engine = Engine::Open(Options(path.path()), restart.Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->BeginStep(1).ok());
    ASSERT_TRUE((*engine)->Close(CloseMode::kAbandon).ok());
  }
  auto pool = layout::Pool::Open(path.path());
  layout::SetWarningSink(nullptr);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_TRUE((*pool)->Latest().ok());
  EXPECT_EQ((*pool)->Latest()->iteration(), 3u);
  EXPECT_EQ(model.CompareWithHistory(*(*pool)->Latest()), "");
}

TEST(EngineTest, RestoreOnAnEmptyPoolIsNotFound) {
  TempPoolPath path("engine-restore-empty");
  ToyModel model(2, 100);
  auto engine = Engine::Open(Options(path.path()), model.Registrations());
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->Restore().status().code(), StatusCode::kNotFound);
}

TEST(EngineTest, RestoreAfterTrainingStartedIsRefused) {
  TempPoolPath path("engine-restore-late");
  ToyModel model(2, 100);
  auto engine = Engine::Open(Options(path.path()), model.Registrations());
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE(model.Step(**engine, 1).ok());
  EXPECT_EQ((*engine)->Restore().status().code(), StatusCode::kFailedPrecondition);
}

TEST(EngineTest, PoolOfAnotherModelNamesTheUnit) {
  TempPoolPath path("engine-mismatch");
  {
    ToyModel model(3, 100);
    ASSERT_TRUE(Engine::Open(Options(path.path()), model.Registrations()).ok());
  }
  ToyModel other(3, 101);  // every tensor one element longer
  auto engine = Engine::Open(Options(path.path()), other.Registrations());
  EXPECT_EQ(engine.status().code(), StatusCode::kModelMismatch);
  EXPECT_THAT(engine.status().message(), HasSubstr("block0.weight"));
  EXPECT_THAT(engine.status().message(), HasSubstr("shape"));
}

TEST(EngineTest, BadRegistrationsAreRejected) {
  TempPoolPath path("engine-bad");
  ToyModel model(2, 100);
  auto units = model.Registrations();
  units[1].tensors[0].data = nullptr;
  auto engine = Engine::Open(Options(path.path()), units);
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(engine.status().message(), HasSubstr("block1.weight"));
  EXPECT_EQ(Engine::Open(Options(path.path()), {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path.path()));
}

TEST(EngineTest, ExtraStateOverCapacityAbandonsThatEpochOnly) {
  TempPoolPath path("engine-extra");
  ToyModel model(2, 100);
  auto options = Options(path.path());
  options.pool_options.extra_state_capacity = 8;
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE(model.Step(**engine, 1, -1, "ok").ok());
  Status too_big = model.Step(**engine, 2, -1, "far too long");
  EXPECT_EQ(too_big.code(), StatusCode::kCapacityExceeded);
  ASSERT_TRUE(model.Step(**engine, 3, -1, "ok3").ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ((*engine)->stats().epochs_committed, 2u);
  EXPECT_EQ((*engine)->stats().epochs_abandoned, 1u);
  ExpectPoolMatchesHistory(path.path(), model, 3);
}

TEST(EngineTest, WorkerErrorSurfacesAtTheNextHookAndPoolKeepsLastCommit) {
  TempPoolPath path("engine-ioerror");
  ToyModel model(3, 1000);
  FailingDevice device(/*successes=*/9 * 2);  // two epochs of 9 parts each
  auto options = Options(path.path());
  options.device = &device;
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  Status status;
  std::uint64_t k = 1;
  for (; k <= 10 && status.ok(); ++k) status = model.Step(**engine, k);
  EXPECT_EQ(status.code(), StatusCode::kIOError) << status.ToString();
  EXPECT_THAT(status.message(), HasSubstr("injected copy failure"));
  EXPECT_THAT(status.message(), HasSubstr("block"));
  EXPECT_FALSE((*engine)->Close().ok());
  ExpectPoolMatchesHistory(path.path(), model, 2);
}

TEST(EngineTest, CloseInsideAStepAbandonsTheEpochAndNeverHangs) {
  TempPoolPath path("engine-close-mid");
  ToyModel model(3, 1000);
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 0.05;
  SimulatedDevice device(sim);
  auto options = Options(path.path());
  options.device = &device;
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE(model.Step(**engine, 1).ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  // Step 2 "throws" after updating one unit: no EndStep.
  ASSERT_TRUE((*engine)->BeginStep(2).ok());
  ASSERT_TRUE((*engine)->BeforeUpdate(2).ok());
  model.Update(2, 2);
  ASSERT_TRUE((*engine)->AfterUpdate(2).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ((*engine)->stats().epochs_abandoned, 1u);
  ExpectPoolMatchesHistory(path.path(), model, 1);
}

TEST(EngineTest, CloseAbandonDropsAnEndedEpoch) {
  TempPoolPath path("engine-close-abandon");
  ToyModel model(3, 1000);
  auto options = EveryStepOptions(path.path());
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE(model.Step(**engine, 1).ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  ASSERT_TRUE(model.Step(**engine, 2).ok());
  ASSERT_TRUE((*engine)->Close(CloseMode::kAbandon).ok());
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  // Either the epoch finished before the abandon request or it was dropped;
  // both leave a consistent, committed epoch.
  ASSERT_TRUE((*pool)->Latest().ok());
  EXPECT_EQ(model.CompareWithHistory(*(*pool)->Latest()), "");
}

// Notes the CPU each worker copy ran on.
class CpuRecordingDevice final : public MemcpyDevice {
 public:
  CpuRecordingDevice() : MemcpyDevice(1ull << 30) {}
  std::string name() const override { return "cpu-recording"; }
  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    cpus_.insert(sched_getcpu());
    return Status::Ok();
  }
  std::set<int> cpus() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cpus_;
  }

 private:
  std::mutex mutex_;
  std::set<int> cpus_;
};

TEST(EngineTest, WorkerCpusPinTheWorkersThatCopy) {
  TempPoolPath path("engine-pinned");
  ToyModel model(4, 20000);
  CpuRecordingDevice device;
  auto options = Options(path.path());
  options.device = &device;
  options.policy = std::make_shared<EveryKPolicy>(1);
  const int worker_cpu = AllowedCpus().back();
  options.worker_cpus = {worker_cpu};
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 5; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ(device.cpus(), std::set<int>{worker_cpu});
  EXPECT_EQ((*engine)->stats().epochs_committed, 5u);
  ExpectPoolMatchesHistory(path.path(), model, 5);
}

TEST(EngineTest, WorkerCpuTheMachineDoesNotHaveIsNamed) {
  TempPoolPath path("engine-pinned-bad");
  ToyModel model(1, 100);
  if (ConfiguredCpus() >= CPU_SETSIZE) GTEST_SKIP() << "every CPU slot exists";
  auto options = Options(path.path());
  options.worker_cpus = {0, ConfiguredCpus()};
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(engine.status().message(),
              HasSubstr("EngineOptions::worker_cpus: CPU " + std::to_string(ConfiguredCpus()) +
                        " does not exist"));
}

// Bytes of fully persisted units, polled until at least `bytes` or
// `patience` is over.
std::uint64_t BytesWrittenWithin(const Engine& engine, std::uint64_t bytes,
                                 std::chrono::milliseconds patience) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  std::uint64_t written = engine.stats().bytes_written;
  while (written < bytes && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    written = engine.stats().bytes_written;
  }
  return written;
}

std::uint64_t UnitBytes(const Engine& engine) {
  std::uint64_t bytes = 0;
  for (const UnitStats& unit : engine.stats().units) bytes += unit.bytes;
  return bytes;
}

struct CopyStartCase {
  const char* name;
  bool host;  // the host device, or a copying non-host device
  CopyStart copy_start;
  bool copies_during_step;
};

class CopyStartTest : public ::testing::TestWithParam<CopyStartCase> {};

// Whether a step's units are copied while the step still runs. Either way
// the epoch holds exactly the post-step values.
TEST_P(CopyStartTest, CopiesStartWhereTheOptionSays) {
  const CopyStartCase& c = GetParam();
  TempPoolPath path(std::string("engine-copy-start-") + c.name);
  ToyModel model(4, 20000);
  CpuRecordingDevice device;  // any copying non-host device
  auto options = Options(path.path());
  if (!c.host) options.device = &device;
  options.copy_start = c.copy_start;
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const std::uint64_t all = UnitBytes(**engine);
  for (std::uint64_t k = 1; k <= 3; ++k) {
    ASSERT_TRUE((*engine)->Flush().ok());
    const std::uint64_t before = (*engine)->stats().bytes_written;
    ASSERT_TRUE(model
                    .Step(**engine, k, -1, "",
                          [&] {
                            // Every unit is updated: all of them, or none, get
                            // copied before EndStep.
                            const std::uint64_t during =
                                BytesWrittenWithin(**engine, before + all,
                                                   c.copies_during_step
                                                       ? std::chrono::milliseconds(20000)
                                                       : std::chrono::milliseconds(300)) -
                                before;
                            EXPECT_EQ(during, c.copies_during_step ? all : 0u) << "step " << k;
                          })
                    .ok());
    ASSERT_TRUE((*engine)->Flush().ok());
    EXPECT_EQ((*engine)->stats().bytes_written, before + all);
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok()) << latest.status().ToString();
    EXPECT_EQ(latest->iteration(), k);
    EXPECT_EQ(model.CompareWithHistory(*latest), "") << "step " << k;
  }
  ASSERT_TRUE((*engine)->Close().ok());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CopyStartTest,
    ::testing::Values(CopyStartCase{"HostAfterStep", true, CopyStart::kAfterStep, false},
                      CopyStartCase{"HostAfterUpdate", true, CopyStart::kAfterUpdate, true},
                      CopyStartCase{"DeviceAuto", false, CopyStart::kAuto, true},
                      CopyStartCase{"DeviceAfterStep", false, CopyStart::kAfterStep, false}),
    [](const auto& info) { return std::string(info.param.name); });

// kAuto on the host: with time between steps (forward and backward) for the
// workers to copy a whole step's captures, they all wait for EndStep, once a
// committed epoch measured the workers' rate.
TEST(EngineTest, OnTheHostCopiesThatFitBetweenStepsWaitForTheEndOfTheStep) {
  TempPoolPath path("engine-auto-hold");
  ToyModel model(4, 20000);
  auto options = EveryStepOptions(path.path());
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const std::uint64_t all = UnitBytes(**engine);
  for (std::uint64_t k = 1; k <= 4; ++k) {
    ASSERT_TRUE((*engine)->Flush().ok());
    const std::uint64_t written = (*engine)->stats().bytes_written;
    const std::uint64_t held = (*engine)->stats().held_bytes;
    ASSERT_TRUE(model
                    .Step(**engine, k, -1, "",
                          [&] {
                            if (k < 3) return;  // the rate is known after epoch 1
                            EXPECT_EQ(BytesWrittenWithin(**engine, written + all,
                                                         std::chrono::milliseconds(300)),
                                      written)
                                << "step " << k;
                          })
                    .ok());
    if (k >= 3) {
      EXPECT_EQ((*engine)->stats().held_bytes - held, all) << "step " << k;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // "forward and backward"
  }
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_THAT((*engine)->stats().Summary(), HasSubstr("copied after their step"));
  ExpectPoolMatchesHistory(path.path(), model, 4);
}

// kAuto on the host with no time between steps: nothing can be copied
// there, so captures are copied right away, as with kAfterUpdate. (A unit
// is 32 MB: only a multi-millisecond preemption between two steps would
// let one wait, and never the first of a step.)
TEST(EngineTest, OnTheHostBackToBackStepsCopyRightAfterEachUpdate) {
  TempPoolPath path("engine-auto-no-hold");
  ToyModel model(4, 4000000);
  auto options = EveryStepOptions(path.path());
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 6; ++k) {
    ASSERT_TRUE((*engine)->BeginStep(k).ok());
    for (std::uint32_t u = 0; u < model.unit_count(); ++u) {
      ASSERT_TRUE((*engine)->BeforeUpdate(u).ok());
      ASSERT_TRUE((*engine)->AfterUpdate(u).ok());  // no update: only the timing matters
    }
    ASSERT_TRUE((*engine)->EndStep().ok());
  }
  ASSERT_TRUE((*engine)->Close().ok());
  const Stats stats = (*engine)->stats();
  EXPECT_GE(stats.epochs_committed, 2u);
  EXPECT_LT(stats.held_bytes, stats.bytes_written / 4) << stats.Summary();
}

// kAuto on the host holds the step's last captures, never its first: the
// bytes held in a step are always those of a tail of the capture order (the
// units differ in size, so each tail has its own sum). With a few
// milliseconds between steps and 32 MB units, some steps hold part of the
// model; how many depends on the machine's copy rate.
TEST(EngineTest, OnTheHostOnlyTheLastCapturesOfAStepWait) {
  TempPoolPath path("engine-auto-tail");
  ToyModel model(4, 4000000);
  auto options = EveryStepOptions(path.path());
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  std::vector<std::uint64_t> unit_bytes;
  for (const UnitStats& unit : (*engine)->stats().units) unit_bytes.push_back(unit.bytes);
  // Captured in the order 3, 2, 1, 0: the tails are {0}, {1, 0}, {2, 1, 0}, all.
  std::set<std::uint64_t> tails = {0};
  std::uint64_t tail = 0;
  for (std::uint64_t bytes : unit_bytes) tails.insert(tail += bytes);
  int partial = 0;
  for (std::uint64_t k = 1; k <= 12; ++k) {
    const std::uint64_t held_before = (*engine)->stats().held_bytes;
    ASSERT_TRUE((*engine)->BeginStep(k).ok());
    for (std::uint32_t u = 4; u-- > 0;) {
      ASSERT_TRUE((*engine)->BeforeUpdate(u).ok());
      ASSERT_TRUE((*engine)->AfterUpdate(u).ok());
    }
    ASSERT_TRUE((*engine)->EndStep().ok());
    const std::uint64_t held = (*engine)->stats().held_bytes - held_before;
    EXPECT_TRUE(tails.count(held)) << "step " << k << " held " << held << " bytes, not a tail";
    partial += held > 0 && held < tail;
    std::this_thread::sleep_for(std::chrono::milliseconds(4));  // "forward and backward"
  }
  ASSERT_TRUE((*engine)->Close().ok());
  std::cout << "steps holding part of the model: " << partial << " of 12\n";
}

// Copies released at EndStep over a slow link: the next step's updates
// conflict with them and wait, and every commit stays exact.
TEST(EngineTest, CopiesHeldForTheEndOfTheStepStayExactUnderConflicts) {
  TempPoolPath path("engine-held-conflicts");
  ToyModel model(6, 30000);
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = LinkSlowerThanTheSteps(6, 30000);
  SimulatedDevice device(sim);
  auto options = Options(path.path());
  options.device = &device;
  options.copy_start = CopyStart::kAfterStep;
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 20; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  const Stats stats = (*engine)->stats();
  EXPECT_GT(stats.conflicts, 0u) << stats.Summary();
  EXPECT_GT(stats.held_bytes, 0u);
  EXPECT_GE(stats.epochs_committed, 2u);
  ExpectPoolMatchesHistory(path.path(), model, 1);
}

// Parts held for EndStep of a step that never ends are released with the
// abandoned epoch: Close returns and the pool keeps its last commit.
TEST(EngineTest, AbandonedStepWithHeldCopiesKeepsTheLastCommit) {
  TempPoolPath path("engine-held-abandon");
  ToyModel model(4, 20000);
  auto options = Options(path.path());
  options.copy_start = CopyStart::kAfterStep;
  options.policy = std::make_shared<EveryKPolicy>(1);
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE(model.Step(**engine, 1).ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  ASSERT_TRUE((*engine)->BeginStep(2).ok());
  for (std::uint32_t u = 0; u < 2; ++u) {
    ASSERT_TRUE((*engine)->BeforeUpdate(u).ok());
    model.Update(u, 2);
    ASSERT_TRUE((*engine)->AfterUpdate(u).ok());
  }
  ASSERT_TRUE((*engine)->Close(CloseMode::kAbandon).ok());
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_TRUE((*pool)->Latest().ok());
  EXPECT_EQ((*pool)->Latest()->iteration(), 1u);
  EXPECT_EQ(model.CompareWithHistory(*(*pool)->Latest()), "");
}

// A strategy whose preparation of one unit fails once (e.g. device memory
// it could not get).
class FailingPreparationStrategy final : public ConflictStrategy {
 public:
  explicit FailingPreparationStrategy(std::uint32_t unit) : unit_(unit) {}
  std::string name() const override { return "failing-preparation"; }
  Status OnCaptured(UnitTask& task) override {
    if (task.unit() != unit_ || failed_.exchange(true)) return Status::Ok();
    return Status(StatusCode::kIOError, "injected preparation failure");
  }
  Status Resolve(UnitTask& task) override {
    task.WaitSnapshotted();
    return Status::Ok();
  }
  StrategyChoice choice(std::uint32_t) const override { return StrategyChoice::kWaitSnapshot; }

 private:
  std::uint32_t unit_;
  std::atomic<bool> failed_{false};
};

// EndStep captures the units the step did not update; one failing must not
// leave the others uncaptured (the epoch would never finish and Close would
// hang): the error surfaces and the pool keeps its last commit.
TEST(EngineTest, CaptureFailureAtEndStepFailsTheEpochWithoutHanging) {
  TempPoolPath path("engine-endstep-capture-failure");
  ToyModel model(3, 1000);
  auto options = EveryStepOptions(path.path());
  options.strategy = std::make_shared<FailingPreparationStrategy>(0);
  options.copy_start = CopyStart::kAfterStep;
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->BeginStep(1).ok());
  ASSERT_TRUE((*engine)->BeforeUpdate(2).ok());
  model.Update(2, 1);
  ASSERT_TRUE((*engine)->AfterUpdate(2).ok());
  // Units 0 (fails) and 1 are captured here.
  EXPECT_EQ((*engine)->EndStep().code(), StatusCode::kIOError);
  EXPECT_EQ((*engine)->BeginStep(2).code(), StatusCode::kIOError);  // the error stays
  EXPECT_EQ((*engine)->Close().code(), StatusCode::kIOError);
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->Latest().status().code(), StatusCode::kNotFound);
}

TEST(EngineTest, HookMisuseIsAnErrorNotACrash) {
  TempPoolPath path("engine-misuse");
  ToyModel model(2, 100);
  auto engine = Engine::Open(Options(path.path()), model.Registrations());
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->EndStep().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*engine)->BeginStep(1).ok());
  EXPECT_EQ((*engine)->BeginStep(2).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*engine)->BeforeUpdate(99).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*engine)->EndStep().ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ((*engine)->BeginStep(3).code(), StatusCode::kFailedPrecondition);
}

TEST(CheckFreqPolicyTest, EngineAdaptsTheIntervalFromMeasurements) {
  TempPoolPath path("engine-checkfreq");
  ToyModel model(4, 50000);
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 0.5;
  sim.memory_bytes = 0;  // no in-device copies: CPU mode
  SimulatedDevice device(sim);
  auto policy = std::make_shared<CheckFreqPolicy>(0.035);
  auto options = Options(path.path());
  options.device = &device;
  options.policy = policy;
  auto engine = Engine::Open(options, model.Registrations());
  ASSERT_TRUE(engine.ok());
  for (std::uint64_t k = 1; k <= 30; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  // Copies take far longer than a toy step: the policy backs off.
  EXPECT_GT(policy->interval(), 1u);
  EXPECT_LT((*engine)->stats().epochs_committed, 30u);
  EXPECT_THAT((*engine)->stats().policy, HasSubstr("checkfreq"));
  ExpectPoolMatchesHistory(path.path(), model, 1);
}

}  // namespace
}  // namespace pmsnap::runtime
