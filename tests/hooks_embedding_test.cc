// Embedding tables through CheckpointedOptimizer: TrackedEmbedding(Bag) marks
// exactly the looked-up rows; a DLRM-like model (EmbeddingBag + MLP) trained
// with Adagrad / SGD under differential and IncrCP policies writes far fewer
// bytes per checkpoint than the table, every retained checkpoint recovers the
// table and its optimizer state as they were at that iteration, and a restore
// into a fresh model + optimizer is bitwise equal and keeps training equal;
// quantized checkpoints recover within the quantizer's bound; rows found from
// gradients and dense-update optimizers (Adam: every row marked) stay exact;
// misuse gives clear errors before any pool is made.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>

#include "hooks_test_util.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/tracked_embedding.h"
#include "testutil/temp_pool.h"

namespace pmsnap::hooks {
namespace {

using pmsnap::testing::StateOf;
using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

constexpr std::int64_t kRows = 20000;
constexpr std::int64_t kDim = 8;
constexpr std::int64_t kBatch = 32;
constexpr std::int64_t kBagSize = 4;
const std::string kTable = "bag.weight";

// DLRM-like: one EmbeddingBag (sum) over sparse ids, concatenated with dense
// features into a small MLP. `tracked` picks TrackedEmbeddingBag or libtorch's.
struct DlrmImpl : torch::nn::Module {
  explicit DlrmImpl(bool tracked_bag, std::optional<double> max_norm = std::nullopt) {
    auto options = torch::nn::EmbeddingBagOptions(kRows, kDim).mode(torch::kSum);
    if (max_norm) options.max_norm(*max_norm);
    if (tracked_bag) {
      tracked = std::make_shared<TrackedEmbeddingBagImpl>(options);
      bag = tracked;
    } else {
      bag = std::make_shared<torch::nn::EmbeddingBagImpl>(options);
    }
    register_module("bag", bag);
    fc1 = register_module("fc1", torch::nn::Linear(kDim + 4, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& dense, const torch::Tensor& ids,
                        const torch::Tensor& offsets) {
    torch::Tensor pooled = tracked ? tracked->forward(ids, offsets) : bag->forward(ids, offsets);
    return fc2->forward(torch::relu(fc1->forward(torch::cat({pooled, dense}, 1))));
  }
  std::shared_ptr<torch::nn::EmbeddingBagImpl> bag;
  std::shared_ptr<TrackedEmbeddingBagImpl> tracked;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Dlrm);

Dlrm MakeDlrm(std::uint64_t seed, bool tracked = true) {
  torch::manual_seed(seed);
  return Dlrm(tracked);
}

struct Batch {
  torch::Tensor dense, ids, offsets, target;
};

// Batch `step`: Zipf-like ids (skewed to low rows), independent of torch's RNG.
Batch MakeBatch(std::uint64_t step) {
  std::mt19937_64 rng(step * 7919 + 3);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<std::int64_t> ids(kBatch * kBagSize);
  for (auto& id : ids) {
    const double x = u(rng);
    id = static_cast<std::int64_t>(static_cast<double>(kRows) * x * x * x);
  }
  Batch b;
  b.ids = torch::tensor(ids, torch::kLong);
  b.offsets = torch::arange(0, kBatch * kBagSize, kBagSize, torch::kLong);
  b.dense = torch::sin(torch::arange(kBatch * 4, torch::kFloat32).reshape({kBatch, 4}) *
                       (0.01f * static_cast<float>(step % 13 + 1)));
  b.target = torch::cos(b.dense.sum(1, /*keepdim=*/true));
  return b;
}

void ForwardBackward(Dlrm& model, torch::optim::Optimizer& optimizer, std::uint64_t step) {
  optimizer.zero_grad();
  Batch b = MakeBatch(step);
  torch::mse_loss(model->forward(b.dense, b.ids, b.offsets), b.target).backward();
}

std::vector<std::int64_t> UniqueIds(const torch::Tensor& ids) {
  torch::Tensor u = std::get<0>(torch::_unique(ids, /*sorted=*/true));
  const std::int64_t* data = u.data_ptr<std::int64_t>();
  return std::vector<std::int64_t>(data, data + u.numel());
}

std::vector<std::int64_t> Marked(const diff::RowTracker& tracker) {
  std::vector<std::int64_t> out;
  for (std::uint64_t i : tracker.marked().SetIndices()) out.push_back(static_cast<std::int64_t>(i));
  return out;
}

// "" if params and optimizer state of (a, opt_a) equal (b, opt_b) bitwise.
std::string FirstDifference(Dlrm& a, torch::optim::Optimizer& opt_a, Dlrm& b,
                            torch::optim::Optimizer& opt_b) {
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const std::string& name = pa[i].key();
    if (!torch::equal(pa[i].value(), pb[i].value())) return "parameter " + name;
    auto sa = StateOf(opt_a, pa[i].value());
    auto sb = StateOf(opt_b, pb[i].value());
    if (sa.step != sb.step) return "step of " + name;
    if (sa.tensors.size() != sb.tensors.size()) return "state tensor count of " + name;
    for (std::size_t t = 0; t < sa.tensors.size(); ++t) {
      if (!torch::equal(sa.tensors[t], sb.tensors[t])) return "state of " + name;
    }
  }
  return "";
}

// The table and its row-shaped optimizer state, in unit order.
std::vector<torch::Tensor> TableTensors(Dlrm& model, torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out{model->bag->weight.detach().clone()};
  for (const torch::Tensor& t : StateOf(optimizer, model->bag->weight).tensors) {
    if (t.dim() >= 1 && t.size(0) == kRows) out.push_back(t.clone());
  }
  return out;
}

bool BitwiseEqual(const torch::Tensor& t, const std::vector<float>& v) {
  return static_cast<std::size_t>(t.numel()) == v.size() &&
         std::memcmp(t.contiguous().data_ptr<float>(), v.data(), v.size() * sizeof(float)) == 0;
}

runtime::EngineOptions EveryStep(const std::string& path) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.workers = 1;
  return options;
}

EmbeddingTables Tables(diff::Policy policy, std::uint32_t retain = 3,
                       RowSource rows = RowSource::kLookups) {
  EmbeddingTables tables;
  tables.names = {kTable};
  tables.options.policy = policy;
  tables.options.retain = retain;
  tables.rows = rows;
  return tables;
}

struct OptimizerCase {
  std::string name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> make;
};

OptimizerCase AdagradCase() {
  return {"Adagrad", [](auto p) {
            return std::make_unique<torch::optim::Adagrad>(
                p, torch::optim::AdagradOptions(0.05).initial_accumulator_value(0.1));
          }};
}
OptimizerCase SgdCase() {
  return {"Sgd", [](auto p) {
            return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1));
          }};
}

