// CudaDevice (see pmsnap/runtime/cuda_device.h). Compiled by nvcc when the
// CUDA toolkit is present; every CUDA call is checked and turned into a
// Status naming the call and the CUDA error.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "detail/staging_ring.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {
namespace {

// A CUDA call's result as a Status. A failed call also set the calling
// thread's "last error" (the runtime API's cudaGetLastError), which the
// next caller of cudaGetLastError (PyTorch, after its next kernel) would
// take for its own: pmsnap clears it here, so that it never leaves a CUDA
// error behind on the caller's thread. (Sticky errors, which break the
// context, cannot be cleared; they surface in every later call anyway.)
Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return Status::Ok();
  cudaGetLastError();
  return Status(StatusCode::kIOError, std::string(call) + " failed: " + cudaGetErrorName(error) +
                                          " (" + cudaGetErrorString(error) + ")");
}

#define PMSNAP_CUDA_RETURN_IF_ERROR(call) PMSNAP_RETURN_IF_ERROR(CudaStatus((call), #call))

// Makes `ordinal` the calling thread's current device for one call and puts
// the caller's back afterwards: pmsnap never changes PyTorch's current
// device (the training thread calls RecordComputeEvent and ComputeWaitFor).
class CurrentDeviceGuard {
 public:
  explicit CurrentDeviceGuard(int ordinal)
      : previous_(CurrentDevice()),
        status_(previous_ == ordinal ? Status::Ok()
                                     : CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice")) {}
  ~CurrentDeviceGuard() {
    if (previous_ >= 0 && CurrentDevice() != previous_) {
      (void)CudaStatus(cudaSetDevice(previous_), "cudaSetDevice");
    }
  }
  CurrentDeviceGuard(const CurrentDeviceGuard&) = delete;
  CurrentDeviceGuard& operator=(const CurrentDeviceGuard&) = delete;
  const Status& status() const { return status_; }

 private:
  // The calling thread's current device; -1 if CUDA cannot say.
  static int CurrentDevice() {
    int device = -1;
    return CudaStatus(cudaGetDevice(&device), "cudaGetDevice").ok() ? device : -1;
  }
  int previous_;
  Status status_;
};

#define PMSNAP_CUDA_ON_DEVICE(ordinal)      \
  CurrentDeviceGuard device_guard(ordinal); \
  PMSNAP_RETURN_IF_ERROR(device_guard.status())

// An event of this device; destroyed when the last waiter lets go (CUDA
// releases a recorded event's resources once it completed).
class CudaEvent final : public DeviceEvent {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

cudaEvent_t Raw(const DeviceEvent& event) { return static_cast<const CudaEvent&>(event).get(); }

// A compute-stream stall at a ComputeWaitFor: timing events just before and
// after the wait, read once both completed.
struct PendingStall {
  cudaEvent_t before = nullptr;
  cudaEvent_t after = nullptr;
};

// Below this the compute stream did not stand still: two back-to-back
// events on an idle stream are this far apart at most.
constexpr float kStallThresholdMs = 0.005f;

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name, CudaDeviceOptions options)
      : ordinal_(ordinal),
        name_(std::move(name)),
        options_(options),
        compute_(reinterpret_cast<cudaStream_t>(options.compute_stream)) {}

