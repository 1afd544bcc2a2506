#include "stall/trials.h"

#include <algorithm>
#include <filesystem>
#include <memory>

#include "pmsnap/common/memory_usage.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/runtime/interval_policy.h"
#include "stall/methods.h"
#include "stall/workloads.h"

namespace pmsnap::bench::stall {

namespace {

// The control for pmsnap's overhead: the same stepping through the hooks,
// without a checkpoint, so its distance from `none` is hook cost plus noise.
class NeverPolicy final : public runtime::IntervalPolicy {
 public:
  std::string name() const override { return "never"; }
  bool ShouldCheckpoint(std::uint64_t, const runtime::PolicyInputs&) override { return false; }
  bool wait_if_busy() const override { return false; }
};

}  // namespace

bool InTargetCellMethods(const std::string& method) {
  return method == "none" || method == "none-libtorch" || method == "pmsnap-adaptive-k1" ||
         method == "pmsnap-hooks-only";
}

std::vector<MethodSpec> AllMethods(const Options& o) {
  std::vector<MethodSpec> m;
  m.push_back({"none", 1, "", false, 0});
  if (o.block_kib > 0) m.push_back({"none-libtorch", 1, "", false, 0, false, true});
  m.push_back({"torch-save-k" + std::to_string(o.k), 2, "", false, o.k});
  m.push_back({"checkfreq-alg1", 3, "", false, 0});
  m.push_back({"checkfreq-k1", 3, "", false, 1});
  m.push_back({"weight-files-k1", 4, "", false, 1});
  for (const std::string s : {"1", "2", "3", "4", "adaptive"}) {
    m.push_back({"pmsnap-" + s + "-cont", 5, s, true, 1});
    m.push_back({"pmsnap-" + s + "-k1", 5, s, false, 1});
  }
  for (std::uint64_t k : o.sweep)
    if (k > 1) m.push_back({"pmsnap-adaptive-k" + std::to_string(k), 5, "adaptive", false, k});
  m.push_back({"pmsnap-hooks-only", 5, "adaptive", false, 1, true});
  m.push_back({"pmsnap-adaptive-k1-backward", 5, "adaptive", false, 1, false, false, true});
  // Continuous, a busy boundary captured into host memory (two buffers).
  m.push_back({"pmsnap-adaptive-cont-staged", 5, "adaptive", true, 1, false, false, false, 2});
  if (o.methods.empty()) return m;
  std::vector<MethodSpec> picked;
  for (const auto& spec : m)
    if (spec.name == "none" ||
        std::find(o.methods.begin(), o.methods.end(), spec.name) != o.methods.end())
      picked.push_back(spec);
  return picked;
}

std::string PoolPath(const Context& c, const std::string& method) {
  return c.dir + "/" + method + ".pool";
}

namespace {

runtime::EngineOptions PmsnapOptions(const Context& c, const MethodSpec& m) {
  runtime::EngineOptions e;
  e.pool_path = PoolPath(c, m.name);
  e.pool_options.part_bytes = c.o.part_mib << 20;
  e.workers = c.o.workers;
  e.worker_cpus = c.checkpoint_cpus;
  e.copy_start = c.o.copy_start;
  e.device = &c.device;
  if (m.never_checkpoints)
    e.policy = std::make_shared<NeverPolicy>();
  else if (m.continuous)
    e.policy = std::make_shared<runtime::ContinuousPolicy>();
  else
    e.policy = std::make_shared<runtime::EveryKPolicy>(m.k);
  e.strategy = conflict::MakeStrategy(m.strategy);
  e.dram_staging_buffers = m.staging_buffers;
  e.print_summary = false;  // the table reports it
  return e;
}

}  // namespace

Trial RunTrial(Context& c, const MethodSpec& m, bool keep_files) {
  Trial trial;
  std::unique_ptr<Method> method;
  auto fail = [&](const std::string& what) {
    trial.ok = false;
    trial.error = what;
    return trial;
  };
  const std::size_t block_bytes = m.libtorch_step ? 0 : c.o.block_kib << 10;
  const bool peak_reset = ResetPeakRss();
  if (m.family == 1) {
    method = MakeNoCheckpoint(c.w, block_bytes);
  } else if (m.family == 2) {
    method = MakeTorchSave(c.w, c.device, c.dir + "/torch-save.pt", m.k, block_bytes);
  } else if (m.family == 3) {
    method = MakeCheckFreq(c.w, c.device, c.dir + "/" + m.name + ".pt", m.k, block_bytes,
                           c.checkpoint_cpus);
  } else if (m.family == 4) {
    auto wf = MakeWeightFiles(c.w, c.device, c.dir + "/" + m.name, m.k, c.o.workers, block_bytes,
                              c.checkpoint_cpus);
    if (!wf.ok()) return fail(wf.status().ToString());
    method = std::move(wf).value();
  } else {
    std::filesystem::remove(PoolPath(c, m.name));
    auto p = MakePmsnap(c.w, PmsnapOptions(c, m), block_bytes, m.in_backward);
    if (!p.ok()) return fail(p.status().ToString());
    method = std::move(p).value();
  }
  const int total = c.o.warmup + c.iterations;
  Clock::time_point start{};
  ThreadCounters counters;
  std::array<double, ThreadCounters::kCount> at_start{};
  const double faults_at_setup = ProcessPageFaults();
  double faults_at_start = faults_at_setup;
  for (int step = 1; step <= total; ++step) {
    if (step == c.o.warmup + 1) {
      method->Mark();
      at_start = counters.Read();
      faults_at_start = ProcessPageFaults();
      start = Clock::now();
    }
    const auto t = Clock::now();
    c.w.forward_backward(static_cast<std::uint64_t>(step));
    method->AfterBackward();
    const auto stepping = Clock::now();
    Status s = method->Step(static_cast<std::uint64_t>(step));
    if (!s.ok()) {
      (void)method->Finish();
      return fail("step " + std::to_string(step) + ": " + s.ToString());
    }
    if (step > c.o.warmup) {
      trial.iteration_seconds.push_back(Since(t));
      trial.step_seconds.push_back(Since(stepping));
    } else {
      trial.cold_iteration_seconds.push_back(Since(t));
    }
  }
  trial.wall = Since(start);
  const double faults_at_end = ProcessPageFaults();
  if (faults_at_setup >= 0 && faults_at_end >= 0) {
    if (c.o.warmup > 0)
      trial.cold_process_faults = (faults_at_start - faults_at_setup) / c.o.warmup;
    trial.process_faults = (faults_at_end - faults_at_start) / c.iterations;
  }
  const auto at_end = counters.Read();
  for (int i = 0; i < ThreadCounters::kCount; ++i)
    trial.per_iteration[i] =
        at_end[i] < 0 || at_start[i] < 0 ? -1.0 : (at_end[i] - at_start[i]) / c.iterations;
  trial.counters = method->Read();
  Status s = method->Finish();
  if (peak_reset) trial.peak_rss_bytes = static_cast<double>(PeakRssBytes());
  trial.note = method->Note();
  method.reset();
  if (!s.ok()) return fail(s.ToString());
  if (!keep_files) {
    std::filesystem::remove(PoolPath(c, m.name));
    std::filesystem::remove_all(c.dir + "/" + m.name);
    std::filesystem::remove(c.dir + "/" + m.name + ".pt");
  }
  return trial;
}

}  // namespace pmsnap::bench::stall
