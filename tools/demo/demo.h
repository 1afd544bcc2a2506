// pmsnap-demo's pieces shared by its parent (train_demo.cc: the crash,
// recovery, verification and overhead rounds) and its children
// (demo_child.cc: one training run): the options, the flags a child gets,
// and where the training thread and the checkpoint workers run.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace pmsnap::demo {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Options {
  std::string role = "main";  // main | baseline | train
  std::uint64_t iterations = 4000;
  int tables = 8;
  std::int64_t rows = 20000;
  std::int64_t dim = 16;
  std::int64_t batch = 128;
  std::int64_t bag = 8;     // ids per sample per table
  std::int64_t dense = 13;  // dense features (as in the Criteo data set)
  double zipf = 1.05;
  std::string optimizer = "adagrad";
  double lr = 0.02;
  std::string pool;  // default: $PMSNAP_POOL_DIR (or /dev/shm)/pmsnap-demo-<pid>.pool
  std::string device = "host";
  std::string policy = "every1";
  std::string tables_policy = "differential";  // differential | full
  std::string strategy = "adaptive";           // adaptive | 1..4
  std::string pin = "auto";                    // auto | off
  int workers = 0;                             // 0: from the CPUs (ResolveWorkers)
  int threads = 1;            // torch intra-op threads per child
  std::uint64_t kill_at = 0;  // 0: random in the middle half
  int rounds = 3;                    // overhead rounds; 0: compare the demo's own runs
  std::uint64_t round_iterations = 0;  // 0: a quarter of --iterations
  std::uint64_t seed = 0;     // 0: from the clock
  bool keep_pool = false;
  std::string out;    // child: where to write the final state
  std::string stats;  // child: where to write the stall profile
};

// The --help text.
extern const char* const kUsage;

// Sets the option `key` (a flag such as "--rows") to `value`; false for an
// unknown flag or a value it does not take. std::invalid_argument or
// std::out_of_range for a number that does not parse.
bool ParseFlag(const std::string& key, const std::string& value, Options* o);

// Flags a child needs to rebuild the same model, data and checkpointing.
std::vector<std::string> ChildFlags(const Options& o);


// Where the training thread and the checkpoint workers run. With --pin=auto
// and 2+ CPUs: training on the first allowed CPU, workers on the others
// (bench/RESULTS.md, "Pinning the checkpoint threads": otherwise the
// scheduler tends to run a worker on the training thread's core right after
// the training thread woke it).
struct CpuPlan {
  std::vector<int> training;  // empty: not pinned
  std::vector<int> workers;
  int worker_count = 2;
  std::string why;
};

CpuPlan PlanCpus(const Options& o);

// A child's whole run (--role=baseline or train): trains, checkpoints with
// --role=train, writes its final state to o.out and its stall profile to
// o.stats. Returns the process's exit status (0 ok, 2 a failure it printed).
int RunChild(const Options& o);

}  // namespace pmsnap::demo
