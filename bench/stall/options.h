// bench/stall's settings: model sizes, methods, rounds, threads, where files
// go; parsed from --flags (kUsage lists them).
//
// Thread-safety: values; parsed once in main before any thread starts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pmsnap/runtime/engine.h"

namespace pmsnap::bench::stall {

// The overhead budget, 3.5%: CheckFreq's Algorithm 1 and the
// longest-frequency estimate (k<3.5%) aim at it.
inline constexpr double kOverheadBudget = 0.035;

// hooks::ParameterStepper's default block, in KiB (--block-kib's default).
extern const std::uint64_t kDefaultBlockKib;

struct Options {
  std::vector<std::string> workloads = {"mlp", "transformer", "dlrm"};
  std::vector<std::string> devices = {"host", "simulated"};
  std::vector<std::string> methods;  // empty: all
  // MLP: in -> width x hidden -> in, Adam.
  std::int64_t mlp_in = 1024, mlp_width = 4096, mlp_hidden = 6, mlp_batch = 16;
  // Transformer encoder stack, Adam.
  std::int64_t tf_dim = 512, tf_layers = 4, tf_heads = 8, tf_seq = 64, tf_batch = 8;
  // DLRM-like, Adagrad.
  std::int64_t dlrm_tables = 8, dlrm_rows = 100000, dlrm_dim = 32, dlrm_batch = 256, dlrm_bag = 8;
  int iters = 4;    // measured iterations per trial (at least)
  int warmup = 1;   // unmeasured iterations per trial (first touch of pools/buffers)
  int repeats = 2;  // rounds; methods interleaved within a round
  // Iteration-count budget per trial for small models: iterations are scaled
  // up so a trial lasts about this long.
  double trial_seconds = 1.5;
  int restore_rounds = 5;  // restores timed per method (median)
  // Rounds of the target cell's methods (InTargetCellMethods). Trials on this
  // VM land on levels up to +-10% apart (cycles per iteration move with them:
  // memory placement and neighbours), so the median needs many rounds.
  int target_rounds = 16;
  std::uint64_t k = 4;                     // interval of torch-save-kK
  std::vector<std::uint64_t> sweep = {2};  // extra pmsnap-adaptive-kK trials
  int threads = 1;                         // torch intra-op threads (training)
  int workers = 1;                         // checkpoint worker threads (all methods)
  std::uint64_t part_mib = 4;              // pmsnap part size
  runtime::CopyStart copy_start = runtime::CopyStart::kAuto;  // pmsnap methods
  // Block size of the stepper's cache-blocked update, every method but
  // none-libtorch; 0: libtorch's own step everywhere (and no none-libtorch).
  std::uint64_t block_kib = kDefaultBlockKib;
  // Training thread on the first CPUs, every method's checkpoint threads on
  // the last --workers (at least one CPU left for training).
  bool pin = true;
  double sim_gbps = 12.0;
  double sim_memory_fraction = 0.25;  // simulated device memory / checkpoint bytes
  std::string out = PMSNAP_BENCH_RESULTS_DIR;
  std::string tag = "stall";  // output file prefix
  std::string dir;            // pools and files; default $PMSNAP_POOL_DIR or /dev/shm
  bool plot = true;
  // "" on the machine's PM; "simulated PM (...)" when PMSNAP_PM_WRITE_GBPS /
  // PMSNAP_PM_READ_GBPS throttle the pools (set in main, written to the CSVs).
  std::string pm_label;
  // Internal: a child process that times one restore (see RunRestoreChild).
  std::string restore_child;              // kRestore* method name
  std::string restore_path;               // pool or torch-save file
  std::string restore_device;             // runtime::MakeDevice spec
  std::vector<std::string> command_line;  // this process's argv, for the children
};

extern const char* const kUsage;

// Applies one flag (ParseCommandLine's key and value) to `o`. False for an
// unknown key or a bad --copy-start; throws std::invalid_argument or
// std::out_of_range for a bad number (ParseCommandLine reports both as a bad
// flag).
bool ParseFlag(const std::string& key, const std::string& v, Options* o);

}  // namespace pmsnap::bench::stall
