// bench/pool_write: bandwidth of writing and committing an epoch through the
// pool (non-temporal copy + per-part checksum + drain + commit record), with
// 1 and 2 threads, against plain pmem_memcpy_persist of the same bytes into a
// file on the same file system, in the same run.
//
//   pmsnap_bench_pool_write [--mib N] [--part-kib K] [--reps R] [--dir D] [--out CSV]
//
// Target (issue [foundation]): pool >= 90% of the plain bandwidth.
#include <libpmem.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

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
  std::string out = std::string(PMSNAP_BENCH_RESULTS_DIR) + "/pool_write.csv";
};

Args ParseArgs(int argc, char** argv) {
  Args args;
  const char* env_dir = std::getenv("PMSNAP_POOL_DIR");
  args.dir = env_dir != nullptr ? env_dir : "/dev/shm";
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
    else {
      std::cerr << "usage: pmsnap_bench_pool_write [--mib N] [--part-kib K] [--reps R] [--dir D] "
                   "[--out CSV]\n";
      std::exit(2);
    }
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

}  // namespace

int main(int argc, char** argv) {
  const Args args = ParseArgs(argc, argv);
  // The PM code path on emulated PM (DESIGN.md); a real DAX mount needs nothing.
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
  std::printf("%-8s %14s %14s %8s\n", "threads", "pool GB/s", "plain GB/s", "ratio");
  std::ofstream csv(args.out);
  csv << "threads,bytes,pool_seconds,plain_seconds,pool_gbps,plain_gbps,ratio\n";
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
        << "," << pool_gbps / plain_gbps << "\n";
  }
  std::printf("csv: %s\n", args.out.c_str());
  pmem_unmap(plain, mapped);
  pool->reset();
  std::filesystem::remove(pool_path);
  std::filesystem::remove(plain_path);
  return 0;
}
