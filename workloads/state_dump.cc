#include "pmsnap/workloads/state_dump.h"

#include <fstream>

#include "pmsnap/hooks/optimizer_state.h"

namespace pmsnap::workloads {

Status WriteStateDump(const std::string& path, torch::nn::Module& module,
                      torch::optim::Optimizer& optimizer) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  auto write = [&](const torch::Tensor& t) {
    torch::Tensor c = t.contiguous();
    out.write(static_cast<const char*>(c.data_ptr()),
              static_cast<std::streamsize>(c.numel() * c.element_size()));
  };
  for (const auto& item : module.named_parameters()) {
    write(item.value());
    const hooks::OptimizerStateView state = hooks::ViewOptimizerState(optimizer, item.value());
    for (const auto& t : state.tensors) write(t);
    out.write(reinterpret_cast<const char*>(&state.step), sizeof(state.step));
  }
  out.close();
  if (!out) {
    return Status(StatusCode::kIOError,
                  "cannot write the state dump '" + path + "' (parameters + optimizer state)");
  }
  return Status::Ok();
}

}  // namespace pmsnap::workloads