class EmbeddingTest : public ::testing::Test {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_F(EmbeddingTest, TrackedModulesMarkExactlyTheLookedUpRowsAndMatchLibtorch) {
  torch::manual_seed(5);
  TrackedEmbedding tracked(torch::nn::EmbeddingOptions(50, 3).padding_idx(7));
  torch::nn::Embedding plain(torch::nn::EmbeddingOptions(50, 3).padding_idx(7));
  plain->weight.data().copy_(tracked->weight.data());
  torch::Tensor ids = torch::tensor({{3, 7, 3}, {49, 0, 12}}, torch::kLong);
  EXPECT_TRUE(torch::equal(tracked(ids), plain(ids)));
  EXPECT_EQ(Marked(*tracked->rows().tracker()), (std::vector<std::int64_t>{0, 3, 12, 49}));
  // int32 ids mark the same rows; the marks accumulate until taken.
  tracked(torch::tensor({20, 21}, torch::kInt));
  EXPECT_EQ(Marked(*tracked->rows().tracker()), (std::vector<std::int64_t>{0, 3, 12, 20, 21, 49}));
  tracked->rows().tracker()->TakeInterval();
  EXPECT_EQ(tracked->rows().tracker()->marked().Count(), 0u);
  // libtorch rejects ids out of range before anything is marked.
  EXPECT_THROW(tracked(torch::tensor({50}, torch::kLong)), c10::Error);
  EXPECT_EQ(tracked->rows().tracker()->marked().Count(), 0u);

