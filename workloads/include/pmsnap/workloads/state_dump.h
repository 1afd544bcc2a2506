// A training run's final state as raw bytes, so that two runs (one
// uninterrupted, one crashed and restored) can be compared byte for byte:
// the demo and the resume test's trainer write it, their parents compare.
//
// Thread-safety: reads the module and the optimizer's state; do not call
// concurrently with a step.
#pragma once

#include <torch/torch.h>

#include <string>

#include "pmsnap/common/status.h"

namespace pmsnap::workloads {

// Writes, for each parameter of `module` in named_parameters() order, its
// values, its optimizer state tensors (hooks::ViewOptimizerState's order)
// and its int64 step, in native byte order, to `path` (created or
// truncated). The format has no header: only equal runs give equal files.
// kIOError naming `path` when the file cannot be written.
Status WriteStateDump(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer);

}  // namespace pmsnap::workloads
