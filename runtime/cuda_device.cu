// CudaDevice (see pmsnap/runtime/cuda_device.h). Compiled by nvcc when the
// CUDA toolkit is present; every CUDA call is checked and turned into a
// Status naming the call and the CUDA error.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {
namespace {

Status CudaStatus(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return Status::Ok();
  return Status(StatusCode::kIOError, std::string(call) + " failed: " + cudaGetErrorName(error) +
                                          " (" + cudaGetErrorString(error) + ")");
}

#define PMSNAP_CUDA_RETURN_IF_ERROR(call) PMSNAP_RETURN_IF_ERROR(CudaStatus((call), #call))

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name) : ordinal_(ordinal), name_(std::move(name)) {}

  ~CudaDevice() override {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    cudaSetDevice(ordinal_);
    for (auto& [thread, stream] : streams_) {
      cudaStreamDestroy(stream.stream);
      cudaEventDestroy(stream.done);
    }
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string name() const override { return name_; }
  // GPU memory: every byte crosses PCIe through CopyToHost / CopyFromHost.
  bool cpu_addressable() const override { return false; }

  Status CopyToHost(void* dst, const void* src, std::size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  Status CopyFromHost(void* dst, const void* src, std::size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  Status CopyInDevice(void* dst, const void* src, std::size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
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
  struct ThreadStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
  };

  // One stream per calling thread so workers copy in parallel. The streams
  // are *blocking* on purpose: with the legacy default stream that PyTorch
  // uses, a copy then starts only after the update kernels queued before it
  // (AfterUpdate is called when the update is queued, not done), and the
  // next update waits for copies in flight, which is strategy 2 enforced
  // by the hardware at stream granularity.
  Result<ThreadStream> StreamForThisThread() {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    auto it = streams_.find(std::this_thread::get_id());
    if (it != streams_.end()) return it->second;
    ThreadStream created;
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&created.stream, cudaStreamDefault));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&created.done, cudaEventDisableTiming));
    streams_.emplace(std::this_thread::get_id(), created);
    return created;
  }

  Status Copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    PMSNAP_ASSIGN_OR_RETURN(ThreadStream s, StreamForThisThread());
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, s.stream));
    PMSNAP_CUDA_RETURN_IF_ERROR(cudaEventRecord(s.done, s.stream));
    return CudaStatus(cudaEventSynchronize(s.done), "cudaEventSynchronize");
  }

  int ordinal_;
  std::string name_;
  double to_host_gbps_ = 12.0;
  double in_device_gbps_ = 500.0;
  std::atomic<std::uint64_t> allocated_{0};
  std::atomic<std::uint64_t> peak_{0};
  std::mutex streams_mutex_;  // guards streams_
  std::unordered_map<std::thread::id, ThreadStream> streams_;
};

}  // namespace

bool CudaSupportCompiled() { return true; }

Result<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
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
      ordinal, "cuda:" + std::to_string(ordinal) + " (" + props.name + ")");
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
