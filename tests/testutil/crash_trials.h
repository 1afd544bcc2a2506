// Kill trials for crash tests, timed by what the child did rather than by
// fixed delays. The child reports every commit on a pipe, with the moment it
// committed and how long that epoch took it; the parent kills it a random
// fraction (0..2) of an epoch after the newest commit it has seen, so kills
// land inside writes, inside commits and between them on a fast machine and
// on a slow or loaded one alike. The epoch is the median of the last
// kRecentEpochs the children reported: a child's first epoch after opening
// the pool can take ten times as long as the ones after it.
//
// A bounded share of the trials (kBeforeFirstCommitShare) kills before the
// child's first commit instead, at a random fraction of the time an earlier
// child took to get there (opening, recovery, the first epoch). The first
// trial always waits for a commit: it has no such time to draw from.
//
// Nothing here waits with a timeout: a child that neither commits nor exits
// is a bug, and hangs the test until the runner's timeout
// (scripts/pmsnap.sh: ctest --timeout 900).
//
// The child also says what it is doing (a test-defined phase, in a page
// shared with the parent), so the parent can tell where each kill landed.
//
// Thread-safety: one CrashTrials per test thread; a CrashChild belongs to the
// forked child.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "testutil/test_seed.h"

namespace pmsnap::testing {

// $PMSNAP_CRASH_TRIALS, or `fallback`.
inline int CrashTrialCount(int fallback) {
  const char* env = std::getenv("PMSNAP_CRASH_TRIALS");
  return env != nullptr && *env != '\0' ? std::max(1, std::atoi(env)) : fallback;
}

// steady_clock is CLOCK_MONOTONIC: one clock for parent and child.
using CrashClock = std::chrono::steady_clock;

// One commit as the child reports it.
struct CommitReport {
  std::uint64_t committed = 0;    // epoch or iteration (the test's choice), growing
  std::int64_t epoch_ns = 0;      // since the child's previous report (or StartEpochs)
  std::int64_t committed_at = 0;  // CrashClock, ns since its epoch
};

// The child's side: phases and commit reports.
class CrashChild {
 public:
  CrashChild(int report_fd, std::atomic<int>* phase) : fd_(report_fd), phase_(phase) {}

  void Phase(int phase) { phase_->store(phase, std::memory_order_relaxed); }

  // Where the first epoch's time starts: opening and recovery are not part
  // of an epoch.
  void StartEpochs() { mark_ = CrashClock::now(); }

  // Reports a durable commit; exits the child if the parent is gone.
  void Committed(std::uint64_t committed) {
    const CrashClock::time_point now = CrashClock::now();
    const CommitReport report{committed, std::chrono::nanoseconds(now - mark_).count(),
                              std::chrono::nanoseconds(now.time_since_epoch()).count()};
    mark_ = now;
    // Smaller than PIPE_BUF: each report is written whole or not at all.
    ssize_t n;
    do {
      n = ::write(fd_, &report, sizeof(report));
    } while (n < 0 && errno == EINTR);
    if (n != static_cast<ssize_t>(sizeof(report))) _exit(120);
  }

 private:
  int fd_;
  std::atomic<int>* phase_;
  CrashClock::time_point mark_ = CrashClock::now();
};

// When to kill one trial's child.
struct KillPlan {
  bool before_first_commit = false;
  int commits = 0;      // wait for this many commits of this child (unless before_first_commit)
  double fraction = 0;  // of the child's epoch time, or of an earlier child's first commit
};

// What happened in one trial.
struct KillOutcome {
  KillPlan plan;
  int wait_status = 0;
  bool killed = false;  // by our SIGKILL, not ended by itself
  int phase = 0;        // the child's phase when it died
  int reports = 0;
  std::uint64_t trigger = 0;        // the commit the kill was timed from (0: none)
  std::int64_t epoch_ns = 0;        // the epoch time the delay was drawn from
  std::int64_t delay_ns = 0;        // planned: from the trigger's commit (or the fork)
  std::int64_t late_ns = 0;         // the kill came this much later (the parent's wake-up)
  std::uint64_t last_reported = 0;  // newest commit the child reported (0: none)
  int reports_after_trigger = 0;    // commits the child still made before the kill landed

