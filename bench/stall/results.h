// bench/stall's results: one Row per (workload, device, method) summarizing
// its rounds, one RestoreRow per restore method; the CSV columns and the
// table are these fields (report.h).
//
// Thread-safety: values.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "stall/counters.h"
#include "stall/trials.h"

namespace pmsnap::bench::stall {

struct Row {
  std::string workload, device, method;
  int family = 0;
  std::uint64_t k = 0;  // checkpoint interval (measured: iterations per commit)
  double median_ms = 0, p99_ms = 0, mean_ms = 0, overhead_pct = 0;
  double overhead_min_pct = 0, overhead_max_pct = 0;  // spread over rounds
  // 95% bootstrap interval of the median overhead (resampled rounds).
  double overhead_ci_low_pct = 0, overhead_ci_high_pct = 0;
  // Training-thread CPU cycles per iteration over `none`'s, paired by round
  // like overhead_pct, and instructions per cycle (medians; NaN: no counters).
  double cycles_overhead_pct = std::nan(""), ipc = std::nan("");
  // Mean optimizer step (hooks included) per iteration, and the extra time
  // per iteration over `none` split into step and zero_grad + forward +
  // backward (paired by round, medians).
  double step_ms = 0, extra_step_ms = 0, extra_forward_backward_ms = 0;
  // Cold start: the warm-up iterations' mean (median over rounds) and its
  // overhead over `none`'s warm-up, paired by round; page faults per
  // iteration of the whole process and of the training thread (NaN: none).
  double cold_ms = 0, cold_overhead_pct = std::nan("");
  double cold_faults_per_iter = std::nan(""), faults_per_iter = std::nan("");
  double training_faults_per_iter = std::nan("");
  Stall stall_per_iter;  // seconds per measured iteration, medians of rounds
  double stall_per_checkpoint_ms = 0;
  double commits_per_min = 0, iterations_per_commit = 0;
  double bytes_per_iter = 0;
  // Peak resident set of the process while the method ran (median over
  // rounds) and its excess over `none`'s in the same rounds; NaN: unknown.
  double peak_rss_mb = std::nan(""), extra_peak_rss_mb = std::nan("");
  std::uint64_t conflicts = 0;
  double cost_per_checkpoint_s = 0;  // extra wall time per commit vs none
  std::uint64_t k35 = 0;             // longest-frequency estimate: every k35 iterations
  int rounds_ok = 0;
  std::string note, error;
};

struct RestoreRow {
  std::string workload, device, method;
  double open_ms = 0, restore_ms = 0, total_ms = 0;
  std::uint64_t bytes = 0;
  // torch::load's time over this method's in the same round: median, range.
  double speedup = 0, speedup_min = 0, speedup_max = 0;
};

struct Results {
  std::vector<Row> rows;
  std::vector<RestoreRow> restores;
  std::vector<std::string> trial_lines;
};

// The row of method `m` on (workload, device) from its trials, each paired
// by round with `none`'s trial of that round (`none` itself included).
// `earlier_rows` must hold this cell's `none` row when `m` is not `none`:
// its mean iteration is the base of the k<3.5% estimate.
Row SummarizeTrials(const std::string& workload, const std::string& device, const MethodSpec& m,
                    const std::vector<Trial>& method_trials, const std::vector<Trial>& none,
                    const std::vector<Row>& earlier_rows);

}  // namespace pmsnap::bench::stall
