// CudaDevice (see pmsnap/runtime/cuda_device.h). Compiled by nvcc when the
// CUDA toolkit is present; every CUDA call is checked and turned into a
// Status naming the call and the CUDA error.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "detail/staging_ring.h"
#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {
namespace {

Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kIOError, std::string(call) + " failed: " + cudaGetErrorName(error) +
                                          " (" + cudaGetErrorString(error) + ")");
}

#define PMSNAP_CUDA_RETURN_IF_ERROR(call) PMSNAP_RETURN_IF_ERROR(CudaStatus((call), #call))

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
    cudaSetDevice(ordinal_);
    {
      std::lock_guard<std::mutex> lock(streams_mutex_);
      for (auto& [thread, stream] : streams_) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
    }
    std::lock_guard<std::mutex> lock(stalls_mutex_);
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
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr event, NewEvent());
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(Raw(*event), compute_));
    return event;
  }

  Status StreamWaitEvent(const DeviceEvent& event) override {
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    return CudaStatus(cudaStreamWaitEvent(stream, Raw(event), 0), "cudaStreamWaitEvent(copy)");
  }

  Status Synchronize(const DeviceEvent& event) override {
    return CudaStatus(cudaEventSynchronize(Raw(event)), "cudaEventSynchronize");
  }

  Status ComputeWaitFor(DeviceEventPtr event) override {
    if (event == nullptr) return Status::Ok();
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PendingStall stall;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stall.before));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreate(&stall.after));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stall.before, compute_));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute_, Raw(*event), 0));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(stall.after, compute_));
    compute_waits_.fetch_add(1);
    std::lock_guard<std::mutex> lock(stalls_mutex_);
    pending_stalls_.push_back(stall);
    HarvestStallsLocked();
    return Status::Ok();
  }

  DeviceQueueStats queue_stats() const override {
    DeviceQueueStats stats;
    {
      std::lock_guard<std::mutex> lock(stalls_mutex_);
      HarvestStallsLocked();
      stats.compute_stalls = compute_stalls_;
      stats.compute_stall_seconds = compute_stall_seconds_;
    }
    stats.compute_waits_on_copies = compute_waits_.load();
    stats.staging_capacity_bytes = options_.staging_ring_bytes;
    std::lock_guard<std::mutex> lock(staging_mutex_);
    stats.staging_peak_bytes = staging_ ? staging_->peak_bytes() : 0;
    return stats;
  }

  Status RegisterHostDestination(void* ptr, std::size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const cudaError_t error = options_.testing_refuse_registration
                                  ? cudaErrorNotSupported
                                  : cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
    if (error == cudaSuccess || error == cudaErrorHostMemoryAlreadyRegistered) {
      if (error != cudaSuccess) cudaGetLastError();
      std::lock_guard<std::mutex> lock(ranges_mutex_);
      registered_.emplace_back(static_cast<std::byte*>(ptr), static_cast<std::byte*>(ptr) + bytes);
      return Status::Ok();
    }
    cudaGetLastError();
    return Status(StatusCode::kFailedPrecondition,
                  "cudaHostRegister of " + std::to_string(bytes) + " bytes failed (" +
                      cudaGetErrorString(error) + "); GPU copies into it stage through a " +
                      std::to_string(options_.staging_ring_bytes >> 20) +
                      " MiB pinned ring (CudaDeviceOptions::staging_ring_bytes)");
  }

  Result<void*> Allocate(std::size_t bytes) override {
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    void* ptr = nullptr;
    const cudaError_t error = cudaMalloc(&ptr, bytes);
    if (error != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state
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
    cudaSetDevice(ordinal_);
    cudaFree(ptr);
    allocated_.fetch_sub(bytes);
  }

  std::uint64_t free_bytes() const override {
    std::size_t free = 0, total = 0;
    cudaSetDevice(ordinal_);
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) return 0;
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
    void* device_a = nullptr;
    void* device_b = nullptr;
    void* host = nullptr;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_a, kBytes));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_b, kBytes));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMallocHost(&host, kBytes));
    auto timed = [&](void* dst, const void* src, cudaMemcpyKind kind) {
      const auto start = std::chrono::steady_clock::now();
      cudaMemcpy(dst, src, kBytes, kind);
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    timed(host, device_a, cudaMemcpyDeviceToHost);  // warm up
    to_host_gbps_ = kBytes / timed(host, device_a, cudaMemcpyDeviceToHost) / 1e9;
    in_device_gbps_ = kBytes / timed(device_b, device_a, cudaMemcpyDeviceToDevice) / 1e9;
    cudaFree(device_a);
    cudaFree(device_b);
    cudaFreeHost(host);
    return CudaStatus(cudaGetLastError(), "calibration copies");
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
    std::lock_guard<std::mutex> lock(streams_mutex_);
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
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    if (after) PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, Raw(*after), 0));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream));
    PMSNAP_ASSIGN_OR_RETURN(DeviceEventPtr done, NewEvent());
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(Raw(*done), stream));
    return done;
  }

  bool Registered(const void* dst, std::size_t bytes) const {
    const auto* begin = static_cast<const std::byte*>(dst);
    {
      std::lock_guard<std::mutex> lock(ranges_mutex_);
      for (const auto& [first, last] : registered_) {
        if (begin >= first && begin + bytes <= last) return true;
      }
    }
    if (options_.testing_refuse_registration) return false;
    // Pinned or registered elsewhere (cudaMallocHost, a caller's own
    // cudaHostRegister): DMA-able too.
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, dst) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.type == cudaMemoryTypeHost;
  }

  // A device -> host copy into memory the DMA cannot target: chunk by chunk
  // through the bounded pinned ring, on this thread's stream after `after`.
  Status Staged(void* dst, const void* src, std::size_t bytes, const DeviceEvent* after) {
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_ASSIGN_OR_RETURN(cudaStream_t stream, StreamForThisThread());
    if (after != nullptr) PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, Raw(*after), 0));
    StagingRing* ring = nullptr;
    {
      std::lock_guard<std::mutex> lock(staging_mutex_);
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
  void HarvestStallsLocked() const {
    auto done = std::partition(pending_stalls_.begin(), pending_stalls_.end(),
                               [](const PendingStall& stall) {
                                 return cudaEventQuery(stall.after) == cudaErrorNotReady;
                               });
    for (auto it = done; it != pending_stalls_.end(); ++it) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, it->before, it->after) == cudaSuccess &&
          ms > kStallThresholdMs) {
        compute_stalls_ += 1;
        compute_stall_seconds_ += ms * 1e-3;
      }
      cudaGetLastError();
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
  std::mutex streams_mutex_;  // guards streams_
  std::unordered_map<std::thread::id, cudaStream_t> streams_;
  mutable std::mutex ranges_mutex_;  // guards registered_
  std::vector<std::pair<const std::byte*, const std::byte*>> registered_;
  mutable std::mutex staging_mutex_;  // guards staging_ (created once)
  std::unique_ptr<StagingRing> staging_;
  mutable std::mutex stalls_mutex_;  // guards the three members below
  mutable std::vector<PendingStall> pending_stalls_;
  mutable std::uint64_t compute_stalls_ = 0;
  mutable double compute_stall_seconds_ = 0;
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

Status RegisterHostMemoryForDevice(void* ptr, std::size_t bytes) {
  const cudaError_t error = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (error == cudaErrorHostMemoryAlreadyRegistered) {
    cudaGetLastError();
    return Status::Ok();
  }
  if (error != cudaSuccess) cudaGetLastError();
  return CudaStatus(error, "cudaHostRegister");
}

}  // namespace pmsnap::runtime
