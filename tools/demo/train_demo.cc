// pmsnap-demo (training): checkpoint a DLRM-like model every iteration while
// it trains, crash it, recover it, and prove the result is bit-exact.
//
//   1. baseline  a child trains N iterations with the plain optimizer (no
//                checkpointing): the reference result and the iteration time
//                without checkpointing.
//   2. crash     a child trains with a CheckpointedOptimizer (a pmsnap epoch
//                every iteration) into a pool; the parent SIGKILLs it at a
//                random iteration, mid-step.
//   3. recover   a fresh child restores the newest committed epoch (weights,
//                optimizer state, data position, RNG) straight from the pool
//                and trains to N, still checkpointing every iteration.
//   4. verify    the recovered run's final parameters and optimizer state
//                are compared byte for byte with the baseline's; the stall
//                profile comes from Engine::stats() of the recovered run.
//   5. overhead  --rounds rounds (default 3), each a plain and a
//                checkpointed run of --round-iterations in fresh processes
//                and fresh pools, their order alternating; the overhead is
//                the median of the rounds' ratios, printed with its spread
//                and the time blocked in hooks. One cold run each would
//                compare a cold baseline with a warm machine (a fresh
//                machine printed -5.3% that way).
//
// It runs pmsnap's recommended configuration for this model and says why
// (--table-checkpoints, --strategy, --pin choose otherwise):
//   * the embedding tables through a differential policy (Check-N-Run's
//     intermittent differential): Adagrad changes only the rows a batch
//     looked up, so a checkpoint writes those rows, not the whole tables;
//   * the adaptive conflict strategy, which picks per unit from the last
//     epoch's profile;
//   * on a machine with two or more CPUs, the training thread pinned to one
//     CPU and the checkpoint workers to the others (the baseline's training
//     thread is pinned alike, so both runs compare on equal terms).
//
// Children are this executable re-executed (posix_spawn of /proc/self/exe
// with --role=...), so no libtorch thread pool is ever forked.
//
// Model: bottom MLP over dense features, embedding-bag tables looked up with
// Zipf-distributed ids (hot rows, as in recommendation traces), DLRM's
// pairwise dot-product interaction, top MLP, binary cross-entropy. Data is a
// pure function of (seed, iteration), so a resumed run sees the same batches.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/child_process.h"
#include "pmsnap/common/command_line.h"
#include "pmsnap/common/pool_directory.h"
#include "pmsnap/common/status.h"

#include "demo.h"

namespace pmsnap::demo {
namespace {

pmsnap::ChildProcess SpawnChild(const std::string& role, const Options& o, const std::string& out,
                                const std::string& stats) {
  std::vector<std::string> args = {"/proc/self/exe", "--role=" + role, "--out=" + out,
                                   "--stats=" + stats};
  for (auto& flag : ChildFlags(o)) args.push_back(flag);
  return pmsnap::ChildProcess(std::move(args));
}

// One progress line, redrawn in place on a terminal, every 10% otherwise.
class Progress {
 public:
  Progress(std::string label, std::uint64_t total, std::uint64_t first)
      : label_(std::move(label)), total_(total), first_(first), tty_(isatty(STDOUT_FILENO)) {}
  void Update(std::uint64_t step) {
    const int percent = static_cast<int>(100 * step / std::max<std::uint64_t>(total_, 1));
    const double elapsed = SecondsSince(start_);
    const double rate = step > first_ ? static_cast<double>(step - first_) / elapsed : 0;
    if (tty_) {
      if (SecondsSince(last_draw_) < 0.1 && step != total_) return;
      last_draw_ = Clock::now();
      const int filled = percent / 4;
      std::printf("\r  %-9s [%s%s] %3d%%  iteration %llu/%llu  %.0f it/s ", label_.c_str(),
                  std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(25 - filled), '.').c_str(), percent,
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(total_),
                  rate);
      std::fflush(stdout);
    } else if (percent / 10 != last_decile_) {
      last_decile_ = percent / 10;
      std::printf("  %-9s %3d%%  iteration %llu/%llu  %.0f it/s\n", label_.c_str(), percent,
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(total_),
                  rate);
      std::fflush(stdout);
    }
  }
  void Done() {
    if (tty_) std::printf("\n");
  }

