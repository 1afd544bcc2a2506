// Devices for engine and hooks tests: host memory behind the Device
// interface, but not CPU-addressable (Device::cpu_addressable), so the
// workers copy through CopyToHost (rather than the host's fused pool write)
// and each test device decides what that copy does.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/device.h"

namespace pmsnap::testing {

class MemcpyDevice : public runtime::HostMemoryDevice {
 public:
  explicit MemcpyDevice(std::uint64_t capacity) : HostMemoryDevice(capacity) {}
  runtime::DeviceKind kind() const override { return runtime::DeviceKind::kSimulated; }
  Status CopyFromHost(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  Status CopyInDevice(void* dst, const void* src, std::size_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }
  double EstimateCopyToHostSeconds(std::uint64_t) const override { return 0; }
  double EstimateInDeviceCopySeconds(std::uint64_t) const override { return 0; }
};

// Copies fail with kIOError after `successes` of them (an I/O error on the
// workers).
class FailingDevice final : public MemcpyDevice {
 public:
  explicit FailingDevice(int successes) : MemcpyDevice(1 << 20), left_(successes) {}
  std::string name() const override { return "failing"; }
  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override {
    if (left_.fetch_sub(1) <= 0) return Status(StatusCode::kIOError, "injected copy failure");
    std::memcpy(dst, src, bytes);
    return Status::Ok();
  }

 private:
  std::atomic<int> left_;
};

}  // namespace pmsnap::testing
