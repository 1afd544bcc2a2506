// LowDiff's controller (diff::LowDiffController), the one place both front
// ends take their LowDiff rules from, driven without torch: an engine takes
// the full checkpoints the controller asks for, a differential log takes
// every step's "gradient", and a scripted coordinator plays the other rank.
// Checked: full checkpoints at anchor + k * interval, retirement behind the
// second-newest committed full checkpoint, the ranks' agreement on a tuned
// batch and interval (and the anchor moving to the latest full checkpoint),
// the replay reach, and bad options.
#include "pmsnap/diff/lowdiff_controller.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "testutil/temp_pool.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::TempPoolPath;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr std::int64_t kWeights = 1024;

// Rank 1 of 2: the other rank's proposals are scripted, one per all-reduce;
// each all-reduce returns MIN(this rank's value, the other's).
class ScriptedOtherRank : public runtime::Coordinator {
 public:
  explicit ScriptedOtherRank(std::vector<std::int64_t> others, bool fail = false)
      : others_(std::move(others)), fail_(fail) {}
  int rank() const override { return 1; }
  int world_size() const override { return 2; }
  Status StartMinAllReduce(std::span<const std::int64_t> values) override {
    if (values.size() != 1 || next_ >= others_.size()) {
      return Status(StatusCode::kInternal, "unexpected all-reduce");
    }
    proposals.push_back(values[0]);
    pending_ = std::min(values[0], others_[next_++]);
    return Status::Ok();
  }
  Result<std::vector<std::int64_t>> FinishMinAllReduce() override {
    if (fail_) return Status(StatusCode::kIOError, "connection reset by the other rank");
    return std::vector<std::int64_t>{pending_};
  }
  Status Broadcast(std::span<std::byte>, int) override {
    return Status(StatusCode::kInternal, "no broadcast expected");
  }
  std::vector<std::int64_t> proposals;  // this rank's, in order

 private:
  std::vector<std::int64_t> others_;
  std::size_t next_ = 0;
  std::int64_t pending_ = 0;
  bool fail_;
};

// A one-unit trainer whose engine takes the full checkpoints the controller
// sets, with every step's gradient appended to the controller's log.
class ControlledRun {
 public:
  ControlledRun(const std::string& path, LowDiffControllerOptions options,
                std::shared_ptr<runtime::Coordinator> agreement = nullptr) {
    runtime::EngineOptions engine;
    engine.pool_path = path;
    engine.pool_options.chunk_heap_bytes = 16ull << 20;
    engine.policy = policy_;
    auto opened = runtime::Engine::Open(
        engine, {{"w", {{"param", w_.data(), layout::DType::kFloat32, {kWeights}}}}});
    EXPECT_TRUE(opened.ok()) << opened.status().ToString();
    engine_ = std::move(*opened);
    auto controller = LowDiffController::Create(
        options, std::move(agreement), [this](std::uint64_t every, std::uint64_t anchor) {
          intervals_set.emplace_back(every, anchor);
          policy_->set_every(every, anchor);
          return Status::Ok();
        });
    EXPECT_TRUE(controller.ok()) << controller.status().ToString();
    controller_ = std::move(*controller);
  }

