// CPU affinity of threads (Linux sched_setaffinity).
//
// On a machine with few cores the scheduler may run a checkpoint worker on
// the core of the training thread that just woke it, and the two then share
// one core until the load balancer separates them. Pinning the workers to
// their own CPUs (EngineOptions::worker_cpus) and the training thread to the
// others avoids that (bench/RESULTS.md, stall).
#pragma once

#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap {

// The CPUs the calling thread may run on, ascending (before any pinning:
// the process's).
inline std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// "0, 1, 3" for {0, 1, 3}.
inline std::string CpuList(std::span<const int> cpus) {
  std::string text;
  for (int cpu : cpus) text += (text.empty() ? "" : ", ") + std::to_string(cpu);
  return text;
}

// Number of CPUs the machine has (online or not).
inline int ConfiguredCpus() {
  const long n = sysconf(_SC_NPROCESSORS_CONF);
  return n > 0 && n < CPU_SETSIZE ? static_cast<int>(n) : CPU_SETSIZE;
}

// kInvalidArgument naming the first CPU of `cpus` the machine does not have
// (or an empty list); OK otherwise. A CPU that exists but that the process's
// cpuset excludes is refused by PinCurrentThread.
inline Status CheckCpus(std::span<const int> cpus, const std::string& what) {
  if (cpus.empty()) return Status(StatusCode::kInvalidArgument, what + ": no CPU given");
  const int configured = ConfiguredCpus();
  for (int cpu : cpus) {
    if (cpu < 0 || cpu >= configured) {
      return Status(StatusCode::kInvalidArgument,
                    what + ": CPU " + std::to_string(cpu) + " does not exist (this machine has " +
                        std::to_string(configured) + ": 0-" + std::to_string(configured - 1) + ")");
    }
  }
  return Status::Ok();
}

// Pins the calling thread to `cpus`. Errors as CheckCpus (nothing changed),
// kInvalidArgument too if the kernel refuses (e.g. CPUs outside the
// process's cpuset).
inline Status PinCurrentThread(std::span<const int> cpus, const std::string& what = "cpus") {
  Status checked = CheckCpus(cpus, what);
  if (!checked.ok()) return checked;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    return Status(StatusCode::kInvalidArgument, what + ": sched_setaffinity to CPUs " +
                                                    CpuList(cpus) + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace pmsnap
