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
// Ordering (docs/ARCHITECTURE.md, "GPU ordering"): on a device whose updates
// are queued (orders_by_events: CUDA, the simulated device's asynchronous
// mode) an update has not necessarily run when AfterUpdate is called. The
// engine then records an event on the compute stream after each captured
// update, every copy of the unit waits for that event on its own copy stream,
// and a conflict makes the compute stream wait for the copy's event instead
// of blocking the host. Devices whose updates are done when the hooks see
// them (host, synchronous simulated) never get these calls.
//
// Thread-safety: every method may be called from any thread concurrently.
// Copies are blocking for the calling thread (a worker), which models a copy
// on its own stream followed by an event wait; CopyToHostAsync returns once
// the copy is queued.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "pmsnap/common/bandwidth_pacer.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/common/status.h"

namespace pmsnap::runtime {

enum class DeviceKind { kHost, kSimulated, kCuda };

// A point in one of a device's queues (the compute stream or a copy stream):
// complete once everything queued before it ran. Made by the device that
// recorded it and only meaningful to that device; shared by whoever waits.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
};
using DeviceEventPtr = std::shared_ptr<DeviceEvent>;

// What the device's queues did (all zero on devices without queues).
struct DeviceQueueStats {
  // ComputeWaitFor calls: a conflict made the compute stream wait for a copy.
  std::uint64_t compute_waits_on_copies = 0;
  // Of those, the waits the compute stream reached before the copy was done
  // (it stood still), and for how long, measured on the device.
  std::uint64_t compute_stalls = 0;
  double compute_stall_seconds = 0;
  // Pinned staging ring (CUDA, where the PM mapping cannot be registered):
  // its configured size and the most of it ever allocated.
  std::uint64_t staging_capacity_bytes = 0;
  std::uint64_t staging_peak_bytes = 0;
};

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

  // Makes the host range [ptr, ptr + bytes) (a pool slot's mapping, a
  // staging buffer) a direct target of CopyToHost / CopyToHostAsync
  // (CUDA: cudaHostRegister, so the DMA writes straight into it).
  //
  // Every registration that returned OK has its pair: whoever registered
  // calls UnregisterHostDestination with the same range before the memory
  // is unmapped or freed (HostRegistration does it). A registration that
  // outlives its mapping pins the old pages: a new mapping at the same
  // address would receive no copy at all.
  //
  // Returns OK (registered; registering the same live range again on the
  // same device counts once more); kFailedPrecondition when this range
  // cannot be registered, with a message saying how copies into it go
  // instead (CUDA: a bounded pinned staging ring): not fatal, copies still
  // work; kBusy when the range, or part of it, is registered already by
  // anyone but this device for exactly this live range (another device, or
  // a registration never undone): fatal, a copy there could land in
  // memory that is no longer this range. Default: nothing to register.
  virtual Status RegisterHostDestination(void* ptr, std::size_t bytes) {
    (void)ptr;
    (void)bytes;
    return Status::Ok();
  }
  // Undoes one RegisterHostDestination of exactly this range. Call it while
  // the range is still mapped. kFailedPrecondition naming the range when
  // this device did not register it (or, on the simulated device, when it
  // was unmapped while registered).
  virtual Status UnregisterHostDestination(void* ptr, std::size_t bytes) {
    (void)ptr;
    (void)bytes;
    return Status::Ok();
  }

  // --- ordering by events (see the file comment) ---
  // True when updates run on a queue after the hooks return, so the engine
  // must order copies and updates with the events below. The defaults are
  // for devices where it is false, and are never called by the engine there.
  virtual bool orders_by_events() const { return false; }
  // Records an event on the compute stream after the work queued so far (the
  // update just launched). nullptr (already complete) by default.
  virtual Result<DeviceEventPtr> RecordComputeEvent() { return DeviceEventPtr(); }
  // Queues a device -> host copy on the calling thread's copy stream, to
  // start once `after` (if not null) completed, and returns the copy's
  // completion event without waiting for it. `src` and `dst` must stay valid
  // until then. Default: copies now (CopyToHost) and returns nullptr.
  virtual Result<DeviceEventPtr> CopyToHostAsync(void* dst, const void* src, std::size_t bytes,
                                                 DeviceEventPtr after) {
    (void)after;
    PMSNAP_RETURN_IF_ERROR(CopyToHost(dst, src, bytes));
    return DeviceEventPtr();
  }
  // As CopyToHostAsync, inside device memory (CopyInDevice).
  virtual Result<DeviceEventPtr> CopyInDeviceAsync(void* dst, const void* src, std::size_t bytes,
                                                   DeviceEventPtr after) {
    (void)after;
    PMSNAP_RETURN_IF_ERROR(CopyInDevice(dst, src, bytes));
    return DeviceEventPtr();
  }
  // The calling thread's next copies (CopyToHost, CopyInDevice) start only
  // after `event` completed.
  virtual Status StreamWaitEvent(const DeviceEvent& event) {
    (void)event;
    return Status::Ok();
  }
  // Blocks the calling thread until `event` completed; the copy's error, if
  // it failed.
  virtual Status Synchronize(const DeviceEvent& event) {
    (void)event;
    return Status::Ok();
  }
  // Makes work launched on the compute stream from now on wait (on the
  // device, not the host) until `event` completed. Returns at once.
  virtual Status ComputeWaitFor(DeviceEventPtr event) {
    (void)event;
    return Status::Ok();
  }
  virtual DeviceQueueStats queue_stats() const { return {}; }
};