  TrackedEmbeddingBag bag(torch::nn::EmbeddingBagOptions(30, 2).mode(torch::kSum));
  torch::nn::EmbeddingBag plain_bag(torch::nn::EmbeddingBagOptions(30, 2).mode(torch::kSum));
  plain_bag->weight.data().copy_(bag->weight.data());
  torch::Tensor bag_ids = torch::tensor({1, 5, 5, 29, 2}, torch::kLong);
  torch::Tensor offsets = torch::tensor({0, 2}, torch::kLong);
  torch::Tensor out = bag(bag_ids, offsets);
  EXPECT_TRUE(torch::equal(out, plain_bag(bag_ids, offsets)));
  EXPECT_EQ(Marked(*bag->rows().tracker()), (std::vector<std::int64_t>{1, 2, 5, 29}));
  // The marked rows are exactly the rows the backward pass gives a gradient.
  out.sum().backward();
  torch::Tensor grad_rows = bag->weight.grad().ne(0).any(1).nonzero().reshape({-1});
  EXPECT_EQ(Marked(*bag->rows().tracker()), UniqueIds(grad_rows));
  EXPECT_EQ(bag->weight.sizes(), plain_bag->weight.sizes());
  EXPECT_EQ(bag->named_parameters().keys(), plain_bag->named_parameters().keys());
}

struct PolicyCase {
  diff::Policy policy;
  OptimizerCase optimizer;
};
void PrintTo(const PolicyCase& c, std::ostream* os) {
  *os << diff::PolicyName(c.policy) << " + " << c.optimizer.name;
}

class EmbeddingPolicyTest : public ::testing::TestWithParam<PolicyCase> {
 protected:
  void SetUp() override { pmsnap::testing::UseOneTorchThread(); }
};

TEST_P(EmbeddingPolicyTest, SmallCheckpointsRecoverEveryIterationAndRestoreBitwise) {
  constexpr std::uint64_t kSteps = 12;
  TempPoolPath pool("hooks-embedding");
  Dlrm model = MakeDlrm(3);
  auto optimizer = GetParam().optimizer.make(model->parameters());
  std::map<std::uint64_t, std::vector<torch::Tensor>> reference;  // iteration -> table tensors
  {
    auto created = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()),
                                                 Tables(GetParam().policy));
    ASSERT_TRUE(created.ok()) << created.status().ToString();
    CheckpointedOptimizer& opt = **created;
    diff::EmbeddingCheckpointer* checkpointer = opt.embedding_checkpointer();
    ASSERT_NE(checkpointer, nullptr);
    EXPECT_FALSE(opt.MarksAllRows(kTable));
    ASSERT_TRUE(model->tracked->rows().bound());
    diff::RowTracker* tracker = checkpointer->tracker(kTable);
    ASSERT_EQ(model->tracked->rows().tracker(), tracker);
    const std::uint64_t table_bytes = static_cast<std::uint64_t>(kRows * kDim * sizeof(float)) *
                                      TableTensors(model, *optimizer).size();
    int differential = 0;
    for (std::uint64_t step = 1; step <= kSteps; ++step) {
      ForwardBackward(model, *optimizer, step);
      // The previous checkpoint took the marks: only this step's lookups remain.
      ASSERT_EQ(Marked(*tracker), UniqueIds(MakeBatch(step).ids)) << "step " << step;
      ASSERT_TRUE(opt.Step().ok());
      ASSERT_TRUE(opt.Flush().ok());
      reference[step] = TableTensors(model, *optimizer);
      const diff::TableCheckpointStats last = checkpointer->last_checkpoint(kTable);
      ASSERT_EQ(last.epoch, step);
      if (step == 1) {
        EXPECT_TRUE(last.full);
      }
      if (!last.full) {
        ++differential;
        EXPECT_LT(last.bytes_written * 8, table_bytes)
            << "step " << step << ": " << last.rows_written << " rows";
        EXPECT_LE(last.rows_written, kSteps * kBatch * kBagSize);
      }
    }
    EXPECT_GE(differential, static_cast<int>(kSteps) - 3);
    EXPECT_GT(opt.stats().encoded_bytes_written, 0u);

