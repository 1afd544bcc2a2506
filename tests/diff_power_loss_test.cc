// Power loss under every embedding policy's chunks, simulated at the
// persistence seam (testutil/engine_power_loss.h): an embedding table with
// skewed row updates and a dense unit train through the Engine with an
// EmbeddingCheckpointer (a checkpoint every step: baselines, differentials,
// increments, IncrCP's extractions, index chunks, retention frees), close,
// reopen, restore and train on. For every image a power loss would leave at
// the commit record's writes, at sampled drains or at sampled seam calls:
//  - the pool recovers the newest committed epoch (or the one in flight);
//  - every retained checkpoint, rebuilt through the policy's public
//    recovery API (ListCheckpoints, RecoverTable), equals bit for bit the
//    table as of that checkpoint, and the newest is the recovered epoch
//    (never a table of one epoch with the dense state of another);
//  - Engine::Restore brings back the table, its accumulator and the dense
//    unit of that iteration bit for bit.
// Unquantized, "the table as of the checkpoint" is the live table after
// that step. Quantized, it is what the policy itself defines: the table
// RecoverTable rebuilt from the uninterrupted pool right after that commit
// (checked against the live table within the 8-bit quantizer's bound).
//
// A test-only switch that drops the drain before the commit word must be
// caught. $PMSNAP_POWER_LOSS_SCALE=N runs N times as many steps.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "detail/persistence.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "testutil/embedding_toy.h"
#include "testutil/engine_power_loss.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::CaptureDensity;
using pmsnap::testing::EmbeddingToy;
using pmsnap::testing::EnginePowerLossOutcome;
using pmsnap::testing::ExpectDroppedCommitDrainCaught;
using pmsnap::testing::PowerLossModel;
using pmsnap::testing::PowerLossScale;
using pmsnap::testing::ReportOutcome;
using pmsnap::testing::RunEnginePowerLoss;

constexpr std::uint64_t kRows = 600;
constexpr std::uint32_t kDim = 16;
constexpr const char* kTable = "emb.users";

struct PolicyCase {
  Policy policy;
  bool quantize;
};

std::string CaseName(const PolicyCase& c) {
  std::string name = PolicyName(c.policy);
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name + (c.quantize ? "_quantized" : "");
}

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

class TablePowerLossModel final : public PowerLossModel {
 public:
  explicit TablePowerLossModel(PolicyCase c) : case_(c), toy_(kRows, kDim) {}

  runtime::EngineOptions Options() const override {
    runtime::EngineOptions options;
    options.pool_options.part_bytes = 4096;
    options.pool_options.extra_state_capacity = 512;
    options.pool_options.chunk_heap_bytes = 2 << 20;
    options.pool_options.prefault_mapping = false;
    options.workers = 2;
    options.policy = std::make_shared<runtime::EveryKPolicy>(1);
    return options;
  }
  std::vector<runtime::UnitRegistration> Registrations() override { return toy_.Registrations(); }
  std::shared_ptr<runtime::Encoder> MakeEncoder() override {
    EmbeddingOptions options;
    options.policy = case_.policy;
    options.retain = 3;
    options.quantize.enabled = case_.quantize;
    options.quantize.bits = 8;
    options.incrcp.duplicate_ratio_threshold = 0.0;  // extract whenever duplicates exist
    options.incrcp.reset_baseline = false;           // timing-driven: not reproducible
    checkpointer_ = std::make_shared<EmbeddingCheckpointer>(options);
    return checkpointer_;
  }
  Status Step(runtime::Engine& engine, std::uint64_t k) override {
    RowTracker* tracker = checkpointer_->tracker(kTable);
    if (tracker == nullptr) return Status(StatusCode::kNotFound, "no tracker for the table");
    return toy_.Step(engine, *tracker, k, ExtraStateOf(k));
  }
  // Each step commits before the next (as the diff tests train); then the
  // expectation for its checkpoint is taken.
  void AfterStep(runtime::Engine& engine, std::uint64_t k) override {
    ASSERT_TRUE(engine.Flush().ok());
    Expected& expected = expected_[k];
    expected.weights = toy_.weights();
    expected.accumulator = toy_.accumulator();
    expected.dense = toy_.dense();
    if (!case_.quantize) return;
    auto table = RecoverTable(engine.pool(), kTable);
    ASSERT_TRUE(table.ok()) << table.status().ToString();
    ASSERT_EQ(table->iteration, k);
    double worst = 0;
    for (std::size_t i = 0; i < expected.weights.size(); ++i) {
      worst = std::max(worst, std::abs(double{table->tensors[0][i]} - expected.weights[i]));
    }
    EXPECT_LE(worst, 0.002) << "8-bit quantization error at iteration " << k;
    expected.weights = table->tensors[0];
  }
  std::unique_ptr<PowerLossModel> Fresh() const override {
    auto fresh = std::make_unique<TablePowerLossModel>(case_);
    fresh->toy_.Zero();
    return fresh;
  }
  std::string CompareRestored(const PowerLossModel& restored, std::uint64_t k) const override {
    auto it = expected_.find(k);
    if (it == expected_.end()) return "no expectation for iteration " + std::to_string(k);
    const EmbeddingToy& toy = static_cast<const TablePowerLossModel&>(restored).toy_;
    if (!SameBytes(toy.weights(), it->second.weights)) return "table weights differ";
    if (!SameBytes(toy.accumulator(), it->second.accumulator)) return "accumulator differs";
    if (!SameBytes(toy.dense(), it->second.dense)) return "dense unit differs";
    return "";
  }
  std::string CheckPool(const layout::Pool& pool, std::uint64_t epoch,
                        std::uint64_t k) const override {
    auto checkpoints = ListCheckpoints(pool, kTable);
    if (!checkpoints.ok()) return "ListCheckpoints fails: " + checkpoints.status().ToString();
    if (checkpoints->empty() || checkpoints->back().epoch != epoch ||
        checkpoints->back().iteration != k) {
      return "the newest table checkpoint is not the recovered epoch's";
    }
    for (const CheckpointInfo& c : *checkpoints) {
      auto table = RecoverTable(pool, kTable, c.epoch);
      const std::string which = "checkpoint " + std::to_string(c.epoch) + " (iteration " +
                                std::to_string(c.iteration) + ")";
      if (!table.ok()) return which + ": RecoverTable fails: " + table.status().ToString();
      auto it = expected_.find(c.iteration);
      if (table->iteration != c.iteration || it == expected_.end()) {
        return which + ": recovers iteration " + std::to_string(table->iteration);
      }
      if (table->tensors.size() != 2 || !SameBytes(table->tensors[0], it->second.weights) ||
          !SameBytes(table->tensors[1], it->second.accumulator)) {
        return which + ": the recovered table differs from the table as of that checkpoint";
      }
    }
    return "";
  }

