#include "stall/restore.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>

#include "pmsnap/common/child_process.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/optimizer_state.h"
#include "pmsnap/runtime/cuda_device.h"
#include "stall/checkpoint_files.h"
#include "stall/counters.h"
#include "stall/statistics.h"
#include "stall/workloads.h"

namespace pmsnap::bench::stall {

namespace {

constexpr const char* kRestorePmsnapVerified = "pmsnap-verify";
constexpr const char* kRestorePmsnapUnverified = "pmsnap-noverify";
constexpr const char* kRestoreTorchLoad = "torch-load";
constexpr const char* kRestoreSampleTag = "restore-sample";

struct RestoreSample {
  double open_s = 0;     // pmsnap: open, verify and register; torch::load: 0
  double restore_s = 0;  // copy into the model and optimizer (and across the link)
  std::uint64_t bytes = 0;
};

// pmsnap: CheckpointedOptimizer::Create on `pool` with a fresh optimizer (the
// stepper allocates the state) + Restore (copy from the mapping).
Result<RestoreSample> TimePmsnapRestore(const Options& o, Workload& w, runtime::Device& device,
                                        const std::string& pool, bool verify) {
  runtime::EngineOptions e;
  e.pool_path = pool;
  e.workers = o.workers;
  e.device = &device;
  e.verify_on_open = verify;
  e.print_summary = false;
  auto fresh = w.make_optimizer();
  const auto t0 = Clock::now();
  PMSNAP_ASSIGN_OR_RETURN(auto opt, hooks::CheckpointedOptimizer::Create(*w.module, *fresh, e));
  RestoreSample sample;
  sample.open_s = Since(t0);
  const auto t1 = Clock::now();
  PMSNAP_RETURN_IF_ERROR(opt->Restore().status());
  sample.restore_s = Since(t1);
  for (const auto& u : opt->stats().units) sample.bytes += u.bytes;
  (void)opt->Close(runtime::CloseMode::kAbandon);
  return sample;
}

// torch::load of `file` into the module and a fresh optimizer; on a device,
// the loaded state then crosses the link into device memory, as pmsnap's
// restore does: into the model's initialized parameters (torch::load gave
// the module new storage; the old one stands for the parameters already on
// the device) and into optimizer state allocated untimed but first touched
// by the copy (a simulated device's memory is host memory: pmsnap's restore
// pays the same page faults for the state its stepper allocates).
Result<RestoreSample> TimeTorchLoad(Workload& w, runtime::Device& device, const std::string& file) {
  try {
    auto fresh = w.make_optimizer();
    std::vector<torch::Tensor> initialized;
    for (const auto& p : w.module->parameters()) initialized.push_back(p.detach());
    const auto t0 = Clock::now();
    LoadFull(*w.module, *fresh, file);
    RestoreSample sample;
    sample.restore_s = Since(t0);
    sample.bytes = FileBytes(file);
    if (device.cpu_addressable()) return sample;
    std::vector<torch::Tensor> loaded, on_device;
    const auto parameters = w.module->parameters();
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      loaded.push_back(parameters[i]);
      on_device.push_back(initialized.at(i));
      for (const auto& t : hooks::ViewOptimizerState(*fresh, parameters[i]).tensors) {
        loaded.push_back(t);
        on_device.push_back(torch::empty_like(t));
      }
    }
    const auto t1 = Clock::now();
    for (std::size_t i = 0; i < loaded.size(); ++i) {
      PMSNAP_RETURN_IF_ERROR(device.CopyFromHost(
          on_device[i].data_ptr(), loaded[i].data_ptr(),
          static_cast<std::size_t>(loaded[i].numel() * loaded[i].element_size())));
    }
    sample.restore_s += Since(t1);
    return sample;
  } catch (const std::exception& e) {
    return Status(StatusCode::kIOError, "torch::load of '" + file + "': " + e.what());
  }
}

}  // namespace

// Builds the workload and times one restore (the --restore-* flags), then
// prints it on stdout as "restore-sample <open s> <restore s> <bytes>".
int RunRestoreChild(const Options& o) {
  std::optional<Workload> w = MakeWorkload(o.workloads.empty() ? "" : o.workloads.front(), o);
  if (!w) return 2;
  auto device = runtime::MakeDevice(o.restore_device, nullptr);
  if (!device.ok()) {
    std::fprintf(stderr, "device %s: %s\n", o.restore_device.c_str(),
                 device.status().ToString().c_str());
    return 2;
  }
  Result<RestoreSample> sample =
      Status(StatusCode::kInvalidArgument, "unknown restore method '" + o.restore_child + "'");
  if (o.restore_child == kRestoreTorchLoad) {
    sample = TimeTorchLoad(*w, **device, o.restore_path);
  } else if (o.restore_child == kRestorePmsnapVerified ||
             o.restore_child == kRestorePmsnapUnverified) {
    sample = TimePmsnapRestore(o, *w, **device, o.restore_path,
                               o.restore_child == kRestorePmsnapVerified);
  }
  if (!sample.ok()) {
    std::fprintf(stderr, "%s\n", sample.status().ToString().c_str());
    return 3;
  }
  std::printf("%s %.9f %.9f %llu\n", kRestoreSampleTag, sample->open_s, sample->restore_s,
              static_cast<unsigned long long>(sample->bytes));
  return 0;
}