 private:
  std::string label_;
  std::uint64_t total_, first_;
  bool tty_;
  int last_decile_ = -1;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_draw_{};
};

std::map<std::string, std::string> ReadStats(const std::string& path) {
  std::map<std::string, std::string> values;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto space = line.find(' ');
    if (space != std::string::npos) values[line.substr(0, space)] = line.substr(space + 1);
  }
  return values;
}

double Num(const std::map<std::string, std::string>& stats, const std::string& key) {
  auto it = stats.find(key);
  return it == stats.end() ? 0.0 : std::atof(it->second.c_str());
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `role` to completion with progress (none when `label` is empty);
// returns its exit status.
int RunWithProgress(const std::string& role, const std::string& label, const Options& o,
                    const std::string& out, const std::string& stats, std::uint64_t kill_at = 0,
                    std::uint64_t* last_step = nullptr, std::uint64_t* restored = nullptr,
                    std::mt19937_64* rng = nullptr) {
  pmsnap::ChildProcess child = SpawnChild(role, o, out, stats);
  if (!child.started()) return -1000;
  std::unique_ptr<Progress> progress;
  std::string line;
  while (child.ReadLine(&line)) {
    if (line.rfind("restored ", 0) == 0) {
      const std::uint64_t from = std::stoull(line.substr(9));
      if (restored) *restored = from;
      if (!label.empty()) progress = std::make_unique<Progress>(label, o.iterations, from);
      continue;
    }
    if (line.rfind("step ", 0) != 0) continue;
    const std::uint64_t step = std::stoull(line.substr(5));
    if (!progress && !label.empty()) progress = std::make_unique<Progress>(label, o.iterations, 0);
    if (progress) progress->Update(step);
    if (last_step) *last_step = step;
    if (kill_at != 0 && step >= kill_at) {
      // Land mid-iteration: up to ~one iteration after the report.
      std::this_thread::sleep_for(std::chrono::microseconds((*rng)() % 3000));
      child.Kill();
      break;
    }
  }
  if (progress) progress->Done();
  return child.Wait();
}

std::string Bytes(double bytes) {
  char buffer[64];
  if (bytes >= 1e9)
    std::snprintf(buffer, sizeof(buffer), "%.2f GB", bytes / 1e9);
  else
    std::snprintf(buffer, sizeof(buffer), "%.1f MB", bytes / 1e6);
  return buffer;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// "median [min .. max]" of `values` scaled by `scale`, in `format` (a printf
// conversion for one double).
std::string MedianAndSpread(const std::vector<double>& values, double scale, const char* format) {
  auto text = [&](double v) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), format, v * scale);
    return std::string(buffer);
  };
  if (values.empty()) return "-";
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  return text(Median(values)) + "  [" + text(*low) + " .. " + text(*high) + "]";
}

// Per-round figures of the overhead measurement (seconds per iteration).
struct OverheadRounds {
  std::vector<double> plain, checkpointed, blocked, overhead;
  std::vector<double> plain_peak_rss, checkpointed_peak_rss;  // bytes
};

// Runs o.rounds rounds of a plain and a checkpointed child, fresh processes
// and a fresh pool each, the order alternating between rounds so that
// neither side always runs first (cold). Returns the rounds, or an error
// message naming the run that failed.
pmsnap::Result<OverheadRounds> MeasureOverhead(const Options& o, const std::string& work) {
  Options run = o;
  run.iterations = o.round_iterations;
  OverheadRounds rounds;
  for (int round = 1; round <= o.rounds; ++round) {
    double plain = 0, checkpointed = 0, blocked = 0;
    for (int turn = 0; turn < 2; ++turn) {
      const bool plain_turn = (turn == 0) == (round % 2 == 1);
      const std::string tag = "round" + std::to_string(round) + (plain_turn ? "-plain" : "-ckpt");
      run.pool = work + "/" + tag + ".pool";
      const std::string stats_path = work + "/" + tag + ".stats";
      const int rc = RunWithProgress(plain_turn ? "baseline" : "train", "", run,
                                     work + "/" + tag + ".state", stats_path);
      if (rc != 0) {
        return pmsnap::Status(pmsnap::StatusCode::kInternal,
                              "overhead run " + tag + " failed (exit " + std::to_string(rc) + ")");
      }
      const auto stats = ReadStats(stats_path);
      if (plain_turn) {
        plain = Num(stats, "iteration_seconds");
        rounds.plain_peak_rss.push_back(Num(stats, "peak_rss_bytes"));
      } else {
        rounds.checkpointed_peak_rss.push_back(Num(stats, "peak_rss_bytes"));
        checkpointed = Num(stats, "iteration_seconds");
        blocked = Num(stats, "blocked_seconds") / std::max(1.0, Num(stats, "iterations"));
      }
      std::filesystem::remove(run.pool);
      std::filesystem::remove(work + "/" + tag + ".state");
    }
    rounds.plain.push_back(plain);
    rounds.checkpointed.push_back(checkpointed);
    rounds.blocked.push_back(blocked);
    rounds.overhead.push_back(plain > 0 ? checkpointed / plain - 1 : 0);
    std::printf("  round %d/%d  plain %.3f ms/it, checkpointed %.3f ms/it (%+.1f%%), "
                "blocked %.3f ms/it\n",
                round, o.rounds, plain * 1e3, checkpointed * 1e3, rounds.overhead.back() * 1e2,
                blocked * 1e3);
    std::fflush(stdout);
  }
  return rounds;
}