 private:
  struct Expected {
    std::vector<float> weights, accumulator, dense;
  };
  PolicyCase case_;
  EmbeddingToy toy_;
  std::shared_ptr<EmbeddingCheckpointer> checkpointer_;
  std::map<std::uint64_t, Expected> expected_;  // by iteration (live model only)
};

// Every commit record write (the Engine test samples these more densely);
// every third drain and every eighth other seam
// call (all of them with $PMSNAP_POWER_LOSS_SCALE > 1).
CaptureDensity Density() {
  if (PowerLossScale() > 1) return {.record_random_images = 4, .drain_stride = 1, .other_stride = 1};
  return {.record_random_images = 1, .drain_stride = 3, .other_stride = 8};
}

class PolicyPowerLossTest : public ::testing::TestWithParam<PolicyCase> {};

TEST_P(PolicyPowerLossTest, EveryImageRecoversEachRetainedCheckpointBitExact) {
  TablePowerLossModel model(GetParam());
  const std::uint64_t steps = 4 * PowerLossScale();
  const EnginePowerLossOutcome outcome =
      RunEnginePowerLoss(model, steps, 2, 31 + static_cast<int>(GetParam().policy), Density());
  ReportOutcome(outcome);
  EXPECT_EQ(outcome.epochs_committed, steps + 2);
  EXPECT_GT(outcome.images, 100u);
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, PolicyPowerLossTest,
                         ::testing::Values(PolicyCase{Policy::kFull, false},
                                           PolicyCase{Policy::kOneShotDifferential, false},
                                           PolicyCase{Policy::kConsecutiveIncremental, false},
                                           PolicyCase{Policy::kIntermittentDifferential, false},
                                           PolicyCase{Policy::kIncrCP, false},
                                           PolicyCase{Policy::kFull, true},
                                           PolicyCase{Policy::kOneShotDifferential, true},
                                           PolicyCase{Policy::kConsecutiveIncremental, true},
                                           PolicyCase{Policy::kIntermittentDifferential, true},
                                           PolicyCase{Policy::kIncrCP, true}),
                         [](const auto& info) { return CaseName(info.param); });

TEST(PolicyPowerLossPlantedBugTest, DroppingTheDrainBeforeTheCommitWordIsCaught) {
  TablePowerLossModel model({Policy::kIncrCP, false});
  ExpectDroppedCommitDrainCaught(model, 4, 2, 41);
}

}  // namespace
}  // namespace pmsnap::diff
