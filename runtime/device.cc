#include "pmsnap/runtime/device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

namespace pmsnap::runtime {
namespace {

// Single-thread host memcpy bandwidth (GB/s), measured once per process on
// 32 MiB (best of three). Every host or simulated copy is at least a memcpy,
// so estimates never promise more than this.
double HostCopyGbps() {
  static const double gbps = [] {
    constexpr std::size_t kBytes = 32u << 20;
    std::vector<char> src(kBytes, 1), dst(kBytes, 0);
    double best = 0;
    for (int i = 0; i < 3; ++i) {
      const auto start = std::chrono::steady_clock::now();
      std::memcpy(dst.data(), src.data(), kBytes);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, kBytes / std::max(seconds, 1e-9) / 1e9);
    }
    return best;
  }();
  return gbps;
}

std::string FormatBytes(std::uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(buf, sizeof(buf), "%.1f GiB", bytes / 1073741824.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f MiB", bytes / 1048576.0);
  }
  return buf;
}

}  // namespace

Result<void*> HostMemoryDevice::Allocate(std::size_t bytes) {
  // Reserve first so concurrent allocations never exceed the capacity.
  std::uint64_t current = allocated_.load(std::memory_order_relaxed);
  do {
    if (current + bytes > capacity_) {
      return Status(StatusCode::kNoSpace, name() + ": cannot allocate " + std::to_string(bytes) +
                                              " bytes of device memory, " +
                                              std::to_string(capacity_ - current) + " free");
    }
  } while (!allocated_.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
  std::uint64_t now = current + bytes;
  std::uint64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
  void* ptr = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (ptr == nullptr) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    return Status(StatusCode::kNoSpace,
                  name() + ": host allocation of " + std::to_string(bytes) + " bytes failed");
  }
  return ptr;
}

void HostMemoryDevice::Free(void* ptr, std::size_t bytes) {
  if (ptr == nullptr) return;
  std::free(ptr);
  allocated_.fetch_sub(bytes, std::memory_order_relaxed);
}

std::uint64_t HostMemoryDevice::free_bytes() const {
  const std::uint64_t used = allocated_.load(std::memory_order_relaxed);
  return used >= capacity_ ? 0 : capacity_ - used;
}

Status HostDevice::CopyToHost(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostDevice::CopyFromHost(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

Status HostDevice::CopyInDevice(void* dst, const void* src, std::size_t bytes) {
  std::memcpy(dst, src, bytes);
  return Status::Ok();
}

double HostDevice::EstimateCopyToHostSeconds(std::uint64_t bytes) const {
  return bytes / (HostCopyGbps() * 1e9);
}

double HostDevice::EstimateInDeviceCopySeconds(std::uint64_t bytes) const {
  return bytes / (HostCopyGbps() * 1e9);
}

SimulatedDevice::SimulatedDevice(SimulatedDeviceOptions options)
    : HostMemoryDevice(options.memory_bytes),
      options_(options),
      link_(options.copy_bandwidth_gbps),
      copy_engine_(options.in_device_bandwidth_gbps) {}

std::string SimulatedDevice::name() const {
  char buf[160];
  std::snprintf(buf, sizeof(buf), "simulated(%.1f GB/s link, %.0f us, %s device memory)",
                options_.copy_bandwidth_gbps, options_.latency_us,
                FormatBytes(options_.memory_bytes).c_str());
  return buf;
}

Status SimulatedDevice::TimedCopy(void* dst, const void* src, std::size_t bytes,
                                  BandwidthPacer& channel) {
  const auto start = Clock::now();
  const auto latency = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.latency_us * 1e-6));
  // Reserve the link (or the device's copy engine): transfers queue behind
  // each other like on PCIe.
  const Clock::time_point done = channel.Reserve(bytes, start) + latency;
  std::memcpy(dst, src, bytes);
  BandwidthPacer::WaitUntil(done);
  return Status::Ok();
}

Status SimulatedDevice::CopyToHost(void* dst, const void* src, std::size_t bytes) {
  return TimedCopy(dst, src, bytes, link_);
}

Status SimulatedDevice::CopyFromHost(void* dst, const void* src, std::size_t bytes) {
  return TimedCopy(dst, src, bytes, link_);
}

Status SimulatedDevice::CopyInDevice(void* dst, const void* src, std::size_t bytes) {
  return TimedCopy(dst, src, bytes, copy_engine_);
}

// The simulation moves real bytes with memcpy: a modelled bandwidth above the
// host's memcpy speed is not what a copy will take here.
double SimulatedDevice::EstimateCopyToHostSeconds(std::uint64_t bytes) const {
  return options_.latency_us * 1e-6 +
         bytes / (std::min(options_.copy_bandwidth_gbps, HostCopyGbps()) * 1e9);
}

double SimulatedDevice::EstimateInDeviceCopySeconds(std::uint64_t bytes) const {
  return options_.latency_us * 1e-6 +
         bytes / (std::min(options_.in_device_bandwidth_gbps, HostCopyGbps()) * 1e9);
}

}  // namespace pmsnap::runtime