  // Step k; the first opens the log behind its full checkpoint, as the
  // front ends do. The engine is flushed every step, so what it committed
  // is known when the controller observes. The controller's error goes to
  // `observed` if given, else fails the test.
  void Step(std::uint64_t k, Status* observed = nullptr) {
    std::vector<float> g(kWeights, 0.001f * static_cast<float>(k));
    DifferentialLog* log = controller_->log().get();
    if (log) {
      controller_->CountHanded(g.size() * sizeof(float));
      ASSERT_TRUE(log->Append(k, {{1, {kWeights}, reinterpret_cast<const std::byte*>(g.data()),
                                   g.size() * sizeof(float)}})
                      .ok());
    }
    ASSERT_TRUE(engine_->BeginStep(k).ok());
    ASSERT_TRUE(engine_->BeforeUpdate(0).ok());
    for (std::size_t i = 0; i < w_.size(); ++i) w_[i] -= g[i];
    ASSERT_TRUE(engine_->AfterUpdate(0).ok());
    ASSERT_TRUE(engine_->EndStep({}).ok());
    ASSERT_TRUE(engine_->Flush().ok());
    if (log) {
      ASSERT_TRUE(log->WaitCopied(k).ok());
    } else {
      DifferentialLogOptions options;
      options.batch = controller_->batch();
      auto opened = DifferentialLog::Open(engine_->pool(), options);
      ASSERT_TRUE(opened.ok()) << opened.status().ToString();
      ASSERT_TRUE(controller_->Attach(std::move(*opened), std::nullopt, std::nullopt).ok());
    }
    const runtime::Stats stats = engine_->stats();
    FullCheckpointProgress progress;
    progress.last_committed_iteration = stats.last_committed_iteration;
    progress.epochs_committed = stats.epochs_committed;
    progress.bytes_written = stats.bytes_written;
    progress.last_epoch_seconds = stats.last_epoch_seconds;
    Status status = controller_->Observe(k, 0.001, progress);
    if (observed != nullptr) {
      *observed = std::move(status);
    } else {
      ASSERT_TRUE(status.ok()) << status.ToString();
    }
  }

  void Close() {
    if (controller_->log()) {
      ASSERT_TRUE(controller_->log()->Close().ok());
    }
    controller_->Detach();
    ASSERT_TRUE(engine_->Close().ok());
  }

  LowDiffController& controller() { return *controller_; }
  runtime::Engine& engine() { return *engine_; }
  std::vector<std::pair<std::uint64_t, std::uint64_t>> intervals_set;  // (every, anchor)

 private:
  std::vector<float> w_ = std::vector<float>(kWeights, 0.5f);
  // Every step until the log opens: the differentials build on step 1's.
  std::shared_ptr<runtime::EveryKPolicy> policy_ = std::make_shared<runtime::EveryKPolicy>(1);
  std::unique_ptr<runtime::Engine> engine_;
  std::unique_ptr<LowDiffController> controller_;
};

LowDiffControllerOptions Fixed(std::uint64_t full_every, std::uint32_t batch) {
  LowDiffControllerOptions options;
  options.full_every = full_every;
  options.batch = batch;
  return options;
}

TEST(LowDiffControllerTest, FullCheckpointsComeEveryIntervalAndOnlyTheNeededDifferentialsStay) {
  TempPoolPath path("ldctl_retire");
  ControlledRun run(path.path(), Fixed(4, 1));
  for (std::uint64_t k = 1; k <= 21; ++k) ASSERT_NO_FATAL_FAILURE(run.Step(k));
  // Step 1's full checkpoint, then 4, 8, ..., 20 (anchor 0).
  EXPECT_THAT(run.intervals_set, ElementsAre(std::make_pair(4u, 0u)));
  EXPECT_EQ(run.engine().stats().last_committed_iteration, 20u);
  // Fulls committed: 1, 4, ..., 20; the second-newest is 16, so what is
  // kept are the differentials after it: 17..21 (batch 1: one chunk each).
  ASSERT_TRUE(run.controller().log()->Flush().ok());
  auto kept = ReadDifferentials(run.engine().pool(), 16);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  ASSERT_EQ(kept->size(), 5u);
  EXPECT_EQ(kept->front().iteration, 17u);
  EXPECT_EQ(kept->back().iteration, 21u);
  // 13..16 were freed: nothing replays from the third-newest full (12).
  auto freed = ReadDifferentials(run.engine().pool(), 12);
  ASSERT_TRUE(freed.ok()) << freed.status().ToString();
  EXPECT_TRUE(freed->empty());
  EXPECT_GT(run.controller().log()->stats().chunks_freed, 0u);
  ASSERT_NO_FATAL_FAILURE(run.Close());
}

