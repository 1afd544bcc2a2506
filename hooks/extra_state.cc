// libtorch RNG capture and restore for the extra state: see extra_state.h.
// The packing format is in extra_state_format.cc.
#include "pmsnap/hooks/extra_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <mutex>
#include <string>

namespace pmsnap::hooks {

Result<std::vector<std::byte>> CaptureCpuRngState() {
  try {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      state = generator.get_state();
    }
    const auto* data = static_cast<const std::byte*>(state.data_ptr());
    return std::vector<std::byte>(data, data + state.numel());
  } catch (const c10::Error& error) {
    return Status(StatusCode::kInternal, std::string("reading the CPU RNG state: libtorch: ") +
                                             error.what_without_backtrace());
  }
}

Status RestoreCpuRngState(std::span<const std::byte> state) {
  try {
    at::Tensor tensor = at::empty({static_cast<std::int64_t>(state.size())}, at::kByte);
    std::memcpy(tensor.data_ptr(), state.data(), state.size());
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(tensor);
  } catch (const c10::Error& error) {
    return Status(
        StatusCode::kInvalidArgument,
        std::string("restoring the CPU RNG state: libtorch: ") + error.what_without_backtrace());
  }
  return Status::Ok();
}

}  // namespace pmsnap::hooks
