// torch::save files of bench/stall's baselines and of the torch::load
// restore: the whole module + optimizer in one archive, made durable.
//
// Thread-safety: plain functions; SaveFull and LoadFull use the module and
// optimizer, so not concurrently with a step.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace pmsnap::bench::stall {

// fsync of the file at `path`; best effort (a file that cannot be opened is skipped).
void Fsync(const std::string& path);

// Size of the file at `path`; 0 if it cannot be read.
std::uint64_t FileBytes(const std::string& path);

// torch::save of `module` plus `optimizer` (under "optimizer") to `path`;
// throws what torch::save throws.
void SaveFull(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
              const std::string& path);

// Reads what SaveFull wrote into `module` and `optimizer`; throws
// c10::Error when the file is missing or of another model.
void LoadFull(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
              const std::string& path);

}  // namespace pmsnap::bench::stall
