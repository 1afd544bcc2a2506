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
//    ring, whose peak stays within its size for a model many times larger.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
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

// One training step: each unit's update queued between its hooks.
Status GpuStep(Engine& engine, GpuModel& gpu, ToyModel& reference, std::uint64_t k) {
  reference.StepPlain(k);
  PMSNAP_RETURN_IF_ERROR(engine.BeginStep(k));
  for (std::size_t u = kUnits; u-- > 0;) {
    PMSNAP_RETURN_IF_ERROR(engine.BeforeUpdate(static_cast<std::uint32_t>(u)));
    gpu.LaunchUpdate(reference, u, k);
    PMSNAP_RETURN_IF_ERROR(engine.AfterUpdate(static_cast<std::uint32_t>(u)));
  }
  return engine.EndStep();
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
  cudaStreamCreateWithFlags(&fixture.compute, cudaStreamNonBlocking);
  options.compute_stream = reinterpret_cast<std::uintptr_t>(fixture.compute);
  auto device = CreateCudaDevice(0, options);
  if (!device.ok()) {
    fixture.skip = device.status().message();
    return fixture;
  }
  fixture.device = std::move(*device);
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
    // Step 1's updates are held on the compute stream, so none of its copies
    // can start; step 2 then conflicts on every unit.
    Latch step1;
    ASSERT_CUDA(cudaLaunchHostFunc(gpu.compute, HoldStream, &step1));
    ASSERT_TRUE(GpuStep(**engine, model, reference, 1).ok());
    step1.OpenAfter(kHangGuard);
    ASSERT_TRUE(GpuStep(**engine, model, reference, 2).ok());
    EXPECT_FALSE(step1.is_open()) << "step 2's conflicts blocked the training thread";
    step1.Open();
    ASSERT_TRUE((*engine)->Flush().ok());
    auto latest = (*engine)->pool().Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(latest->iteration(), 1u);
    EXPECT_EQ(reference.CompareWithHistory(*latest), "");
    Stats stats = (*engine)->stats();
    EXPECT_EQ(stats.conflicts, static_cast<std::uint64_t>(kUnits));
    EXPECT_GE(stats.device_queues.compute_waits_on_copies, stats.conflicts);
    for (std::uint64_t k = 3; k <= 12; ++k) ASSERT_TRUE(GpuStep(**engine, model, reference, k).ok());
    ASSERT_TRUE((*engine)->Close().ok());
    EXPECT_EQ(model.CompareWith(reference, 12), "");
    std::cerr << "cuda " << GetParam() << ": " << (*engine)->stats().Summary() << "\n";
  }
  GpuModel restored(reference, gpu.compute);
  auto engine = Engine::Open(Options(path.path(), *gpu.device, GetParam()), restored.registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto result = (*engine)->Restore();
  ASSERT_TRUE(result.ok()) << result.status().ToString();
  EXPECT_EQ(restored.CompareWith(reference, result->iteration), "");
  ASSERT_TRUE((*engine)->Close().ok());
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
  const Stats stats = (*engine)->stats();
  EXPECT_GT(stats.device_queues.staging_peak_bytes, 0u);
  EXPECT_LE(stats.device_queues.staging_peak_bytes, options.staging_ring_bytes);
  ASSERT_TRUE((*engine)->Close().ok());
}

}  // namespace
}  // namespace pmsnap::runtime
