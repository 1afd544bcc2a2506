// ParameterStepper runs libtorch optimizers one parameter at a time; these
// tests check that 50 such steps give bitwise the same parameters and
// optimizer state as 50 plain optimizer.step() calls, for every supported
// optimizer, that the block-by-block updates of Adam, AdamW and Adagrad do
// too, and that the per-parameter events come in backward order with state
// at stable addresses.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "hooks_test_util.h"
#include "pmsnap/hooks/parameter_stepper.h"

namespace pmsnap::hooks {
namespace {

using pmsnap::testing::AllOptimizerConfigs;
using pmsnap::testing::ForwardBackward;
using pmsnap::testing::MakeMlp;
using pmsnap::testing::Mlp;
using pmsnap::testing::OptimizerConfig;
using pmsnap::testing::StepBothAndCompare;
using pmsnap::testing::UpdatesInBlocks;

template <typename Model>
std::vector<std::pair<std::string, torch::Tensor>> Named(Model& model) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  return named;
}

// Records the observer calls and checks each update happens between them.
class RecordingObserver final : public StepObserver {
 public:
  explicit RecordingObserver(const ParameterStepper& stepper) : stepper_(stepper) {}
  Status BeforeUpdate(std::size_t index) override {
    events.push_back("before " + std::to_string(index));
    before_ = stepper_.slots()[index].param.clone();
    return Status::Ok();
  }
  Status AfterUpdate(std::size_t index) override {
    events.push_back("after " + std::to_string(index));
    if (torch::equal(before_, stepper_.slots()[index].param)) unchanged_updates++;
    return Status::Ok();
  }
  std::vector<std::string> events;
  int unchanged_updates = 0;

 private:
  const ParameterStepper& stepper_;
  torch::Tensor before_;
};

class StepperEquivalenceTest : public ::testing::TestWithParam<OptimizerConfig> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(StepperEquivalenceTest, FiftyStepsAreBitwiseIdenticalToPlainStep) {
  Mlp plain_model = MakeMlp(7);
  Mlp stepped_model = MakeMlp(7);
  auto plain = GetParam().make(plain_model->parameters());
  auto wrapped = GetParam().make(stepped_model->parameters());
  auto stepper = ParameterStepper::Create(*wrapped, Named(stepped_model));
  ASSERT_TRUE(stepper.ok()) << stepper.status().ToString();
  EXPECT_EQ(StepBothAndCompare(plain_model, *plain, stepped_model, *wrapped, 1, 50,
                               [&] { return (*stepper)->Step(nullptr).ok(); }),
            "");
}

// Two identical models and optimizers, the second stepped by a stepper that
// defers the state it creates.
struct DeferredStepperSetup {
  explicit DeferredStepperSetup(const OptimizerConfig& config)
      : plain_model(MakeMlp(7)),
        stepped_model(MakeMlp(7)),
        plain(config.make(plain_model->parameters())),
        wrapped(config.make(stepped_model->parameters())),
        // libtorch's Adagrad makes its state in its constructor: adopted, never deferred.
        adopts_state(!wrapped->state().empty()),
        stepper(ParameterStepper::Create(*wrapped, Named(stepped_model),
                                         ParameterStepper::NewState::kDeferred)) {}
  // "" if 5 steps of both give bitwise the same parameters and state.
  std::string StepBothAndCompare() {
    return pmsnap::testing::StepBothAndCompare(plain_model, *plain, stepped_model, *wrapped, 1, 5,
                                               [&] { return (*stepper)->Step(nullptr).ok(); });
  }

