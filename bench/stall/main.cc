// bench/stall: what checkpointing costs a real libtorch training loop, side by
// side with what a user would pick instead (issue 7, [bench]).
//
// Workloads (libtorch on CPU, sizes by flag): an MLP of ~92M parameters with
// Adam, a transformer-encoder stack with Adam, and a DLRM-like model (bottom
// MLP, embedding-bag tables looked up with Zipf ids, top MLP) with Adagrad.
// Methods, interleaved round-robin in one process on the same model, all
// with the same optimizer step (pmsnap's ParameterStepper, whose Adam and
// Adagrad update parameters of 32 MiB or more in cache-sized blocks, bitwise
// libtorch's arithmetic; --block-kib), so that the overhead column is what
// checkpointing costs and nothing else:
//   none               the step, no checkpoint (the reference)
//   none-libtorch      libtorch's own optimizer.step(), no checkpoint: what a
//                      libtorch user runs today (not with --block-kib=0)
//   torch-save-kK      synchronous torch::save of module + optimizer every K
//   checkfreq-alg1     CheckFreq style: stop, copy the whole state into DRAM,
//                      resume, torch::save the copy on a background thread;
//                      interval from Algorithm 1 (CheckFreqPolicy::ComputeInterval)
//   checkfreq-k1       the same every iteration (pmsnap's frequency)
//   weight-files-k1    weight-grained serialization (slides, "One Possible
//                      Solution"): right after a weight's update a worker
//                      copies it out and torch::saves it to its own file; the
//                      next update of a weight waits for its own snapshot
//   pmsnap-S-cont      CheckpointedOptimizer, strategy S in {1,2,3,4,adaptive},
//   pmsnap-S-kK        continuous mode or every-K
//   pmsnap-adaptive-cont-staged  continuous, a boundary that finds the epoch in
//                      flight captured into host memory (dram_staging_buffers=2)
//   pmsnap-hooks-only  control: steps through the hooks, never checkpoints; its
//                      distance from `none` is hook cost plus the VM's noise
// The overhead target's cell (mlp/host) runs none, none-libtorch,
// pmsnap-adaptive-k1 and the control for --target-rounds rounds (16), the rest
// for --repeats (2).
// Devices: "host" (CPU tensors) and "simulated" (SimulatedDevice: the state
// sits behind a modelled 12 GB/s link with limited device memory; every
// method's device -> host copies go through it). Always labelled.
//
// Measures per method: iteration time (median, p99, mean), overhead over
// `none` (paired per round, median and range of rounds), training-thread
// stall split into conflict waits / boundary waits / copies / synchronous
// saves / hook overhead, checkpoints committed per minute, bytes written, the
// longest interval K for which overhead stays under 3.5%, the training
// thread's CPU cycles and instructions per iteration (perf_event_open, when
// the kernel allows it: an overhead with the same instructions in more cycles
// is interference, e.g. a worker's memory traffic), and restore time of
// the newest checkpoint (pmsnap straight from the pool vs torch::load), each
// restore in a fresh process that builds the model as a restarted trainer
// would, taking turns within each round; speedups paired by round.
// Training runs on --threads cores (torch and OpenBLAS alike), leaving the
// rest to the checkpoint workers; unless --no-pin, the training thread is
// pinned to the first CPUs and every method's checkpoint threads (pmsnap's
// workers through EngineOptions::worker_cpus, CheckFreq's persister, the
// weight-files workers) to the last --workers CPUs. Restores run unpinned.
//
//   pmsnap_bench_stall [--quick] [--help for flags]
// CSV + PNG under bench/results/ (stall.csv, stall_trials.csv,
// stall_restore.csv, stall.png).
//
// The files of bench/stall/: options (flags), workloads (models of
// workloads/ with data and optimizer), methods (the interface;
// baselines.cc: none, torch-save, CheckFreq, weight files;
// pmsnap_method.cc), counters (stall causes, hardware counters, page
// faults, the clock), trials (one method's run), statistics, results (rows
// from rounds), restore (fresh-process restores), report (CSV, tables,
// targets), and this driver.
#include <dlfcn.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/command_line.h"
#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/common/pool_directory.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/cuda_device.h"
#include "stall/counters.h"
#include "stall/options.h"
#include "stall/report.h"
#include "stall/restore.h"
#include "stall/results.h"
#include "stall/statistics.h"
#include "stall/trials.h"
#include "stall/workloads.h"

