// pmsnap-pool-demo (pool round trip): a child process checkpoints a synthetic
// model into a pool epoch after epoch; the parent SIGKILLs it at a random
// moment, reopens the pool, checks the recovered epoch bit-exact against the
// content the child derived from (epoch, unit), and reports.
//
//   pmsnap-pool-demo [--mib N] [--units N] [--pool PATH] [--seconds S]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "pmsnap/common/pool_directory.h"
#include "pmsnap/pmem_layout/pool.h"

namespace {

using Clock = std::chrono::steady_clock;
using pmsnap::layout::Manifest;
using pmsnap::layout::Pool;

// Content of tensor t of unit u at epoch e: a cheap deterministic pattern.
void Fill(std::vector<std::uint64_t>& words, std::uint64_t epoch, std::uint32_t unit) {
  std::uint64_t x = epoch * 0x9E3779B97F4A7C15ull + unit;
  for (auto& w : words) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    w = x;
  }
}

[[noreturn]] void Writer(const std::string& path, int report_fd) {
  pmsnap::layout::SetWarningSink(nullptr);
  auto pool = Pool::Open(path);
  if (!pool.ok()) _exit(3);
  const Manifest& manifest = (*pool)->manifest();
  std::vector<std::vector<std::uint64_t>> buffers;
  for (const auto& unit : manifest.units) buffers.emplace_back(unit.tensors[0].bytes() / 8);
  for (;;) {
    auto epoch = (*pool)->BeginEpoch(0);
    if (!epoch.ok()) _exit(4);
    for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
      Fill(buffers[u], *epoch, u);
      if (!(*pool)->WriteTensor(u, 0, buffers[u].data()).ok()) _exit(5);
    }
    const std::string extra = "epoch " + std::to_string(*epoch);
    if (!(*pool)->Commit({reinterpret_cast<const std::byte*>(extra.data()), extra.size()}).ok()) {
      _exit(6);
    }
    const std::uint64_t e = *epoch;
    if (::write(report_fd, &e, sizeof(e)) != sizeof(e)) _exit(7);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t mib = 256;
  std::uint32_t units = 32;
  double seconds = 2.0;
  std::string path = pmsnap::PoolDirectory() + "/pmsnap-pool-demo.pool";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib")
      mib = std::stoull(argv[i + 1]);
    else if (flag == "--units")
      units = static_cast<std::uint32_t>(std::stoul(argv[i + 1]));
    else if (flag == "--pool")
      path = argv[i + 1];
    else if (flag == "--seconds")
      seconds = std::stod(argv[i + 1]);
    else {
      std::fprintf(stderr,
                   "usage: pmsnap-pool-demo [--mib N] [--units N] [--pool PATH] [--seconds S]\n");
      return 2;
    }
  }
  setenv("PMEM_IS_PMEM_FORCE", "1", 0);
  Manifest manifest;
  const std::int64_t words_per_unit = static_cast<std::int64_t>((mib << 20) / units / 8);
  for (std::uint32_t u = 0; u < units; ++u) {
    manifest.units.push_back({"layer" + std::to_string(u),
                              {{"param", pmsnap::layout::DType::kInt64, {words_per_unit}}},
                              0});
  }
  std::filesystem::remove(path);
  {
    auto pool = Pool::Create(path, manifest);
    if (!pool.ok()) {
      std::fprintf(stderr, "pmsnap-pool-demo: %s\n", pool.status().ToString().c_str());
      return 1;
    }
    std::printf("pool %s: %u units, %.0f MiB per checkpoint, file %.0f MiB\n", path.c_str(), units,
                (*pool)->layout().slot_bytes / 1048576.0, (*pool)->file_bytes() / 1048576.0);
  }
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  const auto start = Clock::now();
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    Writer(path, fds[1]);
  }
  ::close(fds[1]);
  std::mt19937_64 rng(static_cast<std::uint64_t>(start.time_since_epoch().count()));
  const double kill_after = seconds * std::uniform_real_distribution<double>(0.5, 1.0)(rng);
  std::printf("writer pid %d checkpointing continuously; SIGKILL in %.2f s\n", child, kill_after);
  std::uint64_t last_reported = 0;
  while (std::chrono::duration<double>(Clock::now() - start).count() < kill_after) {
    ::usleep(200000);
    std::printf("  %.1f s\r", std::chrono::duration<double>(Clock::now() - start).count());
    std::fflush(stdout);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  std::printf("\n");
  std::uint64_t e = 0;
  while (::read(fds[0], &e, sizeof(e)) == sizeof(e)) last_reported = e;
  ::close(fds[0]);

  const auto open_start = Clock::now();
  auto pool = Pool::Open(path);
  const double open_seconds = std::chrono::duration<double>(Clock::now() - open_start).count();
  if (!pool.ok()) {
    std::fprintf(stderr, "pmsnap-pool-demo: recovery failed: %s\n",
                 pool.status().ToString().c_str());
    return 1;
  }
  auto latest = (*pool)->Latest();
  if (!latest.ok()) {
    std::printf("killed before the first commit; nothing to recover (run again)\n");
    return 0;
  }
  bool exact = latest->epoch() >= last_reported;
  std::vector<std::uint64_t> expected(static_cast<std::size_t>(words_per_unit));
  for (std::uint32_t u = 0; u < units && exact; ++u) {
    Fill(expected, latest->epoch(), u);
    exact = std::memcmp(latest->tensor(u, 0).data(), expected.data(), expected.size() * 8) == 0;
  }
  const double bytes = static_cast<double>(latest->epoch()) * (*pool)->layout().slot_bytes;
  const std::string pm = (*pool)->pm_bandwidth().Label();
  std::printf("killed after %llu committed checkpoints (%.2f GB/s into the pool%s%s)\n",
              static_cast<unsigned long long>(last_reported), bytes / kill_after / 1e9,
              pm.empty() ? "" : ", ", pm.c_str());
  std::printf("recovered epoch %llu in %.3f s (open + verify of every checksum): %s\n",
              static_cast<unsigned long long>(latest->epoch()), open_seconds,
              exact ? "bit-exact" : "MISMATCH");
  pool->reset();
  std::filesystem::remove(path);
  return exact ? 0 : 1;
}