    // Every retained checkpoint rebuilds the table and its optimizer state.
    auto listed = diff::ListCheckpoints(opt.engine().pool(), kTable);
    ASSERT_TRUE(listed.ok()) << listed.status().ToString();
    ASSERT_EQ(listed->size(), 3u);
    for (const diff::CheckpointInfo& info : *listed) {
      auto recovered = diff::RecoverTable(opt.engine().pool(), kTable, info.epoch);
      ASSERT_TRUE(recovered.ok()) << recovered.status().ToString();
      const std::vector<torch::Tensor>& expect = reference.at(info.iteration);
      ASSERT_EQ(recovered->tensors.size(), expect.size());
      for (std::size_t t = 0; t < expect.size(); ++t) {
        EXPECT_TRUE(BitwiseEqual(expect[t], recovered->tensors[t]))
            << "iteration " << info.iteration << " tensor " << t;
      }
    }
    ASSERT_TRUE(opt.Close().ok());
  }
  EXPECT_FALSE(model->tracked->rows().bound());  // the destructor unbound it

  // A fresh model and optimizer restore bitwise and keep training equal.
  Dlrm restored = MakeDlrm(99);
  auto restored_optimizer = GetParam().optimizer.make(restored->parameters());
  auto created = CheckpointedOptimizer::Create(*restored, *restored_optimizer,
                                               EveryStep(pool.path()), Tables(GetParam().policy));
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  auto info = (*created)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, kSteps);
  ASSERT_EQ(FirstDifference(model, *optimizer, restored, *restored_optimizer), "");
  for (std::uint64_t step = kSteps + 1; step <= kSteps + 5; ++step) {
    ForwardBackward(model, *optimizer, step);
    optimizer->step();
    ForwardBackward(restored, *restored_optimizer, step);
    ASSERT_TRUE((*created)->Step().ok());
    ASSERT_EQ(FirstDifference(model, *optimizer, restored, *restored_optimizer), "")
        << "step " << step;
  }
  // The resumed run's checkpoints are differential again and exact.
  ASSERT_TRUE((*created)->Flush().ok());
  auto newest = diff::RecoverTable((*created)->engine().pool(), kTable);
  ASSERT_TRUE(newest.ok()) << newest.status().ToString();
  const std::vector<torch::Tensor> now = TableTensors(restored, *restored_optimizer);
  EXPECT_EQ(newest->iteration, kSteps + 5);
  EXPECT_TRUE(BitwiseEqual(now[0], newest->tensors[0]));
}

INSTANTIATE_TEST_SUITE_P(
    PoliciesAndOptimizers, EmbeddingPolicyTest,
    ::testing::Values(PolicyCase{diff::Policy::kIntermittentDifferential, AdagradCase()},
                      PolicyCase{diff::Policy::kIncrCP, AdagradCase()},
                      PolicyCase{diff::Policy::kIntermittentDifferential, SgdCase()},
                      PolicyCase{diff::Policy::kIncrCP, SgdCase()},
                      PolicyCase{diff::Policy::kConsecutiveIncremental, AdagradCase()}),
    [](const ::testing::TestParamInfo<PolicyCase>& info) {
      std::string name = diff::PolicyName(info.param.policy);
      std::string out;
      for (char c : name) {
        if (std::isalnum(static_cast<unsigned char>(c))) out += c;
      }
      return out + info.param.optimizer.name;
    });

