// hooks::LowDiff: top-k synchronized gradients with error feedback become
// differential checkpoints between full ones. After a crash (Close with
// kAbandon: what is buffered is lost), Restore brings a fresh model and
// optimizer bitwise to the state training had at the newest durable
// differential, also under a learning rate that changes every step, with
// one process and with two gloo ranks; a crash loses at most b-1
// differentials; Eq. 10 re-tunes f and b; bad configurations are refused.
#include "pmsnap/hooks/lowdiff.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "hooks_gloo_ranks.h"
#include "hooks_test_util.h"
#include "pmsnap/hooks/c10d_coordinator.h"
#include "testutil/temp_pool.h"

namespace pmsnap::hooks {
namespace {

using pmsnap::testing::Batch;
using pmsnap::testing::MakeMlp;
using pmsnap::testing::OnGlooRanks;
using pmsnap::testing::Mlp;
using pmsnap::testing::StateOf;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::UseOneTorchThread;
using ::testing::HasSubstr;

// A model's parameters and Adam state at one iteration.
struct Snapshot {
  std::vector<torch::Tensor> tensors;
};

Snapshot Take(Mlp& model, torch::optim::Optimizer& optimizer) {
  Snapshot s;
  for (const auto& p : model->parameters()) {
    s.tensors.push_back(p.detach().clone());
    for (const auto& t : StateOf(optimizer, p).tensors) s.tensors.push_back(t.clone());
  }
  return s;
}

// "" if both are bitwise equal, else the first tensor that differs.
std::string Difference(const Snapshot& a, const Snapshot& b) {
  if (a.tensors.size() != b.tensors.size()) {
    return "tensor count " + std::to_string(a.tensors.size()) + " vs " +
           std::to_string(b.tensors.size());
  }
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    if (!torch::equal(a.tensors[i], b.tensors[i])) return "tensor " + std::to_string(i);
  }
  return "";
}

runtime::EngineOptions Quiet(const std::string& path) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.print_summary = false;
  return options;
}

std::vector<std::byte> ExtraOf(std::uint64_t step) {
  const std::string text = "position " + std::to_string(step);
  std::vector<std::byte> bytes(text.size());
  std::memcpy(bytes.data(), text.data(), text.size());
  return bytes;
}

// Forward + backward on this rank's batch of `step`, then LowDiff's
// synchronization and step (the learning rate changes every step).
void TrainStep(LowDiff& lowdiff, Mlp& model, torch::optim::Optimizer& optimizer,
               std::uint64_t step, int rank = 0) {
  optimizer.zero_grad();
  auto [x, y] = Batch(step * 2 + static_cast<std::uint64_t>(rank));
  torch::mse_loss(model->forward(x), y).backward();
  for (auto& group : optimizer.param_groups()) group.options().set_lr(1e-2 / (1.0 + 0.1 * step));
  ASSERT_TRUE(lowdiff.SynchronizeGradients().ok());
  Status stepped = lowdiff.Step(ExtraOf(step));
  ASSERT_TRUE(stepped.ok()) << stepped.ToString();
}

LowDiffOptions Fixed(std::uint64_t full_every, std::uint32_t batch, double ratio = 0.25) {
  LowDiffOptions o;
  o.topk_ratio = ratio;
  o.full_every = full_every;
  o.batch = batch;
  return o;
}

