// The checkpoint policies alone: every-k with a moving anchor (LowDiff's
// retuned interval) and CheckFreq's Algorithm 1 interval.
#include <gtest/gtest.h>

#include <vector>

#include "pmsnap/runtime/interval_policy.h"

namespace pmsnap::runtime {
namespace {

TEST(EveryKPolicyTest, ANewIntervalCountsFromItsAnchor) {
  EveryKPolicy policy(10);
  const PolicyInputs in;
  std::vector<std::uint64_t> fired;
  for (std::uint64_t step = 1; step <= 45; ++step) {
    if (step == 27) policy.set_every(7, 20);  // tuned after the checkpoint of step 20
    if (policy.ShouldCheckpoint(step, in)) fired.push_back(step);
  }
  // 10, 20; then 20 + 7 k, not the multiples of 7 (28, 35, 42).
  EXPECT_EQ(fired, (std::vector<std::uint64_t>{10, 20, 27, 34, 41}));
  policy.set_every(0);  // 0 counts as 1, anchor 0
  EXPECT_TRUE(policy.ShouldCheckpoint(46, in));
  EXPECT_EQ(policy.name(), "every-1");
}

TEST(CheckFreqPolicyTest, IntervalFollowsAlgorithmOne) {
  PolicyInputs in;
  in.iteration_seconds = 0.1;
  in.update_seconds = 0.02;
  in.snapshot_seconds = 0.3;  // T_oc = 0.3 - 0.08 = 0.22
  in.persist_seconds = 0.2;
  in.in_device_seconds = 0.01;
  in.model_bytes = 1000;
  in.device_free_bytes = 10;  // no room: CPU mode
  bool gpu = true;
  // k = (0.3 + 0.2 - 0.22) / 0.1 = 2.8 -> 3; k_min = ceil(0.22 / (0.035 * 0.1)) = 63.
  EXPECT_EQ(CheckFreqPolicy::ComputeInterval(in, 0.035, &gpu), 63u);
  EXPECT_FALSE(gpu);
  in.device_free_bytes = 1 << 20;  // room: GPU mode, T_o = 0.01
  // k = (0.5 - 0.01) / 0.1 = 4.9 -> 5; k_min = ceil(0.01 / 0.0035) = 3.
  EXPECT_EQ(CheckFreqPolicy::ComputeInterval(in, 0.035, &gpu), 5u);
  EXPECT_TRUE(gpu);
}

}  // namespace
}  // namespace pmsnap::runtime
