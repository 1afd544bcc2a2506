// Device: where live tensors are, and how bytes leave it.
//
// The runtime copies units out of device memory while training runs. A
// Device says how: CopyToHost (device -> host-visible memory, e.g. the PM
// mapping), CopyInDevice (a fast copy inside device memory, used by conflict
// strategies 1, 3 and 4), device-memory allocation for such copies, and how
// much of it is free.
//
//   HostDevice       CPU tensors: memcpy.
//   SimulatedDevice  host memory behind a modelled link (bandwidth, latency)
//                    and a memory capacity, to reproduce GPU-like conflicts
//                    and memory pressure on machines without a GPU. Always
//                    labelled "simulated" in names and output.
//   CudaDevice       (cuda_device.h) CUDA streams and events.
//
// Thread-safety: every method may be called from any thread concurrently.
// Copies are blocking for the calling thread (a worker), which models a copy
// on its own stream followed by an event wait.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "pmsnap/common/bandwidth_pacer.h"
#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

enum class DeviceKind { kHost, kSimulated, kCuda };

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  // Human-readable, e.g. "host", "simulated(12.0 GB/s, 5 us, 256 MiB)".
  virtual std::string name() const = 0;

  // Whether the CPU may load and store this device's tensors itself. True:
  // the engine writes a part into the pool with the pool's own pass (copy,
  // checksum and drain at once), restores straight into the tensors, and
  // host-memory copies compete with the optimizer step for memory bandwidth
  // (CopyStart::kAuto). False: every byte crosses CopyToHost / CopyFromHost
  // (a PCIe link, the simulated one), and the pool seals what arrived. False
  // is correct for any device, only slower where the CPU could do the copy.
  virtual bool cpu_addressable() const { return false; }

  // Copies `bytes` from device memory `src` to host-visible `dst`.
  virtual Status CopyToHost(void* dst, const void* src, std::size_t bytes) = 0;
  // Copies host-visible `src` into device memory `dst` (restore).
  virtual Status CopyFromHost(void* dst, const void* src, std::size_t bytes) = 0;
  // Copies inside device memory.
  virtual Status CopyInDevice(void* dst, const void* src, std::size_t bytes) = 0;

  // Device memory for in-device copies. kNoSpace when fewer than `bytes`
  // are free; the caller falls back (and counts it).
  virtual Result<void*> Allocate(std::size_t bytes) = 0;
  virtual void Free(void* ptr, std::size_t bytes) = 0;
  // Bytes Allocate could still hand out.
  virtual std::uint64_t free_bytes() const = 0;
  // Peak bytes allocated through Allocate since creation.
  virtual std::uint64_t peak_allocated_bytes() const = 0;

  // Expected seconds to move `bytes` device -> host and inside the device
  // (for the adaptive selector and CheckFreq's frequency policy).
  virtual double EstimateCopyToHostSeconds(std::uint64_t bytes) const = 0;
  virtual double EstimateInDeviceCopySeconds(std::uint64_t bytes) const = 0;
};

// Host memory accounting shared by HostDevice and SimulatedDevice.
class HostMemoryDevice : public Device {
 public:
  explicit HostMemoryDevice(std::uint64_t capacity_bytes) : capacity_(capacity_bytes) {}
  Result<void*> Allocate(std::size_t bytes) override;
  void Free(void* ptr, std::size_t bytes) override;
  std::uint64_t free_bytes() const override;
  std::uint64_t peak_allocated_bytes() const override { return peak_.load(); }

 protected:
  std::uint64_t capacity_;

 private:
  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::uint64_t> peak_{0};
};

// CPU tensors. In-device copies use host DRAM up to `memory_budget_bytes`.
class HostDevice final : public HostMemoryDevice {
 public:
  explicit HostDevice(std::uint64_t memory_budget_bytes = 4ull << 30)
      : HostMemoryDevice(memory_budget_bytes) {}
  DeviceKind kind() const override { return DeviceKind::kHost; }
  std::string name() const override { return "host"; }
  bool cpu_addressable() const override { return true; }
  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override;
  Status CopyFromHost(void* dst, const void* src, std::size_t bytes) override;
  Status CopyInDevice(void* dst, const void* src, std::size_t bytes) override;
  double EstimateCopyToHostSeconds(std::uint64_t bytes) const override;
  double EstimateInDeviceCopySeconds(std::uint64_t bytes) const override;
};

struct SimulatedDeviceOptions {
  double copy_bandwidth_gbps = 12.0;        // device <-> host link, GB/s (1e9 B/s)
  double in_device_bandwidth_gbps = 200.0;  // device-internal copies
  double latency_us = 5.0;                  // per copy
  std::uint64_t memory_bytes = 1ull << 30;  // free device memory for in-device copies
};

// Host memory behind a modelled link. Copies to/from host share one link:
// each reserves link time bytes / bandwidth after the previous reservation,
// and returns when its reservation (plus latency) has elapsed, so concurrent
// copies see the link's bandwidth, not the sum of threads.
class SimulatedDevice final : public HostMemoryDevice {
 public:
  explicit SimulatedDevice(SimulatedDeviceOptions options);
  DeviceKind kind() const override { return DeviceKind::kSimulated; }
  std::string name() const override;
  // Host memory, but modelled as device memory: every byte crosses the link.
  bool cpu_addressable() const override { return false; }
  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override;
  Status CopyFromHost(void* dst, const void* src, std::size_t bytes) override;
  Status CopyInDevice(void* dst, const void* src, std::size_t bytes) override;
  double EstimateCopyToHostSeconds(std::uint64_t bytes) const override;
  double EstimateInDeviceCopySeconds(std::uint64_t bytes) const override;
  const SimulatedDeviceOptions& options() const { return options_; }

 private:
  using Clock = std::chrono::steady_clock;
  Status TimedCopy(void* dst, const void* src, std::size_t bytes, BandwidthPacer& channel);
  SimulatedDeviceOptions options_;
  BandwidthPacer link_;         // device <-> host copies
  BandwidthPacer copy_engine_;  // in-device copies
};

}  // namespace pmsnap::runtime