namespace {

// Runs RunRestoreChild in a fresh copy of this program, with this run's
// flags (model sizes, workers) and the restore's own.
Result<RestoreSample> RestoreInFreshProcess(const Options& o, const std::string& workload,
                                            const std::string& device_spec,
                                            const std::string& method, const std::string& path) {
  std::vector<std::string> argv = o.command_line;
  std::error_code ec;
  argv.at(0) = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return Status(StatusCode::kIOError, "cannot find this program: " + ec.message());
  argv.push_back("--workloads=" + workload);
  argv.push_back("--restore-child=" + method);
  argv.push_back("--restore-path=" + path);
  argv.push_back("--restore-device=" + device_spec);
  ChildProcess child(argv);
  if (!child.started()) {
    return Status(StatusCode::kIOError, "cannot start '" + argv[0] + "' for a restore");
  }
  std::optional<RestoreSample> sample;
  std::string line;
  while (child.ReadLine(&line)) {
    std::istringstream in(line);
    std::string tag;
    RestoreSample s;
    if (in >> tag >> s.open_s >> s.restore_s >> s.bytes && tag == kRestoreSampleTag) sample = s;
  }
  const int exit_code = child.Wait();
  if (exit_code != 0 || !sample) {
    return Status(StatusCode::kInternal, "restore child for " + workload + "/" + method + " on '" +
                                             path + "' exited with " + std::to_string(exit_code) +
                                             " (stderr above)");
  }
  return *sample;
}

}  // namespace

void MeasureRestores(const Options& o, const std::string& workload, const std::string& device_spec,
                     const std::string& device_label, const std::string& pool,
                     const std::string& file, Results* results) {
  struct RestoreSamples {
    explicit RestoreSamples(std::string name) : method(std::move(name)) {}
    std::string method;
    std::vector<double> open_s, restore_s;
    std::uint64_t bytes = 0;
    bool failed = false;
  };
  RestoreSamples verified(kRestorePmsnapVerified), unverified(kRestorePmsnapUnverified),
      loaded(kRestoreTorchLoad);
  const bool have_pool = std::filesystem::exists(pool);
  const bool have_file = std::filesystem::exists(file);
  auto restore = [&](RestoreSamples& out, const std::string& path) {
    Result<RestoreSample> sample =
        RestoreInFreshProcess(o, workload, device_spec, out.method, path);
    if (!sample.ok()) {
      std::printf("  restore %s: %s\n", out.method.c_str(), sample.status().ToString().c_str());
      out.failed = true;
      return;
    }
    out.open_s.push_back(sample->open_s);
    out.restore_s.push_back(sample->restore_s);
    out.bytes = sample->bytes;
  };
  for (int r = 0; r < o.restore_rounds; ++r) {
    if (have_pool && !verified.failed) restore(verified, pool);
    if (have_file && !loaded.failed) restore(loaded, file);
    if (have_pool && !unverified.failed) restore(unverified, pool);
  }
  for (const RestoreSamples* s : {&verified, &unverified, &loaded}) {
    if (s->restore_s.empty()) continue;
    RestoreRow rr{
        workload, device_label, s->method, Median(s->open_s) * 1e3, Median(s->restore_s) * 1e3,
        0,        s->bytes};
    rr.total_ms = rr.open_ms + rr.restore_ms;
    // Paired by round: both ran back to back, so a slow spell cancels out.
    std::vector<double> speedups;
    for (std::size_t r = 0; r < s->restore_s.size() && r < loaded.restore_s.size(); ++r)
      speedups.push_back(loaded.restore_s[r] / (s->open_s[r] + s->restore_s[r]));
    if (!speedups.empty() && s != &loaded) {
      rr.speedup = Median(speedups);
      rr.speedup_min = *std::min_element(speedups.begin(), speedups.end());
      rr.speedup_max = *std::max_element(speedups.begin(), speedups.end());
    }
    results->restores.push_back(rr);
  }
  for (const auto& r : results->restores)
    if (r.workload == workload && r.device == device_label)
      std::printf("  [%s/%s] restore %-36s %8.1f ms (open %.1f + restore %.1f)\n", workload.c_str(),
                  device_label.c_str(), r.method.c_str(), r.total_ms, r.open_ms, r.restore_ms);
}

}  // namespace pmsnap::bench::stall