namespace pmsnap::bench::stall {
namespace {

// Every method's rounds of `w` on `device_name` ("host" or "simulated"),
// then the restores; rows appended to `results`. A device that cannot be
// made is reported and skipped.
void RunWorkloadDevice(const Options& o, Workload& w, const std::string& device_name,
                       const std::vector<int>& checkpoint_cpus, Results* results) {
  // Optimizer state exists after one plain step.
  w.forward_backward(0);
  w.optimizer->step();
  const std::uint64_t state_bytes = Bytes(StateTensors(w));
  std::string spec = "host";
  if (device_name == "simulated") {
    char b[64];
    std::snprintf(b, sizeof(b), "simulated:%g:%llu", o.sim_gbps,
                  static_cast<unsigned long long>(std::max(
                      1.0, o.sim_memory_fraction * static_cast<double>(state_bytes) / (1 << 20))));
    spec = b;
  }
  std::string note;
  auto made = runtime::MakeDevice(spec, &note);
  if (!made.ok()) {
    std::fprintf(stderr, "device %s: %s\n", spec.c_str(), made.status().ToString().c_str());
    return;
  }
  std::unique_ptr<runtime::Device> device = std::move(made).value();
  const std::string label = device_name == "simulated" ? "simulated" : "host";
  const std::string dir =
      o.dir + "/pmsnap-bench-stall-" + std::to_string(getpid()) + "/" + w.name + "-" + label;
  std::filesystem::create_directories(dir);

  // Time one iteration to size trials of small models.
  const auto t = Clock::now();
  for (int i = 0; i < 2; ++i) {
    w.forward_backward(1);
    w.optimizer->step();
  }
  const double it = Since(t) / 2;
  const int iterations =
      std::max(o.iters, static_cast<int>(std::min(200.0, o.trial_seconds / std::max(it, 1e-4))));
  const bool target_cell = w.name == kTargetWorkload && label == kTargetDevice;
  const std::string target_note =
      target_cell && o.target_rounds > o.repeats
          ? " (" + std::to_string(o.target_rounds) +
                " for none, none-libtorch, pmsnap-adaptive-k1 and pmsnap-hooks-only: the overhead "
                "target)"
          : "";
  std::printf(
      "\n== %s on %s%s: %lld parameters, %.1f MB checkpoint state, ~%.1f ms/iteration, "
      "%d measured iterations x %d round(s)%s\n",
      w.name.c_str(), device->name().c_str(),
      device_name == "simulated" ? " [SIMULATED device]" : "", static_cast<long long>(w.parameters),
      static_cast<double>(state_bytes) / 1e6, it * 1e3, iterations, o.repeats, target_note.c_str());
  std::fflush(stdout);

  Context c{o, w, *device, label, dir, iterations, checkpoint_cpus};
  const auto methods = AllMethods(o);
  auto rounds_of = [&](const MethodSpec& m) {
    return target_cell && InTargetCellMethods(m.name) ? std::max(o.repeats, o.target_rounds)
                                                      : o.repeats;
  };
  int rounds = 0;
  for (const auto& m : methods) rounds = std::max(rounds, rounds_of(m));
  std::map<std::string, std::vector<Trial>> trials;
  for (int r = 0; r < rounds; ++r) {
    std::vector<const MethodSpec*> in_round;
    for (const auto& m : methods)
      if (r < rounds_of(m)) in_round.push_back(&m);
    // Rotate the order each round so no method always runs in the same slot
    // (a stride of 3 would leave a round of 3 or 6 methods in place).
    const std::size_t stride = in_round.size() % 3 == 0 ? 1 : 3;
    for (std::size_t j = 0; j < in_round.size(); ++j) {
      const MethodSpec& m = *in_round[(j + static_cast<std::size_t>(r) * stride) % in_round.size()];
      const bool last = r == rounds_of(m) - 1;
      const bool keep = last && (m.name == "pmsnap-adaptive-k1" || m.family == 2);
      Trial trial = RunTrial(c, m, keep);
      const double mean = Mean(trial.iteration_seconds);
      if (trial.ok) {
        std::printf(
            "  [%s/%s] round %d/%d %-22s median %8.1f ms  mean %8.1f ms  step %7.1f ms  stall "
            "%7.2f ms/it"
            "  %3llu ckpt%s  %s\n",
            w.name.c_str(), label.c_str(), r + 1, rounds_of(m), m.name.c_str(),
            Median(trial.iteration_seconds) * 1e3, mean * 1e3, Mean(trial.step_seconds) * 1e3,
            trial.counters.stall.total() / iterations * 1e3,
            static_cast<unsigned long long>(trial.counters.commits),
            CountersText(trial.per_iteration).c_str(), trial.note.c_str());
        for (std::size_t i = 0; i < trial.iteration_seconds.size(); ++i) {
          char line[256];
          std::snprintf(line, sizeof(line), "%s,%s,%s,%d,%zu,%.6f,%.6f", w.name.c_str(),
                        label.c_str(), m.name.c_str(), r + 1, i + 1, trial.iteration_seconds[i],
                        trial.step_seconds[i]);
          results->trial_lines.push_back(line);
        }
      } else {
        std::printf("  [%s/%s] round %d/%d %-22s FAILED: %s\n", w.name.c_str(), label.c_str(),
                    r + 1, rounds_of(m), m.name.c_str(), trial.error.c_str());
      }
      std::fflush(stdout);
      trials[m.name].push_back(std::move(trial));
    }
  }

  // Aggregate: per round, overhead is paired with that round's `none`.
  const auto& none = trials["none"];
  for (const auto& m : methods)
    results->rows.push_back(SummarizeTrials(w.name, label, m, trials[m.name], none, results->rows));

  // Restore of the newest checkpoint, as after a crash: each restore runs in
  // a fresh process that builds the model as a restarted trainer would
  // (initialized parameters, no optimizer state) and then either restores
  // from the pool kept from the last pmsnap-adaptive-k1 trial or
  // torch::loads the torch-save file. A fresh process pays what a restart
  // pays (first touch of the optimizer state and of what torch::load
  // allocates); restores in this process would find memory glibc kept from
  // the trials. The three take turns within each round, so a slow spell of
  // the machine slows all of them alike and the ratios stay comparable.
  MeasureRestores(o, w.name, spec, label, PoolPath(c, "pmsnap-adaptive-k1"), dir + "/torch-save.pt",
                  results);
  std::filesystem::remove_all(dir);
  std::error_code ignored;  // the per-process folder goes once its last workload is done
  std::filesystem::remove(std::filesystem::path(dir).parent_path(), ignored);
}

}  // namespace
}  // namespace pmsnap::bench::stall

