// ModuleBuffers: a libtorch module's buffers (BatchNorm's running_mean,
// running_var and num_batches_tracked, any registered buffer) checkpointed
// with every step, as the Python front end does (frontend::BufferUnits).
//
// The forward pass changes buffers in place before the next step's engine
// hooks could order that against a checkpoint copy, so the engine never
// reads a buffer itself: each has a shadow tensor (same dtype and shape,
// contiguous) that Capture fills at the step boundary, between the buffer
// units' hooks (CheckpointedOptimizer does that), and RestoreInto copies
// back after a restore.
//
// Thread-safety: the training thread (the one that runs forward and Step).
#pragma once

#include <torch/nn/module.h>
#include <torch/types.h>

#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::hooks {

class ModuleBuffers {
 public:
  ModuleBuffers() = default;
  // Every buffer of `module` and its submodules, named as the module's
  // state dict names them ("bn.running_mean"). The module keeps owning the
  // buffers; a buffer replaced in the module after this (register_buffer
  // again) is not followed: Capture reports one whose shape or dtype moved.
  // kInvalidArgument naming a buffer that is not a CPU tensor (the libtorch
  // hooks checkpoint CPU tensors) or libtorch's error.
  static Result<ModuleBuffers> Of(const torch::nn::Module& module);

  bool empty() const { return names_.empty(); }
  std::size_t size() const { return names_.size(); }
  // The shadows as the engine registers them: frontend::BufferUnits.
  Result<std::vector<runtime::UnitRegistration>> Units() const;
  // Copies every buffer into its shadow. kFailedPrecondition naming a buffer
  // that changed shape, dtype or storage since Of.
  Status Capture();
  // Copies every shadow (just restored by the engine) into its buffer.
  Status RestoreInto();

 private:
  Status CheckUnchanged() const;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> buffers_;
  std::vector<torch::Tensor> shadows_;
};

}  // namespace pmsnap::hooks
