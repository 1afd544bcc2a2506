// CheckpointedOptimizer over a real pool: bitwise equality with the plain
// optimizer for 50 checkpointed steps, restore straight into a fresh model
// and optimizer (which then keep training bitwise equal), extra-state
// helpers, and the errors a user can run into (changed shapes and dtypes,
// another model's pool, parameters added after training started, a file
// system too small, extra state too large, restore at the wrong time).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "hooks_test_util.h"
#include "pmsnap/frontend/parameter_units.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/extra_state.h"
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
using pmsnap::testing::StepBothAndCompare;
using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

class CheckpointedEquivalenceTest : public ::testing::TestWithParam<OptimizerConfig> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(CheckpointedEquivalenceTest, FiftyCheckpointedStepsThenRestoreAreBitwiseIdentical) {
  TempPoolPath pool("hooks-equivalence");
  Mlp plain_model = MakeMlp(21);
  Mlp model = MakeMlp(21);
  auto plain = GetParam().make(plain_model->parameters());
  auto optimizer = GetParam().make(model->parameters());
  {
    auto checkpointed = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    // Blocks of 64 floats split the test model's weights: the cache-blocked
    // update (Adam, AdamW, Adagrad) runs while the workers copy.
    (*checkpointed)->set_optimizer_block_bytes(256, /*min_parameter_bytes=*/0);
    // Each step's extra state is its number, read back by the restore below.
    ASSERT_EQ(StepBothAndCompare(plain_model, *plain, model, *optimizer, 1, 50,
                                 [&] {
                                   const std::byte marker{static_cast<unsigned char>(
                                       (*checkpointed)->iteration() + 1)};
                                   return (*checkpointed)->Step({&marker, 1}).ok();
                                 }),
              "");
    EXPECT_EQ((*checkpointed)->iteration(), 50u);
    EXPECT_EQ((*checkpointed)->stepper().blocked_updates() > 0,
              pmsnap::testing::UpdatesInBlocks(GetParam()));
    ASSERT_TRUE((*checkpointed)->Close().ok());
    EXPECT_EQ((*checkpointed)->stats().epochs_committed, 50u);
  }