// One registered host range (Device::RegisterHostDestination), undone when
// this object goes: declare it after the memory it covers (and after the
// device), so that it is destroyed first. Move-only.
//
// Thread-safety: one owner; the device's methods are thread-safe.
class HostRegistration {
 public:
  HostRegistration() = default;
  // Registers [ptr, ptr + bytes) with `device`, which must outlive the
  // result. A range the device cannot register (kFailedPrecondition) gives
  // an empty registration and the device's reason in *not_registered
  // (copies into it still work, slower); kBusy and any other error are
  // returned.
  static Result<HostRegistration> Register(Device& device, void* ptr, std::size_t bytes,
                                           std::string* not_registered);
  ~HostRegistration();
  HostRegistration(HostRegistration&& other) noexcept;
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

  bool registered() const { return device_ != nullptr; }
  // The bytes registered (0 when not registered).
  std::size_t bytes() const { return registered() ? bytes_ : 0; }
  // Unregisters now (nothing left to undo afterwards); the device's error,
  // if any. The destructor does the same and reports an error on stderr.
  Status Release();

 private:
  HostRegistration(Device* device, void* ptr, std::size_t bytes)
      : device_(device), ptr_(ptr), bytes_(bytes) {}
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
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
  // A GPU queue's model (orders_by_events): kernels launched with
  // LaunchKernel run in order on a compute-stream thread after the caller
  // returned, events mark points in that stream and in one copy stream per
  // calling thread, and copies run on their stream after the events they
  // wait for. Off: LaunchKernel runs the kernel at once and the device
  // behaves as before (updates are done when the hooks see them).
  bool asynchronous = false;
  // Tests only, asynchronous mode: copies ignore the events they are told to
  // wait for, so they may read a tensor before its queued update ran (the
  // ordering bug that a test must catch).
  bool testing_copies_ignore_events = false;
  // Tests only: refuse every registration (kFailedPrecondition), as a file
  // system CUDA cannot register would; copies into the range are staged.
  bool testing_refuse_registration = false;
};

// What the simulated devices of this process have registered (the model of
// one CUDA context's registrations, shared by every SimulatedDevice as a
// context is by every stream): see SimulatedDevice.
struct SimulatedRegistrationStats {
  std::uint64_t live_ranges = 0;       // registered now, all devices
  std::uint64_t direct_copies = 0;     // device -> host copies into a registered range
  std::uint64_t staged_copies = 0;     // into memory no device registered
};
SimulatedRegistrationStats SimulatedRegistrations();