int RunParent(Options o) {
  if (o.seed == 0) {
    o.seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) % 1000000007 + 1;
  }
  std::mt19937_64 rng(o.seed);
  if (o.kill_at == 0)
    o.kill_at = o.iterations / 4 + rng() % std::max<std::uint64_t>(o.iterations / 2, 1);
  if (o.kill_at >= o.iterations) o.kill_at = o.iterations - 1;
  if (o.round_iterations == 0) o.round_iterations = std::max<std::uint64_t>(o.iterations / 4, 4);
  const std::string dir = pmsnap::PoolDirectory();
  if (o.pool.empty()) o.pool = dir + "/pmsnap-demo-" + std::to_string(getpid()) + ".pool";
  if (std::filesystem::exists(o.pool)) {
    std::fprintf(stderr, "pmsnap-demo: %s exists; pass another --pool or remove it\n",
                 o.pool.c_str());
    return 1;
  }
  const std::string work = dir + "/pmsnap-demo-" + std::to_string(getpid());
  std::filesystem::create_directories(work);
  const bool simulated = o.device.rfind("simulated", 0) == 0;

  // Sizes, for the banner (computed, not built: the parent never touches torch).
  const double embedding_params = static_cast<double>(o.tables) * o.rows * o.dim;
  const double state_factor = o.optimizer == "adam" || o.optimizer == "adamw" ? 3 : 2;
  std::printf(
      "pmsnap-demo: DLRM-like model, %d embedding tables x %lld rows x %lld dims "
      "(Zipf %.2f ids), bottom/top MLPs\n",
      o.tables, static_cast<long long>(o.rows), static_cast<long long>(o.dim), o.zipf);
  std::printf("  optimizer %s, %llu iterations of batch %lld, checkpoint %s, device %s%s\n",
              o.optimizer.c_str(), static_cast<unsigned long long>(o.iterations),
              static_cast<long long>(o.batch),
              o.policy == "every1" ? "every iteration" : "continuously", o.device.c_str(),
              simulated ? " (SIMULATED device: modelled bandwidth and memory)" : "");
  std::printf("  ~%s of parameters + optimizer state in the model; pool %s; seed %llu\n",
              Bytes(embedding_params * 4 * state_factor).c_str(), o.pool.c_str(),
              static_cast<unsigned long long>(o.seed));
  // What the demo chose, and why (the recommended configuration unless a
  // flag said otherwise).
  const CpuPlan cpus = PlanCpus(o);
  std::printf("configuration:\n");
  if (o.tables_policy == "differential") {
    std::printf(
        "  embedding tables  differential (Check-N-Run intermittent differential): %s changes\n"
        "                    only the rows a batch looked up, so each checkpoint writes those\n"
        "                    rows and a full table only when the changed rows add up to one\n",
        o.optimizer.c_str());
    if (o.optimizer != "adagrad" && o.optimizer != "sgd") {
      std::printf(
          "                    (note: %s moves every row each step, so every row is written)\n",
          o.optimizer.c_str());
    }
  } else {
    std::printf("  embedding tables  written in full every checkpoint (--table-checkpoints=full)\n");
  }
  std::printf("  conflict strategy %s%s\n", o.strategy.c_str(),
              o.strategy == "adaptive"
                  ? ": picks per unit from the last epoch's profile (wait, copy in the "
                    "device, or split)"
                  : " (--strategy)");
  std::printf("  CPUs              %s\n", cpus.why.c_str());
  std::printf("  checkpoint        %s\n\n",
              o.policy == "every1" ? "every iteration (the strictest: a crash loses at most one)"
                                   : "continuously (as often as the copies allow)");

  const std::string reference = work + "/baseline.state";
  const std::string baseline_stats = work + "/baseline.stats";
  const int phases = o.rounds > 0 ? 4 : 3;
  std::printf("[1/%d] uninterrupted run, plain optimizer, no checkpointing\n", phases);
  if (int rc = RunWithProgress("baseline", "baseline", o, reference, baseline_stats); rc != 0) {
    std::fprintf(stderr, "pmsnap-demo: baseline run failed (%d)\n", rc);
    return 1;
  }

  std::printf("[2/%d] checkpointed run, killed with SIGKILL at iteration %llu\n", phases,
              static_cast<unsigned long long>(o.kill_at));
  std::uint64_t last_step = 0;
  const std::string crash_stats = work + "/crash.stats";
  const int crash_rc = RunWithProgress("train", "training", o, work + "/crash.state", crash_stats,
                                       o.kill_at, &last_step, nullptr, &rng);
  if (crash_rc != -SIGKILL) {
    std::fprintf(stderr, "pmsnap-demo: the training child ended with %d before the kill\n",
                 crash_rc);
    return 1;
  }
  std::printf("  killed (SIGKILL) after it reported iteration %llu\n",
              static_cast<unsigned long long>(last_step));

  std::printf("[3/%d] new process: restore from the pool, train to the end\n", phases);
  const std::string resumed = work + "/resumed.state";
  const std::string stats_path = work + "/resumed.stats";
  std::uint64_t restored = 0;
  if (int rc = RunWithProgress("train", "recovered", o, resumed, stats_path, 0, nullptr, &restored);
      rc != 0) {
    std::fprintf(stderr, "pmsnap-demo: recovery run failed (%d)\n", rc);
    return 1;
  }
  const auto stats = ReadStats(stats_path);
  const auto base = ReadStats(baseline_stats);
  std::printf(
      "  restored iteration %llu (the kill lost %lld iteration(s)); open %.1f ms, "
      "restore %.1f ms\n\n",
      static_cast<unsigned long long>(restored),
      static_cast<long long>(last_step) - static_cast<long long>(restored),
      Num(stats, "open_seconds") * 1e3, Num(stats, "restore_seconds") * 1e3);

  const std::string a = ReadAll(reference);
  const std::string b = ReadAll(resumed);
  const bool exact = !a.empty() && a == b;
  std::printf(
      "bit-exact: %s  (%s of final parameters + optimizer state compared with the "
      "uninterrupted run)\n\n",
      exact ? "YES" : "NO", Bytes(static_cast<double>(a.size())).c_str());

  std::optional<OverheadRounds> rounds;
  if (o.rounds > 0) {
    std::printf(
        "[4/4] overhead: %d rounds of %llu iterations, each a plain and a checkpointed run "
        "(fresh processes and pools, the order alternating)\n",
        o.rounds, static_cast<unsigned long long>(o.round_iterations));
    auto measured = MeasureOverhead(o, work);
    if (!measured.ok()) {
      std::fprintf(stderr, "pmsnap-demo: %s\n", measured.status().message().c_str());
      return 1;
    }
    rounds = std::move(measured).value();
    std::printf("\n");
  }

  const double iterations = std::max(1.0, Num(stats, "iterations"));
  if (rounds) {
    std::printf("overhead (median of %d interleaved rounds of %llu iterations  [min .. max])\n",
                o.rounds, static_cast<unsigned long long>(o.round_iterations));
    std::printf("  iteration time, plain optimizer       %s ms\n",
                MedianAndSpread(rounds->plain, 1e3, "%.3f").c_str());
    std::printf("  iteration time, checkpoint %-10s %s ms\n",
                o.policy == "every1" ? "every it." : "continuous",
                MedianAndSpread(rounds->checkpointed, 1e3, "%.3f").c_str());
    std::printf("  overhead (checkpointed / plain - 1)   %s %%\n",
                MedianAndSpread(rounds->overhead, 1e2, "%+.1f").c_str());
    std::printf("  blocked in hooks per iteration        %s ms\n",
                MedianAndSpread(rounds->blocked, 1e3, "%.3f").c_str());
    std::printf("  peak resident set, plain optimizer    %s MB\n",
                MedianAndSpread(rounds->plain_peak_rss, 1e-6, "%.1f").c_str());
    std::printf("  peak resident set, checkpointed       %s MB\n\n",
                MedianAndSpread(rounds->checkpointed_peak_rss, 1e-6, "%.1f").c_str());
  }
  std::printf("stall profile (recovered run, %s, %s, device %s)\n",
              stats.count("policy") ? stats.at("policy").c_str() : "?",
              stats.count("strategy") ? stats.at("strategy").c_str() : "?",
              stats.count("device") ? stats.at("device").c_str() : "?");
  if (!rounds) {
    // One run each, the baseline first and cold: indicative only.
    const double plain = Num(base, "iteration_seconds");
    const double with = Num(stats, "iteration_seconds");
    std::printf("  iteration time without checkpointing  %8.3f ms  (one cold run: --rounds=0)\n",
                plain * 1e3);
    std::printf("  iteration time with checkpointing     %8.3f ms  (%+.1f%%, recovered run)\n",
                with * 1e3, plain > 0 ? (with / plain - 1) * 100 : 0.0);
  }
  std::printf(
      "  blocked in hooks per iteration        %8.3f ms mean, p50 %.3f, p99 %.3f, "
      "max %.3f ms\n",
      Num(stats, "blocked_seconds") / iterations * 1e3, Num(stats, "blocked_p50") * 1e3,
      Num(stats, "blocked_p99") * 1e3, Num(stats, "blocked_max") * 1e3);
  std::printf("    of which waiting for a unit's snapshot (conflicts: %.0f)  %.3f ms/it\n",
              Num(stats, "conflicts"), Num(stats, "conflict_wait_seconds") / iterations * 1e3);
  std::printf("    of which waiting for the previous epoch at the step boundary  %.3f ms/it\n",
              Num(stats, "boundary_wait_seconds") / iterations * 1e3);
  std::printf(
      "  pmsnap's memory                       pool %s mapped (%s resident; on tmpfs that is "
      "DRAM), staging %s, pinned %s\n",
      Bytes(Num(stats, "pool_mapped_bytes")).c_str(), Bytes(Num(stats, "pool_resident_bytes")).c_str(),
      Bytes(Num(stats, "staging_bytes")).c_str(), Bytes(Num(stats, "registered_bytes")).c_str());
  std::printf("  checkpoints committed                 %8.0f  (%.0f per minute)\n",
              Num(stats, "epochs_committed"), Num(stats, "checkpoints_per_minute"));
  std::printf("  written to the pool                   %s, last epoch %.2f ms capture->commit\n",
              Bytes(Num(stats, "bytes_written")).c_str(), Num(stats, "last_epoch_seconds") * 1e3);
  if (Num(stats, "encoded_bytes_written") > 0) {
    std::printf("    + embedding-table chunks            %s (%.1f KB per checkpoint)\n",
                Bytes(Num(stats, "encoded_bytes_written")).c_str(),
                Num(stats, "encoded_bytes_written") /
                    std::max(1.0, Num(stats, "epochs_committed")) / 1e3);
  }
  if (stats.count("summary")) std::printf("  %s\n", stats.at("summary").c_str());

  std::filesystem::remove_all(work);
  if (!o.keep_pool)
    std::filesystem::remove(o.pool);
  else
    std::printf("\npool kept at %s\n", o.pool.c_str());
  return exact ? 0 : 3;
}

}  // namespace
}  // namespace pmsnap::demo

int main(int argc, char** argv) {
  using namespace pmsnap::demo;  // NOLINT: the program's entry point only
  Options options;
  if (auto exit_code =
          pmsnap::ParseCommandLine(argc, argv, "pmsnap-demo", kUsage,
                                   [&options](const std::string& key, const std::string& value) {
                                     return ParseFlag(key, value, &options);
                                   })) {
    return *exit_code;
  }
  if (options.iterations < 4 || options.tables < 1 || options.rows < 1 || options.dim < 1 ||
      options.batch < 1 || options.bag < 1) {
    std::fprintf(stderr, "pmsnap-demo: sizes must be positive and --iterations at least 4\n");
    return 1;
  }
  try {
    if (options.role == "main") return RunParent(options);
    if (options.role == "baseline" || options.role == "train") return RunChild(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pmsnap-demo: %s\n", error.what());
    return 2;
  }
  std::fprintf(stderr, "pmsnap-demo: unknown role %s\n", options.role.c_str());
  return 1;
}