TEST_F(EmbeddingTest, QuantizedCheckpointsRestoreWithinTheQuantizerBound) {
  TempPoolPath pool("hooks-embedding-quant");
  Dlrm model = MakeDlrm(4);
  auto optimizer = AdagradCase().make(model->parameters());
  EmbeddingTables tables = Tables(diff::Policy::kIntermittentDifferential);
  tables.options.quantize.enabled = true;
  tables.options.quantize.bits = 8;
  {
    auto opt = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()), tables);
    ASSERT_TRUE(opt.ok()) << opt.status().ToString();
    for (std::uint64_t step = 1; step <= 6; ++step) {
      ForwardBackward(model, *optimizer, step);
      ASSERT_TRUE((*opt)->Step().ok());
    }
    ASSERT_TRUE((*opt)->Close().ok());
  }
  Dlrm restored = MakeDlrm(77);
  auto restored_optimizer = AdagradCase().make(restored->parameters());
  auto opt =
      CheckpointedOptimizer::Create(*restored, *restored_optimizer, EveryStep(pool.path()), tables);
  ASSERT_TRUE(opt.ok()) << opt.status().ToString();
  auto info = (*opt)->Restore();
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 6u);
  // 8-bit rowwise asymmetric: within half a step of each row's range (plus
  // the fp16 rounding of the row's scale and bias).
  torch::Tensor original = model->bag->weight.detach();
  torch::Tensor back = restored->bag->weight.detach();
  torch::Tensor range = std::get<0>(original.max(1)) - std::get<0>(original.min(1));
  torch::Tensor bound = range / 255.0 * 0.5 * 1.01 + original.abs().amax(1) * 1e-3 + 1e-6;
  torch::Tensor error = (back - original).abs().amax(1);
  EXPECT_TRUE(error.le(bound).all().item<bool>())
      << "max error " << error.max().item<float>() << " bound " << bound.min().item<float>();
  EXPECT_FALSE(torch::equal(back, original));  // it really was quantized
  // The dense part is exact.
  EXPECT_TRUE(torch::equal(restored->fc1->weight, model->fc1->weight));
  auto sum_back = StateOf(*restored_optimizer, restored->bag->weight).tensors.at(0);
  auto sum_orig = StateOf(*optimizer, model->bag->weight).tensors.at(0);
  EXPECT_TRUE(torch::allclose(sum_back, sum_orig, /*rtol=*/1e-2, /*atol=*/1e-4));
  EXPECT_EQ(StateOf(*restored_optimizer, restored->bag->weight).step,
            StateOf(*optimizer, model->bag->weight).step);
}

TEST_F(EmbeddingTest, GradientRowsForPlainModulesRestoreBitwise) {
  TempPoolPath pool("hooks-embedding-grad");
  torch::manual_seed(6);
  Dlrm model(/*tracked_bag=*/false);
  auto optimizer = SgdCase().make(model->parameters());
  auto tables = Tables(diff::Policy::kIncrCP, 2, RowSource::kGradients);
  {
    auto opt = CheckpointedOptimizer::Create(*model, *optimizer, EveryStep(pool.path()), tables);
    ASSERT_TRUE(opt.ok()) << opt.status().ToString();
    for (std::uint64_t step = 1; step <= 6; ++step) {
      ForwardBackward(model, *optimizer, step);
      ASSERT_TRUE((*opt)->Step().ok());
      ASSERT_TRUE((*opt)->Flush().ok());
      const auto last = (*opt)->embedding_checkpointer()->last_checkpoint(kTable);
      if (step > 1) {
        EXPECT_FALSE(last.full);
        EXPECT_EQ(last.rows_written, UniqueIds(MakeBatch(step).ids).size()) << "step " << step;
      }
    }
  }
  torch::manual_seed(60);
  Dlrm restored(/*tracked_bag=*/false);
  auto restored_optimizer = SgdCase().make(restored->parameters());
  auto info = RestoreFromPool(*restored, *restored_optimizer, EveryStep(pool.path()), tables);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->iteration, 6u);
  EXPECT_EQ(FirstDifference(model, *optimizer, restored, *restored_optimizer), "");
}

