// bench/stall's workloads: a model of workloads/ (MLP, transformer,
// DLRM-like) with its optimizer and precomputed batches, sized by Options.
//
// Thread-safety: one training thread; the restore child builds its own.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "stall/options.h"

namespace pmsnap::bench::stall {

struct Workload {
  std::string name;
  std::string description;
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  // A fresh optimizer (no state) over the same parameters, as after a restart.
  std::function<std::unique_ptr<torch::optim::Optimizer>()> make_optimizer;
  // zero_grad + forward + backward of iteration `step` (data precomputed).
  std::function<void(std::uint64_t)> forward_backward;
  std::int64_t parameters = 0;
};

// "mlp", "transformer" or "dlrm" at the sizes in `o`, freshly initialized
// from torch's global RNG; nullopt (with a message on stderr) for another
// name.
std::optional<Workload> MakeWorkload(const std::string& name, const Options& o);

// Every checkpointed tensor: each parameter, then its optimizer state.
std::vector<torch::Tensor> StateTensors(Workload& w);

// Total bytes of `ts`.
std::uint64_t Bytes(const std::vector<torch::Tensor>& ts);

// (name, parameter) pairs in registration order, as ParameterStepper takes them.
std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(const Workload& w);

}  // namespace pmsnap::bench::stall
