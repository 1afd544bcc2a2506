#include "stall/results.h"

#include <algorithm>
#include <tuple>

#include "stall/options.h"
#include "stall/statistics.h"

namespace pmsnap::bench::stall {

Row SummarizeTrials(const std::string& workload, const std::string& device, const MethodSpec& m,
                    const std::vector<Trial>& method_trials, const std::vector<Trial>& none,
                    const std::vector<Row>& earlier_rows) {
  Row row;
  row.workload = workload;
  row.device = device;
  row.method = m.name;
  row.family = m.family;
  std::vector<double> all, means, overheads, conflict, boundary, copy, save, hook, cpm, bytes,
      per_ckpt, cost, ipc, cycle_overheads, instructions_per_cycle, steps, extra_steps,
      extra_forward_backwards, colds, cold_overheads, cold_faults, faults, training_faults,
      peak_rss, extra_peak_rss;
  for (std::size_t r = 0; r < method_trials.size(); ++r) {
    const Trial& t = method_trials[r];
    if (!t.ok) {
      row.error = t.error;
      continue;
    }
    ++row.rounds_ok;
    all.insert(all.end(), t.iteration_seconds.begin(), t.iteration_seconds.end());
    const double mean = Mean(t.iteration_seconds);
    means.push_back(mean);
    double base = 0;
    if (r < none.size() && none[r].ok) base = Mean(none[r].iteration_seconds);
    if (base > 0) overheads.push_back((mean / base - 1) * 100);
    const double step = Mean(t.step_seconds);
    steps.push_back(step);
    if (base > 0) {
      const double base_step = Mean(none[r].step_seconds);
      extra_steps.push_back(step - base_step);
      extra_forward_backwards.push_back((mean - step) - (base - base_step));
    }
    if (!t.cold_iteration_seconds.empty()) {
      const double cold = Mean(t.cold_iteration_seconds);
      colds.push_back(cold);
      if (r < none.size() && none[r].ok && !none[r].cold_iteration_seconds.empty())
        cold_overheads.push_back((cold / Mean(none[r].cold_iteration_seconds) - 1) * 100);
    }
    if (t.peak_rss_bytes >= 0) {
      peak_rss.push_back(t.peak_rss_bytes / 1e6);
      if (r < none.size() && none[r].ok && none[r].peak_rss_bytes >= 0)
        extra_peak_rss.push_back((t.peak_rss_bytes - none[r].peak_rss_bytes) / 1e6);
    }
    if (t.cold_process_faults >= 0) cold_faults.push_back(t.cold_process_faults);
    if (t.process_faults >= 0) faults.push_back(t.process_faults);
    if (t.per_iteration[4] >= 0) training_faults.push_back(t.per_iteration[4]);
    const double cycles = t.per_iteration[0], instructions = t.per_iteration[1];
    if (cycles > 0 && instructions >= 0) instructions_per_cycle.push_back(instructions / cycles);
    if (cycles > 0 && r < none.size() && none[r].ok && none[r].per_iteration[0] > 0)
      cycle_overheads.push_back((cycles / none[r].per_iteration[0] - 1) * 100);
    const double n = static_cast<double>(t.iteration_seconds.size());
    conflict.push_back(t.counters.stall.conflict / n);
    boundary.push_back(t.counters.stall.boundary / n);
    copy.push_back(t.counters.stall.copy / n);
    save.push_back(t.counters.stall.save / n);
    hook.push_back(t.counters.stall.hook / n);
    cpm.push_back(t.wall > 0 ? static_cast<double>(t.counters.commits) * 60 / t.wall : 0);
    bytes.push_back(static_cast<double>(t.counters.bytes) / n);
    row.conflicts += t.counters.conflicts;
    if (t.counters.commits > 0) {
      per_ckpt.push_back(t.counters.stall.total() / static_cast<double>(t.counters.commits));
      ipc.push_back(n / static_cast<double>(t.counters.commits));
      if (base > 0) cost.push_back((mean - base) * n / static_cast<double>(t.counters.commits));
    }
    row.note = t.note;
  }
  row.median_ms = Median(all) * 1e3;
  row.p99_ms = Quantile(all, 0.99) * 1e3;
  row.mean_ms = Median(means) * 1e3;
  row.overhead_pct = Median(overheads);
  std::tie(row.overhead_ci_low_pct, row.overhead_ci_high_pct) = MedianInterval95(overheads);
  if (!cycle_overheads.empty()) row.cycles_overhead_pct = Median(cycle_overheads);
  if (!instructions_per_cycle.empty()) row.ipc = Median(instructions_per_cycle);
  row.step_ms = Median(steps) * 1e3;
  row.extra_step_ms = Median(extra_steps) * 1e3;
  row.extra_forward_backward_ms = Median(extra_forward_backwards) * 1e3;
  row.cold_ms = Median(colds) * 1e3;
  if (!cold_overheads.empty()) row.cold_overhead_pct = Median(cold_overheads);
  if (!cold_faults.empty()) row.cold_faults_per_iter = Median(cold_faults);
  if (!faults.empty()) row.faults_per_iter = Median(faults);
  if (!training_faults.empty()) row.training_faults_per_iter = Median(training_faults);
  if (!peak_rss.empty()) row.peak_rss_mb = Median(peak_rss);
  if (!extra_peak_rss.empty()) row.extra_peak_rss_mb = Median(extra_peak_rss);
  if (!overheads.empty()) {
    row.overhead_min_pct = *std::min_element(overheads.begin(), overheads.end());
    row.overhead_max_pct = *std::max_element(overheads.begin(), overheads.end());
  }
  row.stall_per_iter = {Median(conflict), Median(boundary), Median(copy), Median(save),
                        Median(hook)};
  row.stall_per_checkpoint_ms = Median(per_ckpt) * 1e3;
  row.commits_per_min = Median(cpm);
  row.iterations_per_commit = Median(ipc);
  row.bytes_per_iter = Median(bytes);
  row.cost_per_checkpoint_s = Median(cost);
  // Longest-frequency estimate under 3.5%: every k iterations, from the
  // measured wall-time cost of one checkpoint over `none`'s iteration.
  double base_iter = 0;
  for (const auto& r : earlier_rows)
    if (r.workload == workload && r.device == device && r.method == "none")
      base_iter = r.mean_ms / 1e3;
  if (m.family > 1 && base_iter > 0 && !cost.empty()) {
    const double c35 = std::max(0.0, row.cost_per_checkpoint_s);
    row.k35 = std::max<std::uint64_t>(
        1, static_cast<std::uint64_t>(std::ceil(c35 / (kOverheadBudget * base_iter) - 1e-9)));
    // A pipelined method cannot checkpoint more often than it commits.
    row.k35 = std::max<std::uint64_t>(
        row.k35, static_cast<std::uint64_t>(std::ceil(row.iterations_per_commit - 1e-9)));
  }
  return row;
}

}  // namespace pmsnap::bench::stall