  Mlp plain_model;
  Mlp stepped_model;
  std::unique_ptr<torch::optim::Optimizer> plain;
  std::unique_ptr<torch::optim::Optimizer> wrapped;
  bool adopts_state;
  Result<std::unique_ptr<ParameterStepper>> stepper;
};

TEST_P(StepperEquivalenceTest, DeferredStateIsGivenItsInitialValuesBeforeTheFirstStep) {
  DeferredStepperSetup setup(GetParam());
  ASSERT_TRUE(setup.stepper.ok()) << setup.stepper.status().ToString();
  // Whatever the memory held before the fill (here NaN) must not leak into training.
  for (const ParameterSlot& slot :
       setup.adopts_state ? std::vector<ParameterSlot>{} : (*setup.stepper)->slots()) {
    for (const auto& [role, tensor] : slot.state) {
      if (tensor.is_floating_point()) tensor.fill_(std::nan(""));
    }
  }
  EXPECT_EQ(setup.StepBothAndCompare(), "");
}

// Pages of `tensor` that are in memory, and its page count.
std::pair<std::size_t, std::size_t> ResidentPages(const torch::Tensor& tensor) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<std::uintptr_t>(tensor.data_ptr());
  const std::uintptr_t first = start / page * page;
  const std::size_t pages = (start + tensor.nbytes() - first + page - 1) / page;
  std::vector<unsigned char> residency(pages);
  EXPECT_EQ(::mincore(reinterpret_cast<void*>(first), pages * page, residency.data()), 0);
  std::size_t resident = 0;
  for (unsigned char r : residency) resident += r & 1;
  return {resident, pages};
}

TEST_P(StepperEquivalenceTest, PrefaultMapsTheDeferredStateAndChangesNoValue) {
  DeferredStepperSetup setup(GetParam());
  ASSERT_TRUE(setup.stepper.ok()) << setup.stepper.status().ToString();
  ParameterStepper& stepper = **setup.stepper;
  // The stepper's own state (not the one-element "step" mirrors) is fresh
  // arena memory: not in memory before its first touch. Adopted state is.
  std::size_t resident_before = 0, pages = 0;
  for (const ParameterSlot& slot : stepper.slots()) {
    for (const auto& [role, tensor] : slot.state) {
      if (role == "step") continue;
      const auto [resident, count] = ResidentPages(tensor);
      resident_before += resident;
      pages += count;
    }
  }
  if (!setup.adopts_state && pages > 0) {
    EXPECT_LT(resident_before, pages);
  }

  stepper.StartPrefault();
  stepper.FinishPrefault();
  for (const ParameterSlot& slot : stepper.slots()) {
    for (const auto& [role, tensor] : slot.state) {
      const auto [resident, count] = ResidentPages(tensor);
      EXPECT_EQ(resident, count) << slot.name << " " << role;
    }
  }
  if (setup.adopts_state) return;  // the fills below would change training

  // Values set before the prefault survive it (a restore's would too).
  for (const ParameterSlot& slot : stepper.slots()) {
    for (const auto& [role, tensor] : slot.state) tensor.fill_(3);
  }
  stepper.StartPrefault();
  stepper.FinishPrefault();
  for (const ParameterSlot& slot : stepper.slots()) {
    for (const auto& [role, tensor] : slot.state) {
      EXPECT_TRUE(torch::all(tensor == 3).item<bool>()) << slot.name << " " << role;
    }
  }
  // The initial values still come before the first step.
  EXPECT_EQ(setup.StepBothAndCompare(), "");
}

