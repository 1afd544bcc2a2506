// CopyHoldBudget: which captures wait for EndStep under each CopyStart, and
// how kAuto sizes its budget from the workers' measured rate.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "detail/copy_hold_budget.h"

namespace pmsnap::runtime {
namespace {

using Clock = CopyHoldBudget::Clock;
using Seconds = std::chrono::duration<double>;

constexpr std::uint64_t kUnitBytes = 10'000'000;
constexpr int kUnits = 10;
constexpr std::uint64_t kModelBytes = kUnits * kUnitBytes;
constexpr int kWorkers = 2;

Clock::time_point At(double seconds) {
  return Clock::time_point{} + std::chrono::duration_cast<Clock::duration>(Seconds(10 + seconds));
}

// Captures every unit of the model in one step; true for each held one.
std::vector<bool> CaptureStep(CopyHoldBudget& budget) {
  std::vector<bool> held;
  for (int u = 0; u < kUnits; ++u) held.push_back(budget.HoldCapture(kUnitBytes));
  return held;
}

// One worker copies 100 MB/s: two copy 200 MB/s.
CopyHoldBudget::CommittedCopies CopiedAt100MBPerSecond() {
  return {.slot_bytes = 1e8, .copy_seconds = 1.0, .held_bytes = 0, .held_drain_seconds = 0};
}

// Units whose bytes, counted from the step's last capture backwards, fit
// `budget`: a tail of the capture order.
std::vector<bool> TailWithin(std::uint64_t budget) {
  std::vector<bool> held;
  for (int u = 0; u < kUnits; ++u) held.push_back((kUnits - u) * kUnitBytes <= budget);
  return held;
}

TEST(CopyHoldBudgetTest, AfterUpdateNeverHolds) {
  CopyHoldBudget budget(CopyStart::kAfterUpdate, true, kModelBytes, kWorkers);
  budget.OnEpochCommitted(CopiedAt100MBPerSecond());
  budget.OnStepEnd(At(0));
  budget.OnStepBegin(At(10));
  EXPECT_EQ(CaptureStep(budget), std::vector<bool>(kUnits, false));
}

TEST(CopyHoldBudgetTest, AfterStepHoldsEveryCaptureOnAnyDeviceFromTheFirstStep) {
  for (bool cpu_addressable : {true, false}) {
    CopyHoldBudget budget(CopyStart::kAfterStep, cpu_addressable, kModelBytes, kWorkers);
    budget.OnStepBegin(At(0));
    EXPECT_EQ(CaptureStep(budget), std::vector<bool>(kUnits, true)) << cpu_addressable;
  }
}

TEST(CopyHoldBudgetTest, AutoOnADeviceBehindALinkNeverHolds) {
  CopyHoldBudget budget(CopyStart::kAuto, false, kModelBytes, kWorkers);
  budget.OnEpochCommitted(CopiedAt100MBPerSecond());
  budget.OnStepEnd(At(0));
  budget.OnStepBegin(At(10));
  EXPECT_EQ(budget.budget_bytes(), 0u);
  EXPECT_EQ(CaptureStep(budget), std::vector<bool>(kUnits, false));
}

TEST(CopyHoldBudgetTest, AutoHoldsNothingUntilAnEpochMeasuredTheRate) {
  CopyHoldBudget budget(CopyStart::kAuto, true, kModelBytes, kWorkers);
  budget.OnStepBegin(At(0));  // the first step: no time between steps yet
  EXPECT_EQ(CaptureStep(budget), std::vector<bool>(kUnits, false));
  budget.OnStepEnd(At(0.1));
  budget.OnStepBegin(At(10));  // plenty of time, but no rate
  EXPECT_EQ(budget.budget_bytes(), 0u);
  EXPECT_EQ(CaptureStep(budget), std::vector<bool>(kUnits, false));
}

// 80% of 0.3 s between the steps at 2 x 100 MB/s: 48 MB, the last four
// 10 MB units.
TEST(CopyHoldBudgetTest, AutoHoldsTheStepsLastCapturesThatTheWorkersCopyBetweenSteps) {
  CopyHoldBudget budget(CopyStart::kAuto, true, kModelBytes, kWorkers);
  budget.OnEpochCommitted(CopiedAt100MBPerSecond());
  budget.OnStepEnd(At(1.0));
  budget.OnStepBegin(At(1.3));
  EXPECT_NEAR(static_cast<double>(budget.budget_bytes()), 48e6, 1);
  EXPECT_EQ(CaptureStep(budget), TailWithin(48'000'000));
  // The next step counts its captures afresh, with a budget from its own gap
  // (0.1 s: 16 MB, the last unit).
  budget.OnStepEnd(At(2.0));
  budget.OnStepBegin(At(2.1));
  EXPECT_EQ(CaptureStep(budget), TailWithin(16'000'000));
}

// Held copies drained at 300 MB/s: from then on that rate sizes the budget
// (80% of 0.3 s: 72 MB), not the workers' copy rate.
TEST(CopyHoldBudgetTest, AutoPrefersTheMeasuredDrainOfHeldCopies) {
  CopyHoldBudget budget(CopyStart::kAuto, true, kModelBytes, kWorkers);
  budget.OnEpochCommitted({.slot_bytes = 1e8,
                           .copy_seconds = 1.0,
                           .held_bytes = 30'000'000,
                           .held_drain_seconds = 0.1});
  budget.OnStepEnd(At(1.0));
  budget.OnStepBegin(At(1.3));
  EXPECT_EQ(CaptureStep(budget), TailWithin(72'000'000));
}

// Fewer held bytes than a quarter of the model would mostly time the
// commit: such an epoch does not change the drain rate.
TEST(CopyHoldBudgetTest, AutoIgnoresTheDrainOfASmallHeldSet) {
  CopyHoldBudget budget(CopyStart::kAuto, true, kModelBytes, kWorkers);
  budget.OnEpochCommitted({.slot_bytes = 1e8,
                           .copy_seconds = 1.0,
                           .held_bytes = kModelBytes / 4 - 1,
                           .held_drain_seconds = 0.001});
  budget.OnStepEnd(At(1.0));
  budget.OnStepBegin(At(1.3));
  EXPECT_EQ(CaptureStep(budget), TailWithin(48'000'000));  // still 2 x 100 MB/s

  budget.OnEpochCommitted({.slot_bytes = 1e8,
                           .copy_seconds = 1.0,
                           .held_bytes = 30'000'000,
                           .held_drain_seconds = 0.1});
  budget.OnEpochCommitted(
      {.slot_bytes = 1e8, .copy_seconds = 1.0, .held_bytes = 1'000'000, .held_drain_seconds = 1.0});
  budget.OnStepEnd(At(2.0));
  budget.OnStepBegin(At(2.3));
  EXPECT_EQ(CaptureStep(budget), TailWithin(72'000'000));  // still 300 MB/s
}

}  // namespace
}  // namespace pmsnap::runtime
