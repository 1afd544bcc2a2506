// The CUDA device on a real GPU, through the Engine: updates are copies
// queued on a compute stream of the test's own (torch's current stream's
// stand-in), held by a host function where the test needs a conflict. On a
// machine without a GPU every test skips and says why (scripts/gpu_check.sh
// runs them where there is one).
//
//  - a checkpoint and a resume are bit-exact under each conflict strategy,
//    with a conflict forced on every unit, and the conflicts never block the
//    training thread (the compute stream waits for the copies instead);
//  - with registration refused, copies go through the bounded pinned staging
//    ring, whose peak stays within its size for a model many times larger;
//  - pools opened, closed and opened again in one process each checkpoint
//    their own bytes (the first GPU run: every pool after the first held
//    the old pool's pages, the slots were never unregistered), and leave
//    CUDA usable for the next kernel;
//  - no pmsnap call leaves a CUDA error behind on the calling thread
//    (cudaGetLastError after each), nor changes its current device.
//
// With CUDA_LAUNCH_BLOCKING=1 every launch waits for its work, so a stream
// cannot be held while the host goes on: the tests then force no conflict
// (the checks of content, errors and lifetimes still run) instead of
// deadlocking on their own hold.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "pmsnap/conflict/strategies.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/latch.h"
#include "testutil/temp_pool.h"
#include "testutil/toy_model.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::Latch;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;

constexpr int kUnits = 4;
constexpr auto kHangGuard = std::chrono::seconds(60);

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

// pmsnap left no error for the caller's next cudaGetLastError (which
// PyTorch calls after its kernels) and kept the caller's current device.
#define EXPECT_NO_CUDA_ERROR_LEFT(what)                                                 \
  do {                                                                                  \
    const cudaError_t left = cudaGetLastError();                                        \
    EXPECT_EQ(left, cudaSuccess) << what << " left " << cudaGetErrorName(left);         \
    int current = -1;                                                                   \
    EXPECT_EQ(cudaGetDevice(&current), cudaSuccess);                                    \
    EXPECT_EQ(current, 0) << what << " changed the current device";                     \
  } while (0)

bool LaunchBlocking() {
  const char* value = std::getenv("CUDA_LAUNCH_BLOCKING");
  return value != nullptr && std::string(value) == "1";
}

// The GPU's copy of a ToyModel: the same registrations, tensors in device
// memory, updated by uploading the reference model's values of a step on the
// compute stream (a device-side update ordered like a kernel).
class GpuModel {
 public:
  GpuModel(ToyModel& shape_of, cudaStream_t compute) : compute_(compute) {
    registrations_ = shape_of.Registrations();
    for (UnitRegistration& unit : registrations_) {
      for (TensorView& tensor : unit.tensors) {
        const std::uint64_t bytes = layout::TensorSpec{tensor.name, tensor.dtype, tensor.shape}.bytes();
        void* device = nullptr;
        EXPECT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
        EXPECT_EQ(cudaMemset(device, 0, bytes), cudaSuccess);
        tensor.data = device;
        tensors_.push_back(device);
        bytes_.push_back(bytes);
      }
    }
  }
  ~GpuModel() {
    cudaStreamSynchronize(compute_);
    for (void* tensor : tensors_) cudaFree(tensor);
    for (void* staged : staged_) cudaFreeHost(staged);
  }
  const std::vector<UnitRegistration>& registrations() const { return registrations_; }

  // Queues unit u's update to `reference`'s values after step k.
  void LaunchUpdate(const ToyModel& reference, std::size_t u, std::uint64_t k) {
    for (std::size_t t = 0; t < 3; ++t) {
      const std::size_t flat = u * 3 + t;
      const std::vector<std::byte>& values = reference.At(k)[flat];
      void* pinned = nullptr;
      ASSERT_EQ(cudaMallocHost(&pinned, values.size()), cudaSuccess);
      std::memcpy(pinned, values.data(), values.size());
      staged_.push_back(pinned);
      ASSERT_EQ(cudaMemcpyAsync(tensors_[flat], pinned, values.size(), cudaMemcpyHostToDevice,
                                compute_),
                cudaSuccess);
    }
  }

