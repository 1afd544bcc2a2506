// bench/stall's counters: the training thread's stall by cause, what a
// method committed and wrote, the training thread's hardware counters and
// the process's page faults, and the clock all of them are timed with.
//
// Thread-safety: values, except ThreadCounters (see there).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>

namespace pmsnap::bench::stall {

using Clock = std::chrono::steady_clock;

// Seconds from `t` to now.
inline double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Training-thread stall, seconds, by cause.
struct Stall {
  double conflict = 0;  // waiting for a unit's/weight's snapshot before its update
  double boundary = 0;  // waiting for the previous checkpoint at a step boundary
  double copy = 0;      // copies on the training thread (snapshot, in-device)
  double save = 0;      // synchronous serialization + write
  double hook = 0;      // the rest of the time inside pmsnap's hooks
  double total() const { return conflict + boundary + copy + save + hook; }
};

struct Counters {
  Stall stall;
  std::uint64_t commits = 0;
  std::uint64_t bytes = 0;
  std::uint64_t conflicts = 0;
};

// Hardware counters of the calling (training) thread, kernel time included
// (page faults zero pages there): they tell whether an overhead is more work
// on the training thread (instructions) or the same work done slower (cycles
// per instruction, cache and TLB misses), e.g. memory traffic of a worker on
// another core. Counters the kernel or the VM does not offer read as absent.
// Counts the thread that constructs it; read it from that thread.
class ThreadCounters {
 public:
  // cycles, instructions, LLC misses, dTLB load misses, page faults
  static constexpr int kCount = 5;
  // Opens what perf_event_open allows (user time only where kernel time is
  // refused); never fails.
  ThreadCounters();
  ~ThreadCounters();
  ThreadCounters(const ThreadCounters&) = delete;
  ThreadCounters& operator=(const ThreadCounters&) = delete;

  // Current values; -1 for a counter that is not available.
  std::array<double, kCount> Read() const;

 private:
  int fds_[kCount] = {-1, -1, -1, -1, -1};
};

// workers, the pool's prefault): where a method pays for first touches of
// its pool, files or buffers.
double ProcessPageFaults();

// "  per it: 1.096 Gcycles IPC 1.94 ..." for a trial's progress line: the
// training thread's counters this machine offers.
std::string CountersText(const std::array<double, ThreadCounters::kCount>& per_iteration);

}  // namespace pmsnap::bench::stall
