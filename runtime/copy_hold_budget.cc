#include "detail/copy_hold_budget.h"

#include <algorithm>

namespace pmsnap::runtime {

CopyHoldBudget::CopyHoldBudget(CopyStart copy_start, bool cpu_addressable,
                               std::uint64_t model_bytes, int workers)
    : hold_every_capture_(copy_start == CopyStart::kAfterStep),
      hold_within_budget_(copy_start == CopyStart::kAuto && cpu_addressable),
      model_bytes_(model_bytes),
      workers_(workers) {}

void CopyHoldBudget::OnStepBegin(Clock::time_point step_begin) {
  captured_bytes_in_step_ = 0;
  if (!hold_within_budget_ || !last_step_end_) return;
  const double between_steps = std::chrono::duration<double>(step_begin - *last_step_end_).count();
  const double rate = held_drain_bytes_per_second_ > 0 ? held_drain_bytes_per_second_
                                                       : worker_bytes_per_second_ * workers_;
  budget_bytes_ = static_cast<std::uint64_t>(kWindowShare * between_steps * rate);
}

bool CopyHoldBudget::HoldCapture(std::uint64_t unit_bytes) {
  const std::uint64_t uncaptured =
      model_bytes_ - std::min(model_bytes_, captured_bytes_in_step_);  // this unit's included
  captured_bytes_in_step_ += unit_bytes;
  return hold_every_capture_ ||
         (hold_within_budget_ && budget_bytes_ > 0 && uncaptured <= budget_bytes_);
}

void CopyHoldBudget::OnStepEnd(Clock::time_point step_end) { last_step_end_ = step_end; }

void CopyHoldBudget::OnEpochCommitted(const CommittedCopies& copies) {
  if (copies.copy_seconds > 0) worker_bytes_per_second_ = copies.slot_bytes / copies.copy_seconds;
  if (copies.held_bytes >= model_bytes_ / 4 && copies.held_drain_seconds > 0) {
    held_drain_bytes_per_second_ =
        static_cast<double>(copies.held_bytes) / copies.held_drain_seconds;
  }
}

}  // namespace pmsnap::runtime