  // "" if the device tensors hold `reference`'s values after step k.
  std::string CompareWith(const ToyModel& reference, std::uint64_t k) {
    if (cudaStreamSynchronize(compute_) != cudaSuccess) return "compute stream failed";
    for (std::size_t flat = 0; flat < tensors_.size(); ++flat) {
      std::vector<std::byte> back(bytes_[flat]);
      if (cudaMemcpy(back.data(), tensors_[flat], back.size(), cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
        return "download failed";
      }
      if (back != reference.At(k)[flat]) {
        return "unit " + std::to_string(flat / 3) + " tensor " + std::to_string(flat % 3) +
               " differs from step " + std::to_string(k);
      }
    }
    return "";
  }

 private:
  cudaStream_t compute_;
  std::vector<UnitRegistration> registrations_;
  std::vector<void*> tensors_;
  std::vector<std::uint64_t> bytes_;
  std::vector<void*> staged_;
};

// One training step: each unit's update queued between its hooks, and no
// CUDA error left after any hook.
Status GpuStep(Engine& engine, GpuModel& gpu, ToyModel& reference, std::uint64_t k) {
  reference.StepPlain(k);
  PMSNAP_RETURN_IF_ERROR(engine.BeginStep(k));
  EXPECT_NO_CUDA_ERROR_LEFT("BeginStep");
  for (std::size_t u = kUnits; u-- > 0;) {
    PMSNAP_RETURN_IF_ERROR(engine.BeforeUpdate(static_cast<std::uint32_t>(u)));
    EXPECT_NO_CUDA_ERROR_LEFT("BeforeUpdate");
    gpu.LaunchUpdate(reference, u, k);
    PMSNAP_RETURN_IF_ERROR(engine.AfterUpdate(static_cast<std::uint32_t>(u)));
    EXPECT_NO_CUDA_ERROR_LEFT("AfterUpdate");
  }
  PMSNAP_RETURN_IF_ERROR(engine.EndStep());
  EXPECT_NO_CUDA_ERROR_LEFT("EndStep");
  return Status::Ok();
}

struct GpuFixture {
  cudaStream_t compute = nullptr;
  std::unique_ptr<Device> device;
  std::string skip;  // why the test cannot run, if it cannot
};

GpuFixture OpenGpu(CudaDeviceOptions options) {
  GpuFixture fixture;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    fixture.skip = "no usable GPU on this machine: the CUDA tests need one "
                   "(scripts/gpu_check.sh runs them on a GPU machine)";
    return fixture;
  }
  cudaSetDevice(0);
  cudaStreamCreateWithFlags(&fixture.compute, cudaStreamNonBlocking);
  options.compute_stream = reinterpret_cast<std::uintptr_t>(fixture.compute);
  auto device = CreateCudaDevice(0, options);
  if (!device.ok()) {
    fixture.skip = device.status().message();
    return fixture;
  }
  fixture.device = std::move(*device);
  EXPECT_NO_CUDA_ERROR_LEFT("CreateCudaDevice");
  return fixture;
}

EngineOptions Options(const std::string& path, Device& device, const std::string& strategy) {
  EngineOptions options;
  options.pool_path = path;
  options.pool_options.part_bytes = 64 << 10;
  options.device = &device;
  options.strategy = conflict::MakeStrategy(strategy);
  options.print_summary = false;
  return options;
}

void HoldStream(void* latch) { static_cast<Latch*>(latch)->Wait(); }

class CudaStrategyTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaStrategyTest, OnAGpuAConflictWaitsOnTheComputeStreamAndResumeIsBitExact) {
  GpuFixture gpu = OpenGpu({});
  if (!gpu.skip.empty()) GTEST_SKIP() << gpu.skip;
  TempPoolPath path("cuda-" + GetParam());
  ToyModel reference(kUnits, 1 << 18);  // 2 MiB per unit
  {
    GpuModel model(reference, gpu.compute);
    auto engine = Engine::Open(Options(path.path(), *gpu.device, GetParam()), model.registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    EXPECT_NO_CUDA_ERROR_LEFT("Engine::Open");
    if (LaunchBlocking()) {
      // A held stream would hold the host too: no forced conflict.
      ASSERT_TRUE(GpuStep(**engine, model, reference, 1).ok());
      ASSERT_TRUE(GpuStep(**engine, model, reference, 2).ok());
    } else {
      // Step 1's updates are held on the compute stream, so none of its
      // copies can start; step 2 then conflicts on every unit.
      Latch step1;
      ASSERT_CUDA(cudaLaunchHostFunc(gpu.compute, HoldStream, &step1));
      ASSERT_TRUE(GpuStep(**engine, model, reference, 1).ok());
      step1.OpenAfter(kHangGuard);
      ASSERT_TRUE(GpuStep(**engine, model, reference, 2).ok());
      EXPECT_FALSE(step1.is_open()) << "step 2's conflicts blocked the training thread";
      step1.Open();
    }
    ASSERT_TRUE((*engine)->Flush().ok());
    EXPECT_NO_CUDA_ERROR_LEFT("Flush");
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(reference.CompareWithHistory(*latest), "");
    if (!LaunchBlocking()) {
      EXPECT_EQ(latest->iteration(), 1u);
      Stats stats = (*engine)->stats();
      EXPECT_EQ(stats.conflicts, static_cast<std::uint64_t>(kUnits));
      EXPECT_GE(stats.device_queues.compute_waits_on_copies, stats.conflicts);
    }
    for (std::uint64_t k = 3; k <= 12; ++k) ASSERT_TRUE(GpuStep(**engine, model, reference, k).ok());
    ASSERT_TRUE((*engine)->Close().ok());
    EXPECT_NO_CUDA_ERROR_LEFT("Close");
    EXPECT_EQ(model.CompareWith(reference, 12), "");
    std::cerr << "cuda " << GetParam() << ": " << (*engine)->stats().Summary() << "\n";
  }
  GpuModel restored(reference, gpu.compute);
  auto engine = Engine::Open(Options(path.path(), *gpu.device, GetParam()), restored.registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto result = (*engine)->Restore();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_NO_CUDA_ERROR_LEFT("Restore");
  EXPECT_EQ(restored.CompareWith(reference, result->iteration), "");
  ASSERT_TRUE((*engine)->Close().ok());
}

// The first GPU run: strategies 2-4 failed after strategy 1 had run in the
// same process, each passing alone. Pools of one size, one after the other,
// are mapped where the last one was; each must hold its own bytes, and
// CUDA must stay usable after them.
TEST(CudaLifetimeTest, PoolsOpenedAndClosedInOneProcessEachHoldTheirOwnBytes) {
  GpuFixture gpu = OpenGpu({});
  if (!gpu.skip.empty()) GTEST_SKIP() << gpu.skip;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("pool " + std::to_string(round));
    TempPoolPath path("cuda-lifetime-" + std::to_string(round));
    ToyModel reference(kUnits, 1 << 16);
    GpuModel model(reference, gpu.compute);
    {
      auto engine = Engine::Open(Options(path.path(), *gpu.device, "2"), model.registrations());
      ASSERT_TRUE(engine.ok()) << engine.status().ToString();
      for (std::uint64_t k = 1; k <= static_cast<std::uint64_t>(3 + round); ++k) {
        ASSERT_TRUE(GpuStep(**engine, model, reference, k).ok());
      }
      ASSERT_TRUE((*engine)->Flush().ok());
      auto latest = (*engine)->pool().Latest();
      ASSERT_TRUE(latest.ok());
      EXPECT_EQ(reference.CompareWithHistory(*latest), "");
      ASSERT_TRUE((*engine)->Close().ok());
      EXPECT_NO_CUDA_ERROR_LEFT("Close");
    }
    // The next kernel-like work of the caller runs.
    void* scratch = nullptr;
    ASSERT_CUDA(cudaMalloc(&scratch, 1 << 20));
    ASSERT_CUDA(cudaMemsetAsync(scratch, 1, 1 << 20, gpu.compute));
    ASSERT_CUDA(cudaStreamSynchronize(gpu.compute));
    ASSERT_CUDA(cudaFree(scratch));
  }
}

INSTANTIATE_TEST_SUITE_P(Strategies, CudaStrategyTest,
                         ::testing::Values("1", "2", "3", "4", "adaptive"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return "strategy_" + info.param;
                         });

TEST(CudaStagingTest, OnAGpuRefusedRegistrationStagesThroughABoundedRing) {
  CudaDeviceOptions options;
  options.testing_refuse_registration = true;
  options.staging_ring_bytes = 1 << 20;
  options.staging_chunk_bytes = 256 << 10;
  GpuFixture gpu = OpenGpu(options);
  if (!gpu.skip.empty()) GTEST_SKIP() << gpu.skip;
  TempPoolPath path("cuda-staging");
  ToyModel reference(kUnits, 1 << 19);  // 4 MiB per unit: 16 times the ring
  GpuModel model(reference, gpu.compute);
  auto engine = Engine::Open(Options(path.path(), *gpu.device, "2"), model.registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 6; ++k) {
    ASSERT_TRUE(GpuStep(**engine, model, reference, k).ok());
    ASSERT_TRUE((*engine)->Flush().ok());
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(reference.CompareWithHistory(*latest), "") << "step " << k;
  }
  EXPECT_NO_CUDA_ERROR_LEFT("staged steps");
  const Stats stats = (*engine)->stats();
  EXPECT_GT(stats.device_queues.staging_peak_bytes, 0u);
  EXPECT_LE(stats.device_queues.staging_peak_bytes, options.staging_ring_bytes);
  ASSERT_TRUE((*engine)->Close().ok());
}

}  // namespace
}  // namespace pmsnap::runtime
