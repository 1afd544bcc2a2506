// Read-only view of libtorch's per-parameter optimizer state, for tools that
// compare two runs bit for bit (the demo, benchmarks).
//
// Thread-safety: reads the optimizer's state map; do not call concurrently
// with a step of the same optimizer.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

namespace pmsnap::hooks {

struct OptimizerStateView {
  bool present = false;  // libtorch has state for the parameter
  // Defined state tensors in a fixed order per optimizer (e.g. Adam:
  // exp_avg, exp_avg_sq, max_exp_avg_sq if amsgrad).
  std::vector<torch::Tensor> tensors;
  std::int64_t step = -1;  // libtorch's int64 step field; -1 for SGD (none)
};

// The state of `param` in `optimizer` (SGD, Adam, AdamW, Adagrad, RMSprop;
// other optimizers give present = true with no tensors).
OptimizerStateView ViewOptimizerState(torch::optim::Optimizer& optimizer,
                                      const torch::Tensor& param);

}  // namespace pmsnap::hooks