  ~CudaDevice() override {
    CurrentDeviceGuard device_guard(ordinal_);
    {
      // Registrations a user of this device never undid (a contract
      // violation): undone here, so they cannot outlive their memory.
      MutexLock lock(ranges_mutex_);
      for (const Registration& range : registered_) cudaHostUnregister(range.ptr);
      registered_.clear();
      cudaGetLastError();
    }
    {
      MutexLock lock(streams_mutex_);
      for (auto& [thread, stream] : streams_) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
    }
    MutexLock lock(stalls_mutex_);
    for (const PendingStall& stall : pending_stalls_) {
      cudaEventDestroy(stall.before);
      cudaEventDestroy(stall.after);
    }
    staging_.reset();
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  // GPU memory: every byte crosses PCIe through CopyToHost / CopyFromHost.
  bool cpu_addressable() const override { return false; }
  bool orders_by_events() const override { return true; }

  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override {
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr done, CopyToHostAsync(dst, src, bytes, nullptr));
    return done ? Synchronize(*done) : Status::Ok();
  }
  // Restore: from the (registered) mapping straight into device memory.
  Status CopyFromHost(void* dst, const void* src, std::size_t bytes) override {
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr done,
                            Queue(dst, src, bytes, cudaMemcpyHostToDevice, nullptr));
    return Synchronize(*done);
  }
  Status CopyInDevice(void* dst, const void* src, std::size_t bytes) override {
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr done, CopyInDeviceAsync(dst, src, bytes, nullptr));
    return Synchronize(*done);
  }

  Result<DeviceEventPtr> CopyToHostAsync(void* dst, const void* src, std::size_t bytes,
                                         DeviceEventPtr after) override {
    if (Registered(dst, bytes)) return Queue(dst, src, bytes, cudaMemcpyDeviceToHost, after);
    PMSNAP_RETURN_IF_ERROR(Staged(dst, src, bytes, after.get()));
    return DeviceEventPtr();  // the staged copy is done
  }
  Result<DeviceEventPtr> CopyInDeviceAsync(void* dst, const void* src, std::size_t bytes,
                                           DeviceEventPtr after) override {
    return Queue(dst, src, bytes, cudaMemcpyDeviceToDevice, after);
  }

  Result<DeviceEventPtr> RecordComputeEvent() override {
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr event, NewEvent());
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(Raw(*event), compute_));
    return event;
  }

  Status StreamWaitEvent(const DeviceEvent& event) override {
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    return CudaStatus(cudaStreamWaitEvent(stream, Raw(event), 0), "cudaStreamWaitEvent(copy)");
  }

  Status Synchronize(const DeviceEvent& event) override {
    return CudaStatus(cudaEventSynchronize(Raw(event)), "cudaEventSynchronize");
  }

  Status ComputeWaitFor(DeviceEventPtr event) override {
    if (event == nullptr) return Status::Ok();
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    PendingStall stall;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stall.before));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stall.after));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stall.before, compute_));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, Raw(*event), 0));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stall.after, compute_));
    compute_waits_.fetch_add(1);
    MutexLock lock(stalls_mutex_);
    pending_stalls_.push_back(stall);
    HarvestStallsLocked();
    return Status::Ok();
  }

  DeviceQueueStats queue_stats() const override {
    DeviceQueueStats stats;
    {
      MutexLock lock(stalls_mutex_);
      HarvestStallsLocked();
      stats.compute_stalls = compute_stalls_;
      stats.compute_stall_seconds = compute_stall_seconds_;
    }
    stats.compute_waits_on_copies = compute_waits_.load();
    stats.staging_capacity_bytes = options_.staging_ring_bytes;
    MutexLock lock(staging_mutex_);
    stats.staging_peak_bytes = staging_ ? staging_->peak_bytes() : 0;
    return stats;
  }

  // Device::RegisterHostDestination's contract. The registration was the
  // first GPU run's bug: "already registered" taken for success let a pool
  // mapped where a closed one had been (never unregistered) receive its DMA
  // in the old pinned pages. Now only this device's own live registration
  // of exactly this range counts as registered.
  Status RegisterHostDestination(void* ptr, std::size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    const auto* begin = static_cast<const std::byte*>(ptr);
    MutexLock lock(ranges_mutex_);
    for (Registration& range : registered_) {
      if (range.begin() + range.bytes <= begin || begin + bytes <= range.begin()) continue;
      if (range.ptr == ptr && range.bytes == bytes) {
        range.count += 1;
        return Status::Ok();
      }
      return Status(StatusCode::kBusy, name_ + ": host range of " + std::to_string(bytes) +
                                           " bytes overlaps one this device registered");
    }
    const cudaError_t error = options_.testing_refuse_registration
                                  ? cudaErrorNotSupported
                                  : cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (error == cudaSuccess) {
      registered_.push_back({ptr, bytes, 1});
      return Status::Ok();
    }
    if (error != cudaErrorNotSupported) cudaGetLastError();
    if (error == cudaErrorHostMemoryAlreadyRegistered) {
      return Status(StatusCode::kBusy,
                    name_ + ": cudaHostRegister of " + std::to_string(bytes) +
                        " bytes: part of the range is registered with CUDA already, and not by "
                        "this device: a registration that outlived its memory (unmapped "
                        "without cudaHostUnregister) would receive the copies in its old "
                        "pages; refusing");
    }
    return Status(StatusCode::kFailedPrecondition,
                  "cudaHostRegister of " + std::to_string(bytes) + " bytes failed (" +
                      cudaGetErrorString(error) + "); GPU copies into it stage through a " +
                      std::to_string(options_.staging_ring_bytes >> 20) +
                      " MiB pinned ring (CudaDeviceOptions::staging_ring_bytes)");
  }

  Status UnregisterHostDestination(void* ptr, std::size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    MutexLock lock(ranges_mutex_);
    for (auto it = registered_.begin(); it != registered_.end(); ++it) {
      if (it->ptr != ptr || it->bytes != bytes) continue;
      if (--it->count > 0) return Status::Ok();
      registered_.erase(it);
      return CudaStatus(cudaHostUnregister(ptr), "cudaHostUnregister");
    }
    return Status(StatusCode::kFailedPrecondition,
                  name_ + ": a host range of " + std::to_string(bytes) +
                      " bytes was unregistered that this device did not register");
  }

  Result<void*> Allocate(std::size_t bytes) override {
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    void* ptr = nullptr;
    const cudaError_t error = cudaMalloc(&ptr, bytes);
    if (error != cudaSuccess) {
      (void)CudaStatus(error, "cudaMalloc");  // clears the thread's last error
      return Status(StatusCode::kNoSpace, name_ + ": cudaMalloc of " + std::to_string(bytes) +
                                              " bytes failed: " + cudaGetErrorString(error));
    }
    const std::uint64_t now = allocated_.fetch_add(bytes) + bytes;
    std::uint64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    return ptr;
  }

  void Free(void* ptr, std::size_t bytes) override {
    if (ptr == nullptr) return;
    CurrentDeviceGuard device_guard(ordinal_);
    (void)CudaStatus(cudaFree(ptr), "cudaFree");
    allocated_.fetch_sub(bytes);
  }

  std::uint64_t free_bytes() const override {
    std::size_t free = 0, total = 0;
    CurrentDeviceGuard device_guard(ordinal_);
    if (!CudaStatus(cudaMemGetInfo(&free, &total), "cudaMemGetInfo").ok()) return 0;
    return free;
  }
  std::uint64_t peak_allocated_bytes() const override { return peak_.load(); }

  double EstimateCopyToHostSeconds(std::uint64_t bytes) const override {
    return 10e-6 + bytes / (to_host_gbps_ * 1e9);
  }
  double EstimateInDeviceCopySeconds(std::uint64_t bytes) const override {
    return 5e-6 + bytes / (in_device_gbps_ * 1e9);
  }

  // Measures both bandwidths once with 64 MiB copies (estimates steer the
  // adaptive selector and CheckFreq's policy).
  Status Calibrate() {
    constexpr std::size_t kBytes = 64ull << 20;
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    // Freed on every path out.
    struct Buffers {
      void* device_a = nullptr;
      void* device_b = nullptr;
      void* host = nullptr;
      ~Buffers() {
        if (device_a != nullptr) (void)CudaStatus(cudaFree(device_a), "cudaFree");
        if (device_b != nullptr) (void)CudaStatus(cudaFree(device_b), "cudaFree");
        if (host != nullptr) (void)CudaStatus(cudaFreeHost(host), "cudaFreeHost");
      }
    } buffers;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&buffers.device_a, kBytes));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&buffers.device_b, kBytes));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&buffers.host, kBytes));
    auto timed = [&](void* dst, const void* src, cudaMemcpyKind kind) -> Result<double> {
      const auto start = std::chrono::steady_clock::now();
      PMSNAP_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, kBytes, kind));
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    PMSNAP_ASSIGN_OR_RETURN(const double warm_up,
                            timed(buffers.host, buffers.device_a, cudaMemcpyDeviceToHost));
    (void)warm_up;
    PMSNAP_ASSIGN_OR_RETURN(const double to_host,
                            timed(buffers.host, buffers.device_a, cudaMemcpyDeviceToHost));
    PMSNAP_ASSIGN_OR_RETURN(const double in_device,
                            timed(buffers.device_b, buffers.device_a, cudaMemcpyDeviceToDevice));
    to_host_gbps_ = kBytes / to_host / 1e9;
    in_device_gbps_ = kBytes / in_device / 1e9;
    return Status::Ok();
  }

 private:
  Result<DeviceEventPtr> NewEvent() {
    cudaEvent_t event = nullptr;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return DeviceEventPtr(std::make_shared<CudaEvent>(event));
  }

  // One stream per calling thread so workers copy in parallel. Non-blocking:
  // the legacy default stream (PyTorch's) never waits for these copies, and
  // they never wait for it; every order between them is an event.
  Result<cudaStream_t> StreamForThisThread() {
    MutexLock lock(streams_mutex_);
    auto it = streams_.find(std::this_thread::get_id());
    if (it != streams_.end()) return it->second;
    cudaStream_t stream = nullptr;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    streams_.emplace(std::this_thread::get_id(), stream);
    return stream;
  }

  // Queues a copy on this thread's stream after `after`; returns its event.
  Result<DeviceEventPtr> Queue(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                               const DeviceEventPtr& after) {
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    if (after) PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, Raw(*after), 0));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr done, NewEvent());
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(Raw(*done), stream));
    return done;
  }

  // Whether [dst, dst + bytes) lies in a range this device registered.
  // Memory pinned by others goes through the staging ring like pageable
  // memory: CUDA cannot tell a live registration from one that outlived
  // its mapping, so only this device's own are trusted.
  bool Registered(const void* dst, std::size_t bytes) const {
    const auto* begin = static_cast<const std::byte*>(dst);
    MutexLock lock(ranges_mutex_);
    for (const Registration& range : registered_) {
      if (begin >= range.begin() && begin + bytes <= range.begin() + range.bytes) return true;
    }
    return false;
  }

  // A device -> host copy into memory the DMA cannot target: chunk by chunk
  // through the bounded pinned ring, on this thread's stream after `after`.
  Status Staged(void* dst, const void* src, std::size_t bytes, const DeviceEvent* after) {
    PMSNAP_CUDA_ON_DEVICE(ordinal_);
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    if (after != nullptr) PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, Raw(*after), 0));
    StagingRing* ring = nullptr;
    {
      MutexLock lock(staging_mutex_);
      if (!staging_) {
        StagingRing::Allocator pinned{[](std::size_t n) -> void* {
                                        void* ptr = nullptr;
                                        if (cudaHostAlloc(&ptr, n, cudaHostAllocDefault) !=
                                            cudaSuccess) {
                                          cudaGetLastError();
                                          return nullptr;
                                        }
                                        return ptr;
                                      },
                                      [](void* ptr) { cudaFreeHost(ptr); }};
        PMSNAP_ASSIGN_OR_RETURN(staging_,
                                StagingRing::Create(options_.staging_ring_bytes,
                                                    options_.staging_chunk_bytes, pinned));
      }
      ring = staging_.get();
    }
    const auto* device = static_cast<const std::byte*>(src);
    return ring->Transfer(static_cast<std::byte*>(dst), bytes,
                          [&](std::byte* buffer, std::uint64_t offset, std::uint64_t n) {
                            PMSNAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
                                buffer, device + offset, n, cudaMemcpyDeviceToHost, stream));
                            return CudaStatus(cudaStreamSynchronize(stream),
                                              "cudaStreamSynchronize(staging)");
                          });
  }

  // Folds completed stall measurements into the totals.
  void HarvestStallsLocked() const PMSNAP_REQUIRES(stalls_mutex_) {
    // cudaEventQuery's "not ready" is recorded as the thread's last error
    // like a failure: CudaStatus clears it.
    auto done = std::partition(pending_stalls_.begin(), pending_stalls_.end(),
                               [](const PendingStall& stall) {
                                 const cudaError_t state = cudaEventQuery(stall.after);
                                 (void)CudaStatus(state, "cudaEventQuery");
                                 return state == cudaErrorNotReady;
                               });
    for (auto it = done; it != pending_stalls_.end(); ++it) {
      float ms = 0;
      if (CudaStatus(cudaEventElapsedTime(&ms, it->before, it->after), "cudaEventElapsedTime")
              .ok() &&
          ms > kStallThresholdMs) {
        compute_stalls_ += 1;
        compute_stall_seconds_ += ms * 1e-3;
      }
      cudaEventDestroy(it->before);
      cudaEventDestroy(it->after);
    }
    pending_stalls_.erase(done, pending_stalls_.end());
  }

  int ordinal_;
  std::string name_;
  CudaDeviceOptions options_;
  cudaStream_t compute_;
  double to_host_gbps_ = 12.0;
  double in_device_gbps_ = 500.0;
  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::uint64_t> peak_{0};
  std::atomic<std::uint64_t> compute_waits_{0};
  Mutex streams_mutex_;
  std::unordered_map<std::thread::id, cudaStream_t> streams_ PMSNAP_GUARDED_BY(streams_mutex_);
  struct Registration {
    void* ptr;
    std::size_t bytes;
    int count;  // RegisterHostDestination calls not yet undone
    const std::byte* begin() const { return static_cast<const std::byte*>(ptr); }
  };
  mutable Mutex ranges_mutex_;
  std::vector<Registration> registered_ PMSNAP_GUARDED_BY(ranges_mutex_);
  mutable Mutex staging_mutex_;  // staging_ is created once
  std::unique_ptr<StagingRing> staging_ PMSNAP_GUARDED_BY(staging_mutex_);
  mutable Mutex stalls_mutex_;
  mutable std::vector<PendingStall> pending_stalls_ PMSNAP_GUARDED_BY(stalls_mutex_);
  mutable std::uint64_t compute_stalls_ PMSNAP_GUARDED_BY(stalls_mutex_) = 0;
  mutable double compute_stall_seconds_ PMSNAP_GUARDED_BY(stalls_mutex_) = 0;
};

}  // namespace

bool CudaSupportCompiled() { return true; }

Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal, CudaDeviceOptions options) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kFailedPrecondition,
                  std::string("CUDA is unavailable: ") + cudaGetErrorString(error));
  }
  if (ordinal < 0 || ordinal >= count) {
    return Status(StatusCode::kFailedPrecondition, "CUDA device " + std::to_string(ordinal) +
                                                       " requested, " + std::to_string(count) +
                                                       " present");
  }
  cudaDeviceProp props{};
  PMSNAP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, ordinal));
  auto device = std::make_unique<CudaDevice>(
      ordinal, "cuda:" + std::to_string(ordinal) + " (" + props.name + ")", options);
  PMSNAP_RETURN_IF_ERROR(device->Calibrate());
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace pmsnap::runtime