// Host memory behind a modelled link. Copies to/from host share one link:
// each reserves link time bytes / bandwidth after the previous reservation,
// and returns when its reservation (plus latency) has elapsed, so concurrent
// copies see the link's bandwidth, not the sum of threads.
//
// Registration (RegisterHostDestination) follows CUDA's rules, so that a
// lifetime bug fails on the CPU: registrations live in one table per process
// (a CUDA context's), each with the identity of the memory it covered (the
// file and offset of its mapping, from /proc/self/maps). Registering a range
// that overlaps a live registration of another device is kBusy naming both;
// so is any registration while some registration's memory was unmapped or
// replaced since it was made (a pool closed without unregistering: the
// next pool may be mapped at the same address, or anywhere else);
// unregistering a range this device did not register, or one unmapped while
// registered, is kFailedPrecondition (and forgets the stale one). Every Register and
// Unregister checks the whole table, and a device -> host copy into a range
// found stale that way fails (CUDA would have written the old pages). A copy
// into memory nobody registered is allowed and counted as staged (CUDA's
// pinned ring).
//
// Asynchronous mode (SimulatedDeviceOptions::asynchronous) models a GPU's
// queues with threads: one compute stream, and one copy stream per thread
// that calls CopyToHostAsync. Kernels queued after a copy do not wait for it;
// the compute stream waits for a copy only where ComputeWaitFor says so.
// Events of any SimulatedDevice may be passed to another.
class SimulatedDevice final : public HostMemoryDevice {
 public:
  explicit SimulatedDevice(SimulatedDeviceOptions options);
  // Waits for every queued kernel and copy, then stops the stream threads.
  ~SimulatedDevice() override;
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

  bool orders_by_events() const override { return options_.asynchronous; }
  Result<DeviceEventPtr> RecordComputeEvent() override;
  Result<DeviceEventPtr> CopyToHostAsync(void* dst, const void* src, std::size_t bytes,
                                         DeviceEventPtr after) override;
  Result<DeviceEventPtr> CopyInDeviceAsync(void* dst, const void* src, std::size_t bytes,
                                           DeviceEventPtr after) override;
  Status StreamWaitEvent(const DeviceEvent& event) override;
  Status Synchronize(const DeviceEvent& event) override;
  Status ComputeWaitFor(DeviceEventPtr event) override;
  DeviceQueueStats queue_stats() const override;
  Status RegisterHostDestination(void* ptr, std::size_t bytes) override;
  Status UnregisterHostDestination(void* ptr, std::size_t bytes) override;

  // Launches `kernel` (e.g. an optimizer update of simulated device memory)
  // on the compute stream: in asynchronous mode it runs later on the stream's
  // thread, after everything launched before it; otherwise it runs now.
  void LaunchKernel(std::function<void()> kernel);
  // Blocks until every kernel, event and wait launched on the compute stream
  // so far has run (torch.cuda.synchronize's model).
  void SynchronizeCompute();
  // Whether `event` (from a SimulatedDevice) has completed; nullptr has.
  static bool EventComplete(const DeviceEvent* event);
  // Asynchronous mode, for tests that must order a kernel against a copy
  // without timing: copies that reached the head of their stream and either
  // began waiting for an event not yet complete, or finished.
  std::uint64_t copies_settled() const { return copies_settled_.load(); }

 private:
  using Clock = std::chrono::steady_clock;
  class Queue;  // one simulated stream: a thread running jobs in order
  Status TimedCopy(void* dst, const void* src, std::size_t bytes, BandwidthPacer& channel);
  // A device -> host copy's destination: kFailedPrecondition if it lies in a
  // stale registration (class comment); counts direct and staged copies.
  Status CheckCopyDestination(const void* dst, std::size_t bytes) const;
  // Queues a copy on the calling thread's copy stream after `after`.
  Result<DeviceEventPtr> QueueCopy(void* dst, const void* src, std::size_t bytes,
                                   DeviceEventPtr after, bool uses_link);
  // A copy's wait for `event` (unless the testing switch drops it); counts
  // the copy as settled and returns true when it blocked.
  bool CopyWaitsFor(const DeviceEvent* event);
  Queue& CopyStreamForThisThread() PMSNAP_EXCLUDES(copy_streams_mutex_);
  SimulatedDeviceOptions options_;
  std::uint64_t serial_;        // names this device in the registration table
  BandwidthPacer link_;         // device <-> host copies
  BandwidthPacer copy_engine_;  // in-device copies
  std::atomic<std::uint64_t> copies_settled_{0};
  std::atomic<std::uint64_t> compute_waits_{0};
  std::atomic<std::uint64_t> compute_stalls_{0};
  std::atomic<std::int64_t> compute_stall_ns_{0};
  std::unique_ptr<Queue> compute_;  // asynchronous mode only
  Mutex copy_streams_mutex_;
  std::unordered_map<std::thread::id, std::unique_ptr<Queue>> copy_streams_
      PMSNAP_GUARDED_BY(copy_streams_mutex_);
};

}  // namespace pmsnap::runtime
