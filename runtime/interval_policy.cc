#include "pmsnap/runtime/interval_policy.h"

#include <algorithm>
#include <cmath>

namespace pmsnap::runtime {

std::string CheckFreqPolicy::name() const {
  return "checkfreq(k=" + std::to_string(k_) + (gpu_mode_ ? ", in-device" : ", direct") + ")";
}

std::uint64_t CheckFreqPolicy::ComputeInterval(const PolicyInputs& in, double p, bool* gpu_mode) {
  const double t_i = std::max(in.iteration_seconds, 1e-9);
  const double t_oc = std::max(0.0, in.snapshot_seconds - (t_i - in.update_seconds));
  const double t_og = in.in_device_seconds;
  const bool gpu = in.device_free_bytes > in.model_bytes && t_og <= t_oc;
  const double t_o = gpu ? t_og : t_oc;
  const double k = (in.snapshot_seconds + in.persist_seconds - t_o) / t_i;
  const double k_min = std::ceil(t_o / (p * t_i));
  if (gpu_mode != nullptr) *gpu_mode = gpu;
  return static_cast<std::uint64_t>(std::max({1.0, std::ceil(k), k_min}));
}

bool CheckFreqPolicy::ShouldCheckpoint(std::uint64_t step, const PolicyInputs& inputs) {
  if (inputs.have_profile) k_ = ComputeInterval(inputs, p_, &gpu_mode_);
  if (!started_) {
    started_ = true;
    return true;
  }
  return step >= last_step_ + k_;
}

}  // namespace pmsnap::runtime