int main(int argc, char** argv) {
  using namespace pmsnap;
  using namespace pmsnap::bench::stall;
  Options o;
  if (auto exit_code = ParseCommandLine(argc, argv, "pmsnap_bench_stall", kUsage,
                                        [&o](const std::string& key, const std::string& value) {
                                          return ParseFlag(key, value, &o);
                                        })) {
    return *exit_code;
  }
  if (o.dir.empty()) o.dir = PoolDirectory();
  if (o.iters < 1 || o.repeats < 1 || o.warmup < 0 || o.k < 1 || o.threads < 1 || o.workers < 1 ||
      o.restore_rounds < 1 || o.target_rounds < 1) {
    std::fprintf(stderr, "pmsnap_bench_stall: counts must be positive\n");
    return 1;
  }
  // Pools in /dev/shm take the PM code path (non-temporal stores + drain), as
  // in the tests and the other benchmarks.
  setenv("PMEM_IS_PMEM_FORCE", "1", 0);
  torch::set_num_threads(o.threads);
  // Debian's libtorch reaches OpenBLAS through libblas.so.3, and OpenBLAS's
  // own thread pool ignores torch::set_num_threads: left alone it runs GEMMs
  // on every core, including the one meant for the checkpoint workers.
  using SetBlasThreads = void (*)(int);
  const auto set_blas_threads =
      reinterpret_cast<SetBlasThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set_blas_threads != nullptr) set_blas_threads(o.threads);
  torch::manual_seed(1);
  if (!o.restore_child.empty()) {
    // A restart is not pinned: undo the training CPU mask inherited from the
    // parent, so the restore's workers may use every CPU.
    std::vector<int> every_cpu(static_cast<std::size_t>(ConfiguredCpus()));
    std::iota(every_cpu.begin(), every_cpu.end(), 0);
    (void)PinCurrentThread(every_cpu, "restore child");
    try {
      return RunRestoreChild(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pmsnap_bench_stall restore child: %s\n", e.what());
      return 2;
    }
  }
  o.command_line.assign(argv, argv + argc);
  const auto start = Clock::now();
  std::string pinning = "threads not pinned";
  std::vector<int> checkpoint_cpus;  // every method's checkpoint threads; empty: not pinned
  const std::vector<int> cpus = AllowedCpus();
  if (o.pin && cpus.size() >= 2) {
    const std::size_t workers = std::min<std::size_t>(cpus.size() - 1, o.workers);
    const std::vector<int> training(cpus.begin(), cpus.end() - workers);
    checkpoint_cpus.assign(cpus.end() - workers, cpus.end());
    Status pinned = PinCurrentThread(training, "training thread");
    if (!pinned.ok()) {
      std::fprintf(stderr, "pmsnap_bench_stall: %s\n", pinned.ToString().c_str());
      return 1;
    }
    pinning = "training on CPU " + CpuList(training) + ", checkpoint threads on CPU " +
              CpuList(checkpoint_cpus);
  }
  std::printf(
      "pmsnap_bench_stall: %u hardware threads, torch intra-op threads %d (OpenBLAS %s), %d "
      "checkpoint worker(s) per method, %s, pmsnap parts %llu MiB, stepper's blocks %llu KiB, "
      "files and pools in %s\n",
      std::thread::hardware_concurrency(), o.threads,
      set_blas_threads != nullptr ? "capped alike" : "not found", o.workers, pinning.c_str(),
      static_cast<unsigned long long>(o.part_mib), static_cast<unsigned long long>(o.block_kib),
      o.dir.c_str());
  // Simulated PM (PmBandwidth): pmsnap's pools, and the restores read from
  // them, run at the modelled rates; the file baselines write at the
  // machine's speed.
  auto pm = layout::ResolvePmBandwidth({});
  if (!pm.ok()) {
    std::fprintf(stderr, "pmsnap_bench_stall: %s\n", pm.status().ToString().c_str());
    return 1;
  }
  o.pm_label = pm->Label();
  if (!o.pm_label.empty()) {
    std::printf(
        "PM: %s for pmsnap's pools (PMSNAP_PM_WRITE_GBPS / PMSNAP_PM_READ_GBPS); the file "
        "baselines write to %s at this machine's speed\n",
        o.pm_label.c_str(), o.dir.c_str());
  }
  Results results;
  try {
    for (const auto& name : o.workloads) {
      std::optional<Workload> w = MakeWorkload(name, o);
      if (!w) return 1;
      std::printf("\nworkload %s: %s\n", w->name.c_str(), w->description.c_str());
      for (const auto& d : o.devices) {
        if (d != "host" && d != "simulated") {
          std::fprintf(stderr, "unknown device %s (host | simulated)\n", d.c_str());
          return 1;
        }
        RunWorkloadDevice(o, *w, d, checkpoint_cpus, &results);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pmsnap_bench_stall: %s\n", e.what());
    return 2;
  }
  PrintTable(results);
  PrintTargets(results);
  WriteCsv(o, results.rows, results.restores, results.trial_lines);
  std::printf("\ncsv: %s/%s.csv, %s_restore.csv, %s_trials.csv; total %.0f s\n", o.out.c_str(),
              o.tag.c_str(), o.tag.c_str(), o.tag.c_str(), Since(start));
  if (o.plot) {
    const std::string cmd = std::string(PMSNAP_BENCH_PYTHON " ") + PMSNAP_BENCH_SOURCE_DIR +
                            "/stall_plot.py " + o.out + " " + o.tag;
    if (std::system(cmd.c_str()) == 0)
      std::printf("plot: %s/%s.png\n", o.out.c_str(), o.tag.c_str());
  }
  return 0;
}