  // A fresh model and optimizer (different initial values) restored from the pool.
  Mlp restored_model = MakeMlp(99);
  auto restored_optimizer = GetParam().make(restored_model->parameters());
  auto checkpointed =
      CheckpointedOptimizer::Create(*restored_model, *restored_optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  auto info = (*checkpointed)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 50u);
  ASSERT_EQ(info->extra_state.size(), 1u);
  EXPECT_EQ(info->extra_state[0], std::byte{50});
  EXPECT_EQ((*checkpointed)->iteration(), 50u);
  // Parameters, state tensors and libtorch's int64 step fields are all back.
  EXPECT_EQ(FirstBitwiseDifference(plain_model, *plain, restored_model, *restored_optimizer), "");
  // And training continues exactly as the uninterrupted run.
  EXPECT_EQ(StepBothAndCompare(plain_model, *plain, restored_model, *restored_optimizer, 51, 55,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
}

TEST_P(CheckpointedEquivalenceTest, StartingOverWithoutRestoreTrainsLikeAFreshOptimizer) {
  TempPoolPath pool("hooks-start-over");
  {
    Mlp model = MakeMlp(3);
    auto optimizer = GetParam().make(model->parameters());
    auto checkpointed = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    for (std::uint64_t step = 1; step <= 3; ++step) {
      ForwardBackward(model, *optimizer, step);
      ASSERT_TRUE((*checkpointed)->Step().ok());
    }
  }
  // The pool holds a checkpoint, so the new optimizer state waits for a
  // restore that never comes: the first Step must start it from scratch.
  Mlp plain_model = MakeMlp(4);
  Mlp model = MakeMlp(4);
  auto plain = GetParam().make(plain_model->parameters());
  auto optimizer = GetParam().make(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  EXPECT_EQ(StepBothAndCompare(plain_model, *plain, model, *optimizer, 1, 5,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, CheckpointedEquivalenceTest,
                         ::testing::ValuesIn(AllOptimizerConfigs()),
                         [](const auto& info) { return info.param.name; });

TEST(CheckpointedRestoreTest, SgdMomentumRestoredBeforeItsFirstUpdateStillClonesTheGradient) {
  // fc3 is frozen for the first run, so its momentum buffer was never made;
  // after restore it must be created from its first gradient, like libtorch.
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-sgd-lazy");
  auto make_sgd = [](Mlp& m) {
    return torch::optim::SGD(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  };
  Mlp plain_model = MakeMlp(8);
  Mlp model = MakeMlp(8);
  auto plain = make_sgd(plain_model);
  auto sgd = make_sgd(model);
  for (Mlp* m : {&plain_model, &model}) {
    for (auto& p : (*m)->fc3->parameters()) p.set_requires_grad(false);
  }
  {
    auto checkpointed = CheckpointedOptimizer::Create(*model, sgd, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    ASSERT_EQ(StepBothAndCompare(plain_model, plain, model, sgd, 1, 3,
                                 [&] { return (*checkpointed)->Step().ok(); }),
              "");
  }
  Mlp restored_model = MakeMlp(8);
  auto restored_sgd = make_sgd(restored_model);
  auto checkpointed =
      CheckpointedOptimizer::Create(*restored_model, restored_sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  ASSERT_TRUE((*checkpointed)->Restore().ok());
  for (auto& p : plain_model->fc3->parameters()) p.set_requires_grad(true);
  EXPECT_EQ(StepBothAndCompare(plain_model, plain, restored_model, restored_sgd, 4, 8,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
}

TEST(CheckpointedRestoreTest, FreshPoolHasNothingToRestore) {
  TempPoolPath pool("hooks-fresh");
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  EXPECT_EQ((*checkpointed)->Restore().status().code(), StatusCode::kNotFound);
  EXPECT_EQ((*checkpointed)->iteration(), 0u);
}

TEST(CheckpointedRestoreTest, RestoreAfterTrainingStartedIsRefused) {
  TempPoolPath pool("hooks-late-restore");
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  ForwardBackward(model, adam, 1);
  ASSERT_TRUE((*checkpointed)->Step().ok());
  EXPECT_EQ((*checkpointed)->Restore().status().code(), StatusCode::kFailedPrecondition);
}

TEST(CheckpointedRestoreTest, RestoreFromPoolLoadsModelAndOptimizerAndReleasesThePool) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-restore-from-pool");
  Mlp model = MakeMlp(5);
  torch::optim::AdamW adamw(model->parameters());
  {
    auto checkpointed = CheckpointedOptimizer::Create(*model, adamw, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok());
    for (std::uint64_t step = 1; step <= 4; ++step) {
      ForwardBackward(model, adamw, step);
      ASSERT_TRUE((*checkpointed)->Step().ok());
    }
  }
  Mlp loaded = MakeMlp(6);
  torch::optim::AdamW loaded_adamw(loaded->parameters());
  auto info = RestoreFromPool(*loaded, loaded_adamw, EveryStep(pool.path()));
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 4u);
  EXPECT_EQ(FirstBitwiseDifference(model, adamw, loaded, loaded_adamw), "");
  // Released: the pool opens again.
  auto again = RestoreFromPool(*loaded, loaded_adamw, EveryStep(pool.path()));
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

// A module with BatchNorm: forward changes its running statistics in place;
// every checkpoint holds them as of its step boundary and Restore brings
// them back with the parameters ([lossless]: they used to be left out).
struct BatchNormNet : torch::nn::Module {
  BatchNormNet() {
    fc = register_module("fc", torch::nn::Linear(6, 8));
    bn = register_module("bn", torch::nn::BatchNorm1d(8));
    out = register_module("out", torch::nn::Linear(8, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return out(torch::relu(bn(fc(x))));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
  torch::nn::Linear out{nullptr};
};

void TrainBatchNormNet(BatchNormNet& net, torch::optim::Optimizer& optimizer,
                       CheckpointedOptimizer* checkpointed, std::uint64_t first,
                       std::uint64_t last) {
  for (std::uint64_t step = first; step <= last; ++step) {
    torch::manual_seed(static_cast<std::uint64_t>(step));
    optimizer.zero_grad();
    net.forward(torch::randn({5, 6})).square().mean().backward();
    if (checkpointed != nullptr) {
      ASSERT_TRUE(checkpointed->Step().ok());
    } else {
      optimizer.step();
    }
  }
}

std::string FirstBufferDifference(const BatchNormNet& a, const BatchNormNet& b) {
  auto want = a.named_buffers();
  auto got = b.named_buffers();
  for (const auto& item : want) {
    const torch::Tensor* other = got.find(item.key());
    if (other == nullptr) return "no buffer " + item.key();
    if (other->scalar_type() != item.value().scalar_type() || !torch::equal(*other, item.value())) {
      return "buffer " + item.key() + " differs";
    }
  }
  return "";
}

TEST(CheckpointedBuffersTest, BatchNormStatisticsAreRestoredWithTheParameters) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-buffers");
  torch::manual_seed(3);
  BatchNormNet net;
  torch::optim::Adam adam(net.parameters());
  {
    auto checkpointed = CheckpointedOptimizer::Create(net, adam, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    TrainBatchNormNet(net, adam, checkpointed->get(), 1, 6);
    ASSERT_TRUE((*checkpointed)->Close().ok());
  }
  torch::manual_seed(4);
  BatchNormNet restored;
  torch::optim::Adam restored_adam(restored.parameters());
  auto checkpointed = CheckpointedOptimizer::Create(restored, restored_adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  auto info = (*checkpointed)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 6u);
  EXPECT_EQ(FirstBufferDifference(net, restored), "");
  EXPECT_EQ(restored.bn->num_batches_tracked.item<std::int64_t>(), 6);
  // And both go on alike.
  TrainBatchNormNet(net, adam, nullptr, 7, 8);
  TrainBatchNormNet(restored, restored_adam, checkpointed->get(), 7, 8);
  EXPECT_EQ(FirstBufferDifference(net, restored), "");
}

TEST(CheckpointedBuffersTest, BufferModeSkipLeavesThemOutOfThePool) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-buffers-skip");
  BatchNormNet net;
  torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
  {
    auto checkpointed = CheckpointedOptimizer::Create(net, sgd, EveryStep(pool.path()), {},
                                                      UpdateMode::kInStep, BufferMode::kSkip);
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    TrainBatchNormNet(net, sgd, checkpointed->get(), 1, 2);
    EXPECT_FALSE((*checkpointed)->engine().FindUnit(std::string(frontend::kBuffersUnit)));
  }
  // Opened with buffers, the pool is another model's.
  auto with_buffers = CheckpointedOptimizer::Create(net, sgd, EveryStep(pool.path()));
  EXPECT_EQ(with_buffers.status().code(), StatusCode::kModelMismatch);
}

TEST(CheckpointedRestoreTest, RestoreFromMissingPoolIsNotFound) {
  Mlp model = MakeMlp(5);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto info = RestoreFromPool(*model, sgd, EveryStep(pmsnap::PoolDirectory() + "/no-such.pool"));
  EXPECT_EQ(info.status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(pmsnap::PoolDirectory() + "/no-such.pool"));
}

// --- errors ---

struct TwoTensors {
  torch::Tensor weight;
  torch::Tensor bias;
  std::vector<std::pair<std::string, torch::Tensor>> named() const {
    return {{"layer.weight", weight}, {"layer.bias", bias}};
  }
};

TwoTensors MakeTensors(std::vector<std::int64_t> weight_shape, torch::Dtype dtype) {
  return {torch::zeros(weight_shape, dtype).requires_grad_(true),
          torch::zeros({4}, dtype).requires_grad_(true)};
}

Status CreateAndClose(const TwoTensors& tensors, const std::string& path) {
  torch::optim::Adam adam(std::vector<torch::Tensor>{tensors.weight, tensors.bias});
  auto checkpointed = CheckpointedOptimizer::Create(tensors.named(), adam, EveryStep(path));
  if (!checkpointed.ok()) return checkpointed.status();
  return (*checkpointed)->Close();
}

TEST(CheckpointedErrorsTest, ParameterWithChangedShapeIsNamed) {
  TempPoolPath pool("hooks-shape");
  ASSERT_TRUE(CreateAndClose(MakeTensors({4, 8}, torch::kFloat32), pool.path()).ok());
  Status status = CreateAndClose(MakeTensors({4, 9}, torch::kFloat32), pool.path());
  EXPECT_EQ(status.code(), StatusCode::kModelMismatch);
  EXPECT_THAT(status.message(), HasSubstr("layer.weight"));
  EXPECT_THAT(status.message(), HasSubstr(pool.path()));
}

TEST(CheckpointedErrorsTest, ParameterWithChangedDtypeIsNamed) {
  TempPoolPath pool("hooks-dtype");
  ASSERT_TRUE(CreateAndClose(MakeTensors({4, 8}, torch::kFloat32), pool.path()).ok());
  Status status = CreateAndClose(MakeTensors({4, 8}, torch::kFloat64), pool.path());
  EXPECT_EQ(status.code(), StatusCode::kModelMismatch);
  EXPECT_THAT(status.message(), HasSubstr("layer.weight"));
}

TEST(CheckpointedErrorsTest, PoolOfAnotherModelIsRefused) {
  TempPoolPath pool("hooks-other-model");
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters());
  ASSERT_TRUE(CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path())).ok());
  TwoTensors other = MakeTensors({4, 8}, torch::kFloat32);
  torch::optim::Adam other_adam(std::vector<torch::Tensor>{other.weight, other.bias});
  auto checkpointed =
      CheckpointedOptimizer::Create(other.named(), other_adam, EveryStep(pool.path()));
  EXPECT_EQ(checkpointed.status().code(), StatusCode::kModelMismatch);
  EXPECT_THAT(checkpointed.status().message(), HasSubstr("another model"));
}

TEST(CheckpointedErrorsTest, SameModelWithAnotherOptimizerIsRefused) {
  TempPoolPath pool("hooks-other-optimizer");
  Mlp model = MakeMlp(1);
  {
    torch::optim::Adam adam(model->parameters());
    ASSERT_TRUE(CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path())).ok());
  }
  torch::optim::Adagrad adagrad(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, adagrad, EveryStep(pool.path()));
  EXPECT_EQ(checkpointed.status().code(), StatusCode::kModelMismatch);
  EXPECT_THAT(checkpointed.status().message(), HasSubstr("Adagrad"));
}

TEST(CheckpointedErrorsTest, ParamGroupAddedAfterTrainingStartedIsRefused) {
  TempPoolPath pool("hooks-late-group");
  Mlp model = MakeMlp(1);
  torch::optim::SGD sgd(model->fc1->parameters(), torch::optim::SGDOptions(0.1));
  auto checkpointed = CheckpointedOptimizer::Create(*model, sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  ForwardBackward(model, sgd, 1);
  ASSERT_TRUE((*checkpointed)->Step().ok());
  sgd.add_param_group(torch::optim::OptimizerParamGroup(model->fc2->parameters()));
  ForwardBackward(model, sgd, 2);
  Status status = (*checkpointed)->Step();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("gained parameters"));
  EXPECT_EQ((*checkpointed)->iteration(), 1u);
}

TEST(CheckpointedErrorsTest, ParameterReallocatedAfterRegistrationIsNamed) {
  TempPoolPath pool("hooks-realloc");
  Mlp model = MakeMlp(1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto checkpointed = CheckpointedOptimizer::Create(*model, sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  {
    torch::NoGradGuard no_grad;
    model->fc2->weight.set_data(torch::zeros({16, 16}, torch::kFloat64));
  }
  Status status = (*checkpointed)->Step();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("fc2.weight"));
}

// The checkpoint of a step copies the parameters in the background after
// Step returns. A training loop that replaces a parameter's data right then
// (set_data) dropped the last reference to the storage the engine was
// copying: with the stepper holding only raw addresses, libtorch freed it
// under the copy (a heap-use-after-free under AddressSanitizer, the bug the
// Python front end had). The registered storage must stay alive, the
// checkpoint must hold what the step wrote, and ownership must end with the
// optimizer.
TEST(CheckpointedErrorsTest, ReplacedParameterStorageStaysAliveForTheCheckpointInFlight) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-replaced-storage");
  Mlp model = MakeMlp(3);
  torch::optim::Adam adam(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  ForwardBackward(model, adam, 1);
  ASSERT_TRUE((*checkpointed)->Step().ok());
  const torch::Tensor stepped = model->fc2->weight.detach().clone();
  c10::weak_intrusive_ptr<c10::StorageImpl> old_storage =
      model->fc2->weight.storage().getWeakStorageImpl();
  {
    torch::NoGradGuard no_grad;
    model->fc2->weight.set_data(torch::zeros_like(stepped));
  }
  EXPECT_FALSE(old_storage.expired())
      << "fc2.weight's registered storage was freed while its checkpoint may still copy it";
  EXPECT_TRUE((*checkpointed)->Flush().ok());
  ForwardBackward(model, adam, 2);
  Status refused = (*checkpointed)->Step();
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("fc2.weight"));
  checkpointed->reset();
  EXPECT_TRUE(old_storage.expired()) << "the optimizer kept fc2.weight's old storage after it closed";

  Mlp loaded = MakeMlp(4);
  torch::optim::Adam loaded_adam(loaded->parameters());
  auto info = RestoreFromPool(*loaded, loaded_adam, EveryStep(pool.path()));
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 1u);
  EXPECT_TRUE(torch::equal(loaded->fc2->weight, stepped))
      << "the checkpoint of step 1 does not hold fc2.weight as that step left it";
}

// Restore writes to the addresses registered at Create; a parameter replaced
// in between would keep its new values (and, before the stepper held the
// registered storage, the restore wrote into freed memory).
TEST(CheckpointedErrorsTest, ParameterReplacedBeforeRestoreIsRefused) {
  TempPoolPath pool("hooks-replaced-before-restore");
  {
    Mlp model = MakeMlp(3);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
    auto checkpointed = CheckpointedOptimizer::Create(*model, sgd, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    ForwardBackward(model, sgd, 1);
    ASSERT_TRUE((*checkpointed)->Step().ok());
  }
  Mlp model = MakeMlp(4);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto checkpointed = CheckpointedOptimizer::Create(*model, sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  {
    torch::NoGradGuard no_grad;
    model->fc1->bias.set_data(torch::zeros_like(model->fc1->bias));
  }
  auto restored = (*checkpointed)->Restore();
  EXPECT_EQ(restored.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(restored.status().message(), HasSubstr("fc1.bias"));
  EXPECT_TRUE(torch::equal(model->fc1->bias, torch::zeros_like(model->fc1->bias)));
}

TEST(CheckpointedErrorsTest, FileSystemTooSmallForThePoolIsNoSpace) {
  TempPoolPath pool("hooks-no-space");
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters());
  runtime::EngineOptions options = EveryStep(pool.path());
  options.pool_options.extra_state_capacity = 1ull << 46;  // 64 TiB per slot
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, options);
  EXPECT_EQ(checkpointed.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(checkpointed.status().message(), HasSubstr("free"));
  EXPECT_FALSE(std::filesystem::exists(pool.path()));
}

TEST(CheckpointedErrorsTest, ExtraStateOverCapacityFailsTheCheckpointNotTheStep) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-extra-too-big");
  Mlp plain_model = MakeMlp(2);
  Mlp model = MakeMlp(2);
  torch::optim::Adam plain(plain_model->parameters());
  torch::optim::Adam adam(model->parameters());
  runtime::EngineOptions options = EveryStep(pool.path());
  options.pool_options.extra_state_capacity = 16;
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, options);
  ASSERT_TRUE(checkpointed.ok());
  std::vector<std::byte> big(17);
  ForwardBackward(plain_model, plain, 1);
  plain.step();
  ForwardBackward(model, adam, 1);
  EXPECT_EQ((*checkpointed)->Step(big).code(), StatusCode::kCapacityExceeded);
  EXPECT_EQ(FirstBitwiseDifference(plain_model, plain, model, adam), "");
}

TEST(CheckpointedErrorsTest, UnsupportedOptimizerIsInvalidArgument) {
  TempPoolPath pool("hooks-lbfgs");
  Mlp model = MakeMlp(1);
  torch::optim::LBFGS lbfgs(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, lbfgs, EveryStep(pool.path()));
  EXPECT_EQ(checkpointed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(pool.path()));
}

// --- extra state ---

TEST(ExtraStateTest, PackedStateRoundTrips) {
  ExtraState state;
  state.data_position = 123456789012345ull;
  state.rng_state = {std::byte{1}, std::byte{2}, std::byte{3}};
  state.user = {std::byte{9}};
  auto unpacked = UnpackExtraState(PackExtraState(state));
  ASSERT_TRUE(unpacked.ok()) << unpacked.status().ToString();
  EXPECT_EQ(*unpacked, state);
}

TEST(ExtraStateTest, TruncatedOrForeignBytesAreCorruption) {
  ExtraState state;
  state.rng_state.resize(100);
  std::vector<std::byte> packed = PackExtraState(state);
  for (std::size_t cut : {std::size_t{0}, std::size_t{3}, std::size_t{20}, packed.size() - 1}) {
    auto unpacked = UnpackExtraState(std::span(packed).first(cut));
    EXPECT_EQ(unpacked.status().code(), StatusCode::kCorruption) << cut;
  }
  packed.push_back(std::byte{0});
  EXPECT_EQ(UnpackExtraState(packed).status().code(), StatusCode::kCorruption);
  std::vector<std::byte> foreign(64, std::byte{0x41});
  EXPECT_THAT(UnpackExtraState(foreign).status().message(), HasSubstr("magic"));
}

TEST(ExtraStateTest, CpuRngStateRestoresTheRandomStream) {
  torch::manual_seed(77);
  auto saved = CaptureCpuRngState();
  ASSERT_TRUE(saved.ok());
  torch::Tensor first = torch::rand({16});
  torch::rand({1000});
  ASSERT_TRUE(RestoreCpuRngState(*saved).ok());
  EXPECT_TRUE(torch::equal(torch::rand({16}), first));
}

TEST(ExtraStateTest, GarbageRngStateIsRejectedWithLibtorchMessage) {
  std::vector<std::byte> garbage(7, std::byte{1});
  Status status = RestoreCpuRngState(garbage);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("libtorch"));
}

}  // namespace
}  // namespace pmsnap::hooks