TEST_P(StepperEquivalenceTest, StateLivesInTheSlotTensorsAtStableAddresses) {
  Mlp model = MakeMlp(3);
  auto optimizer = GetParam().make(model->parameters());
  auto stepper = ParameterStepper::Create(*optimizer, Named(model));
  ASSERT_TRUE(stepper.ok()) << stepper.status().ToString();
  std::vector<std::vector<void*>> addresses;
  for (const ParameterSlot& slot : (*stepper)->slots()) {
    ASSERT_FALSE(slot.state.empty());
    EXPECT_EQ(slot.state.back().first, "step");
    std::vector<void*> slot_addresses;
    for (const auto& [role, tensor] : slot.state) slot_addresses.push_back(tensor.data_ptr());
    addresses.push_back(slot_addresses);
  }
  for (std::uint64_t step = 1; step <= 5; ++step) {
    ForwardBackward(model, *optimizer, step);
    ASSERT_TRUE((*stepper)->Step(nullptr).ok());
  }
  const auto& slots = (*stepper)->slots();
  for (std::size_t i = 0; i < slots.size(); ++i) {
    pmsnap::testing::ParamStateView state = pmsnap::testing::StateOf(*optimizer, slots[i].param);
    // Every libtorch state tensor is one of the slot's (same storage).
    ASSERT_EQ(state.tensors.size() + 1, slots[i].state.size()) << slots[i].name;
    for (std::size_t t = 0; t < state.tensors.size(); ++t) {
      EXPECT_EQ(state.tensors[t].data_ptr(), addresses[i][t]) << slots[i].name;
    }
    const std::int64_t mirrored = slots[i].state.back().second.item<std::int64_t>();
    EXPECT_EQ(mirrored, 5) << slots[i].name;
    if (state.step >= 0) {
      EXPECT_EQ(state.step, mirrored) << slots[i].name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, StepperEquivalenceTest,
                         ::testing::ValuesIn(AllOptimizerConfigs()),
                         [](const auto& info) { return info.param.name; });

// Weights of 11100 and 90000 elements: many blocks, the last one partial.
torch::nn::Sequential MakeWideModel(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(37, 300), torch::nn::Tanh(),
                               torch::nn::Linear(300, 300), torch::nn::Tanh(),
                               torch::nn::Linear(300, 5));
}

void ForwardBackwardWide(torch::nn::Sequential& model, torch::optim::Optimizer& optimizer,
                         std::uint64_t step) {
  optimizer.zero_grad();
  const auto phase = static_cast<float>(step % 89) * 0.29f + 0.07f;
  torch::Tensor x = torch::sin(
      torch::arange(16 * 37, torch::kFloat32).reshape({16, 37}) * 0.011f * phase + phase);
  torch::Tensor y = torch::cos(x.narrow(1, 0, 5) * 1.3f);
  torch::mse_loss(model->forward(x), y).backward();
}

struct BlockedCase {
  std::string name;
  std::size_t block_bytes;
  int torch_threads;
};

class BlockedStepTest : public ::testing::TestWithParam<BlockedCase> {
 protected:
  void SetUp() override { torch::set_num_threads(GetParam().torch_threads); }
  void TearDown() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(BlockedStepTest, BlockedUpdatesAreBitwiseIdenticalToPlainStep) {
  for (const OptimizerConfig& config : AllOptimizerConfigs()) {
    if (!UpdatesInBlocks(config)) continue;
    SCOPED_TRACE(config.name);
    torch::nn::Sequential plain_model = MakeWideModel(11);
    torch::nn::Sequential stepped_model = MakeWideModel(11);
    auto plain = config.make(plain_model->parameters());
    auto wrapped = config.make(stepped_model->parameters());
    auto stepper = ParameterStepper::Create(*wrapped, Named(stepped_model));
    ASSERT_TRUE(stepper.ok()) << stepper.status().ToString();
    (*stepper)->set_block_bytes(GetParam().block_bytes, /*min_parameter_bytes=*/0);
    for (std::uint64_t k = 1; k <= 20; ++k) {
      if (k == 11) {  // as an LR scheduler would: the blocked step must read it
        for (torch::optim::Optimizer* optimizer : {plain.get(), wrapped.get()}) {
          for (auto& group : optimizer->param_groups()) {
            group.options().set_lr(group.options().get_lr() * 0.5);
          }
        }
      }
      ForwardBackwardWide(plain_model, *plain, k);
      plain->step();
      ForwardBackwardWide(stepped_model, *wrapped, k);
      ASSERT_TRUE((*stepper)->Step(nullptr).ok());
      ASSERT_EQ(
          pmsnap::testing::FirstBitwiseDifference(plain_model, *plain, stepped_model, *wrapped), "")
          << "after step " << k;
    }
    // Small blocks split every weight and the two 300-element biases; default
    // blocks only the 90000-element weight.
    const std::size_t blocked_per_step = GetParam().block_bytes < 1024 ? 5 : 1;
    EXPECT_EQ((*stepper)->blocked_updates(), 20 * blocked_per_step);
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizesAndThreads, BlockedStepTest,
                         ::testing::Values(BlockedCase{"Blocks256BytesOneThread", 256, 1},
                                           BlockedCase{"Blocks256BytesTwoThreads", 256, 2},
                                           BlockedCase{"DefaultBlocksOneThread",
                                                       ParameterStepper::kDefaultBlockBytes, 1},
                                           BlockedCase{"DefaultBlocksTwoThreads",
                                                       ParameterStepper::kDefaultBlockBytes, 2}),
                         [](const auto& info) { return info.param.name; });

TEST(BlockedStepTest, OtherOptimizersAndSmallParametersUseTheOptimizersOwnStep) {
  pmsnap::testing::UseOneTorchThread();
  for (const OptimizerConfig& config : AllOptimizerConfigs()) {
    SCOPED_TRACE(config.name);
    const bool blocked = UpdatesInBlocks(config);
    torch::nn::Sequential model = MakeWideModel(3);
    auto optimizer = config.make(model->parameters());
    auto stepper = ParameterStepper::Create(*optimizer, Named(model));
    ASSERT_TRUE(stepper.ok()) << stepper.status().ToString();
    // Defaults: every weight here is under kDefaultMinBlockedBytes.
    ForwardBackwardWide(model, *optimizer, 1);
    ASSERT_TRUE((*stepper)->Step(nullptr).ok());
    EXPECT_EQ((*stepper)->blocked_updates(), 0u);
    // Without the size floor only the 90000-element weight is larger than a
    // default block.
    (*stepper)->set_block_bytes(ParameterStepper::kDefaultBlockBytes, 0);
    ForwardBackwardWide(model, *optimizer, 2);
    ASSERT_TRUE((*stepper)->Step(nullptr).ok());
    EXPECT_EQ((*stepper)->blocked_updates(), blocked ? 1u : 0u);
    (*stepper)->set_block_bytes(0, 0);
    ForwardBackwardWide(model, *optimizer, 3);
    ASSERT_TRUE((*stepper)->Step(nullptr).ok());
    EXPECT_EQ((*stepper)->blocked_updates(), blocked ? 1u : 0u);
  }
}

TEST(StepperOrderTest, UpdatesRunLastParameterFirstBetweenTheirHooks) {
  pmsnap::testing::UseOneTorchThread();
  Mlp model = MakeMlp(1);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto stepper = ParameterStepper::Create(adam, Named(model));
  ASSERT_TRUE(stepper.ok());
  RecordingObserver observer(**stepper);
  ForwardBackward(model, adam, 1);
  ASSERT_TRUE((*stepper)->Step(&observer).ok());
  const std::size_t n = (*stepper)->slots().size();
  ASSERT_EQ(observer.events.size(), 2 * n);
  for (std::size_t k = 0; k < n; ++k) {
    EXPECT_EQ(observer.events[2 * k], "before " + std::to_string(n - 1 - k));
    EXPECT_EQ(observer.events[2 * k + 1], "after " + std::to_string(n - 1 - k));
  }
  EXPECT_EQ(observer.unchanged_updates, 0);
  EXPECT_EQ((*stepper)->slots()[0].name, "fc1.weight");
}

TEST(StepperOrderTest, ParametersWithoutGradientAreSkippedLikeThePlainOptimizer) {
  pmsnap::testing::UseOneTorchThread();
  Mlp plain_model = MakeMlp(5);
  Mlp stepped_model = MakeMlp(5);
  // fc2 frozen: no gradient, so neither optimizer touches it or creates state.
  for (Mlp* m : {&plain_model, &stepped_model}) {
    for (auto& p : (*m)->fc2->parameters()) p.set_requires_grad(false);
  }
  torch::optim::SGD plain(plain_model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.5));
  torch::optim::SGD wrapped(stepped_model->parameters(),
                            torch::optim::SGDOptions(0.1).momentum(0.5));
  auto stepper = ParameterStepper::Create(wrapped, Named(stepped_model));
  ASSERT_TRUE(stepper.ok());
  RecordingObserver observer(**stepper);
  EXPECT_EQ(StepBothAndCompare(plain_model, plain, stepped_model, wrapped, 1, 10,
                               [&] { return (*stepper)->Step(&observer).ok(); }),
            "");
  EXPECT_EQ(observer.events.size(), 10u * 2 * 4);  // fc1 and fc3: 4 parameters
}

TEST(StepperOrderTest, GradientsAreLeftAsTheyWere) {
  pmsnap::testing::UseOneTorchThread();
  Mlp model = MakeMlp(2);
  torch::optim::RMSprop rmsprop(model->parameters(), torch::optim::RMSpropOptions(1e-2));
  auto stepper = ParameterStepper::Create(rmsprop, Named(model));
  ASSERT_TRUE(stepper.ok());
  ForwardBackward(model, rmsprop, 1);
  std::vector<torch::Tensor> grads;
  for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
  ASSERT_TRUE((*stepper)->Step(nullptr).ok());
  auto params = model->parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].grad().defined());
    EXPECT_TRUE(torch::equal(params[i].grad(), grads[i]));
  }
}

