// bench/pool_write: bandwidth of writing and committing an epoch through the
// pool (non-temporal copy + per-part checksum + drain + commit record), with
// 1 and 2 threads, against plain pmem_memcpy_persist of the same bytes into a
// file on the same file system, in the same run.
//
//   pmsnap_bench_pool_write [--mib N] [--part-kib K] [--reps R] [--dir D] [--out CSV]
//
// Target (issue [foundation]): pool >= 90% of the plain bandwidth.
//
// --cold: the first epochs into a freshly created pool, whose mapping has no
// page-table entries yet, and the first ones after closing and reopening it
// (a restart), against the pool's later epochs, with the background
// prefault of the mapping (PoolOptions::prefault_mapping) off and with each
// method, interleaved in one run (CSV: bench/results/pool_cold.csv). Counts
// the writing threads' page faults (getrusage RUSAGE_THREAD). --gap-ms:
// time between the open and the first epoch (a first training step).
//
//   pmsnap_bench_pool_write --cold [--mib N] [--reps R] [--epochs E] [--threads T]
//                           [--gap-ms G] [--dir D] [--out CSV]
#include <libpmem.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/pool_directory.h"
#include "pmsnap/pmem_layout/pool.h"

namespace {

using Clock = std::chrono::steady_clock;
using pmsnap::layout::Manifest;
using pmsnap::layout::Pool;

struct Args {
  std::uint64_t mib = 1024;
  std::uint64_t part_kib = 4096;
  int reps = 3;
  std::string dir;
  std::string out;
  bool cold = false;
  int epochs = 6;
  int threads = 2;
  int gap_ms = 0;
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  args.dir = pmsnap::PoolDirectory();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "missing value for " << a << "\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--mib")
      args.mib = std::stoull(next());
    else if (a == "--part-kib")
      args.part_kib = std::stoull(next());
    else if (a == "--reps")
      args.reps = std::stoi(next());
    else if (a == "--dir")
      args.dir = next();
    else if (a == "--out")
      args.out = next();
    else if (a == "--cold")
      args.cold = true;
    else if (a == "--epochs")
      args.epochs = std::max(3, std::stoi(next()));
    else if (a == "--threads")
      args.threads = std::max(1, std::stoi(next()));
    else if (a == "--gap-ms")
      args.gap_ms = std::stoi(next());
    else {
      std::cerr << "usage: pmsnap_bench_pool_write [--mib N] [--part-kib K] [--reps R] [--dir D] "
                   "[--out CSV]\n"
                   "       pmsnap_bench_pool_write --cold [--mib N] [--reps R] [--epochs E] "
                   "[--threads T] [--gap-ms G] [--dir D] [--out CSV]\n";
      std::exit(2);
    }
  }
  if (args.out.empty()) {
    args.out =
        std::string(PMSNAP_BENCH_RESULTS_DIR) + (args.cold ? "/pool_cold.csv" : "/pool_write.csv");
  }
  return args;
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Runs `work(thread_index)` on `threads` threads and returns the wall time.
template <typename Work>
double TimeParallel(int threads, Work&& work) {
  const auto start = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& t : pool) t.join();
  return Seconds(start, Clock::now());
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::uint64_t ThreadMinorFaults() {
  rusage usage{};
  ::getrusage(RUSAGE_THREAD, &usage);
  return static_cast<std::uint64_t>(usage.ru_minflt);
}

std::string FirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line.empty() ? "(unreadable)" : line;
}

// Bytes of this process's shmem mapped by huge pages (PMD), from smaps_rollup.
std::uint64_t ShmemPmdMappedBytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("ShmemPmdMapped:", 0) == 0) {
      std::istringstream fields(line.substr(15));
      std::uint64_t kib = 0;
      fields >> kib;
      return kib << 10;
    }
  }
  return 0;
}

struct ColdVariant {
  const char* name;
  bool prefault;
  pmsnap::PrefaultMethod method;
};