  std::string Describe(const std::vector<std::string>& phase_names) const {
    char buffer[240];
    if (plan.before_first_commit) {
      std::snprintf(buffer, sizeof(buffer),
                    "killed %.0f us after fork (%.2f of an earlier child's time to its first "
                    "commit), %.0f us late",
                    static_cast<double>(delay_ns) * 1e-3, plan.fraction,
                    static_cast<double>(late_ns) * 1e-3);
    } else {
      std::snprintf(buffer, sizeof(buffer),
                    "killed %.0f us (%.2f of its %.0f us epoch) after commit %llu (waited for %d "
                    "commits), %.0f us late",
                    static_cast<double>(delay_ns) * 1e-3, plan.fraction,
                    static_cast<double>(epoch_ns) * 1e-3, static_cast<unsigned long long>(trigger),
                    plan.commits, static_cast<double>(late_ns) * 1e-3);
    }
    std::string s = buffer;
    s += "; " + std::to_string(reports) + " commits reported, the last " +
         std::to_string(last_reported);
    if (killed) {
      s += ", died while " + (static_cast<std::size_t>(phase) < phase_names.size()
                                  ? phase_names[phase]
                                  : "in phase " + std::to_string(phase));
    } else if (WIFEXITED(wait_status)) {
      s += ", but it exited by itself with code " + std::to_string(WEXITSTATUS(wait_status));
    } else {
      s += ", but it died of signal " + std::to_string(WTERMSIG(wait_status));
    }
    return s;
  }
};

class CrashTrials {
 public:
  enum class Kill {
    kDrawn,  // before the first commit at kBeforeFirstCommitShare, else after commits
    // Before the first commit once a child's first commit was timed; a
    // trial before that waits for one.
    kBeforeFirstCommit,
  };
  static constexpr double kBeforeFirstCommitShare = 0.125;
  static constexpr int kMaxCommitsBeforeKill = 3;
  static constexpr double kMaxEpochFraction = 2.0;
  static constexpr std::size_t kRecentEpochs = 15;

  // `phase_names`: the child's phases, 0 being the one it starts in.
  CrashTrials(std::uint64_t seed, std::vector<std::string> phase_names)
      : rng_(seed), phase_names_(std::move(phase_names)) {
    void* page = ::mmap(nullptr, sizeof(std::atomic<int>), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) {
      std::perror("crash_trials: mmap");
      std::abort();
    }
    phase_ = new (page) std::atomic<int>(0);
  }
  ~CrashTrials() { ::munmap(phase_, sizeof(std::atomic<int>)); }
  CrashTrials(const CrashTrials&) = delete;
  CrashTrials& operator=(const CrashTrials&) = delete;

  // Forks a child running `body(CrashChild&)` (which must never return),
  // kills it as planned, reaps it and drains its reports.
  template <class Body>
  KillOutcome Run(Body&& body, Kill when = Kill::kDrawn) {
    KillOutcome out;
    out.plan = Plan(when);
    int fds[2];
    if (::pipe(fds) != 0) {
      std::perror("crash_trials: pipe");
      std::abort();
    }
    phase_->store(0);
    const CrashClock::time_point forked = CrashClock::now();
    const pid_t child = ::fork();
    if (child < 0) {
      std::perror("crash_trials: fork");
      std::abort();
    }
    if (child == 0) {
      ::close(fds[0]);
      CrashChild crash(fds[1], phase_);
      body(crash);
      _exit(121);
    }
    ::close(fds[1]);

    CommitReport report;
    bool ended = false;
    CrashClock::time_point target;
    if (out.plan.before_first_commit) {
      out.delay_ns =
          static_cast<std::int64_t>(out.plan.fraction * static_cast<double>(first_commit_ns_));
      target = forked + std::chrono::nanoseconds(out.delay_ns);
    } else {
      // Timed from the newest commit the child made, not from when the
      // parent got to read about it.
      while (!ended && (out.reports < out.plan.commits || Readable(fds[0]))) {
        ended = !Read(fds[0], &report);
        if (ended) break;
        if (++out.reports == 1) first_commit_ns_ = report.committed_at - Ns(forked);
        out.last_reported = out.trigger = report.committed;
        Observe(report);
      }
      if (!ended) {
        out.epoch_ns = RecentEpochNs();
        out.delay_ns =
            static_cast<std::int64_t>(out.plan.fraction * static_cast<double>(out.epoch_ns));
        target =
            CrashClock::time_point(std::chrono::nanoseconds(report.committed_at + out.delay_ns));
      }
    }
    if (!ended) std::this_thread::sleep_until(target);
    ::kill(child, SIGKILL);
    out.late_ns = std::max<std::int64_t>(0, Ns(CrashClock::now()) - Ns(target));
    while (::waitpid(child, &out.wait_status, 0) < 0 && errno == EINTR) {
    }
    while (Read(fds[0], &report)) {
      ++out.reports;
      ++out.reports_after_trigger;
      out.last_reported = report.committed;
      Observe(report);
    }
    ::close(fds[0]);
    out.killed = WIFSIGNALED(out.wait_status) && WTERMSIG(out.wait_status) == SIGKILL;
    out.phase = phase_->load();
    Count(out);
    return out;
  }

  // Commits the trials waited for before killing: each one is durable.
  std::uint64_t commits_waited_for() const { return commits_waited_for_; }