TEST(StepperOrderTest, FailingObserverStillCompletesTheStepAndReportsTheFirstError) {
  pmsnap::testing::UseOneTorchThread();
  class FailingObserver final : public StepObserver {
   public:
    Status BeforeUpdate(std::size_t) override {
      ++calls;
      return Status(StatusCode::kIOError, "disk on fire");
    }
    Status AfterUpdate(std::size_t) override {
      ++calls;
      return Status::Ok();
    }
    int calls = 0;
  };
  Mlp plain_model = MakeMlp(9);
  Mlp stepped_model = MakeMlp(9);
  torch::optim::Adam plain(plain_model->parameters());
  torch::optim::Adam wrapped(stepped_model->parameters());
  auto stepper = ParameterStepper::Create(wrapped, Named(stepped_model));
  ASSERT_TRUE(stepper.ok());
  FailingObserver observer;
  ForwardBackward(plain_model, plain, 1);
  plain.step();
  ForwardBackward(stepped_model, wrapped, 1);
  Status status = (*stepper)->Step(&observer);
  EXPECT_EQ(status.code(), StatusCode::kIOError);
  EXPECT_EQ(observer.calls, 1);
  EXPECT_EQ(pmsnap::testing::FirstBitwiseDifference(plain_model, plain, stepped_model, wrapped),
            "");
}

