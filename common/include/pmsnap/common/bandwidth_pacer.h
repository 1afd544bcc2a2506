// BandwidthPacer: holds transfers to a modelled bandwidth, for things this
// machine only simulates (a device's link, persistent memory slower than the
// DRAM it is emulated in).
//
// The model is a single channel: each transfer reserves bytes / bandwidth of
// channel time after the previous reservation ends (or when it started, if
// the channel was idle by then), and the caller returns once its reservation
// has elapsed. Concurrent callers therefore see the channel's bandwidth
// together, not the sum of their threads, and a caller whose real transfer
// took longer than the modelled one is not held at all (the model can only
// slow things down).
//
// Thread-safety: every method may be called from any thread at once.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include "pmsnap/common/mutex.h"

namespace pmsnap {

class BandwidthPacer {
 public:
  using Clock = std::chrono::steady_clock;

  // `gigabytes_per_second` in 1e9 B/s; must be > 0.
  explicit BandwidthPacer(double gigabytes_per_second) : gbps_(gigabytes_per_second) {}
  BandwidthPacer(const BandwidthPacer&) = delete;
  BandwidthPacer& operator=(const BandwidthPacer&) = delete;

  double gigabytes_per_second() const { return gbps_; }

  // Reserves channel time for `bytes` of a transfer that began at `started`
  // and returns when that reservation ends. Does not wait.
  Clock::time_point Reserve(std::uint64_t bytes, Clock::time_point started) {
    const auto transfer = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / (gbps_ * 1e9)));
    MutexLock lock(mutex_);
    const Clock::time_point begin = std::max(started, free_at_);
    free_at_ = begin + transfer;
    return free_at_;
  }

  // Reserve, then wait until the reservation has elapsed. Call it after the
  // real transfer (begun at `started`) is done.
  void Pace(std::uint64_t bytes, Clock::time_point started) { WaitUntil(Reserve(bytes, started)); }

  // Waits until `done`. A sleep overshoots by the timer slack (~50 us), which
  // would make short transfers many times slower than modelled; ahead of the
  // timeline by less than that, it returns at once: the reservations, which
  // each start where the previous one ended, keep the long-run rate exact.
  static void WaitUntil(Clock::time_point done) {
    constexpr auto kSleepGranularity = std::chrono::microseconds(100);
    if (done - Clock::now() > kSleepGranularity) std::this_thread::sleep_until(done);
  }

 private:
  const double gbps_;
  Mutex mutex_;
  Clock::time_point free_at_ PMSNAP_GUARDED_BY(mutex_){};
};

}  // namespace pmsnap
