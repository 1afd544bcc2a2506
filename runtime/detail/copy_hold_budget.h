// CopyHoldBudget: which captured units' copies wait for EndStep instead of
// starting right after the unit's update (EngineOptions::copy_start).
//
// An optimizer step streams every parameter and its state through memory;
// host-memory copies running beside it compete for the same bandwidth, while
// forward and backward, which come next, leave more of it free. So
// CopyStart::kAuto on a CPU-addressable device holds the step's last
// captures, as many bytes as the workers copy in kWindowShare of the time
// between two steps at their measured rate; the first captures, whose units
// the next step updates first, are copied right away. Until an epoch
// measured that rate nothing is held. kAfterStep holds every capture,
// kAfterUpdate none.
//
// Thread-safety: none; the engine's training thread owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

#include "pmsnap/runtime/engine.h"

namespace pmsnap::runtime {

class CopyHoldBudget {
 public:
  using Clock = std::chrono::steady_clock;

  // Share of the time between two steps that held copies may fill; the rest
  // is slack for a slower drain.
  static constexpr double kWindowShare = 0.8;

  // What the workers did for one committed epoch: the rate the budget uses.
  struct CommittedCopies {
    // Slot bytes the workers copied and the seconds those copies took,
    // summed over parts (one worker's rate).
    double slot_bytes = 0;
    double copy_seconds = 0;
    // Bytes held for EndStep, and seconds from EndStep releasing them to
    // the commit (draining them and whatever else was still copying).
    std::uint64_t held_bytes = 0;
    double held_drain_seconds = 0;
  };

  // `copy_start` as configured; `cpu_addressable` from the engine's Device
  // (kAuto holds only there); `model_bytes`: the bytes of every slot unit;
  // `workers`: EngineOptions::workers.
  CopyHoldBudget(CopyStart copy_start, bool cpu_addressable, std::uint64_t model_bytes,
                 int workers);

  // A step begins at `step_begin` (after the previous epoch was reaped):
  // nothing is captured in it yet, and kAuto sizes the budget from the time
  // since the last OnStepEnd (forward and backward; a wait inside BeginStep
  // is not time the copies can have). The first step keeps a budget of 0.
  void OnStepBegin(Clock::time_point step_begin);

  // A slot unit of `unit_bytes` is captured in this step: true if its
  // copies wait for EndStep. kAuto holds it when the bytes not yet captured
  // in this step, its own included, fit the budget; its bytes then count as
  // captured.
  bool HoldCapture(std::uint64_t unit_bytes);

  // The step's EndStep finished at `step_end`.
  void OnStepEnd(Clock::time_point step_end);

  // Learns the workers' rate from a committed epoch. The drain rate of held
  // copies, once measured, is what the budget uses; it is measured only
  // from epochs that held at least a quarter of the model (a small held set
  // would mostly time the commit, not the copies). It counts only the held
  // bytes as drained after EndStep, though others may still have been
  // copying: it errs towards a smaller budget. Until then the budget uses
  // one worker's copy rate times the workers.
  void OnEpochCommitted(const CommittedCopies& copies);

  // Bytes the step that began last may hold (kAuto); 0 otherwise.
  std::uint64_t budget_bytes() const { return budget_bytes_; }

 private:
  const bool hold_every_capture_;
  const bool hold_within_budget_;
  const std::uint64_t model_bytes_;
  const int workers_;
  std::uint64_t budget_bytes_ = 0;
  std::uint64_t captured_bytes_in_step_ = 0;
  std::optional<Clock::time_point> last_step_end_;
  double worker_bytes_per_second_ = 0;
  double held_drain_bytes_per_second_ = 0;
};

}  // namespace pmsnap::runtime
