#include "stall/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "stall/trials.h"

namespace pmsnap::bench::stall {

void WriteCsv(const Options& o, const std::vector<Row>& rows,
              const std::vector<RestoreRow>& restores,
              const std::vector<std::string>& trial_lines) {
  std::filesystem::create_directories(o.out);
  std::ofstream csv(o.out + "/" + o.tag + ".csv");
  csv << "workload,device,method,family,median_ms,p99_ms,mean_ms,overhead_pct,"
         "stall_ms_per_iter,conflict_ms,boundary_ms,copy_ms,save_ms,hook_ms,"
         "stall_ms_per_checkpoint,commits_per_min,iterations_per_commit,mb_written_per_iter,"
         "conflicts,cost_per_checkpoint_ms,k_under_3.5pct,rounds,note,overhead_min_pct,"
         "overhead_max_pct,overhead_ci95_low_pct,overhead_ci95_high_pct,cycles_overhead_pct,"
         "training_ipc,step_ms,extra_step_ms,extra_forward_backward_ms,cold_ms,cold_overhead_pct,"
         "cold_faults_per_iter,faults_per_iter,training_faults_per_iter,pm,peak_rss_mb,"
         "extra_peak_rss_mb\n";
  for (const auto& r : rows) {
    const double n = 1e3;
    csv << r.workload << "," << r.device << "," << r.method << "," << r.family << "," << r.median_ms
        << "," << r.p99_ms << "," << r.mean_ms << "," << r.overhead_pct << ","
        << r.stall_per_iter.total() * n << "," << r.stall_per_iter.conflict * n << ","
        << r.stall_per_iter.boundary * n << "," << r.stall_per_iter.copy * n << ","
        << r.stall_per_iter.save * n << "," << r.stall_per_iter.hook * n << ","
        << r.stall_per_checkpoint_ms << "," << r.commits_per_min << "," << r.iterations_per_commit
        << "," << r.bytes_per_iter / 1e6 << "," << r.conflicts << ","
        << r.cost_per_checkpoint_s * 1e3 << "," << r.k35 << "," << r.rounds_ok << ",\""
        << (r.error.empty() ? r.note : "ERROR " + r.error) << "\"," << r.overhead_min_pct << ","
        << r.overhead_max_pct << "," << r.overhead_ci_low_pct << "," << r.overhead_ci_high_pct
        << "," << r.cycles_overhead_pct << "," << r.ipc << "," << r.step_ms << ","
        << r.extra_step_ms << "," << r.extra_forward_backward_ms << "," << r.cold_ms << ","
        << r.cold_overhead_pct << "," << r.cold_faults_per_iter << "," << r.faults_per_iter << ","
        << r.training_faults_per_iter << ",\"" << (o.pm_label.empty() ? "machine" : o.pm_label)
        << "\"," << r.peak_rss_mb << "," << r.extra_peak_rss_mb << "\n";
  }
  std::ofstream rcsv(o.out + "/" + o.tag + "_restore.csv");
  rcsv << "workload,device,method,open_ms,restore_ms,total_ms,bytes,speedup_vs_torch_load,"
          "speedup_min,speedup_max,pm\n";
  for (const auto& r : restores)
    rcsv << r.workload << "," << r.device << "," << r.method << "," << r.open_ms << ","
         << r.restore_ms << "," << r.total_ms << "," << r.bytes << "," << r.speedup << ","
         << r.speedup_min << "," << r.speedup_max << ",\""
         << (o.pm_label.empty() ? "machine" : o.pm_label) << "\"\n";
  std::ofstream tcsv(o.out + "/" + o.tag + "_trials.csv");
  tcsv << "workload,device,method,round,iteration,seconds,step_seconds\n";
  for (const auto& line : trial_lines) tcsv << line << "\n";
}

void PrintTable(const Results& res) {
  std::printf("\n%-11s %-9s %-22s %8s %8s %8s %8s | %8s %7s %7s %7s %7s %7s | %7s %6s %7s %6s\n",
              "workload", "device", "method", "med ms", "p99 ms", "mean ms", "ovh %", "stall/it",
              "confl", "bound", "copy", "save", "hook", "ckpt/min", "it/ckpt", "MB/it", "k<3.5%");
  for (const auto& r : res.rows) {
    if (r.rounds_ok == 0) {
      std::printf("%-11s %-9s %-22s FAILED: %s\n", r.workload.c_str(), r.device.c_str(),
                  r.method.c_str(), r.error.c_str());
      continue;
    }
    const double n = 1e3;
    std::printf(
        "%-11s %-9s %-22s %8.1f %8.1f %8.1f %+8.1f | %8.2f %7.2f %7.2f %7.2f %7.2f %7.2f | %8.1f "
        "%6.1f %7.1f %6s\n",
        r.workload.c_str(), r.device.c_str(), r.method.c_str(), r.median_ms, r.p99_ms, r.mean_ms,
        r.overhead_pct, r.stall_per_iter.total() * n, r.stall_per_iter.conflict * n,
        r.stall_per_iter.boundary * n, r.stall_per_iter.copy * n, r.stall_per_iter.save * n,
        r.stall_per_iter.hook * n, r.commits_per_min, r.iterations_per_commit,
        r.bytes_per_iter / 1e6, r.k35 ? std::to_string(r.k35).c_str() : "-");
  }
  std::printf(
      "(stall columns: ms per measured iteration on the training thread; k<3.5%%: "
      "estimated longest-frequency interval keeping overhead under 3.5%%)\n");
  std::printf("\n%-11s %-9s %-22s %9s %9s | %12s %12s %12s | %9s %9s\n", "workload", "device",
              "method", "cold ms", "cold ovh%", "cold flt/it", "flt/it", "train flt/it",
              "peak MB", "+MB");
  for (const auto& r : res.rows) {
    if (r.rounds_ok == 0) continue;
    std::printf("%-11s %-9s %-22s %9.1f %+9.1f | %12.0f %12.0f %12.0f | %9.1f %+9.1f\n",
                r.workload.c_str(), r.device.c_str(), r.method.c_str(), r.cold_ms,
                r.cold_overhead_pct, r.cold_faults_per_iter, r.faults_per_iter,
                r.training_faults_per_iter, r.peak_rss_mb, r.extra_peak_rss_mb);
  }
  std::printf(
      "(cold: the --warmup iterations right after a method was set up, i.e. a fresh pool, "
      "file or buffer, against none's; flt/it: page faults per iteration, whole process "
      "and training thread; peak MB: the process's peak resident set while the method ran, "
      "+MB: its excess over none's, a pool on tmpfs included as it is mapped)\n");
  std::printf("\n%-11s %-9s %-36s %9s %9s %9s %9s\n", "workload", "device", "restore", "open ms",
              "copy ms", "total ms", "MB");
  for (const auto& r : res.restores)
    std::printf("%-11s %-9s %-36s %9.1f %9.1f %9.1f %9.1f\n", r.workload.c_str(), r.device.c_str(),
                r.method.c_str(), r.open_ms, r.restore_ms, r.total_ms,
                static_cast<double>(r.bytes) / 1e6);
}

namespace {

const Row* Find(const Results& res, const std::string& w, const std::string& d,
                const std::string& m) {
  for (const auto& r : res.rows)
    if (r.workload == w && r.device == d && r.method == m && r.rounds_ok > 0) return &r;
  return nullptr;
}

}  // namespace

void PrintTargets(const Results& res) {
  std::printf("\ntargets\n");
  if (const Row* a = Find(res, kTargetWorkload, kTargetDevice, "pmsnap-adaptive-k1")) {
    std::string control;
    if (const Row* h = Find(res, kTargetWorkload, kTargetDevice, "pmsnap-hooks-only")) {
      char text[128];
      std::snprintf(text, sizeof(text), "; hooks-only control %+.1f%%, %+.1f%% to %+.1f%%",
                    h->overhead_pct, h->overhead_min_pct, h->overhead_max_pct);
      control = text;
    }
    char where[160];
    std::snprintf(where, sizeof(where),
                  "; extra per iteration %+.1f ms in the step, %+.1f ms in forward+backward",
                  a->extra_step_ms, a->extra_forward_backward_ms);
    std::string details = where;  // where the time went, then cycles
    if (!std::isnan(a->cycles_overhead_pct)) {
      char text[128];
      std::snprintf(text, sizeof(text), "; training-thread cycles per iteration %+.1f%%",
                    a->cycles_overhead_pct);
      details += text;
    }
    std::printf(
        "  pmsnap adaptive every iteration, MLP, host: overhead %+.1f%% over none, the same "
        "optimizer step without checkpoints, i.e. what checkpointing costs (median of %d rounds, "
        "95%% interval %+.1f%% to %+.1f%%, rounds %+.1f%% to %+.1f%%%s%s) (target <= 3.5%%): %s\n",
        a->overhead_pct, a->rounds_ok, a->overhead_ci_low_pct, a->overhead_ci_high_pct,
        a->overhead_min_pct, a->overhead_max_pct, details.c_str(), control.c_str(),
        a->overhead_pct <= 3.5 ? "MET" : "MISSED");
    if (const Row* l = Find(res, kTargetWorkload, kTargetDevice, "none-libtorch")) {
      // From the two medians against `none`.
      const double versus_libtorch =
          ((1 + a->overhead_pct / 100) / (1 + l->overhead_pct / 100) - 1) * 100;
      std::printf(
          "  the same against none-libtorch, libtorch's own step without checkpoints (what a "
          "libtorch user runs today; %+.1f%% on none): %+.1f%% (target <= 3.5%%): %s\n",
          l->overhead_pct, versus_libtorch, versus_libtorch <= 3.5 ? "MET" : "MISSED");
    }
  }
  for (const auto& r : res.rows) {
    if (r.method != "pmsnap-adaptive-k1") continue;
    const Row* cf = Find(res, r.workload, r.device, "checkfreq-k1");
    if (!cf) continue;
    const double ratio = cf->stall_per_iter.total() / std::max(r.stall_per_iter.total(), 1e-9);
    std::printf(
        "  %s/%s: stall %.2f ms/it vs checkfreq-k1 %.2f ms/it: %.1fx less (target >= 5x): %s\n",
        r.workload.c_str(), r.device.c_str(), r.stall_per_iter.total() * 1e3,
        cf->stall_per_iter.total() * 1e3, ratio, ratio >= 5 ? "MET" : "MISSED");
  }
  for (const auto& p : res.restores) {
    if (p.method != "pmsnap-verify") continue;
    for (const auto& t : res.restores) {
      if (t.workload != p.workload || t.device != p.device || t.method != "torch-load") continue;
      std::printf(
          "  %s/%s: restore %.1f ms (open+verify+copy; copy alone %.1f ms) vs torch::load "
          "%.1f ms: %.1fx faster (paired rounds, median; %.1fx to %.1fx) (target >= 3x): %s\n",
          p.workload.c_str(), p.device.c_str(), p.total_ms, p.restore_ms, t.total_ms, p.speedup,
          p.speedup_min, p.speedup_max, p.speedup >= 3 ? "MET" : "MISSED");
    }
  }
}

}  // namespace pmsnap::bench::stall