TEST(StepperRegistrationTest, ParamGroupAddedAfterCreateIsRefusedWithoutUpdating) {
  pmsnap::testing::UseOneTorchThread();
  Mlp model = MakeMlp(4);
  torch::optim::SGD sgd(model->fc1->parameters(), torch::optim::SGDOptions(0.1));
  auto stepper = ParameterStepper::Create(sgd, Named(model));
  ASSERT_TRUE(stepper.ok());
  sgd.add_param_group(torch::optim::OptimizerParamGroup(model->fc2->parameters()));
  ForwardBackward(model, sgd, 1);
  torch::Tensor before = model->fc1->weight.clone();
  Status status = (*stepper)->Step(nullptr);
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("gained parameters"), std::string::npos) << status.message();
  EXPECT_TRUE(torch::equal(before, model->fc1->weight));
}

TEST(StepperRegistrationTest, UnsupportedOptimizerIsRejected) {
  Mlp model = MakeMlp(4);
  torch::optim::LBFGS lbfgs(model->parameters());
  auto stepper = ParameterStepper::Create(lbfgs, Named(model));
  EXPECT_EQ(stepper.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stepper.status().message().find("unsupported optimizer"), std::string::npos);
}

TEST(StepperRegistrationTest, NonContiguousParameterIsRejectedByName) {
  torch::Tensor base = torch::zeros({4, 6}).requires_grad_(false);
  torch::Tensor transposed = base.t().detach().requires_grad_(true);
  torch::optim::SGD sgd(std::vector<torch::Tensor>{transposed}, torch::optim::SGDOptions(0.1));
  auto stepper = ParameterStepper::Create(sgd, {{"odd.weight", transposed}});
  EXPECT_EQ(stepper.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stepper.status().message().find("odd.weight"), std::string::npos);
}

TEST(StepperRegistrationTest, UnnamedParametersGetGroupNames) {
  torch::Tensor w = torch::zeros({3}).requires_grad_(true);
  torch::optim::SGD sgd(std::vector<torch::Tensor>{w}, torch::optim::SGDOptions(0.1));
  auto stepper = ParameterStepper::Create(sgd, {});
  ASSERT_TRUE(stepper.ok());
  EXPECT_EQ((*stepper)->slots()[0].name, "group0.param0");
}

}  // namespace
}  // namespace pmsnap::hooks
