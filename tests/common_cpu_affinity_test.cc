// Pinning threads to CPUs: the calling thread ends up on the CPU it asked
// for, and CPUs the process may not use are refused before anything changes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

#include "pmsnap/common/cpu_affinity.h"

namespace pmsnap {
namespace {

using ::testing::HasSubstr;

TEST(CpuAffinityTest, APinnedThreadRunsOnItsCpu) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  const int target = allowed.back();
  std::thread thread([&] {
    const int cpus[] = {target};
    Status pinned = PinCurrentThread(cpus);
    ASSERT_TRUE(pinned.ok()) << pinned.ToString();
    EXPECT_EQ(AllowedCpus(), std::vector<int>{target});
    for (int i = 0; i < 100; ++i) ASSERT_EQ(sched_getcpu(), target);
  });
  thread.join();
  EXPECT_EQ(AllowedCpus(), allowed) << "another thread's pinning leaked into this one";
}

TEST(CpuAffinityTest, MissingCpusAreInvalidArgumentAndChangeNothing) {
  const std::vector<int> before = AllowedCpus();
  if (ConfiguredCpus() >= CPU_SETSIZE) GTEST_SKIP() << "every CPU slot exists";
  const int missing[] = {ConfiguredCpus()};
  Status status = PinCurrentThread(missing, "test cpus");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("test cpus: CPU " + std::to_string(ConfiguredCpus()) + " does not exist"));
  const int negative[] = {-1};
  EXPECT_EQ(PinCurrentThread(negative, "test cpus").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PinCurrentThread({}, "test cpus").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AllowedCpus(), before);
}

TEST(CpuAffinityTest, AThreadPinnedByAPinnedThreadCanStillMoveToAnyCpu) {
  // The engine pins its workers to CPUs its (pinned) creator may not use.
  const std::vector<int> allowed = AllowedCpus();
  if (allowed.size() < 2) GTEST_SKIP() << "one CPU";
  std::thread outer([&] {
    const int first[] = {allowed.front()};
    ASSERT_TRUE(PinCurrentThread(first).ok());
    std::thread inner([&] {
      const int last[] = {allowed.back()};
      Status pinned = PinCurrentThread(last);
      ASSERT_TRUE(pinned.ok()) << pinned.ToString();
      EXPECT_EQ(sched_getcpu(), allowed.back());
    });
    inner.join();
  });
  outer.join();
}

}  // namespace
}  // namespace pmsnap