TEST_F(EmbeddingTest, DenseUpdateOptimizersMarkEveryRowAndStayExact) {
  TempPoolPath pool("hooks-embedding-adam");
  Dlrm model = MakeDlrm(8);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto tables = Tables(diff::Policy::kIntermittentDifferential);
  {
    auto opt = CheckpointedOptimizer::Create(*model, optimizer, EveryStep(pool.path()), tables);
    ASSERT_TRUE(opt.ok()) << opt.status().ToString();
    EXPECT_TRUE((*opt)->MarksAllRows(kTable));
    for (std::uint64_t step = 1; step <= 4; ++step) {
      ForwardBackward(model, optimizer, step);
      ASSERT_TRUE((*opt)->Step().ok());
    }
  }
  Dlrm restored = MakeDlrm(80);
  torch::optim::Adam restored_optimizer(restored->parameters(), torch::optim::AdamOptions(1e-2));
  auto info = RestoreFromPool(*restored, restored_optimizer, EveryStep(pool.path()), tables);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(FirstDifference(model, optimizer, restored, restored_optimizer), "");
}

TEST_F(EmbeddingTest, MisuseIsRefusedBeforeAnyPoolIsMade) {
  TempPoolPath pool("hooks-embedding-errors");
  auto expect_refused = [&](torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                            runtime::EngineOptions options, EmbeddingTables tables,
                            const std::string& message) {
    auto created = CheckpointedOptimizer::Create(module, optimizer, std::move(options), tables);
    ASSERT_FALSE(created.ok()) << message;
    EXPECT_EQ(created.status().code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(created.status().message(), HasSubstr(message));
    EXPECT_FALSE(std::filesystem::exists(pool.path()));
  };
  Dlrm model = MakeDlrm(1);
  torch::optim::Adagrad adagrad(model->parameters(), torch::optim::AdagradOptions(0.1));
  auto tables = Tables(diff::Policy::kIncrCP);
  tables.names = {"bag.wieght"};
  expect_refused(*model, adagrad, EveryStep(pool.path()), tables,
                 "embedding table 'bag.wieght' is not a parameter");
  tables.names = {"fc1.bias"};
  expect_refused(*model, adagrad, EveryStep(pool.path()), tables, "float32 [rows, dim]");
  tables.names = {kTable, kTable};
  expect_refused(*model, adagrad, EveryStep(pool.path()), tables, "named twice");
  tables.names = {kTable};
  auto with_encoder = EveryStep(pool.path());
  with_encoder.encoder = std::make_shared<diff::EmbeddingCheckpointer>(diff::EmbeddingOptions{});
  expect_refused(*model, adagrad, with_encoder, tables, "EngineOptions::encoder");

  torch::manual_seed(1);
  Dlrm plain(/*tracked_bag=*/false);
  torch::optim::Adagrad plain_adagrad(plain->parameters(), torch::optim::AdagradOptions(0.1));
  expect_refused(*plain, plain_adagrad, EveryStep(pool.path()), tables,
                 "has no TrackedEmbedding / TrackedEmbeddingBag module");

  Dlrm renormed(/*tracked_bag=*/true, /*max_norm=*/1.0);
  torch::optim::Adagrad renormed_adagrad(renormed->parameters(), torch::optim::AdagradOptions(0.1));
  expect_refused(*renormed, renormed_adagrad, EveryStep(pool.path()), tables, "max_norm");

  // Binding a tracker to a table the checkpointer does not have.
  TrackedEmbedding lone(10, 2);
  auto checkpointer = std::make_shared<diff::EmbeddingCheckpointer>(diff::EmbeddingOptions{});
  Status bound = lone->rows().Bind(checkpointer, "missing.weight");
  EXPECT_EQ(bound.code(), StatusCode::kNotFound);
  EXPECT_THAT(bound.message(), HasSubstr("missing.weight"));
  EXPECT_FALSE(lone->rows().bound());
}

}  // namespace
}  // namespace pmsnap::hooks
