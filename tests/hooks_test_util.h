// Shared pieces of the libtorch hook tests: a small deterministic MLP, its
// data, the optimizer configurations every test runs, and access to
// libtorch's per-parameter optimizer state for bitwise comparisons.
//
// Thread-safety: plain functions; torch itself is set to one thread by
// UseOneTorchThread so that results are deterministic.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pmsnap/hooks/optimizer_state.h"
#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "testutil/engine_options.h"

namespace pmsnap::testing {

inline void UseOneTorchThread() { torch::set_num_threads(1); }

// 8 -> 16 -> 16 -> 4 with a dropout, so the RNG state matters for resume.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(double dropout = 0.0) : dropout_p(dropout) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1->forward(x));
    if (dropout_p > 0) x = torch::dropout(x, dropout_p, is_training());
    x = torch::tanh(fc2->forward(x));
    return fc3->forward(x);
  }
  double dropout_p;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

inline Mlp MakeMlp(std::uint64_t seed, double dropout = 0.0) {
  torch::manual_seed(seed);
  return Mlp(dropout);
}

// Batch `step` of a deterministic data set (independent of torch's RNG).
inline std::pair<torch::Tensor, torch::Tensor> Batch(std::uint64_t step) {
  const double phase = static_cast<double>(step % 97) * 0.37 + 0.11;
  torch::Tensor x = torch::sin(torch::arange(32 * 8, torch::kFloat32).reshape({32, 8}) * 0.013 *
                                   static_cast<float>(phase) +
                               static_cast<float>(phase));
  torch::Tensor y = torch::cos(x.narrow(1, 0, 4) * 1.7f);
  return {x, y};
}

// Forward + backward of batch `step`; leaves the gradients in the model.
inline void ForwardBackward(Mlp& model, torch::optim::Optimizer& optimizer, std::uint64_t step) {
  optimizer.zero_grad();
  auto [x, y] = Batch(step);
  torch::Tensor loss = torch::mse_loss(model->forward(x), y);
  loss.backward();
}

struct OptimizerConfig {
  std::string name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)> make;
};

inline std::vector<OptimizerConfig> AllOptimizerConfigs() {
  namespace o = torch::optim;
  return {
      {"SgdMomentum",
       [](auto p) { return std::make_unique<o::SGD>(p, o::SGDOptions(0.05).momentum(0.9)); }},
      {"SgdNesterovWeightDecay",
       [](auto p) {
         return std::make_unique<o::SGD>(
             p, o::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
       }},
      {"SgdPlain", [](auto p) { return std::make_unique<o::SGD>(p, o::SGDOptions(0.05)); }},
      {"Adam", [](auto p) { return std::make_unique<o::Adam>(p, o::AdamOptions(1e-2)); }},
      {"AdamAmsgradWeightDecay",
       [](auto p) {
         return std::make_unique<o::Adam>(p, o::AdamOptions(1e-2).amsgrad(true).weight_decay(1e-3));
       }},
      {"AdamW", [](auto p) { return std::make_unique<o::AdamW>(p, o::AdamWOptions(1e-2)); }},
      {"AdamWAmsgrad",
       [](auto p) { return std::make_unique<o::AdamW>(p, o::AdamWOptions(1e-2).amsgrad(true)); }},
      {"Adagrad",
       [](auto p) {
         return std::make_unique<o::Adagrad>(
             p, o::AdagradOptions(0.05).lr_decay(1e-3).initial_accumulator_value(0.1));
       }},
      {"AdagradWeightDecay",
       [](auto p) {
         return std::make_unique<o::Adagrad>(p, o::AdagradOptions(0.05).weight_decay(1e-3));
       }},
      {"Rmsprop", [](auto p) { return std::make_unique<o::RMSprop>(p, o::RMSpropOptions(1e-2)); }},
      {"RmspropCenteredMomentum",
       [](auto p) {
         return std::make_unique<o::RMSprop>(
             p, o::RMSpropOptions(1e-2).centered(true).momentum(0.9).weight_decay(1e-3));
       }},
  };
}

// Whether ParameterStepper updates large parameters of this configuration's
// optimizer block by block (Adam, AdamW, Adagrad).
inline bool UpdatesInBlocks(const OptimizerConfig& config) {
  return config.name.rfind("Adam", 0) == 0 || config.name.rfind("Adagrad", 0) == 0;
}

// libtorch's state for parameter `p`: its tensors (undefined ones skipped)
// and its int64 step (-1 where the optimizer has none). Empty tensors and -2
// when libtorch has no state for p.
struct ParamStateView {
  std::vector<torch::Tensor> tensors;
  std::int64_t step = -2;
};

inline ParamStateView StateOf(torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  const pmsnap::hooks::OptimizerStateView state = pmsnap::hooks::ViewOptimizerState(optimizer, p);
  ParamStateView view;
  if (!state.present) return view;
  view.tensors = state.tensors;
  view.step = state.step;
  return view;
}

// "" if every parameter and every optimizer state tensor of (a, opt_a) is
// bitwise equal to (b, opt_b), else what differs first.
// Model: any torch::nn::ModuleHolder (Mlp, Linear...).
template <typename Model>
std::string FirstBitwiseDifference(Model& a, torch::optim::Optimizer& opt_a, Model& b,
                                   torch::optim::Optimizer& opt_b) {
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  if (pa.size() != pb.size()) return "parameter count";
  for (std::size_t i = 0; i < pa.size(); ++i) {
    const std::string& name = pa[i].key();
    // torch::equal compares values; NaN != NaN, which these runs never produce.
    if (!torch::equal(pa[i].value(), pb[i].value())) return "parameter " + name;
    ParamStateView sa = StateOf(opt_a, pa[i].value());
    ParamStateView sb = StateOf(opt_b, pb[i].value());
    if (sa.step != sb.step) {
      return "step of " + name + ": " + std::to_string(sa.step) + " vs " + std::to_string(sb.step);
    }
    if (sa.tensors.size() != sb.tensors.size()) return "state tensor count of " + name;
    for (std::size_t t = 0; t < sa.tensors.size(); ++t) {
      if (!torch::equal(sa.tensors[t], sb.tensors[t])) {
        return "state tensor " + std::to_string(t) + " of " + name;
      }
    }
  }
  return "";
}

// Steps `first`..`last` on the same batches: the plain optimizer with
// step(), and (model, optimizer) through `step` (the wrapped path, true on
// success). "" if both stay bitwise equal after every step, else where they
// first part.
inline std::string StepBothAndCompare(Mlp& plain_model, torch::optim::Optimizer& plain, Mlp& model,
                                      torch::optim::Optimizer& optimizer, std::uint64_t first,
                                      std::uint64_t last, const std::function<bool()>& step) {
  for (std::uint64_t k = first; k <= last; ++k) {
    ForwardBackward(plain_model, plain, k);
    plain.step();
    ForwardBackward(model, optimizer, k);
    if (!step()) return "the wrapped step " + std::to_string(k) + " failed";
    std::string difference = FirstBitwiseDifference(plain_model, plain, model, optimizer);
    if (!difference.empty()) return difference + " after step " + std::to_string(k);
  }
  return "";
}

}  // namespace pmsnap::testing
