// hooks::LowDiffPlus: gradients handed over per parameter are copied by a
// snapshot thread, and a replica thread applies an optimizer of the same kind
// to a host replica that commits to the pool every iteration. On the CPU the
// replica equals the trained model bitwise, for every optimizer
// configuration the hooks support (parameters and libtorch state), also
// under a changing learning rate; Restore brings a fresh model and optimizer
// to the pool's iteration and training continues bitwise as without the
// interruption; created mid-training, the replica starts from the
// optimizer's state. Errors: a second gradient before Step, a gradient that
// was not handed over, a parameter without a name, an unsupported optimizer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hooks_test_util.h"
#include "pmsnap/hooks/lowdiff_plus.h"
#include "testutil/temp_pool.h"

namespace pmsnap::hooks {
namespace {

using pmsnap::testing::AllOptimizerConfigs;
using pmsnap::testing::EveryStep;
using pmsnap::testing::FirstBitwiseDifference;
using pmsnap::testing::ForwardBackward;
using pmsnap::testing::MakeMlp;
using pmsnap::testing::Mlp;
using pmsnap::testing::OptimizerConfig;
using pmsnap::testing::StateOf;
using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

// Hands every parameter's gradient over, as an all-reduce's completion would.
Status HandAll(LowDiffPlus& plus, Mlp& model) {
  std::size_t i = 0;
  for (const torch::Tensor& p : model->parameters()) {
    PMSNAP_RETURN_IF_ERROR(plus.HandGradient(i++, p.grad()));
  }
  return Status::Ok();
}

// "" if the replica is bitwise the model and its optimizer state.
std::string ReplicaDifference(LowDiffPlus& plus, Mlp& model, torch::optim::Optimizer& optimizer) {
  auto params = model->parameters();
  const auto& replica = plus.replica_parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!torch::equal(params[i], replica[i])) return "parameter " + std::to_string(i);
    auto live = StateOf(optimizer, params[i]);
    auto copy = StateOf(plus.replica_optimizer(), replica[i]);
    if (live.step != copy.step) return "step of parameter " + std::to_string(i);
    if (live.tensors.size() != copy.tensors.size()) return "state count " + std::to_string(i);
    for (std::size_t t = 0; t < live.tensors.size(); ++t) {
      if (!torch::equal(live.tensors[t], copy.tensors[t])) {
        return "state " + std::to_string(t) + " of parameter " + std::to_string(i);
      }
    }
  }
  return "";
}

class LowDiffPlusTest : public ::testing::TestWithParam<OptimizerConfig> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(LowDiffPlusTest, ReplicaEqualsTheTrainedModelBitwiseAndRestoresBitExact) {
  TempPoolPath pool("lowdiff_plus");
  Mlp model = MakeMlp(1);
  auto optimizer = GetParam().make(model->parameters());
  auto plus = LowDiffPlus::Create(model->named_parameters().pairs(), *optimizer,
                                  EveryStep(pool.path()));
  ASSERT_TRUE(plus.ok()) << plus.status().ToString();
  for (std::uint64_t k = 1; k <= 8; ++k) {
    // A learning-rate schedule: the replica must follow each step's options.
    for (auto& group : optimizer->param_groups()) {
      group.options().set_lr(group.options().get_lr() * 0.9);
    }
    ForwardBackward(model, *optimizer, k);
    ASSERT_TRUE(HandAll(**plus, model).ok());
    Status step = (*plus)->Step();
    ASSERT_TRUE(step.ok()) << step.ToString();
    if (k == 3) {
      ASSERT_TRUE((*plus)->Flush().ok());
      EXPECT_EQ(ReplicaDifference(**plus, model, *optimizer), "") << "after step 3";
    }
  }
  ASSERT_TRUE((*plus)->Flush().ok());
  EXPECT_EQ(ReplicaDifference(**plus, model, *optimizer), "");
  LowDiffPlusStats stats = (*plus)->stats();
  EXPECT_EQ(stats.iterations, 8u);
  EXPECT_EQ(stats.replica_iteration, 8u);
  EXPECT_EQ(stats.gradient_bytes_snapshotted, 8 * stats.gradient_bytes_per_iteration);
  EXPECT_EQ((*plus)->checkpoint_stats().epochs_committed, 8u);
  ASSERT_TRUE((*plus)->Close().ok());