TEST(LowDiffTest, TopKSendsAtMostKElementsAndKeepsTheRestForTheNextStep) {
  UseOneTorchThread();
  TempPoolPath pool("lowdiff_topk");
  Mlp model = MakeMlp(1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto ld = LowDiff::Create(*model, sgd, Quiet(pool.path()), Fixed(4, 2, 0.25));
  ASSERT_TRUE(ld.ok()) << ld.status().ToString();
  sgd.zero_grad();
  auto [x, y] = Batch(0);
  torch::mse_loss(model->forward(x), y).backward();
  std::vector<torch::Tensor> before;
  for (const auto& p : model->parameters()) before.push_back(p.grad().clone());
  ASSERT_TRUE((*ld)->SynchronizeGradients().ok());
  std::size_t i = 0;
  for (const auto& p : model->parameters()) {
    const auto k = static_cast<std::int64_t>(std::ceil(0.25 * p.numel()));
    torch::Tensor sent = p.grad().reshape({-1});
    torch::Tensor nonzero = sent.nonzero().reshape({-1});
    EXPECT_LE(nonzero.numel(), k) << i;
    EXPECT_GT(nonzero.numel(), 0) << i;
    // One rank: the sent elements are the original ones, unaveraged.
    EXPECT_TRUE(torch::equal(sent.index_select(0, nonzero),
                             before[i].reshape({-1}).index_select(0, nonzero)))
        << i;
    ++i;
  }
  EXPECT_EQ((*ld)->SynchronizeGradients().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*ld)->Step().ok());
  // Without a new synchronization there is nothing to checkpoint.
  EXPECT_EQ((*ld)->Step().code(), StatusCode::kFailedPrecondition);
}

TEST(LowDiffTest, RestoreReplaysDifferentialsBitExactUnderAChangingLearningRate) {
  UseOneTorchThread();
  TempPoolPath pool("lowdiff_replay");
  constexpr std::uint64_t kSteps = 13;
  std::vector<Snapshot> trained(kSteps + 1);
  {
    Mlp model = MakeMlp(2);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto ld = LowDiff::Create(*model, adam, Quiet(pool.path()), Fixed(5, 2));
    ASSERT_TRUE(ld.ok()) << ld.status().ToString();
    for (std::uint64_t k = 1; k <= kSteps; ++k) {
      TrainStep(**ld, model, adam, k);
      trained[k] = Take(model, adam);
    }
    ASSERT_TRUE((*ld)->Close(runtime::CloseMode::kAbandon).ok());  // a crash
  }
  Mlp model = MakeMlp(99);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto ld = LowDiff::Create(*model, adam, Quiet(pool.path()), Fixed(5, 2));
  ASSERT_TRUE(ld.ok()) << ld.status().ToString();
  auto restored = (*ld)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  // Differentials 2..13 in batches of 2: 12 and 13 close the last one, so
  // every step is durable; the full checkpoints are 1, 5 and 10.
  EXPECT_EQ(restored->iteration, kSteps);
  EXPECT_GE(restored->full_iteration, 5u);
  EXPECT_EQ(restored->replayed, restored->iteration - restored->full_iteration);
  EXPECT_GT(restored->replayed, 0u);
  EXPECT_EQ(restored->extra_state, ExtraOf(restored->iteration));
  EXPECT_EQ((*ld)->iteration(), restored->iteration);
  EXPECT_EQ(Difference(Take(model, adam), trained[restored->iteration]), "");
  // Replay set each group's learning rate to the one its step had.
  EXPECT_DOUBLE_EQ(adam.param_groups()[0].options().get_lr(), 1e-2 / (1.0 + 0.1 * kSteps));
  // Training goes on from there, and a second crash restores again.
  TrainStep(**ld, model, adam, kSteps + 1);
  const Snapshot after = Take(model, adam);
  ASSERT_TRUE((*ld)->Flush().ok());
  ASSERT_TRUE((*ld)->Close(runtime::CloseMode::kAbandon).ok());
  Mlp again = MakeMlp(7);
  torch::optim::Adam adam_again(again->parameters(), torch::optim::AdamOptions(1e-2));
  auto ld_again = LowDiff::Create(*again, adam_again, Quiet(pool.path()), Fixed(5, 2));
  ASSERT_TRUE(ld_again.ok());
  auto second = (*ld_again)->Restore();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->iteration, kSteps + 1);
  EXPECT_EQ(Difference(Take(again, adam_again), after), "");
}

