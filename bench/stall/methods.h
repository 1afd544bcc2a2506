// bench/stall's checkpoint methods: what each row of the table runs on top of
// the same optimizer step. Baselines (baselines.cc): none, none-libtorch,
// torch-save-kK, checkfreq-*, weight-files-k1; pmsnap's
// CheckpointedOptimizer (pmsnap_method.cc).
//
// Thread-safety: a method is driven by the training thread; the threads a
// baseline starts are its own and are joined by Finish (or the destructor).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/runtime/engine.h"
#include "stall/counters.h"

namespace pmsnap::bench::stall {

struct Workload;

// One checkpointing method over a workload, for one trial.
class Method {
 public:
  virtual ~Method() = default;
  // The optimizer step of iteration `step` (1-based) plus checkpointing.
  virtual Status Step(std::uint64_t step) = 0;
  // Backward of the iteration has returned (Step follows): for methods that
  // work inside backward, to see how much they got done there.
  virtual void AfterBackward() {}
  // Counters since the last Mark().
  virtual void Mark() = 0;
  virtual Counters Read() = 0;
  // Waits for background work and releases files/pools.
  virtual Status Finish() = 0;
  virtual std::string Note() const { return ""; }
};

// The optimizer step alone (`none`; `none-libtorch` with block_bytes 0).
std::unique_ptr<Method> MakeNoCheckpoint(Workload& w, std::size_t block_bytes);

// Synchronous torch::save of module + optimizer to `path` every k steps
// (torch-save-kK); through `device` to a host copy first unless it is the host.
std::unique_ptr<Method> MakeTorchSave(Workload& w, runtime::Device& device, std::string path,
                                      std::uint64_t k, std::size_t block_bytes);

// CheckFreq: stop, copy the state to DRAM, resume, torch::save the copy to
// `path` on a background thread (pinned to `checkpoint_cpus` unless empty).
// Every fixed_k steps, or CheckFreq's Algorithm 1 when fixed_k is 0.
std::unique_ptr<Method> MakeCheckFreq(Workload& w, runtime::Device& device, std::string path,
                                      std::uint64_t fixed_k, std::size_t block_bytes,
                                      std::vector<int> checkpoint_cpus);

// Weight-grained serialization into `dir`, one file per weight and epoch,
// by `workers` threads (pinned to `checkpoint_cpus` unless empty). Fails
// when ParameterStepper refuses the workload's optimizer.
Result<std::unique_ptr<Method>> MakeWeightFiles(Workload& w, runtime::Device& device,
                                                std::string dir, std::uint64_t k, int workers,
                                                std::size_t block_bytes,
                                                std::vector<int> checkpoint_cpus);

// pmsnap's CheckpointedOptimizer with `options` (pool, policy, strategy,
// device, workers); each parameter updated inside backward when
// `update_in_backward`. Fails as CheckpointedOptimizer::Create does.
Result<std::unique_ptr<Method>> MakePmsnap(Workload& w, runtime::EngineOptions options,
                                           std::size_t block_bytes, bool update_in_backward);

}  // namespace pmsnap::bench::stall
