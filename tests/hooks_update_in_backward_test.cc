// UpdateMode::kInBackward: CheckpointedOptimizer updates each parameter
// inside backward(), from its post-accumulate-grad hook. The parameters
// have their new values when backward returns, bitwise those of backward()
// then step() of the plain optimizer (every optimizer configuration, the
// cache-blocked update included), and the pool restores them; copies start
// after each update (kAuto means kAfterUpdate); on a slow simulated device
// the conflicts change nothing; embedding tables marked from gradients in the
// hooks keep exact differential checkpoints. Step applies gradients no hook
// saw (set by hand, frozen parameters, no backward). Errors: a second backward
// before Step throws out of backward naming the parameter; a worker error in
// a hook leaves training exact and comes back from Step; changed parameters
// make the hooks update nothing. Close and the destructor take the hooks off
// and give back the hook a parameter had. Each check has its counterpart in
// UpdateMode::kInStep where that tells the modes apart. ParameterStepper's
// StepOne, which the hooks run, equals Step slot by slot.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <cstring>
#include <map>
#include <random>

#include "hooks_test_util.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/parameter_stepper.h"
#include "pmsnap/runtime/cuda_device.h"
#include "testutil/temp_pool.h"
#include "testutil/test_devices.h"

namespace pmsnap::hooks {
namespace {

using pmsnap::testing::AllOptimizerConfigs;
using pmsnap::testing::EveryStep;
using pmsnap::testing::FailingDevice;
using pmsnap::testing::FirstBitwiseDifference;
using pmsnap::testing::ForwardBackward;
using pmsnap::testing::MakeMlp;
using pmsnap::testing::Mlp;
using pmsnap::testing::OptimizerConfig;
using pmsnap::testing::StepBothAndCompare;
using pmsnap::testing::TempPoolPath;
using ::testing::ContainsRegex;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

Result<std::unique_ptr<CheckpointedOptimizer>> CreateInBackward(Mlp& model,
                                                                torch::optim::Optimizer& optimizer,
                                                                runtime::EngineOptions options) {
  return CheckpointedOptimizer::Create(*model, optimizer, std::move(options), {},
                                       UpdateMode::kInBackward);
}

std::vector<torch::Tensor> Snapshot(Mlp& model) {
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

// Names of the parameters that are (moved) or are not (!moved) bitwise
// what `before` holds.
std::vector<std::string> Parameters(Mlp& model, const std::vector<torch::Tensor>& before,
                                    bool moved) {
  std::vector<std::string> out;
  auto named = model->named_parameters();
  for (std::size_t i = 0; i < named.size(); ++i) {
    if (torch::equal(named[i].value(), before[i]) != moved) out.push_back(named[i].key());
  }
  return out;
}
std::vector<std::string> Moved(Mlp& model, const std::vector<torch::Tensor>& before) {
  return Parameters(model, before, true);
}
std::vector<std::string> Unmoved(Mlp& model, const std::vector<torch::Tensor>& before) {
  return Parameters(model, before, false);
}

// Runs `steps` plain steps from MakeMlp(seed) (the reference for a restore).
std::pair<Mlp, std::unique_ptr<torch::optim::Optimizer>> TrainPlain(const OptimizerConfig& config,
                                                                    std::uint64_t seed,
                                                                    std::uint64_t steps) {
  Mlp model = MakeMlp(seed);
  auto optimizer = config.make(model->parameters());
  for (std::uint64_t k = 1; k <= steps; ++k) {
    ForwardBackward(model, *optimizer, k);
    optimizer->step();
  }
  return {model, std::move(optimizer)};
}

class UpdateInBackwardTest : public ::testing::TestWithParam<OptimizerConfig> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(UpdateInBackwardTest, BackwardUpdatesBitwiseAsStepAndThePoolRestoresIt) {
  TempPoolPath pool("hooks-uib-equivalence");
  Mlp plain_model = MakeMlp(21);
  Mlp model = MakeMlp(21);
  auto plain = GetParam().make(plain_model->parameters());
  auto optimizer = GetParam().make(model->parameters());
  {
    auto checkpointed = CreateInBackward(model, *optimizer, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    EXPECT_EQ((*checkpointed)->update_mode(), UpdateMode::kInBackward);
    // Blocks of 64 floats split the weights: the cache-blocked update (Adam,
    // AdamW, Adagrad) runs inside the hooks.
    (*checkpointed)->set_optimizer_block_bytes(256, /*min_parameter_bytes=*/0);
    for (std::uint64_t k = 1; k <= 20; ++k) {
      ForwardBackward(plain_model, *plain, k);
      plain->step();
      const std::vector<torch::Tensor> before = Snapshot(model);
      ForwardBackward(model, *optimizer, k);
      // backward() did the whole optimizer step.
      ASSERT_THAT(Unmoved(model, before), IsEmpty()) << "step " << k;
      ASSERT_EQ(FirstBitwiseDifference(plain_model, *plain, model, *optimizer), "")
          << "after backward " << k;
      Status status = (*checkpointed)->Step();
      ASSERT_TRUE(status.ok()) << status.ToString();
      ASSERT_EQ(FirstBitwiseDifference(plain_model, *plain, model, *optimizer), "")
          << "after step " << k;
    }
    EXPECT_EQ((*checkpointed)->iteration(), 20u);
    EXPECT_EQ((*checkpointed)->stepper().blocked_updates() > 0,
              pmsnap::testing::UpdatesInBlocks(GetParam()));
    ASSERT_TRUE((*checkpointed)->Close().ok());
    EXPECT_EQ((*checkpointed)->stats().epochs_committed, 20u);
  }

  // A fresh model and optimizer (other initial values) restored from the
  // pool, then trained on in backward: still the uninterrupted plain run.
  Mlp restored_model = MakeMlp(99);
  auto restored_optimizer = GetParam().make(restored_model->parameters());
  auto checkpointed = CreateInBackward(restored_model, *restored_optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  auto info = (*checkpointed)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 20u);
  EXPECT_EQ(FirstBitwiseDifference(plain_model, *plain, restored_model, *restored_optimizer), "");
  EXPECT_EQ(StepBothAndCompare(plain_model, *plain, restored_model, *restored_optimizer, 21, 25,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
}

TEST_P(UpdateInBackwardTest, StartingOverWithoutRestoreInitializesTheStateInTheFirstHook) {
  TempPoolPath pool("hooks-uib-start-over");
  {
    Mlp model = MakeMlp(3);
    auto optimizer = GetParam().make(model->parameters());
    auto checkpointed = CreateInBackward(model, *optimizer, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    for (std::uint64_t step = 1; step <= 3; ++step) {
      ForwardBackward(model, *optimizer, step);
      ASSERT_TRUE((*checkpointed)->Step().ok());
    }
  }
  // The pool holds a checkpoint, so the new optimizer state waits for a
  // restore that never comes: the first backward must start it from scratch.
  Mlp plain_model = MakeMlp(4);
  Mlp model = MakeMlp(4);
  auto plain = GetParam().make(plain_model->parameters());
  auto optimizer = GetParam().make(model->parameters());
  auto checkpointed = CreateInBackward(model, *optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  ForwardBackward(plain_model, *plain, 1);
  plain->step();
  ForwardBackward(model, *optimizer, 1);
  EXPECT_EQ(FirstBitwiseDifference(plain_model, *plain, model, *optimizer), "");
  ASSERT_TRUE((*checkpointed)->Step().ok());
  EXPECT_EQ(StepBothAndCompare(plain_model, *plain, model, *optimizer, 2, 5,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
  // The pool holds this run now: a restore gives its last step back.
  ASSERT_TRUE((*checkpointed)->Close().ok());
  Mlp restored_model = MakeMlp(99);
  auto restored_optimizer = GetParam().make(restored_model->parameters());
  auto info = RestoreFromPool(*restored_model, *restored_optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 5u);
  EXPECT_EQ(FirstBitwiseDifference(plain_model, *plain, restored_model, *restored_optimizer), "");
}

TEST_P(UpdateInBackwardTest, InStepModeBackwardLeavesTheParametersToStep) {
  TempPoolPath pool("hooks-uib-in-step");
  Mlp model = MakeMlp(21);
  auto optimizer = GetParam().make(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  EXPECT_EQ((*checkpointed)->update_mode(), UpdateMode::kInStep);
  for (std::uint64_t k = 1; k <= 3; ++k) {
    const std::vector<torch::Tensor> before = Snapshot(model);
    ForwardBackward(model, *optimizer, k);
    ASSERT_THAT(Moved(model, before), IsEmpty()) << "step " << k;
    ASSERT_TRUE((*checkpointed)->Step().ok());
    ASSERT_THAT(Unmoved(model, before), IsEmpty()) << "step " << k;
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, UpdateInBackwardTest,
                         ::testing::ValuesIn(AllOptimizerConfigs()),
                         [](const auto& info) { return info.param.name; });

OptimizerConfig AdamConfig() {
  for (OptimizerConfig& config : AllOptimizerConfigs()) {
    if (config.name == "Adam") return config;
  }
  return {};
}

class UpdateInBackwardConflictTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(UpdateInBackwardConflictTest, SlowDeviceConflictsInsideBackwardChangeNothing) {
  TempPoolPath pool("hooks-uib-conflicts");
  // 2 MB/s: an epoch of the MLP with Adam state (about 6 KB) takes ~3 ms,
  // several iterations, so the next backward meets uncopied weights.
  auto device = runtime::MakeDevice("simulated:0.002:64");
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  runtime::EngineOptions options;
  options.pool_path = pool.path();
  options.device = device->get();
  options.strategy = conflict::MakeStrategy(GetParam());
  // The continuous policy (no policy set): an epoch starts at the first step
  // boundary after the previous one is durable, nothing waits for it there.
  options.print_summary = false;
  const OptimizerConfig adam = AdamConfig();
  Mlp plain_model = MakeMlp(5);
  Mlp model = MakeMlp(5);
  auto plain = adam.make(plain_model->parameters());
  auto optimizer = adam.make(model->parameters());
  std::uint64_t committed = 0;
  {
    auto checkpointed = CreateInBackward(model, *optimizer, options);
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    for (std::uint64_t k = 1; k <= 20; ++k) {
      ForwardBackward(plain_model, *plain, k);
      plain->step();
      const std::vector<torch::Tensor> before = Snapshot(model);
      ForwardBackward(model, *optimizer, k);  // the conflicts happen in here
      ASSERT_THAT(Unmoved(model, before), IsEmpty()) << "step " << k;
      Status status = (*checkpointed)->Step();
      ASSERT_TRUE(status.ok()) << status.ToString();
      ASSERT_EQ(FirstBitwiseDifference(plain_model, *plain, model, *optimizer), "") << "step " << k;
    }
    ASSERT_TRUE((*checkpointed)->Close().ok());
    const runtime::Stats stats = (*checkpointed)->stats();
    EXPECT_GT(stats.conflicts, 0u) << stats.Summary();
    EXPECT_GT(stats.epochs_committed, 0u);
    committed = stats.last_committed_iteration;
  }
  ASSERT_GT(committed, 0u);
  Mlp restored_model = MakeMlp(99);
  auto restored_optimizer = adam.make(restored_model->parameters());
  auto info = RestoreFromPool(*restored_model, *restored_optimizer, EveryStep(pool.path()));
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, committed);
  auto [reference_model, reference] = TrainPlain(adam, 5, committed);
  EXPECT_EQ(
      FirstBitwiseDifference(reference_model, *reference, restored_model, *restored_optimizer), "");
}

INSTANTIATE_TEST_SUITE_P(Strategies, UpdateInBackwardConflictTest,
                         ::testing::Values("1", "2", "3", "adaptive"), [](const auto& info) {
                           return info.param == "adaptive" ? std::string("Adaptive")
                                                           : "Strategy" + info.param;
                         });

// Bytes whose copies waited for EndStep over 5 steps on the host device.
std::uint64_t HeldBytes(UpdateMode mode, runtime::CopyStart copy_start) {
  TempPoolPath pool("hooks-uib-held");
  Mlp model = MakeMlp(7);
  torch::optim::Adam adam(model->parameters());
  runtime::EngineOptions options = EveryStep(pool.path());
  options.copy_start = copy_start;
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, options, {}, mode);
  EXPECT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  if (!checkpointed.ok()) return 0;
  for (std::uint64_t k = 1; k <= 5; ++k) {
    ForwardBackward(model, adam, k);
    EXPECT_TRUE((*checkpointed)->Step().ok());
  }
  EXPECT_TRUE((*checkpointed)->Close().ok());
  return (*checkpointed)->stats().held_bytes;
}

TEST(UpdateInBackwardCopyStartTest, AutoStartsEveryCopyAfterItsUpdate) {
  pmsnap::testing::UseOneTorchThread();
  EXPECT_EQ(HeldBytes(UpdateMode::kInBackward, runtime::CopyStart::kAuto), 0u);
  // An explicit choice stands (and shows that held_bytes counts).
  EXPECT_GT(HeldBytes(UpdateMode::kInBackward, runtime::CopyStart::kAfterStep), 0u);
}

// A gradient for every parameter of `model`, as if set by hand (no autograd).
void SetGradients(const std::vector<torch::Tensor>& parameters, std::uint64_t step) {
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    torch::Tensor p = parameters[i];
    p.mutable_grad() = torch::sin(torch::arange(p.numel(), torch::kFloat32).reshape(p.sizes()) *
                                      (0.1f * static_cast<float>(step)) +
                                  static_cast<float>(i)) *
                       0.01f;
  }
}

TEST(UpdateInBackwardStepTest, StepAppliesTheGradientsNoHookSaw) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-by-hand");
  auto make = [](Mlp& m) {
    return torch::optim::SGD(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  };
  Mlp plain_model = MakeMlp(8);
  Mlp model = MakeMlp(8);
  auto plain = make(plain_model);
  auto sgd = make(model);
  auto checkpointed = CreateInBackward(model, sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();

  // The first step without any backward: Step does it all (the optimizer
  // state gets its initial values there).
  SetGradients(plain_model->parameters(), 1);
  plain.step();
  SetGradients(model->parameters(), 1);
  ASSERT_TRUE((*checkpointed)->Step().ok());
  ASSERT_EQ(FirstBitwiseDifference(plain_model, plain, model, sgd), "");

  // fc1 frozen: backward gives it no gradient and fires no hook; its
  // gradient is then set by hand.
  for (Mlp* m : {&plain_model, &model}) {
    for (auto& p : (*m)->fc1->parameters()) p.set_requires_grad(false);
  }
  for (std::uint64_t k = 2; k <= 6; ++k) {
    ForwardBackward(plain_model, plain, k);
    SetGradients(plain_model->fc1->parameters(), k);
    plain.step();
    const std::vector<torch::Tensor> before = Snapshot(model);
    ForwardBackward(model, sgd, k);
    SetGradients(model->fc1->parameters(), k);
    ASSERT_THAT(Unmoved(model, before), ElementsAre("fc1.weight", "fc1.bias")) << "step " << k;
    ASSERT_TRUE((*checkpointed)->Step().ok());
    ASSERT_THAT(Unmoved(model, before), IsEmpty()) << "step " << k;
    ASSERT_EQ(FirstBitwiseDifference(plain_model, plain, model, sgd), "") << "step " << k;
  }
  ASSERT_TRUE((*checkpointed)->Close().ok());
  EXPECT_EQ((*checkpointed)->stats().epochs_committed, 6u);
}

TEST(UpdateInBackwardErrorsTest, SecondBackwardBeforeStepThrowsNamingTheParameter) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-accumulate");
  Mlp plain_model = MakeMlp(3);
  Mlp model = MakeMlp(3);
  torch::optim::Adam plain(plain_model->parameters());
  torch::optim::Adam adam(model->parameters());
  auto checkpointed = CreateInBackward(model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  ForwardBackward(plain_model, plain, 1);
  plain.step();
  ForwardBackward(model, adam, 1);
  std::string message;
  try {
    auto [x, y] = pmsnap::testing::Batch(2);
    torch::mse_loss(model->forward(x), y).backward();  // accumulates onto batch 1's
    ADD_FAILURE() << "the second backward returned";
  } catch (const c10::ValueError& error) {
    message = error.what_without_backtrace();
  }
  // The output layer's gradients come first.
  EXPECT_THAT(message, ContainsRegex("parameter 'fc3\\.(weight|bias)' got a second gradient"));
  EXPECT_THAT(message, HasSubstr("call Step() after every backward pass"));
  EXPECT_THAT(message, HasSubstr("UpdateMode::kInStep"));
  // The first backward's update stands and Step ends its iteration.
  ASSERT_TRUE((*checkpointed)->Step().ok());
  EXPECT_EQ((*checkpointed)->iteration(), 1u);
  EXPECT_EQ(FirstBitwiseDifference(plain_model, plain, model, adam), "");
  EXPECT_EQ(StepBothAndCompare(plain_model, plain, model, adam, 2, 4,
                               [&] { return (*checkpointed)->Step().ok(); }),
            "");
}

TEST(UpdateInBackwardErrorsTest, InStepModeAccumulatesGradientsOverSeveralBackwardPasses) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-accumulate-in-step");
  Mlp plain_model = MakeMlp(3);
  Mlp model = MakeMlp(3);
  torch::optim::Adam plain(plain_model->parameters());
  torch::optim::Adam adam(model->parameters());
  auto checkpointed = CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  auto [x, y] = pmsnap::testing::Batch(2);
  ForwardBackward(plain_model, plain, 1);
  torch::mse_loss(plain_model->forward(x), y).backward();
  ForwardBackward(model, adam, 1);
  EXPECT_NO_THROW(torch::mse_loss(model->forward(x), y).backward());
  plain.step();
  ASSERT_TRUE((*checkpointed)->Step().ok());
  EXPECT_EQ(FirstBitwiseDifference(plain_model, plain, model, adam), "");
}

TEST(UpdateInBackwardErrorsTest, CheckpointErrorInsideBackwardComesBackFromStep) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-io-error");
  FailingDevice device(/*successes=*/18);  // a few epochs of the MLP's 6 units
  runtime::EngineOptions options = EveryStep(pool.path());
  options.device = &device;
  Mlp plain_model = MakeMlp(4);
  Mlp model = MakeMlp(4);
  torch::optim::AdamW plain(plain_model->parameters());
  torch::optim::AdamW adamw(model->parameters());
  auto checkpointed = CreateInBackward(model, adamw, options);
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  Status first_error;
  for (std::uint64_t k = 1; k <= 10; ++k) {
    ForwardBackward(plain_model, plain, k);
    plain.step();
    const std::vector<torch::Tensor> before = Snapshot(model);
    ASSERT_NO_THROW(ForwardBackward(model, adamw, k)) << "step " << k;
    // Every update completed in backward, the failed hook's and those after it.
    ASSERT_THAT(Unmoved(model, before), IsEmpty()) << "step " << k;
    Status status = (*checkpointed)->Step();
    if (first_error.ok()) first_error = status;
    ASSERT_EQ(FirstBitwiseDifference(plain_model, plain, model, adamw), "") << "step " << k;
  }
  EXPECT_EQ(first_error.code(), StatusCode::kIOError) << first_error.ToString();
  EXPECT_THAT(first_error.message(), HasSubstr("injected copy failure"));
  (void)(*checkpointed)->Close(runtime::CloseMode::kAbandon);
}

// An embedding with sparse gradients, which libtorch's Adam refuses.
struct SparseModelImpl : torch::nn::Module {
  SparseModelImpl() {
    emb = register_module("emb",
                          torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true)));
    fc = register_module("fc", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return fc->forward(emb->forward(ids)); }
  torch::nn::Embedding emb{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(SparseModel);

TEST(UpdateInBackwardErrorsTest, LibtorchErrorInsideAHookComesBackFromStepAsInStepMode) {
  pmsnap::testing::UseOneTorchThread();
  for (UpdateMode mode : {UpdateMode::kInStep, UpdateMode::kInBackward}) {
    SCOPED_TRACE(mode == UpdateMode::kInStep ? "in step" : "in backward");
    TempPoolPath pool("hooks-uib-sparse");
    torch::manual_seed(1);
    SparseModel model;
    torch::optim::Adam adam(model->parameters());
    auto checkpointed =
        CheckpointedOptimizer::Create(*model, adam, EveryStep(pool.path()), {}, mode);
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    const torch::Tensor emb_before = model->emb->weight.detach().clone();
    const torch::Tensor fc_before = model->fc->weight.detach().clone();
    torch::Tensor out = model->forward(torch::tensor({1, 3, 3}, torch::kLong));
    ASSERT_NO_THROW(out.sum().backward());
    EXPECT_EQ(torch::equal(model->fc->weight, fc_before), mode == UpdateMode::kInStep);
    Status status = (*checkpointed)->Step();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_THAT(status.message(), HasSubstr("sparse"));
    EXPECT_FALSE(torch::equal(model->fc->weight, fc_before));
    EXPECT_TRUE(torch::equal(model->emb->weight, emb_before));
  }
}

TEST(UpdateInBackwardErrorsTest, ChangedParametersAreNotUpdatedInBackwardAndStepSaysWhy) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-realloc");
  Mlp model = MakeMlp(1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto checkpointed = CreateInBackward(model, sgd, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  {
    torch::NoGradGuard no_grad;
    model->fc2->weight.set_data(model->fc2->weight.data().clone());  // new storage
  }
  const std::vector<torch::Tensor> before = Snapshot(model);
  ForwardBackward(model, sgd, 1);
  EXPECT_THAT(Moved(model, before), IsEmpty());
  Status status = (*checkpointed)->Step();
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.ToString();
  EXPECT_THAT(status.message(), HasSubstr("fc2.weight"));
  EXPECT_THAT(Moved(model, before), IsEmpty());
  EXPECT_EQ((*checkpointed)->iteration(), 0u);
}

TEST(UpdateInBackwardErrorsTest, RestoreAfterABackwardIsRefused) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-late-restore");
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters());
  {
    auto checkpointed = CreateInBackward(model, adam, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok());
    ForwardBackward(model, adam, 1);
    ASSERT_TRUE((*checkpointed)->Step().ok());
  }
  auto checkpointed = CreateInBackward(model, adam, EveryStep(pool.path()));
  ASSERT_TRUE(checkpointed.ok());
  ForwardBackward(model, adam, 2);  // the pool's checkpoint is no longer what training holds
  EXPECT_EQ((*checkpointed)->Restore().status().code(), StatusCode::kFailedPrecondition);
}

// Stands for a hook the parameter had before (e.g. one set from Python).
struct CountingHook final : torch::autograd::PostAccumulateGradHook {
  explicit CountingHook(std::shared_ptr<int> calls) : calls(std::move(calls)) {}
  void operator()(const torch::autograd::Variable&) override { ++*calls; }
  std::shared_ptr<int> calls;
};

TEST(UpdateInBackwardHooksTest, CloseAndTheDestructorTakeTheHooksOffAndGiveBackTheOldOne) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-lifetime");
  Mlp model = MakeMlp(2);
  torch::optim::Adam adam(model->parameters());
  auto calls = std::make_shared<int>(0);
  auto* old_hook = new CountingHook(calls);
  torch::autograd::impl::set_post_acc_grad_hooks(model->fc2->weight,
                                                 std::unique_ptr<CountingHook>(old_hook));
  auto installed = [&] {
    return torch::autograd::impl::post_acc_grad_hooks(model->fc2->weight).get();
  };
  {
    auto checkpointed = CreateInBackward(model, adam, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    EXPECT_NE(installed(), old_hook);
    std::vector<torch::Tensor> before = Snapshot(model);
    ForwardBackward(model, adam, 1);
    EXPECT_EQ(*calls, 1);  // chained
    EXPECT_THAT(Unmoved(model, before), IsEmpty());
    ASSERT_TRUE((*checkpointed)->Step().ok());
    ASSERT_TRUE((*checkpointed)->Close().ok());
    EXPECT_EQ(installed(), old_hook);
    before = Snapshot(model);
    ForwardBackward(model, adam, 2);
    EXPECT_THAT(Moved(model, before), IsEmpty());
    EXPECT_EQ(*calls, 2);
  }
  {
    // The destructor alone, mid-iteration (no Step after the backward).
    auto checkpointed = CreateInBackward(model, adam, EveryStep(pool.path()));
    ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
    std::vector<torch::Tensor> before = Snapshot(model);
    ForwardBackward(model, adam, 3);
    EXPECT_THAT(Unmoved(model, before), IsEmpty());
  }
  EXPECT_EQ(installed(), old_hook);
  for (const torch::Tensor& p : model->parameters()) {
    if (p.is_same(model->fc2->weight)) continue;
    EXPECT_EQ(torch::autograd::impl::post_acc_grad_hooks(p), nullptr);
  }
  const std::vector<torch::Tensor> before = Snapshot(model);
  ForwardBackward(model, adam, 4);
  EXPECT_THAT(Moved(model, before), IsEmpty());
  EXPECT_EQ(*calls, 4);
}

// --- ParameterStepper::StepOne, which the hooks use ---

// Notes the observer calls: +index before an update, -(index + 1) after.
class RecordingObserver final : public StepObserver {
 public:
  Status BeforeUpdate(std::size_t index) override {
    calls.push_back(static_cast<int>(index));
    return Status::Ok();
  }
  Status AfterUpdate(std::size_t index) override {
    calls.push_back(-static_cast<int>(index) - 1);
    return Status::Ok();
  }
  std::vector<int> calls;
};

TEST(StepOneTest, EachSlotOnceInAnyOrderIsBitwiseStepAndLeavesTheGradients) {
  pmsnap::testing::UseOneTorchThread();
  for (const OptimizerConfig& config : AllOptimizerConfigs()) {
    SCOPED_TRACE(config.name);
    Mlp plain_model = MakeMlp(12);
    Mlp model = MakeMlp(12);
    auto plain = config.make(plain_model->parameters());
    auto optimizer = config.make(model->parameters());
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
    auto stepper = ParameterStepper::Create(*optimizer, named);
    ASSERT_TRUE(stepper.ok()) << stepper.status().ToString();
    (*stepper)->set_block_bytes(256, /*min_parameter_bytes=*/0);
    const std::size_t n = named.size();
    for (std::uint64_t k = 1; k <= 4; ++k) {
      ForwardBackward(plain_model, *plain, k);
      plain->step();
      ForwardBackward(model, *optimizer, k);
      std::vector<torch::Tensor> grads;
      for (const auto& [name, p] : named) grads.push_back(p.grad());
      // Forward order, the reverse of Step's.
      RecordingObserver observer;
      std::vector<int> expected;
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_TRUE((*stepper)->StepOne(i, &observer).ok());
        expected.push_back(static_cast<int>(i));
        expected.push_back(-static_cast<int>(i) - 1);
      }
      EXPECT_EQ(observer.calls, expected);
      for (std::size_t i = 0; i < n; ++i) EXPECT_TRUE(named[i].second.grad().is_same(grads[i]));
      ASSERT_EQ(FirstBitwiseDifference(plain_model, *plain, model, *optimizer), "") << "step " << k;
    }
    EXPECT_EQ((*stepper)->blocked_updates() > 0, pmsnap::testing::UpdatesInBlocks(config));
    EXPECT_EQ((*stepper)->StepOne(n, nullptr).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ((*stepper)->Step(nullptr, std::vector<bool>(n + 1)).code(),
              StatusCode::kInvalidArgument);
    // Skipped slots keep their value.
    const std::vector<torch::Tensor> before = Snapshot(model);
    ForwardBackward(model, *optimizer, 5);
    std::vector<bool> skip(n, true);
    skip[0] = false;
    ASSERT_TRUE((*stepper)->Step(nullptr, skip).ok());
    EXPECT_THAT(Moved(model, before), ElementsAre("fc1.weight"));
  }
}

// --- embedding tables: rows marked from the gradient inside the hooks ---

constexpr std::int64_t kRows = 4000;
constexpr std::int64_t kDim = 4;
const std::string kTable = "bag.weight";

struct BagModelImpl : torch::nn::Module {
  BagModelImpl() {
    bag = register_module(
        "bag",
        torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(kRows, kDim).mode(torch::kSum)));
    fc = register_module("fc", torch::nn::Linear(kDim, 1));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& offsets) {
    return fc->forward(bag->forward(ids, offsets));
  }
  torch::nn::EmbeddingBag bag{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(BagModel);

void BagForwardBackward(BagModel& model, torch::optim::Optimizer& optimizer, std::uint64_t step) {
  optimizer.zero_grad();
  std::mt19937_64 rng(step * 7919 + 3);
  std::uniform_int_distribution<std::int64_t> id(0, kRows - 1);
  std::vector<std::int64_t> ids(64);
  for (auto& i : ids) i = id(rng);
  torch::Tensor offsets = torch::arange(0, 64, 4, torch::kLong);
  torch::Tensor out = model->forward(torch::tensor(ids, torch::kLong), offsets);
  torch::mse_loss(out, torch::ones_like(out)).backward();
}

TEST(UpdateInBackwardEmbeddingTest, RowsMarkedInTheHooksKeepDifferentialCheckpointsExact) {
  pmsnap::testing::UseOneTorchThread();
  TempPoolPath pool("hooks-uib-embedding");
  auto make = [](BagModel& m) {
    return torch::optim::Adagrad(m->parameters(),
                                 torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.1));
  };
  torch::manual_seed(6);
  BagModel plain_model;
  torch::manual_seed(6);
  BagModel model;
  auto plain = make(plain_model);
  auto adagrad = make(model);
  EmbeddingTables tables;
  tables.names = {kTable};
  tables.options.policy = diff::Policy::kIntermittentDifferential;
  tables.options.retain = 3;
  tables.rows = RowSource::kGradients;
  runtime::EngineOptions options = EveryStep(pool.path());
  auto checkpointed =
      CheckpointedOptimizer::Create(*model, adagrad, options, tables, UpdateMode::kInBackward);
  ASSERT_TRUE(checkpointed.ok()) << checkpointed.status().ToString();
  std::map<std::uint64_t, std::vector<float>> reference;  // iteration -> table
  int differential = 0;
  for (std::uint64_t k = 1; k <= 10; ++k) {
    BagForwardBackward(plain_model, plain, k);
    plain.step();
    BagForwardBackward(model, adagrad, k);
    ASSERT_TRUE(torch::equal(plain_model->bag->weight, model->bag->weight)) << "step " << k;
    ASSERT_TRUE((*checkpointed)->Step().ok());
    ASSERT_TRUE((*checkpointed)->Flush().ok());
    torch::Tensor table = model->bag->weight.detach().contiguous();
    reference[k].assign(table.data_ptr<float>(), table.data_ptr<float>() + table.numel());
    if (!(*checkpointed)->embedding_checkpointer()->last_checkpoint(kTable).full) ++differential;
  }
  EXPECT_GE(differential, 5);
  auto listed = diff::ListCheckpoints((*checkpointed)->engine().pool(), kTable);
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 3u);
  for (const diff::CheckpointInfo& info : *listed) {
    auto recovered = diff::RecoverTable((*checkpointed)->engine().pool(), kTable, info.epoch);
    ASSERT_TRUE(recovered.ok()) << recovered.status().ToString();
    ASSERT_FALSE(recovered->tensors.empty());
    EXPECT_TRUE(recovered->tensors[0] == reference.at(info.iteration))
        << "iteration " << info.iteration;
  }
}

}  // namespace
}  // namespace pmsnap::hooks