TEST(LowDiffTest, ACrashLosesAtMostBatchMinusOneDifferentials) {
  UseOneTorchThread();
  constexpr std::uint32_t kBatch = 4;
  for (std::uint64_t steps : {9u, 10u, 12u}) {
    TempPoolPath pool("lowdiff_loss");
    std::vector<Snapshot> trained(steps + 1);
    {
      Mlp model = MakeMlp(3);
      torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      auto ld = LowDiff::Create(*model, sgd, Quiet(pool.path()), Fixed(1000, kBatch));
      ASSERT_TRUE(ld.ok());
      for (std::uint64_t k = 1; k <= steps; ++k) {
        TrainStep(**ld, model, sgd, k);
        trained[k] = Take(model, sgd);
      }
      EXPECT_EQ((*ld)->stats().max_loss, kBatch - 1);
      ASSERT_TRUE((*ld)->Close(runtime::CloseMode::kAbandon).ok());
    }
    Mlp model = MakeMlp(4);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto ld = LowDiff::Create(*model, sgd, Quiet(pool.path()), Fixed(1000, kBatch));
    ASSERT_TRUE(ld.ok());
    auto restored = (*ld)->Restore();
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    // Full checkpoint 1, differentials from 2 on, sealed 4 at a time.
    const std::uint64_t durable = 1 + (steps - 1) / kBatch * kBatch;
    EXPECT_EQ(restored->full_iteration, 1u) << steps;
    EXPECT_EQ(restored->iteration, durable) << steps;
    EXPECT_LE(steps - restored->iteration, kBatch - 1) << steps;
    EXPECT_EQ(Difference(Take(model, sgd), trained[restored->iteration]), "") << steps;
  }
}

TEST(LowDiffTest, FlushMakesThePartialBatchDurable) {
  UseOneTorchThread();
  TempPoolPath pool("lowdiff_flush");
  Snapshot last;
  {
    Mlp model = MakeMlp(5);
    torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
    auto ld = LowDiff::Create(*model, adamw, Quiet(pool.path()), Fixed(1000, 8));
    ASSERT_TRUE(ld.ok());
    for (std::uint64_t k = 1; k <= 6; ++k) TrainStep(**ld, model, adamw, k);
    last = Take(model, adamw);
    ASSERT_TRUE((*ld)->Flush().ok());
    ASSERT_TRUE((*ld)->Close(runtime::CloseMode::kAbandon).ok());
  }
  Mlp model = MakeMlp(6);
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  auto ld = LowDiff::Create(*model, adamw, Quiet(pool.path()), Fixed(1000, 8));
  ASSERT_TRUE(ld.ok());
  auto restored = (*ld)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 6u);
  EXPECT_EQ(restored->replayed, 5u);
  EXPECT_EQ(Difference(Take(model, adamw), last), "");
}

TEST(LowDiffTest, Eq10TunesTheFullIntervalAndBatchFromWhatItMeasured) {
  UseOneTorchThread();
  TempPoolPath pool("lowdiff_tune");
  Mlp model = MakeMlp(8);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  LowDiffOptions options;
  options.initial_full_every = 3;
  options.mtbf_seconds = 600;
  auto ld = LowDiff::Create(*model, adam, Quiet(pool.path()), options);
  ASSERT_TRUE(ld.ok());
  for (std::uint64_t k = 1; k <= 12 && !(*ld)->stats().tuned; ++k) {
    TrainStep(**ld, model, adam, k);
    if (k % 3 == 0) {
      ASSERT_TRUE((*ld)->checkpointed().Flush().ok());
    }
  }
  const LowDiffStats stats = (*ld)->stats();
  ASSERT_TRUE(stats.tuned);
  auto expected = diff::OptimalConfiguration(stats.inputs, LowDiffOptions{}.max_batch);
  ASSERT_TRUE(expected.ok());
  // Within what the chunk heap holds at the measured differential size.
  ASSERT_GT(stats.heap_max_full_every, 0u);
  EXPECT_EQ(stats.full_every, std::min(expected->full_interval, stats.heap_max_full_every));
  EXPECT_EQ(stats.batch, expected->batch);
  EXPECT_EQ(stats.max_loss, stats.batch - 1);
  EXPECT_DOUBLE_EQ(stats.f_star, expected->f_star);
  EXPECT_GT(stats.inputs.write_bandwidth, 0);
  EXPECT_EQ(stats.inputs.mtbf_seconds, 600);
}