// One pool's epochs, from its open (Create or Open) on.
struct ColdPhase {
  std::vector<double> epoch_seconds;
  std::vector<std::uint64_t> epoch_faults;  // writing threads' minor faults, summed
  pmsnap::PrefaultProgress prefault;        // right after the last epoch
  double prefault_settled_seconds = 0;      // from the open until it settled
};

struct ColdTrial {
  double create_seconds = 0;
  ColdPhase fresh;     // epochs 1..E into a new pool
  ColdPhase reopened;  // epochs E+1..E+3 after closing and opening it again (a restart)
  std::uint64_t shmem_pmd_mapped = 0;
};

// First epochs into fresh pools (see the file comment).
int RunCold(const Args& args, const Manifest& manifest, const std::vector<std::byte>& source,
            std::uint64_t unit_bytes) {
  const std::uint64_t bytes = source.size();
  const std::vector<ColdVariant> variants = {
      {"off", false, pmsnap::PrefaultMethod::kAuto},
      {"auto (default)", true, pmsnap::PrefaultMethod::kAuto},
      {"touch", true, pmsnap::PrefaultMethod::kTouch},
      {"populate-write", true, pmsnap::PrefaultMethod::kPopulateWrite},
  };
  constexpr int kReopenedEpochs = 3;
  const std::string pool_path = args.dir + "/pmsnap-bench-pool-cold.pool";
  std::vector<std::vector<ColdTrial>> trials(variants.size());

  // Writes `epochs` epochs of every part from args.threads threads.
  auto write_epochs = [&](Pool& pool, int epochs, Clock::time_point opened, ColdPhase* phase) {
    const auto& parts = pool.layout().parts;
    for (int e = 0; e < epochs; ++e) {
      if (!pool.BeginEpoch(static_cast<std::uint64_t>(e)).ok()) std::abort();
      std::atomic<std::uint64_t> faults{0};
      double seconds = TimeParallel(args.threads, [&](int t) {
        const std::uint64_t before = ThreadMinorFaults();
        for (std::size_t p = static_cast<std::size_t>(t); p < parts.size(); p += args.threads) {
          const auto& part = parts[p];
          const std::byte* src = source.data() + part.unit * unit_bytes + part.offset_in_tensor;
          if (!pool.WritePart(static_cast<std::uint32_t>(p), src).ok()) std::abort();
        }
        faults += ThreadMinorFaults() - before;
      });
      const std::uint64_t before_commit = ThreadMinorFaults();
      const auto commit_start = Clock::now();
      if (!pool.Commit().ok()) std::abort();
      seconds += Seconds(commit_start, Clock::now());
      phase->epoch_seconds.push_back(seconds);
      phase->epoch_faults.push_back(faults + ThreadMinorFaults() - before_commit);
    }
    phase->prefault = pool.prefault_progress();
    pool.WaitForPrefault(std::chrono::minutes(10));
    phase->prefault_settled_seconds = Seconds(opened, Clock::now());
    if (phase->prefault.state != pmsnap::PrefaultProgress::State::kRunning) {
      phase->prefault_settled_seconds = pool.prefault_progress().seconds;
    }
  };

  auto run_trial = [&](const ColdVariant& variant) {
    std::filesystem::remove(pool_path);
    pmsnap::layout::PoolOptions options;
    options.part_bytes = args.part_kib << 10;
    options.prefault_mapping = variant.prefault;
    options.prefault_method = variant.method;
    ColdTrial trial;
    auto opened = Clock::now();
    auto pool = Pool::Create(pool_path, manifest, options);
    if (!pool.ok()) {
      std::cerr << pool.status().ToString() << "\n";
      std::exit(1);
    }
    trial.create_seconds = Seconds(opened, Clock::now());
    opened = Clock::now();  // the prefault starts as Create returns
    if (args.gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(args.gap_ms));
    write_epochs(**pool, args.epochs, opened, &trial.fresh);
    trial.shmem_pmd_mapped = ShmemPmdMappedBytes();
    pool->reset();

    pmsnap::layout::OpenOptions open_options;
    open_options.verify_data = false;  // only the writes' page faults, not a verification's
    open_options.prefault_mapping = variant.prefault;
    open_options.prefault_method = variant.method;
    auto reopened = Pool::Open(pool_path, manifest, open_options);
    opened = Clock::now();
    if (!reopened.ok()) {
      std::cerr << reopened.status().ToString() << "\n";
      std::exit(1);
    }
    if (args.gap_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(args.gap_ms));
    write_epochs(**reopened, kReopenedEpochs, opened, &trial.reopened);
    reopened->reset();
    std::filesystem::remove(pool_path);
    return trial;
  };

  std::printf(
      "pool_write --cold: %.0f MiB per slot, parts of %llu KiB, %d writing threads, "
      "%d ms from open to the first epoch, %s\n",
      bytes / 1048576.0, static_cast<unsigned long long>(args.part_kib), args.threads, args.gap_ms,
      args.dir.c_str());
  std::printf("shmem huge pages (transparent_hugepage/shmem_enabled): %s\n",
              FirstLine("/sys/kernel/mm/transparent_hugepage/shmem_enabled").c_str());
  for (int r = 0; r < args.reps; ++r) {
    // Interleaved, so every variant sees the same machine state.
    for (std::size_t v = 0; v < variants.size(); ++v) trials[v].push_back(run_trial(variants[v]));
  }

  std::ofstream csv(args.out);
  csv << "variant,method,rep,phase,epoch,bytes,seconds,gbps,writer_faults,create_seconds,"
         "prefault_state_after_epochs,prefault_bytes_done_after_epochs,prefault_bytes_total,"
         "prefault_bytes_populated,prefault_settled_seconds,prefault_thread_faults,shmem_pmd_"
         "mapped\n";
  for (std::size_t v = 0; v < variants.size(); ++v) {
    for (std::size_t r = 0; r < trials[v].size(); ++r) {
      const ColdTrial& t = trials[v][r];
      for (const auto& [phase_name, phase] :
           {std::pair<const char*, const ColdPhase*>{"fresh", &t.fresh},
            std::pair<const char*, const ColdPhase*>{"reopened", &t.reopened}}) {
        for (std::size_t e = 0; e < phase->epoch_seconds.size(); ++e) {
          csv << variants[v].name << "," << (variants[v].prefault ? phase->prefault.method : "off")
              << "," << r << "," << phase_name << "," << e + 1 << "," << bytes << ","
              << phase->epoch_seconds[e] << "," << bytes / phase->epoch_seconds[e] / 1e9 << ","
              << phase->epoch_faults[e] << "," << t.create_seconds << ","
              << pmsnap::PrefaultStateName(phase->prefault.state) << ","
              << phase->prefault.bytes_done << "," << phase->prefault.bytes_total << ","
              << phase->prefault.bytes_populated << "," << phase->prefault_settled_seconds << ","
              << phase->prefault.thread_page_faults << "," << t.shmem_pmd_mapped << "\n";
        }
      }
    }
  }

  auto gbps = [&](double seconds) { return bytes / seconds / 1e9; };
  std::printf("%-20s %8s %8s %8s %6s %6s %9s %9s %8s | %8s %8s %6s %6s %9s %8s\n", "prefault",
              "e1 GB/s", "e2 GB/s", "steady", "e1/st", "e2/st", "e1 faults", "e2 faults", "pf s",
              "r1 GB/s", "r2 GB/s", "r1/st", "r2/st", "r1 faults", "pf s");
  for (std::size_t v = 0; v < variants.size(); ++v) {
    std::vector<double> e1, e2, steady, f1, f2, pf, r1, r2, fr1, pfr;
    for (const ColdTrial& t : trials[v]) {
      e1.push_back(gbps(t.fresh.epoch_seconds[0]));
      e2.push_back(gbps(t.fresh.epoch_seconds[1]));
      steady.push_back(
          gbps(Median({t.fresh.epoch_seconds.begin() + 2, t.fresh.epoch_seconds.end()})));
      f1.push_back(static_cast<double>(t.fresh.epoch_faults[0]));
      f2.push_back(static_cast<double>(t.fresh.epoch_faults[1]));
      pf.push_back(variants[v].prefault ? t.fresh.prefault_settled_seconds : 0);
      r1.push_back(gbps(t.reopened.epoch_seconds[0]));
      r2.push_back(gbps(t.reopened.epoch_seconds[1]));
      fr1.push_back(static_cast<double>(t.reopened.epoch_faults[0]));
      pfr.push_back(variants[v].prefault ? t.reopened.prefault_settled_seconds : 0);
    }
    const double st = Median(steady);
    std::printf(
        "%-20s %8.2f %8.2f %8.2f %5.0f%% %5.0f%% %9.0f %9.0f %8.3f | %8.2f %8.2f %5.0f%% "
        "%5.0f%% %9.0f %8.3f\n",
        variants[v].name, Median(e1), Median(e2), st, 100 * Median(e1) / st, 100 * Median(e2) / st,
        Median(f1), Median(f2), Median(pf), Median(r1), Median(r2), 100 * Median(r1) / st,
        100 * Median(r2) / st, Median(fr1), Median(pfr));
  }
  std::vector<double> create;
  for (const auto& variant_trials : trials) {
    for (const ColdTrial& t : variant_trials) create.push_back(t.create_seconds);
  }
  std::printf(
      "(medians of %d fresh pools each; e1, e2: the fresh pool's first two epochs (one per "
      "slot); steady: median of its epochs 3..%d; r1, r2: the first two after closing "
      "and reopening it; faults: the writing threads'; pf s: from open until the prefault "
      "settled; Pool::Create took %.2f s, median)\n",
      args.reps, args.epochs, Median(create));
  std::printf("csv: %s\n", args.out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  // The PM code path on emulated PM (README, "Where pools live"); a real DAX
  // mount needs nothing.
  setenv("PMEM_IS_PMEM_FORCE", "1", 0);

  constexpr std::uint64_t kUnitBytes = 16ull << 20;
  const std::uint64_t total = args.mib << 20;
  const std::uint64_t units = std::max<std::uint64_t>(1, total / kUnitBytes);
  Manifest manifest;
  for (std::uint64_t u = 0; u < units; ++u) {
    manifest.units.push_back(
        {"unit" + std::to_string(u),
         {{"param", pmsnap::layout::DType::kFloat32, {static_cast<std::int64_t>(kUnitBytes / 4)}}},
         0});
  }
  const std::uint64_t bytes = units * kUnitBytes;
  std::vector<std::byte> source(bytes);
  for (std::uint64_t i = 0; i < bytes; i += 8) {
    const std::uint64_t v = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(source.data() + i, &v, 8);
  }

  if (args.cold) return RunCold(args, manifest, source, kUnitBytes);

  const std::string pool_path = args.dir + "/pmsnap-bench-pool-write.pool";
  const std::string plain_path = args.dir + "/pmsnap-bench-plain.bin";
  std::filesystem::remove(pool_path);
  std::filesystem::remove(plain_path);
  pmsnap::layout::PoolOptions options;
  options.part_bytes = args.part_kib << 10;
  auto pool = Pool::Create(pool_path, manifest, options);
  if (!pool.ok()) {
    std::cerr << pool.status().ToString() << "\n";
    return 1;
  }
  std::size_t mapped = 0;
  int is_pmem = 0;
  void* plain = pmem_map_file(plain_path.c_str(), bytes, PMEM_FILE_CREATE, 0644, &mapped, &is_pmem);
  if (plain == nullptr) {
    std::cerr << "cannot map " << plain_path << ": " << pmem_errormsg() << "\n";
    return 1;
  }

  const auto& parts = (*pool)->layout().parts;
  const auto& layout = (*pool)->layout();
  auto write_epoch = [&](int threads) {
    if (!(*pool)->BeginEpoch(1).ok()) std::abort();
    const double seconds = TimeParallel(threads, [&](int t) {
      for (std::size_t p = static_cast<std::size_t>(t); p < parts.size(); p += threads) {
        const auto& part = parts[p];
        const std::byte* src = source.data() + part.unit * kUnitBytes + part.offset_in_tensor;
        if (!(*pool)->WritePart(static_cast<std::uint32_t>(p), src).ok()) std::abort();
      }
    });
    const auto commit_start = Clock::now();
    if (!(*pool)->Commit().ok()) std::abort();
    return seconds + Seconds(commit_start, Clock::now());
  };
  auto write_plain = [&](int threads) {
    const std::uint64_t share = bytes / threads;
    return TimeParallel(threads, [&](int t) {
      const std::uint64_t begin = share * t;
      const std::uint64_t end = t == threads - 1 ? bytes : begin + share;
      // Same granularity as the pool's parts, so both drain equally often.
      for (std::uint64_t off = begin; off < end; off += options.part_bytes) {
        const std::uint64_t n = std::min<std::uint64_t>(options.part_bytes, end - off);
        pmem_memcpy_persist(static_cast<char*>(plain) + off, source.data() + off, n);
      }
    });
  };

  // Warm up: touch both slots and the plain file once (page faults on tmpfs).
  write_epoch(2);
  write_epoch(2);
  write_plain(2);

  std::printf(
      "pool_write: %.0f MiB in %llu units, parts of %llu KiB, %s (is_pmem=%d), slot %llu B\n",
      bytes / 1048576.0, static_cast<unsigned long long>(units),
      static_cast<unsigned long long>(args.part_kib), args.dir.c_str(), is_pmem,
      static_cast<unsigned long long>(layout.slot_bytes));
  // A throttled pool (PMSNAP_PM_WRITE_GBPS, PmBandwidth) is simulated PM:
  // its rate is the model's, the plain file's the machine's.
  const std::string pm = (*pool)->pm_bandwidth().Label();
  if (!pm.empty()) std::printf("pool: %s; plain file: this machine\n", pm.c_str());
  std::printf("%-8s %14s %14s %8s\n", "threads", pm.empty() ? "pool GB/s" : "pool GB/s (sim)",
              "plain GB/s", "ratio");
  std::ofstream csv(args.out);
  csv << "threads,bytes,pool_seconds,plain_seconds,pool_gbps,plain_gbps,ratio,pm\n";
  for (int threads : {1, 2}) {
    std::vector<double> pool_s, plain_s;
    // Interleave so both see the same machine state.
    for (int r = 0; r < args.reps; ++r) {
      pool_s.push_back(write_epoch(threads));
      plain_s.push_back(write_plain(threads));
    }
    const double p = Median(pool_s), q = Median(plain_s);
    const double pool_gbps = bytes / p / 1e9, plain_gbps = bytes / q / 1e9;
    std::printf("%-8d %14.2f %14.2f %7.1f%%\n", threads, pool_gbps, plain_gbps,
                100.0 * pool_gbps / plain_gbps);
    csv << threads << "," << bytes << "," << p << "," << q << "," << pool_gbps << "," << plain_gbps
        << "," << pool_gbps / plain_gbps << "," << (pm.empty() ? "machine" : pm) << "\n";
  }
  std::printf("csv: %s\n", args.out.c_str());
  pmem_unmap(plain, mapped);
  pool->reset();
  std::filesystem::remove(pool_path);
  std::filesystem::remove(plain_path);
  return 0;
}