  // One paragraph: where the kills landed, how late, and the epoch times
  // they were drawn from.
  std::string Summary() const {
    std::string s = std::to_string(before_first_commit_ + after_commit_) + " kills (" +
                    std::to_string(planned_before_) +
                    " planned before the first commit): " + std::to_string(before_first_commit_) +
                    " before the child's first commit (" + Phases(phases_before_) + "), " +
                    std::to_string(after_commit_) + " after it reported one (" +
                    Phases(phases_after_) + ")";
    if (planned_after_ > 0) {
      s += "; of those timed from a commit, " + std::to_string(landed_[0]) +
           " landed before the next commit, " + std::to_string(landed_[1]) + " after one more, " +
           std::to_string(landed_[2]) + " after two or more";
    }
    if (!epoch_us_.empty()) {
      char buffer[240];
      std::snprintf(
          buffer, sizeof(buffer),
          "; the epoch time drawn from: median %.0f us (%.0f..%.0f); the kill came a median "
          "%.2f epochs (90th percentile %.2f) late by the parent's clock; the latest first "
          "commit %.1f ms after fork",
          Quantile(epoch_us_, 0.5), Quantile(epoch_us_, 0), Quantile(epoch_us_, 1),
          Quantile(late_epochs_, 0.5), Quantile(late_epochs_, 0.9),
          static_cast<double>(first_commit_ns_) * 1e-6);
      s += buffer;
    }
    return s;
  }

 private:
  static std::int64_t Ns(CrashClock::time_point t) {
    return std::chrono::nanoseconds(t.time_since_epoch()).count();
  }

  static bool Readable(int fd) {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  }

  // False at the end of the stream (the child died or exited).
  static bool Read(int fd, CommitReport* report) {
    ssize_t n;
    do {
      n = ::read(fd, report, sizeof(*report));
    } while (n < 0 && errno == EINTR);
    return n == static_cast<ssize_t>(sizeof(*report));
  }

  void Observe(const CommitReport& report) {
    recent_epochs_[observed_++ % kRecentEpochs] = report.epoch_ns;
  }

  std::int64_t RecentEpochNs() const {
    std::vector<std::int64_t> recent(recent_epochs_,
                                     recent_epochs_ + std::min(observed_, kRecentEpochs));
    std::nth_element(recent.begin(), recent.begin() + recent.size() / 2, recent.end());
    return recent[recent.size() / 2];
  }

  static double Quantile(std::vector<double> values, double q) {
    std::sort(values.begin(), values.end());
    return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
  }

  KillPlan Plan(Kill when) {
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    KillPlan plan;
    // Until a child committed there is no time to draw an early kill from.
    plan.before_first_commit = first_commit_ns_ > 0 && (when == Kill::kBeforeFirstCommit ||
                                                        unit(rng_) < kBeforeFirstCommitShare);
    if (plan.before_first_commit) {
      plan.fraction = unit(rng_);
    } else {
      plan.commits = std::uniform_int_distribution<int>(1, kMaxCommitsBeforeKill)(rng_);
      plan.fraction = kMaxEpochFraction * unit(rng_);
    }
    return plan;
  }

  void Count(const KillOutcome& out) {
    if (out.reports == 0) {
      ++before_first_commit_;
      ++phases_before_[out.phase];
    } else {
      ++after_commit_;
      ++phases_after_[out.phase];
    }
    if (out.plan.before_first_commit) {
      ++planned_before_;
    } else if (out.trigger != 0) {
      ++planned_after_;
      ++landed_[std::min(out.reports_after_trigger, 2)];
      commits_waited_for_ += static_cast<std::uint64_t>(out.plan.commits);
      epoch_us_.push_back(static_cast<double>(out.epoch_ns) * 1e-3);
      late_epochs_.push_back(static_cast<double>(out.late_ns) /
                             static_cast<double>(std::max<std::int64_t>(out.epoch_ns, 1)));
    }
  }

  std::string Phases(const std::map<int, int>& counts) const {
    std::string s;
    for (const auto& [phase, count] : counts) {
      if (!s.empty()) s += ", ";
      s += (static_cast<std::size_t>(phase) < phase_names_.size() ? phase_names_[phase]
                                                                  : std::to_string(phase)) +
           " " + std::to_string(count);
    }
    return s.empty() ? "none" : s;
  }

  std::mt19937_64 rng_;
  std::vector<std::string> phase_names_;
  std::atomic<int>* phase_ = nullptr;
  // Fork to first commit of the latest child timed so far (the child's clock).
  std::int64_t first_commit_ns_ = 0;
  int before_first_commit_ = 0;
  int after_commit_ = 0;
  int planned_before_ = 0;
  int planned_after_ = 0;
  std::uint64_t commits_waited_for_ = 0;
  std::map<int, int> phases_before_;
  std::map<int, int> phases_after_;
  int landed_[3] = {0, 0, 0};
  std::vector<double> epoch_us_;
  std::vector<double> late_epochs_;
  std::int64_t recent_epochs_[kRecentEpochs] = {};
  std::size_t observed_ = 0;
};

}  // namespace pmsnap::testing
