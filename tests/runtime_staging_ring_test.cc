// StagingRing, the CUDA device's fallback when the PM mapping cannot be
// registered for DMA, on plain host memory: bytes come out bit-exact, and
// the ring never allocates more than its configured size however large the
// model and however many threads copy through it at once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "detail/staging_ring.h"

namespace pmsnap::runtime {
namespace {

using ::testing::HasSubstr;

// Host memory standing in for cudaHostAlloc / cudaFreeHost, counting what is
// allocated at once.
struct CountingAllocator {
  std::atomic<std::int64_t> live_bytes{0};
  std::atomic<std::int64_t> peak_bytes{0};
  StagingRing::Allocator Get() {
    return {[this](std::size_t bytes) -> void* {
              const std::int64_t now = live_bytes.fetch_add(static_cast<std::int64_t>(bytes)) +
                                       static_cast<std::int64_t>(bytes);
              std::int64_t peak = peak_bytes.load();
              while (now > peak && !peak_bytes.compare_exchange_weak(peak, now)) {
              }
              return std::malloc(bytes);
            },
            [this](void* ptr) {
              // Sizes are fixed per ring; the tests free whole rings only.
              std::free(ptr);
            }};
  }
};

std::vector<std::byte> RandomBytes(std::size_t n, unsigned seed) {
  std::vector<std::byte> bytes(n);
  std::mt19937_64 rng(seed);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

// "Device memory" is host memory here; the fill is the device -> pinned copy.
StagingRing::Fill FillFrom(const std::vector<std::byte>& device) {
  return [&device](std::byte* buffer, std::uint64_t offset, std::uint64_t n) {
    std::memcpy(buffer, device.data() + offset, n);
    return Status::Ok();
  };
}

TEST(StagingRingTest, AModelManyTimesTheRingComesOutBitExactWithinTheBound) {
  constexpr std::uint64_t kCapacity = 1 << 20, kChunk = 256 << 10;
  CountingAllocator allocator;
  auto ring = StagingRing::Create(kCapacity, kChunk, allocator.Get());
  ASSERT_TRUE(ring.ok()) << ring.status().ToString();
  // A "model" of 6 units, 48 MiB in all: 48 times the ring, copied by 6
  // threads at once, each unit an odd size so the last chunk is partial.
  constexpr int kThreads = 6;
  std::vector<std::vector<std::byte>> device, host;
  for (int t = 0; t < kThreads; ++t) {
    device.push_back(RandomBytes((8u << 20) + 4093 * t, t + 1));
    host.emplace_back(device.back().size(), std::byte{0});
  }
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      results[t] = (*ring)->Transfer(host[t].data(), host[t].size(), FillFrom(device[t]));
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(results[t].ok()) << results[t].ToString();
    EXPECT_TRUE(host[t] == device[t]) << "unit " << t << " differs after staging";
  }
  EXPECT_LE((*ring)->peak_bytes(), kCapacity);
  EXPECT_GT((*ring)->peak_bytes(), 0u);
  EXPECT_LE(allocator.peak_bytes.load(), static_cast<std::int64_t>(kCapacity));
  EXPECT_EQ((*ring)->capacity_bytes(), kCapacity);
}

TEST(StagingRingTest, AChunkLargerThanTheCapacityIsCutToIt) {
  CountingAllocator allocator;
  auto ring = StagingRing::Create(64 << 10, 1 << 20, allocator.Get());
  ASSERT_TRUE(ring.ok());
  EXPECT_EQ((*ring)->chunk_bytes(), 64u << 10);
  const std::vector<std::byte> device = RandomBytes(1 << 20, 9);
  std::vector<std::byte> host(device.size());
  ASSERT_TRUE((*ring)->Transfer(host.data(), host.size(), FillFrom(device)).ok());
  EXPECT_TRUE(host == device);
  EXPECT_EQ(allocator.peak_bytes.load(), 64 << 10);
}

TEST(StagingRingTest, AFailedFillIsReturnedAndTheBufferGoesBack) {
  CountingAllocator allocator;
  auto ring = StagingRing::Create(64 << 10, 64 << 10, allocator.Get());
  ASSERT_TRUE(ring.ok());
  std::vector<std::byte> host(256 << 10);
  Status failed = (*ring)->Transfer(host.data(), host.size(),
                                    [](std::byte*, std::uint64_t offset, std::uint64_t) {
                                      return offset > 0 ? Status(StatusCode::kIOError,
                                                                 "injected copy failure")
                                                        : Status::Ok();
                                    });
  EXPECT_EQ(failed.code(), StatusCode::kIOError);
  // The ring's only buffer is free again: a later transfer does not hang.
  const std::vector<std::byte> device = RandomBytes(host.size(), 3);
  ASSERT_TRUE((*ring)->Transfer(host.data(), host.size(), FillFrom(device)).ok());
  EXPECT_TRUE(host == device);
}

TEST(StagingRingTest, NoBufferAtAllIsAnErrorNotAHang) {
  StagingRing::Allocator refusing{[](std::size_t) -> void* { return nullptr; }, [](void*) {}};
  auto ring = StagingRing::Create(1 << 20, 1 << 20, refusing);
  ASSERT_TRUE(ring.ok());
  std::vector<std::byte> host(16);
  Status status = (*ring)->Transfer(host.data(), host.size(),
                                    [](std::byte*, std::uint64_t, std::uint64_t) {
                                      return Status::Ok();
                                    });
  EXPECT_EQ(status.code(), StatusCode::kNoSpace);
  EXPECT_THAT(status.message(), HasSubstr("pinned buffer"));
}

TEST(StagingRingTest, ZeroSizesAreRejected) {
  CountingAllocator allocator;
  EXPECT_EQ(StagingRing::Create(0, 1, allocator.Get()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StagingRing::Create(1, 0, allocator.Get()).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pmsnap::runtime
