#include "stall/counters.h"

#include <linux/perf_event.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <utility>

namespace pmsnap::bench::stall {

ThreadCounters::ThreadCounters() {
  const std::pair<std::uint32_t, std::uint64_t> events[kCount] = {
      {PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES},
      {PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS},
      {PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_MISSES},
      {PERF_TYPE_HW_CACHE, PERF_COUNT_HW_CACHE_DTLB | (PERF_COUNT_HW_CACHE_OP_READ << 8) |
                               (PERF_COUNT_HW_CACHE_RESULT_MISS << 16)},
      {PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS}};
  for (int i = 0; i < kCount; ++i) {
    perf_event_attr attr{};
    attr.size = sizeof(attr);
    attr.type = events[i].first;
    attr.config = events[i].second;
    attr.exclude_hv = 1;
    fds_[i] = static_cast<int>(::syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
    if (fds_[i] < 0) {  // e.g. perf_event_paranoid >= 2 without privileges
      attr.exclude_kernel = 1;
      fds_[i] = static_cast<int>(::syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
    }
  }
}

ThreadCounters::~ThreadCounters() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

std::array<double, ThreadCounters::kCount> ThreadCounters::Read() const {
  std::array<double, kCount> values;
  for (int i = 0; i < kCount; ++i) {
    std::uint64_t v = 0;
    values[i] =
        fds_[i] >= 0 && ::read(fds_[i], &v, sizeof(v)) == sizeof(v) ? static_cast<double>(v) : -1.0;
  }
  return values;
}

double ProcessPageFaults() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<double>(usage.ru_minflt + usage.ru_majflt);
}

std::string CountersText(const std::array<double, ThreadCounters::kCount>& per_iteration) {
  std::string text;
  char item[64];
  auto add = [&](const char* format, double value) {
    std::snprintf(item, sizeof(item), format, value);
    text += item;
  };
  const double cycles = per_iteration[0], instructions = per_iteration[1];
  if (cycles > 0) add(" %.3f Gcycles", cycles / 1e9);
  if (cycles > 0 && instructions >= 0) add(" IPC %.2f", instructions / cycles);
  if (per_iteration[2] >= 0) add(" LLC-miss %.1fM", per_iteration[2] / 1e6);
  if (per_iteration[3] >= 0) add(" dTLB-miss %.2fM", per_iteration[3] / 1e6);
  if (per_iteration[4] >= 0) add(" faults %.0fK", per_iteration[4] / 1e3);
  return text.empty() ? text : "  per it:" + text;
}

}  // namespace pmsnap::bench::stall