TEST(LowDiffTest, BadConfigurationsAreRefused) {
  UseOneTorchThread();
  TempPoolPath pool("lowdiff_bad");
  Mlp model = MakeMlp(9);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  for (double ratio : {0.0, -0.5, 1.5}) {
    auto ld = LowDiff::Create(*model, sgd, Quiet(pool.path()), Fixed(4, 2, ratio));
    ASSERT_FALSE(ld.ok());
    EXPECT_EQ(ld.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(ld.status().message(), HasSubstr("topk_ratio"));
    EXPECT_THAT(ld.status().message(), HasSubstr(pool.path()));
  }
  LowDiffOptions zero_batch;
  zero_batch.max_batch = 0;
  EXPECT_EQ(LowDiff::Create(*model, sgd, Quiet(pool.path()), zero_batch).status().code(),
            StatusCode::kInvalidArgument);
  auto ld = LowDiff::Create(*model, sgd, Quiet(pool.path()), Fixed(4, 2));
  ASSERT_TRUE(ld.ok());
  EXPECT_EQ((*ld)->Restore().status().code(), StatusCode::kNotFound);
  TrainStep(**ld, model, sgd, 1);
  auto late = (*ld)->Restore();
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*ld)->Close().ok());
  EXPECT_EQ((*ld)->SynchronizeGradients().code(), StatusCode::kFailedPrecondition);
}

// Two gloo ranks (threads, one in-memory store): each computes its own
// gradient, both apply the same averaged top-k gradient, and after a crash
// both restore bitwise to what they trained.
TEST(LowDiffTest, TwoGlooRanksApplyTheSameGradientAndRestoreBitExact) {
  UseOneTorchThread();
  constexpr int kWorld = 2;
  constexpr std::uint64_t kSteps = 9;
  TempPoolPath pool0("lowdiff_rank0"), pool1("lowdiff_rank1");
  const std::string paths[kWorld] = {pool0.path(), pool1.path()};
  std::vector<std::vector<Snapshot>> trained(kWorld, std::vector<Snapshot>(kSteps + 1));
  std::vector<Snapshot> restored_state(kWorld);
  std::vector<std::uint64_t> restored_iteration(kWorld);
  auto make = [&](int r, c10::intrusive_ptr<c10d::Backend> backend, Mlp& model,
                  torch::optim::Optimizer& opt) {
    runtime::EngineOptions engine = Quiet(paths[r]);
    engine.coordinator = std::make_shared<C10dCoordinator>(backend);
    // No full checkpoint after the first: what survives is the differentials'.
    LowDiffOptions options = Fixed(1000, 3);
    options.gradient_group = backend;
    return LowDiff::Create(*model, opt, engine, options);
  };
  // Models are made here, one after the other: torch's seed is global, and
  // two threads seeding and drawing at once give the ranks different weights.
  std::vector<Mlp> models, fresh;
  for (int r = 0; r < kWorld; ++r) models.push_back(MakeMlp(11));
  for (int r = 0; r < kWorld; ++r) fresh.push_back(MakeMlp(50 + static_cast<std::uint64_t>(r)));
  OnGlooRanks(kWorld, [&](int r, c10::intrusive_ptr<c10d::Backend> backend) {
    Mlp& model = models[static_cast<std::size_t>(r)];
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto ld = make(r, backend, model, adam);
    ASSERT_TRUE(ld.ok()) << ld.status().ToString();
    for (std::uint64_t k = 1; k <= kSteps; ++k) {
      TrainStep(**ld, model, adam, k, r);
      trained[r][k] = Take(model, adam);
    }
    ASSERT_TRUE((*ld)->Close(runtime::CloseMode::kAbandon).ok());
  });
  for (std::uint64_t k = 1; k <= kSteps; ++k) {
    ASSERT_EQ(Difference(trained[0][k], trained[1][k]), "") << "ranks differ after step " << k;
  }
  OnGlooRanks(kWorld, [&](int r, c10::intrusive_ptr<c10d::Backend> backend) {
    Mlp& model = fresh[static_cast<std::size_t>(r)];
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto ld = make(r, backend, model, adam);
    ASSERT_TRUE(ld.ok()) << ld.status().ToString();
    auto restored = (*ld)->Restore();
    ASSERT_TRUE(restored.ok()) << restored.status().ToString();
    restored_iteration[r] = restored->iteration;
    restored_state[r] = Take(model, adam);
  });
  // Differentials 2..9 in batches of 3: 2-4 and 5-7 are sealed, 8-9 lost.
  EXPECT_EQ(restored_iteration[0], 7u);
  EXPECT_EQ(restored_iteration[1], 7u);
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(Difference(restored_state[r], trained[r][restored_iteration[r]]), "") << r;
  }
}