TEST(LowDiffControllerTest, RanksAgreeOnTheSmallestBatchThenIntervalCountedFromTheLatestFull) {
  TempPoolPath path("ldctl_agree");
  LowDiffControllerOptions options;  // both tuned
  options.initial_full_every = 50;
  options.initial_batch = 4;
  options.world_size = 2;
  // The other rank proposes batch 1, then interval 2, at the first tuning
  // step (10); nothing else is asked before step 12.
  auto other = std::make_shared<ScriptedOtherRank>(std::vector<std::int64_t>{1, 2});
  ControlledRun run(path.path(), options, other);
  for (std::uint64_t k = 1; k <= 10; ++k) ASSERT_NO_FATAL_FAILURE(run.Step(k));
  ASSERT_EQ(other->proposals.size(), 2u) << "one all-reduce for the batch, one for the interval";
  const LowDiffControllerStats stats = run.controller().stats();
  EXPECT_TRUE(stats.tuned);  // the step-1 full checkpoint was measured
  EXPECT_GE(other->proposals[0], 1) << "this rank's batch proposal";
  EXPECT_GE(other->proposals[1], 1) << "this rank's interval proposal";
  EXPECT_EQ(stats.batch, 1u);
  EXPECT_EQ(run.controller().log()->stats().batch, 1u);
  EXPECT_LE(stats.full_every, 2u);
  EXPECT_GE(stats.full_every, 1u);
  // The new interval counts from the latest full checkpoint: step 1's.
  ASSERT_EQ(run.intervals_set.size(), 2u);
  EXPECT_EQ(run.intervals_set.back(), std::make_pair(stats.full_every, std::uint64_t{1}));
  ASSERT_NO_FATAL_FAILURE(run.Close());
}

TEST(LowDiffControllerTest, AFailedAgreementNamesTheRank) {
  TempPoolPath path("ldctl_fail");
  LowDiffControllerOptions options;
  options.world_size = 2;
  auto other = std::make_shared<ScriptedOtherRank>(std::vector<std::int64_t>{1, 2}, true);
  ControlledRun run(path.path(), options, other);
  for (std::uint64_t k = 1; k <= 9; ++k) ASSERT_NO_FATAL_FAILURE(run.Step(k));
  // Step 10 is the first tuning step: its all-reduce fails, and the values
  // in force stay.
  Status observed;
  ASSERT_NO_FATAL_FAILURE(run.Step(10, &observed));
  EXPECT_EQ(observed.code(), StatusCode::kInternal);
  EXPECT_THAT(observed.message(), HasSubstr("rank 1"));
  EXPECT_EQ(run.controller().full_every(), options.initial_full_every);
  EXPECT_EQ(run.controller().batch(), options.initial_batch);
  ASSERT_NO_FATAL_FAILURE(run.Close());
}

TEST(LowDiffControllerTest, TheReplayReachIsTheSmallestAnyRankHolds) {
  auto reach = LowDiffController::AgreeOnReplayReach(nullptr, 20, 7);
  ASSERT_TRUE(reach.ok());
  EXPECT_EQ(*reach, 27u);
  ScriptedOtherRank behind({23});
  reach = LowDiffController::AgreeOnReplayReach(&behind, 20, 7);
  ASSERT_TRUE(reach.ok());
  EXPECT_EQ(*reach, 23u);
  EXPECT_THAT(behind.proposals, ElementsAre(27));
  ScriptedOtherRank broken({23}, /*fail=*/true);
  reach = LowDiffController::AgreeOnReplayReach(&broken, 20, 7);
  ASSERT_FALSE(reach.ok());
  EXPECT_EQ(reach.status().code(), StatusCode::kInternal);
  EXPECT_THAT(reach.status().message(), HasSubstr("rank 1"));
  EXPECT_THAT(reach.status().message(), HasSubstr("connection reset"));
}

TEST(LowDiffControllerTest, BadOptionsAreRefused) {
  const auto set = [](std::uint64_t, std::uint64_t) { return Status::Ok(); };
  for (auto broken : {+[](LowDiffControllerOptions& o) { o.max_batch = 0; },
                      +[](LowDiffControllerOptions& o) { o.initial_batch = 0; },
                      +[](LowDiffControllerOptions& o) { o.initial_full_every = 0; },
                      +[](LowDiffControllerOptions& o) { o.mtbf_seconds = 0; }}) {
    LowDiffControllerOptions options;
    broken(options);
    auto controller = LowDiffController::Create(options, nullptr, set);
    ASSERT_FALSE(controller.ok());
    EXPECT_EQ(controller.status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE(LowDiffController::Create({}, nullptr, nullptr).ok());
}

}  // namespace
}  // namespace pmsnap::diff
