// Device selection and the CUDA device: real copies when a GPU is present,
// a clean fallback to the host device when not.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {
namespace {

using ::testing::HasSubstr;

TEST(MakeDeviceTest, HostAndSimulatedSpecs) {
  auto host = MakeDevice("host");
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->kind(), DeviceKind::kHost);
  auto sim = MakeDevice("simulated:2.5:64");
  ASSERT_TRUE(sim.ok()) << sim.status().ToString();
  EXPECT_EQ((*sim)->kind(), DeviceKind::kSimulated);
  EXPECT_THAT((*sim)->name(), HasSubstr("simulated(2.5 GB/s"));
  EXPECT_EQ((*sim)->free_bytes(), 64u << 20);
}

// The host's tensors are the CPU's own memory: the pool copies them itself.
// The simulated device models memory behind a link, like a GPU.
TEST(MakeDeviceTest, OnlyTheHostDeviceIsCpuAddressable) {
  auto host = MakeDevice("host");
  ASSERT_TRUE(host.ok());
  EXPECT_TRUE((*host)->cpu_addressable());
  auto sim = MakeDevice("simulated:2.5:64");
  ASSERT_TRUE(sim.ok()) << sim.status().ToString();
  EXPECT_FALSE((*sim)->cpu_addressable());
}

TEST(MakeDeviceTest, BadSpecsAreRejectedWithTheSpecInTheMessage) {
  for (const char* spec : {"gpu", "simulated:fast", "simulated:0", "host:1", "simulated:1:2:3"}) {
    auto device = MakeDevice(spec);
    EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(device.status().message(), HasSubstr(spec));
  }
}

TEST(CudaDeviceTest, WithoutAGpuCudaFallsBackToTheHostAndSaysWhy) {
  auto cuda = CreateCudaDevice(0);
  if (cuda.ok()) GTEST_SKIP() << "a GPU is present: " << (*cuda)->name();
  EXPECT_EQ(cuda.status().code(), StatusCode::kFailedPrecondition);
  std::string note;
  auto device = MakeDevice("cuda", &note);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ((*device)->kind(), DeviceKind::kHost);
  EXPECT_THAT(note, HasSubstr("no usable CUDA device"));
}

TEST(CudaDeviceTest, OnAGpuBytesRoundTripThroughDeviceMemory) {
  auto cuda = CreateCudaDevice(0);
  if (!cuda.ok()) GTEST_SKIP() << cuda.status().message();
  Device& device = **cuda;
  std::vector<std::uint32_t> host(1 << 20);
  std::iota(host.begin(), host.end(), 7u);
  const std::size_t bytes = host.size() * sizeof(host[0]);
  auto a = device.Allocate(bytes);
  auto b = device.Allocate(bytes);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(device.CopyFromHost(*a, host.data(), bytes).ok());
  ASSERT_TRUE(device.CopyInDevice(*b, *a, bytes).ok());
  std::vector<std::uint32_t> back(host.size(), 0);
  {
    std::string not_registered;
    auto registration = HostRegistration::Register(device, back.data(), bytes, &not_registered);
    ASSERT_TRUE(registration.ok()) << registration.status().ToString();
    EXPECT_TRUE(registration->registered()) << not_registered;
    ASSERT_TRUE(device.CopyToHost(back.data(), *b, bytes).ok());
    ASSERT_TRUE(registration->Release().ok());  // before `back` goes
  }
  EXPECT_EQ(back, host);
  EXPECT_GE(device.peak_allocated_bytes(), 2 * bytes);
  device.Free(*a, bytes);
  device.Free(*b, bytes);
}

TEST(SimulatedDeviceTest, CopiesTakeBandwidthTimeAndShareTheLink) {
  SimulatedDeviceOptions sim;
  sim.copy_bandwidth_gbps = 1.0;
  sim.latency_us = 0;
  SimulatedDevice device(sim);
  // Two destinations: the concurrent copies below must not write the same
  // bytes (that was a data race, found by ThreadSanitizer).
  std::vector<std::byte> src(10'000'000), dst(10'000'000), other_dst(10'000'000);
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(device.CopyToHost(dst.data(), src.data(), src.size()).ok());
  const double one =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(one, 0.0099);
  start = std::chrono::steady_clock::now();
  std::thread other([&] { (void)device.CopyToHost(other_dst.data(), src.data(), src.size()); });
  ASSERT_TRUE(device.CopyToHost(dst.data(), src.data(), src.size()).ok());
  other.join();
  const double two =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(two, 0.0199);  // two concurrent copies share one link
  EXPECT_THAT(device.name(), HasSubstr("simulated"));
}

TEST(SimulatedDeviceTest, AllocationsRespectTheMemoryCapacity) {
  SimulatedDeviceOptions sim;
  sim.memory_bytes = 1000;
  SimulatedDevice device(sim);
  auto a = device.Allocate(600);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(device.free_bytes(), 400u);
  EXPECT_EQ(device.Allocate(600).status().code(), StatusCode::kNoSpace);
  device.Free(*a, 600);
  EXPECT_EQ(device.free_bytes(), 1000u);
  EXPECT_EQ(device.peak_allocated_bytes(), 600u);
}

}  // namespace
}  // namespace pmsnap::runtime
