// bench/stall's trials: the methods of the table (MethodSpec), and one trial
// of one method: warm-up and measured iterations of the workload with that
// method's checkpointing, timed and counted.
//
// Thread-safety: the training thread; a trial's methods start and join
// their own threads.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "pmsnap/runtime/device.h"
#include "stall/counters.h"
#include "stall/options.h"

namespace pmsnap::bench::stall {

struct Workload;

// One row of the table: a method and its settings.
struct MethodSpec {
  std::string name;
  int family = 1;                  // the method number
  std::string strategy;            // pmsnap
  bool continuous = false;         // pmsnap
  std::uint64_t k = 1;             // 0: CheckFreq Algorithm 1
  bool never_checkpoints = false;  // pmsnap control: the hooks run, no epoch ever opens
  bool libtorch_step = false;      // none-libtorch: libtorch's own optimizer.step()
  bool in_backward = false;        // pmsnap: each parameter updated inside backward
  int staging_buffers = 0;         // pmsnap: EngineOptions::dram_staging_buffers
};

// The overhead target is a few percent, inside a round's noise on a
// small VM: its cell gets extra rounds of these methods.
constexpr const char* kTargetWorkload = "mlp";
constexpr const char* kTargetDevice = "host";
bool InTargetCellMethods(const std::string& method);

// Every method the options select ('none', the reference, always).
std::vector<MethodSpec> AllMethods(const Options& o);

// What one trial measured.
struct Trial {
  std::vector<double> iteration_seconds;
  // The warm-up iterations right after the method was set up (a fresh pool,
  // file or buffer): its cold start, reported apart from the steady state.
  std::vector<double> cold_iteration_seconds;
  // Process page faults per iteration, all threads: cold start, steady state.
  double cold_process_faults = -1, process_faults = -1;
  // Of each iteration, the optimizer step with its checkpoint hooks (the
  // rest is zero_grad + forward + backward): where an overhead lands.
  std::vector<double> step_seconds;
  // Training-thread hardware counters per measured iteration (-1: absent).
  std::array<double, ThreadCounters::kCount> per_iteration{};
  double wall = 0;
  // The process's peak resident set while the method ran, from a reset at
  // its set-up (-1: the kernel would not reset it).
  double peak_rss_bytes = -1;
  Counters counters;
  std::string note;
  bool ok = true;
  std::string error;
};

// What every trial of one workload on one device shares.
struct Context {
  const Options& o;
  Workload& w;
  runtime::Device& device;
  std::string device_label;
  std::string dir;  // per workload/device scratch directory
  int iterations;   // measured iterations per trial
  // CPUs of every method's checkpoint threads; empty: not pinned (Options::pin).
  std::vector<int> checkpoint_cpus;
};

// The pool of pmsnap method `method` in the context's scratch directory.
std::string PoolPath(const Context& c, const std::string& method);

// Sets up method `m` on a fresh pool or file, runs c.o.warmup unmeasured and
// c.iterations measured iterations, and tears it down; the method's files
// stay when `keep_files` (for the restores). A failed step or setup gives a
// Trial with ok = false and the error.
Trial RunTrial(Context& c, const MethodSpec& m, bool keep_files);

}  // namespace pmsnap::bench::stall
