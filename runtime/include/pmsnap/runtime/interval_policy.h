// IntervalPolicy: at which step boundaries an epoch starts.
//
// The engine asks at every BeginStep whether step k should be captured. At
// most one epoch is ever in flight: a policy that says yes while the previous
// epoch is still running is either skipped (continuous) or waited for
// (every-k, CheckFreq), as `wait_if_busy` says.
//
// Thread-safety: called on the training thread only.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "pmsnap/common/mutex.h"

namespace pmsnap::runtime {

// What the engine measured, for policies that adapt (all seconds).
struct PolicyInputs {
  double iteration_seconds = 0;         // T_i: last step boundary to boundary
  double update_seconds = 0;            // T_w: optimizer step (first hook to EndStep)
  double snapshot_seconds = 0;          // T_c: last epoch, capture -> all snapshotted
  double in_device_seconds = 0;         // T_g: estimated in-device copy of the model
  double persist_seconds = 0;           // T_s: last epoch, snapshot done -> committed
  std::uint64_t model_bytes = 0;        // m
  std::uint64_t device_free_bytes = 0;  // M_max - M
  bool have_profile = false;            // false until one epoch committed
};

class IntervalPolicy {
 public:
  virtual ~IntervalPolicy() = default;
  virtual std::string name() const = 0;
  virtual bool ShouldCheckpoint(std::uint64_t step, const PolicyInputs& inputs) = 0;
  // Continuous mode skips a busy boundary; fixed intervals wait for it.
  virtual bool wait_if_busy() const = 0;
  // Called when an epoch for `step` started.
  virtual void OnEpochStarted(std::uint64_t step) { (void)step; }
  // Whether answers depend on this process's measurements. Several ranks
  // must make the same decisions, so the engine refuses such a policy when
  // it coordinates ranks.
  virtual bool adapts_to_measurements() const { return false; }
};

// As many checkpoints as the machine allows: a new epoch at the first step
// boundary after the previous one committed.
class ContinuousPolicy final : public IntervalPolicy {
 public:
  std::string name() const override { return "continuous"; }
  bool ShouldCheckpoint(std::uint64_t, const PolicyInputs&) override { return true; }
  bool wait_if_busy() const override { return false; }
};

// Steps k with k % every == 0 (every >= 1).
class EveryKPolicy final : public IntervalPolicy {
 public:
  explicit EveryKPolicy(std::uint64_t every) : every_(every == 0 ? 1 : every) {}
  std::string name() const override {
    MutexLock lock(mutex_);
    return "every-" + std::to_string(every_);
  }
  // Steps anchor + k, anchor + 2k, ... (anchor 0: the multiples of k).
  bool ShouldCheckpoint(std::uint64_t step, const PolicyInputs&) override {
    MutexLock lock(mutex_);
    return step > anchor_ && (step - anchor_) % every_ == 0;
  }
  bool wait_if_busy() const override { return true; }
  // Changes k from the next ShouldCheckpoint on (0 counts as 1), counting
  // from step `anchor`: a tuner that changes k right after a checkpoint at
  // step s passes anchor = s, so the next one comes k steps later rather
  // than at the next multiple of k (LowDiff re-tunes its full-checkpoint
  // interval while training runs). Any thread.
  void set_every(std::uint64_t every, std::uint64_t anchor = 0) {
    MutexLock lock(mutex_);
    every_ = every == 0 ? 1 : every;
    anchor_ = anchor;
  }

 private:
  mutable Mutex mutex_;
  std::uint64_t every_ PMSNAP_GUARDED_BY(mutex_);
  std::uint64_t anchor_ PMSNAP_GUARDED_BY(mutex_) = 0;
};

// CheckFreq's frequency determination (Algorithm 1 of the PM-DNN slides):
//   T_oc = max(0, T_c - (T_i - T_w)), T_og = T_g
//   GPU mode if free device memory > m and T_og <= T_oc: T_o = T_og, else T_o = T_oc
//   k = (T_c + T_s - T_o) / T_i,  k_min = ceil(T_o / (p * T_i)),  k = max(k, k_min)
// recomputed after every committed epoch from the engine's measurements.
// Until the first profile exists it checkpoints every `initial_every` steps.
class CheckFreqPolicy final : public IntervalPolicy {
 public:
  explicit CheckFreqPolicy(double overhead_fraction = 0.035, std::uint64_t initial_every = 1)
      : p_(overhead_fraction), k_(initial_every == 0 ? 1 : initial_every) {}
  std::string name() const override;
  bool ShouldCheckpoint(std::uint64_t step, const PolicyInputs& inputs) override;
  bool wait_if_busy() const override { return true; }
  void OnEpochStarted(std::uint64_t step) override { last_step_ = step; }
  bool adapts_to_measurements() const override { return true; }

  // The algorithm itself, exposed for tests: returns k and whether the GPU
  // (in-device) mode was chosen.
  static std::uint64_t ComputeInterval(const PolicyInputs& inputs, double overhead_fraction,
                                       bool* gpu_mode);
  std::uint64_t interval() const { return k_; }
  bool gpu_mode() const { return gpu_mode_; }

 private:
  double p_;
  std::uint64_t k_;
  bool gpu_mode_ = false;
  std::uint64_t last_step_ = 0;
  bool started_ = false;
};

}  // namespace pmsnap::runtime