  // A fresh process's view: other initial values, restored from the pool.
  Mlp fresh = MakeMlp(77);
  auto fresh_optimizer = GetParam().make(fresh->parameters());
  auto resumed = LowDiffPlus::Create(fresh->named_parameters().pairs(), *fresh_optimizer,
                                     EveryStep(pool.path()));
  ASSERT_TRUE(resumed.ok()) << resumed.status().ToString();
  auto info = (*resumed)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 8u);
  EXPECT_EQ(FirstBitwiseDifference(model, *optimizer, fresh, *fresh_optimizer), "");
  // The C++ pool holds the caller's extra state, not param-group options: a
  // schedule sets its value after Restore, as with CheckpointedOptimizer.
  for (std::size_t g = 0; g < optimizer->param_groups().size(); ++g) {
    fresh_optimizer->param_groups()[g].options().set_lr(
        optimizer->param_groups()[g].options().get_lr());
  }
  for (std::uint64_t k = 9; k <= 11; ++k) {
    ForwardBackward(model, *optimizer, k);
    optimizer->step();
    ForwardBackward(fresh, *fresh_optimizer, k);
    ASSERT_TRUE(HandAll(**resumed, fresh).ok());
    ASSERT_TRUE((*resumed)->Step().ok());
  }
  EXPECT_EQ(FirstBitwiseDifference(model, *optimizer, fresh, *fresh_optimizer), "");
  ASSERT_TRUE((*resumed)->Flush().ok());
  EXPECT_EQ(ReplicaDifference(**resumed, fresh, *fresh_optimizer), "");
}

INSTANTIATE_TEST_SUITE_P(Optimizers, LowDiffPlusTest, ::testing::ValuesIn(AllOptimizerConfigs()),
                         [](const auto& info) { return info.param.name; });

TEST(LowDiffPlusErrorsTest, ASecondGradientAndAnUnseenGradientAreRefused) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("lowdiff_plus_errors");
  Mlp model = MakeMlp(2);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto plus = LowDiffPlus::Create(model->named_parameters().pairs(), adam, EveryStep(pool.path()));
  ASSERT_TRUE(plus.ok()) << plus.status().ToString();
  ForwardBackward(model, adam, 1);
  // Only the first parameter handed: Step refuses before any update.
  torch::Tensor before = model->parameters()[1].detach().clone();
  ASSERT_TRUE((*plus)->HandGradient(0, model->parameters()[0].grad()).ok());
  Status second = (*plus)->HandGradient(0, model->parameters()[0].grad());
  EXPECT_EQ(second.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(second.message(), HasSubstr("second gradient"));
  Status unseen = (*plus)->Step();
  EXPECT_EQ(unseen.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(unseen.message(), HasSubstr("fc1.bias"));
  EXPECT_TRUE(torch::equal(before, model->parameters()[1]));
  Status shape = (*plus)->HandGradient(1, torch::zeros({3}));
  EXPECT_EQ(shape.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*plus)->HandGradient(99, torch::zeros({3})).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*plus)->Close(runtime::CloseMode::kAbandon).ok());
}

TEST(LowDiffPlusTest, CreatedMidTrainingTheReplicaStartsFromTheOptimizersState) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("lowdiff_plus_mid");
  Mlp model = MakeMlp(3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (std::uint64_t k = 1; k <= 2; ++k) {
    ForwardBackward(model, sgd, k);
    sgd.step();  // momentum buffers the replica must start from
  }
  auto plus = LowDiffPlus::Create(model->named_parameters().pairs(), sgd, EveryStep(pool.path()));
  ASSERT_TRUE(plus.ok()) << plus.status().ToString();
  for (std::uint64_t k = 3; k <= 5; ++k) {
    ForwardBackward(model, sgd, k);
    ASSERT_TRUE(HandAll(**plus, model).ok());
    ASSERT_TRUE((*plus)->Step().ok());
  }
  ASSERT_TRUE((*plus)->Flush().ok());
  EXPECT_EQ(ReplicaDifference(**plus, model, sgd), "");
}

TEST(LowDiffPlusErrorsTest, AnUnnamedParameterOrAnotherOptimizerIsRefused) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("lowdiff_plus_create");
  Mlp model = MakeMlp(3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto named = model->named_parameters().pairs();
  named.pop_back();
  auto unnamed = LowDiffPlus::Create(named, sgd, EveryStep(pool.path()));
  ASSERT_FALSE(unnamed.ok());
  EXPECT_EQ(unnamed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(unnamed.status().message(), HasSubstr("group0.param5"));

  torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(0.1));
  auto other = LowDiffPlus::Create(model->named_parameters().pairs(), lbfgs,
                                   EveryStep(pool.path()));
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(other.status().message(), HasSubstr("same kind"));
}

}  // namespace
}  // namespace pmsnap::hooks