// Each rank measures its own W, R_D and iteration time, and the MTBFs differ
// 1000x here, so alone the ranks would tune different intervals; every
// rank's engine must ask for the same full checkpoints.
TEST(LowDiffTest, TwoGlooRanksTuneToTheSameFullIntervalThoughTheirMeasurementsDiffer) {
  UseOneTorchThread();
  constexpr int kWorld = 2;
  constexpr std::uint64_t kSteps = 24;
  TempPoolPath pool0("lowdiff_tune_rank0"), pool1("lowdiff_tune_rank1");
  const std::string paths[kWorld] = {pool0.path(), pool1.path()};
  std::vector<LowDiffStats> stats(kWorld);
  std::vector<Mlp> models;
  for (int r = 0; r < kWorld; ++r) models.push_back(MakeMlp(13));
  OnGlooRanks(kWorld, [&](int r, c10::intrusive_ptr<c10d::Backend> backend) {
    Mlp& model = models[static_cast<std::size_t>(r)];
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
    runtime::EngineOptions engine = Quiet(paths[r]);
    engine.coordinator = std::make_shared<C10dCoordinator>(backend);
    LowDiffOptions options;
    options.topk_ratio = 0.25;
    options.initial_full_every = 3;
    options.mtbf_seconds = r == 0 ? 60 : 60000;
    options.gradient_group = backend;
    auto ld = LowDiff::Create(*model, adam, engine, options);
    ASSERT_TRUE(ld.ok()) << ld.status().ToString();
    for (std::uint64_t k = 1; k <= kSteps; ++k) TrainStep(**ld, model, adam, k, r);
    stats[static_cast<std::size_t>(r)] = (*ld)->stats();
    ASSERT_TRUE((*ld)->Close().ok());
  });
  ASSERT_TRUE(stats[0].tuned && stats[1].tuned);
  // What a rank alone would run: Eq. 10 within its chunk heap.
  const auto own = [](const LowDiffStats& s) {
    const auto eq10 = static_cast<std::uint64_t>(std::max(1.0, std::round(1 / s.f_star)));
    return s.heap_max_full_every ? std::min(eq10, s.heap_max_full_every) : eq10;
  };
  ASSERT_NE(own(stats[0]), own(stats[1]));  // alone they would disagree
  EXPECT_EQ(stats[0].full_every, stats[1].full_every);
  EXPECT_EQ(stats[0].full_every, std::min(own(stats[0]), own(stats[1])));
  EXPECT_EQ(stats[0].batch, stats[1].batch);
}

}  // namespace
}  // namespace pmsnap::hooks
