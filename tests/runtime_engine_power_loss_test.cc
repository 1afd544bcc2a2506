// Power loss under the Engine's epoch flow, simulated at the persistence
// seam (testutil/engine_power_loss.h): a toy model of several units trains
// through the Engine's hooks (workers copy and persist parts from their own
// threads, the last release commits, units without a gradient are captured
// at EndStep, extra state goes with each epoch), closes, reopens, restores
// and trains on, and ends with an epoch abandoned at Close. Every image a
// power loss would leave at the commit record's writes, at sampled drains
// or at sampled seam calls between opens to the
// newest epoch whose commit returned (or the one in flight), and the
// Engine's restore brings back exactly what that epoch captured. On the host
// the parts go through the fused copy-and-hash kernel; on the simulated
// device through Pool::PartDestination, plain stores and SealPart; staged
// (continuous mode with host staging buffers on slow simulated PM), the
// next epoch begins on the worker that commits the one before it.
//
// A test-only switch that drops the drain before the commit word must be
// caught. $PMSNAP_POWER_LOSS_SCALE=N runs N times as many steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>

#include "detail/persistence.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/engine_power_loss.h"
#include "testutil/toy_model.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::CaptureDensity;
using pmsnap::testing::EnginePowerLossOutcome;
using pmsnap::testing::ExpectDroppedCommitDrainCaught;
using pmsnap::testing::PowerLossModel;
using pmsnap::testing::PowerLossScale;
using pmsnap::testing::ReportOutcome;
using pmsnap::testing::RunEnginePowerLoss;
using pmsnap::testing::ToyModel;

constexpr int kUnits = 3;
constexpr std::int64_t kFloats = 1500;  // 6 KB tensors: two parts of 4 KiB each

enum class Flow { kHostEveryStep, kSimulatedContinuous, kHostStaged };

// The ToyModel on the host (every-step policy), on the simulated device
// (continuous: busy boundaries are skipped, so epochs and steps drift
// apart), or on the host in continuous mode with two staging buffers and PM
// slow enough (1 MB/s, 36 ms an epoch) that boundaries find the epoch busy.
class ToyPowerLossModel final : public PowerLossModel {
 public:
  explicit ToyPowerLossModel(Flow flow) : flow_(flow), model_(kUnits, kFloats) {
    if (flow_ == Flow::kSimulatedContinuous) {
      device_ = std::make_unique<SimulatedDevice>(SimulatedDeviceOptions{});
    }
  }

  EngineOptions Options() const override {
    EngineOptions options;
    options.pool_options.part_bytes = 4096;
    options.pool_options.extra_state_capacity = 512;
    options.pool_options.prefault_mapping = false;
    options.workers = 2;
    options.device = device_.get();
    if (flow_ == Flow::kHostEveryStep) options.policy = std::make_shared<EveryKPolicy>(1);
    if (flow_ == Flow::kHostStaged) {
      options.dram_staging_buffers = 2;
      options.pool_options.pm_bandwidth.write_gbps = 0.001;
    }
    return options;
  }
  std::vector<UnitRegistration> Registrations() override { return model_.Registrations(); }
  Status Step(Engine& engine, std::uint64_t k) override {
    // Every third step one unit has no gradient: EndStep captures it.
    return model_.Step(engine, k, k % 3 == 0 ? static_cast<int>(k % kUnits) : -1,
                       ExtraStateOf(k));
  }
  // Continuous mode starts an epoch at a boundary only once the previous one
  // committed; a flush every third step makes sure several do, however
  // fast the steps run (how many more does depend on the machine).
  void AfterStep(Engine& engine, std::uint64_t k) override {
    staged_ = std::max(staged_, engine.stats().epochs_staged);
    if (flow_ != Flow::kHostEveryStep && k % 3 == 0) {
      ASSERT_TRUE(engine.Flush().ok());
    }
  }
  std::unique_ptr<PowerLossModel> Fresh() const override {
    auto fresh = std::make_unique<ToyPowerLossModel>(flow_);
    fresh->model_.Zero();
    return fresh;
  }
  std::string CompareRestored(const PowerLossModel& restored, std::uint64_t k) const override {
    if (!model_.HasHistory(k)) return "no history for iteration " + std::to_string(k);
    return static_cast<const ToyPowerLossModel&>(restored).model_.CompareLive(model_, k);
  }
  // The most staged epochs one engine of the run counted.
  std::uint64_t staged() const { return staged_; }

 private:
  Flow flow_;
  std::uint64_t staged_ = 0;
  std::unique_ptr<SimulatedDevice> device_;
  ToyModel model_;
};

// Every commit record write; every second drain and every sixth other seam
// call (all of them with $PMSNAP_POWER_LOSS_SCALE > 1).
CaptureDensity Density() {
  if (PowerLossScale() > 1) return {.record_random_images = 4, .drain_stride = 1, .other_stride = 1};
  return {.record_random_images = 3, .drain_stride = 2, .other_stride = 6};
}

class EnginePowerLossTest : public ::testing::TestWithParam<Flow> {};

TEST_P(EnginePowerLossTest, EveryImageRestoresTheLastCommittedEpochBitExact) {
  ToyPowerLossModel model(GetParam());
  const std::uint64_t steps = 6 * PowerLossScale();
  const EnginePowerLossOutcome outcome = RunEnginePowerLoss(model, steps, 3, 21, Density());
  ReportOutcome(outcome);
  // Host: every step; continuous: at least steps 1 and 4 (after the first
  // flush) and the first step after the restore.
  EXPECT_GE(outcome.epochs_committed, GetParam() == Flow::kHostEveryStep ? steps + 3 : 3u);
  // Each commit alone is captured at its record's writes and their drains.
  EXPECT_GE(outcome.images, 20 * outcome.epochs_committed);
  // Staged: the boundary after each flushed one finds that epoch persisting.
  if (GetParam() == Flow::kHostStaged) {
    EXPECT_GT(model.staged(), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Flows, EnginePowerLossTest,
                         ::testing::Values(Flow::kHostEveryStep, Flow::kSimulatedContinuous,
                                           Flow::kHostStaged),
                         [](const auto& info) -> std::string {
                           switch (info.param) {
                             case Flow::kHostEveryStep:
                               return "host";
                             case Flow::kSimulatedContinuous:
                               return "simulated";
                             case Flow::kHostStaged:
                               return "host_staged";
                           }
                           return "unknown";
                         });

TEST(EnginePowerLossPlantedBugTest, DroppingTheDrainBeforeTheCommitWordIsCaught) {
  ToyPowerLossModel model(Flow::kHostEveryStep);
  ExpectDroppedCommitDrainCaught(model, 5, 3, 23);
}

}  // namespace
}  // namespace pmsnap::runtime
