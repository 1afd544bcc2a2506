// The simulated device's asynchronous mode, the GPU queue model behind the
// event ordering (docs/ARCHITECTURE.md, "GPU ordering"): copies wait for the
// events they are given, kernels queued after a copy do not wait for it, and
// ComputeWaitFor makes later kernels wait on the device, not the host.
// Ordering is checked with latches, never with timing.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "pmsnap/runtime/device.h"
#include "testutil/latch.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::Latch;
constexpr auto kHangGuard = std::chrono::seconds(60);

SimulatedDeviceOptions Async() {
  SimulatedDeviceOptions options;
  options.asynchronous = true;
  options.copy_bandwidth_gbps = 1;
  return options;
}

// An event that completes when `latch` opens: a blocked kernel on a second
// device's compute stream (events of simulated devices are interchangeable).
DeviceEventPtr GateEvent(SimulatedDevice& gate_device, Latch& latch) {
  gate_device.LaunchKernel([&latch] { latch.Wait(); });
  auto event = gate_device.RecordComputeEvent();
  EXPECT_TRUE(event.ok());
  return *event;
}

TEST(AsyncSimulatedDeviceTest, KernelsQueuedAfterACopyDoNotWaitForIt) {
  SimulatedDevice gate_device(Async()), device(Async());
  ASSERT_TRUE(device.orders_by_events());
  Latch latch;
  DeviceEventPtr gate = GateEvent(gate_device, latch);
  std::vector<char> src(4096, 'a'), dst(4096, 0);
  auto copy = device.CopyToHostAsync(dst.data(), src.data(), src.size(), gate);
  ASSERT_TRUE(copy.ok());
  bool copy_done_when_kernel_ran = true;
  device.LaunchKernel(
      [&] { copy_done_when_kernel_ran = SimulatedDevice::EventComplete(copy->get()); });
  latch.OpenAfter(kHangGuard);
  device.SynchronizeCompute();  // returns while the copy is still held
  EXPECT_FALSE(latch.opened_by_guard()) << "the compute stream waited for a copy";
  EXPECT_FALSE(copy_done_when_kernel_ran);
  EXPECT_EQ(device.queue_stats().compute_waits_on_copies, 0u);
  latch.Open();
  ASSERT_TRUE(device.Synchronize(**copy).ok());
  EXPECT_EQ(dst, src);
}

TEST(AsyncSimulatedDeviceTest, ComputeWaitForHoldsLaterKernelsOnTheDeviceUntilTheCopyIsDone) {
  SimulatedDevice gate_device(Async()), device(Async());
  Latch latch;
  DeviceEventPtr gate = GateEvent(gate_device, latch);
  std::vector<char> src(4096, 'a'), dst(4096, 0);
  auto copy = device.CopyToHostAsync(dst.data(), src.data(), src.size(), gate);
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE(device.ComputeWaitFor(*copy).ok());  // returns at once: no host block
  std::atomic<bool> ran{false};
  bool copy_done_when_kernel_ran = false;
  device.LaunchKernel([&] {
    copy_done_when_kernel_ran = SimulatedDevice::EventComplete(copy->get());
    ran = true;
  });
  // The compute stream reaches the wait and stalls there (or, broken, runs
  // the kernel at once).
  while (device.queue_stats().compute_stalls == 0 && !ran) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  EXPECT_FALSE(ran.load()) << "a kernel after ComputeWaitFor ran before the copy";
  latch.Open();
  device.SynchronizeCompute();
  EXPECT_TRUE(ran.load());
  EXPECT_TRUE(copy_done_when_kernel_ran);
  EXPECT_EQ(dst, src);
  const DeviceQueueStats stats = device.queue_stats();
  EXPECT_EQ(stats.compute_waits_on_copies, 1u);
  EXPECT_EQ(stats.compute_stalls, 1u);
  EXPECT_GT(stats.compute_stall_seconds, 0);
}

// The copy of a tensor whose update is still queued reads the updated bytes
// when it waits for the update's event, and the stale ones when the testing
// switch drops the wait: the check below catches the missing wait.
std::vector<char> CopyAfterQueuedUpdate(bool copies_ignore_events) {
  SimulatedDeviceOptions options = Async();
  options.testing_copies_ignore_events = copies_ignore_events;
  SimulatedDevice device(options);
  std::vector<char> tensor(8192, 'a'), dst(8192, 0);
  Latch update_may_run;
  device.LaunchKernel([&] {
    update_may_run.Wait();
    std::fill(tensor.begin(), tensor.end(), 'b');
  });
  auto updated = device.RecordComputeEvent();
  EXPECT_TRUE(updated.ok());
  auto copy = device.CopyToHostAsync(dst.data(), tensor.data(), tensor.size(), *updated);
  EXPECT_TRUE(copy.ok());
  // Settled: blocked on the update's event, or (switch on) done without it.
  while (device.copies_settled() == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  update_may_run.Open();
  EXPECT_TRUE(device.Synchronize(**copy).ok());
  device.SynchronizeCompute();
  return dst;
}

TEST(AsyncSimulatedDeviceTest, ACopyWaitsForTheUpdateEventItIsGiven) {
  EXPECT_EQ(CopyAfterQueuedUpdate(false), std::vector<char>(8192, 'b'));
}

TEST(AsyncSimulatedDeviceTest, WithoutTheEventWaitTheCopyReadsTheStaleTensor) {
  EXPECT_EQ(CopyAfterQueuedUpdate(true), std::vector<char>(8192, 'a'));
}

TEST(AsyncSimulatedDeviceTest, SynchronousModeRunsKernelsAtOnceAndOrdersNothing) {
  SimulatedDevice device(SimulatedDeviceOptions{});
  EXPECT_FALSE(device.orders_by_events());
  bool ran = false;
  device.LaunchKernel([&] { ran = true; });
  EXPECT_TRUE(ran);
  auto event = device.RecordComputeEvent();
  ASSERT_TRUE(event.ok());
  EXPECT_EQ(*event, nullptr);
}

}  // namespace
}  // namespace pmsnap::runtime
