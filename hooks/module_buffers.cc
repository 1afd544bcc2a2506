// ModuleBuffers (see pmsnap/hooks/module_buffers.h).
#include "pmsnap/hooks/module_buffers.h"

#include <torch/torch.h>

#include <utility>

#include "pmsnap/frontend/parameter_units.h"
#include "pmsnap/pmem_layout/manifest.h"
#include "tensor_views.h"

namespace pmsnap::hooks {
namespace {

std::string Describe(const torch::Tensor& tensor) {
  return std::string(c10::toString(tensor.scalar_type())) + " " +
         layout::ShapeToString(tensor.sizes());
}

}  // namespace

Result<ModuleBuffers> ModuleBuffers::Of(const torch::nn::Module& module) {
  ModuleBuffers out;
  try {
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      const torch::Tensor& buffer = item.value();
      if (!buffer.defined()) continue;
      if (!buffer.device().is_cpu()) {
        return Status(StatusCode::kInvalidArgument,
                      "module buffer '" + item.key() + "' is on " + buffer.device().str() +
                          ": the libtorch hooks support CPU tensors");
      }
      out.names_.push_back(item.key());
      out.buffers_.push_back(buffer);
      out.shadows_.push_back(torch::empty_like(buffer, at::MemoryFormat::Contiguous));
    }
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInvalidArgument,
                  std::string("listing the module's buffers: libtorch: ") +
                      error.what_without_backtrace());
  }
  return out;
}

Result<std::vector<runtime::UnitRegistration>> ModuleBuffers::Units() const {
  std::vector<runtime::TensorView> views;
  for (std::size_t i = 0; i < names_.size(); ++i) {
    PMSNAP_ASSIGN_OR_RETURN(runtime::TensorView view,
                            ViewOf(std::string(frontend::kBuffersUnit), names_[i], shadows_[i]));
    views.push_back(std::move(view));
  }
  return frontend::BufferUnits(std::move(views));
}

Status ModuleBuffers::CheckUnchanged() const {
  for (std::size_t i = 0; i < names_.size(); ++i) {
    const torch::Tensor& buffer = buffers_[i];
    const torch::Tensor& shadow = shadows_[i];
    if (buffer.scalar_type() != shadow.scalar_type() || buffer.sizes() != shadow.sizes()) {
      return Status(StatusCode::kFailedPrecondition,
                    "module buffer '" + names_[i] + "' changed from " + Describe(shadow) +
                        " to " + Describe(buffer) + " since the pool was laid out");
    }
  }
  return Status::Ok();
}

Status ModuleBuffers::Capture() {
  PMSNAP_RETURN_IF_ERROR(CheckUnchanged());
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names_.size(); ++i) shadows_[i].copy_(buffers_[i]);
  return Status::Ok();
}

Status ModuleBuffers::RestoreInto() {
  PMSNAP_RETURN_IF_ERROR(CheckUnchanged());
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names_.size(); ++i) buffers_[i].copy_(shadows_[i]);
  return Status::Ok();
}

}  // namespace pmsnap::hooks
