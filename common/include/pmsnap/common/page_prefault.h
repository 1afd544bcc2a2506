// Faulting memory in for writing ahead of its first use, without changing a
// byte, on a thread of its own.
//
// Why: the first write to each 4 KiB page of a fresh mapping takes a page
// fault. On bare metal that is ~1 us; on some VMs it is ~20 us (0.2 GB/s
// against 15-20 GB/s into resident memory), and a writer that meets the
// faults (a checkpoint worker filling a fresh pool, a restore filling fresh
// optimizer state) runs at the fault rate. Taken on another thread while the
// writer does other work, the faults are out of its way; and taken in bulk
// they cost less: MADV_POPULATE_WRITE takes them without a trap per page,
// and a read fault of a file page that is already in the page cache maps its
// neighbours too (fault-around, 16 pages by default).
//
// Every way here leaves every byte as it was, also when other threads write
// into the memory meanwhile, so live data (a pool being written) can be
// prefaulted.
//
// Thread-safety: the free functions from any thread. PagePrefaulter: Stop,
// Finish and the destructor from its owner thread; progress and
// WaitUntilSettled from any thread.
#pragma once

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "pmsnap/common/mutex.h"

namespace pmsnap {

#ifdef MADV_POPULATE_WRITE
inline constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
// Linux 5.14's value, for C libraries whose headers predate it.
inline constexpr int kMadvPopulateWrite = 23;
#endif

inline std::uintptr_t PageBytes() {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

// Write-faults every page that [data, data + bytes) overlaps: one write per
// page, inside the range, that leaves the byte as it was even if another
// thread writes it meanwhile: a compare-and-swap of the byte's value with
// itself. Compilers keep that as a write; an atomic `or 0` is compiled to a
// plain load by clang, and a read fault maps only the kernel's zero page (or
// a page the next write faults on again). The memory must be mapped
// writable; a page of a file mapping past the file's end raises SIGBUS, as
// any write there would.
//
// These touches race with the training and checkpoint threads' reads and
// writes of the same bytes, by design: a page is faulted in while its data
// may be in use (PagePrefaulter's threads run beside Pool::Open's caller).
// The value is left as it was and the atomic read-modify-write cannot undo
// a concurrent store (pool_prefault_test's
// LeavesBytesThatOtherThreadsWriteMeanwhile checks that), so they are not
// instrumented by ThreadSanitizer (scripts/sanitize.sh), which would report
// every touch that meets a plain access to the same byte.
#define PMSNAP_PREFAULT_TOUCH __attribute__((no_sanitize("thread")))
PMSNAP_PREFAULT_TOUCH inline void TouchPagesForWrite(std::byte* data, std::size_t bytes) {
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t end = start + bytes;
  const std::uintptr_t page = PageBytes();
  for (std::uintptr_t at = start; at < end; at = (at / page + 1) * page) {
    auto* byte = reinterpret_cast<unsigned char*>(at);
    unsigned char value = __atomic_load_n(byte, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(byte, &value, value, /*weak=*/false, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
  }
}

// madvise(`advice`) (MADV_POPULATE_READ, kMadvPopulateWrite) over every
// page that [data, data + bytes) overlaps: the kernel faults them in without
// touching the data. 0, or the errno: EINVAL from kernels before 5.14 (and
// for mappings it cannot populate), EFAULT where an access would raise
// SIGBUS (past a file's end, a full tmpfs), ENOMEM where nothing is mapped.
inline int PopulatePages(std::byte* data, std::size_t bytes, int advice) {
  if (bytes == 0) return 0;
  const std::uintptr_t page = PageBytes();
  const auto start = reinterpret_cast<std::uintptr_t>(data) / page * page;
  const std::uintptr_t end =
      (reinterpret_cast<std::uintptr_t>(data) + bytes + page - 1) / page * page;
  while (::madvise(reinterpret_cast<void*>(start), end - start, advice) != 0) {
    // EINTR: a signal arrived; populating again skips what is already done.
    if (errno != EINTR) return errno;
  }
  return 0;
}

inline std::uint64_t ThreadMinorFaults() {
  rusage usage{};
  ::getrusage(RUSAGE_THREAD, &usage);
  return static_cast<std::uint64_t>(usage.ru_minflt);
}

enum class PrefaultMethod : std::uint8_t {
  // Per piece: a probe reads its first page, then its second. If the first
  // read's fault mapped its neighbours (file pages already in the page
  // cache, as a pool written before, or reopened, has them), kTouch, which
  // then takes one fault per 16 pages (on tmpfs the read-faulted pages are
  // writable already: shmem does not track dirtying). Otherwise (pages the
  // kernel must still allocate or zero, as a new pool's slots)
  // kPopulateWrite. On a fresh 2 GiB pool in tmpfs here: 0.86 s against
  // 1.13 s for kTouch; reopened: 0.17 s against 0.6 s for kPopulateWrite.
  kAuto,
  // MADV_POPULATE_WRITE: one write fault per 4 KiB page, taken by the kernel
  // without a trap per page. Page touches where the kernel lacks it.
  kPopulateWrite,
  // TouchPagesForWrite: its load takes the read fault (with fault-around)
  // and its compare-and-swap the write fault, if any, by traps from user
  // space (without the mmap lock the populates hold per call).
  kTouch,
};

inline const char* PrefaultMethodName(PrefaultMethod method) {
  switch (method) {
    case PrefaultMethod::kAuto:
      return "auto";
    case PrefaultMethod::kPopulateWrite:
      return "MADV_POPULATE_WRITE";
    case PrefaultMethod::kTouch:
      return "touch";
  }
  return "invalid";
}

struct PrefaultRange {
  std::byte* data = nullptr;
  std::size_t bytes = 0;
};

struct PrefaultProgress {
  enum class State : std::uint8_t {
    kRunning,
    kDone,     // every range is faulted in
    kStopped,  // Stop came first
    kFailed,   // an error ended it early (`problem`); only the head start is lost
  };
  State state = State::kRunning;
  std::uint64_t bytes_total = 0;
  std::uint64_t bytes_done = 0;  // in pieces finished
  // From the constructor to settling (or to now while running), pauses
  // included.
  double seconds = 0;
  // PrefaultMethodName of the method (kTouch once a kernel without
  // MADV_POPULATE_WRITE made it fall back).
  const char* method = "";
  // Of bytes_done, faulted in by MADV_POPULATE_WRITE (the rest by touches).
  std::uint64_t bytes_populated = 0;
  // Minor page faults the background thread took (getrusage RUSAGE_THREAD;
  // the kernel counts the faults MADV_POPULATE_WRITE takes for it too). Set
  // when that thread ends.
  std::uint64_t thread_page_faults = 0;
  std::string problem;
};

inline const char* PrefaultStateName(PrefaultProgress::State state) {
  switch (state) {
    case PrefaultProgress::State::kRunning:
      return "running";
    case PrefaultProgress::State::kDone:
      return "done";
    case PrefaultProgress::State::kStopped:
      return "stopped";
    case PrefaultProgress::State::kFailed:
      return "failed";
  }
  return "invalid";
}

// Faults in `ranges` for writing, in the order given, on a thread of its own.
// The work is cut into pieces of at most `piece_bytes` (aligned to that size
// in the address space, so a piece never straddles a huge page) handed out
// through an atomic index: Stop waits for at most the pieces in progress,
// and a caller that Finishes takes pieces too.
//
// Costs: one thread until the work is done, and the kernel time of the
// faults, which the memory's first writers would otherwise take themselves.
// Memory not yet allocated (a fresh anonymous mapping, holes of a file) is
// allocated by the faults, as a write would.
//
// The ranges must stay mapped and writable until Stop, Finish or the
// destructor returns. A thread that cannot start, or a failing populate,
// ends it early (kFailed): only the head start is lost.
class PagePrefaulter {
 public:
  static constexpr std::size_t kDefaultPieceBytes = 2u << 20;

  explicit PagePrefaulter(const std::vector<PrefaultRange>& ranges,
                          PrefaultMethod method = PrefaultMethod::kAuto,
                          std::size_t piece_bytes = kDefaultPieceBytes)
      : method_(method), started_(std::chrono::steady_clock::now()) {
    const std::uintptr_t piece = std::max<std::uintptr_t>(piece_bytes, PageBytes());
    for (const PrefaultRange& range : ranges) {
      auto start = reinterpret_cast<std::uintptr_t>(range.data);
      const std::uintptr_t end = start + range.bytes;
      bytes_total_ += range.bytes;
      while (start < end) {
        const std::uintptr_t piece_end = std::min<std::uintptr_t>(end, (start / piece + 1) * piece);
        pieces_.push_back({reinterpret_cast<std::byte*>(start), piece_end - start});
        start = piece_end;
      }
    }
    if (pieces_.empty()) {
      Settle();
      return;
    }
    try {
      thread_ = std::thread([this] { Work(/*background=*/true); });
    } catch (const std::system_error& error) {
      Fail(std::string("cannot start a prefault thread: ") + error.what());
    }
  }
  ~PagePrefaulter() { Stop(); }
  PagePrefaulter(const PagePrefaulter&) = delete;
  PagePrefaulter& operator=(const PagePrefaulter&) = delete;

  // No piece starts any more; waits for the ones in progress. Idempotent.
  void Stop() {
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
  }

  // While a Pause is outstanding, and for kResumeGraceMs after the last
  // Resume, the background thread starts no new piece: for work that needs
  // the CPUs now (a restore reading the pool) and would share them with the
  // prefault otherwise. Counted; any thread. Finish's caller is not paused.
  static constexpr int kResumeGraceMs = 5;
  void Pause() { pauses_.fetch_add(1, std::memory_order_acq_rel); }
  void Resume() {
    last_resume_ns_.store(NowNs(), std::memory_order_relaxed);
    pauses_.fetch_sub(1, std::memory_order_acq_rel);
  }

  // The calling thread faults in the pieces nobody started (also after a
  // failed thread start), then waits for the thread. Idempotent.
  void Finish() {
    Work(/*background=*/false);
    if (thread_.joinable()) thread_.join();
  }

  // True once the work settled (done, stopped or failed) within `timeout`.
  bool WaitUntilSettled(std::chrono::nanoseconds timeout) const PMSNAP_EXCLUDES(mutex_) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    MutexLock lock(mutex_);
    while (!settled_ && settled_changed_.WaitUntil(lock, deadline)) {
    }
    return settled_;
  }

  PrefaultProgress progress() const PMSNAP_EXCLUDES(mutex_) {
    MutexLock lock(mutex_);
    PrefaultProgress progress = result_;
    progress.bytes_total = bytes_total_;
    progress.bytes_done = bytes_done_.load(std::memory_order_relaxed);
    progress.bytes_populated = bytes_populated_.load(std::memory_order_relaxed);
    progress.method = PrefaultMethodName(method_.load(std::memory_order_relaxed));
    if (!settled_) progress.seconds = SecondsSinceStart();
    return progress;
  }

 private:
  static std::int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  bool Paused() const {
    return pauses_.load(std::memory_order_acquire) > 0 ||
           NowNs() - last_resume_ns_.load(std::memory_order_relaxed) < kResumeGraceMs * 1000000ll;
  }

  double SecondsSinceStart() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  }

  void Work(bool background) {
    active_.fetch_add(1, std::memory_order_acq_rel);
    const std::uint64_t faults_before = ThreadMinorFaults();
    while (!stop_.load(std::memory_order_relaxed)) {
      if (background && Paused()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      const std::size_t index = next_.fetch_add(1, std::memory_order_relaxed);
      if (index >= pieces_.size()) break;
      if (!FaultIn(pieces_[index])) break;
      bytes_done_.fetch_add(pieces_[index].bytes, std::memory_order_relaxed);
      pieces_done_.fetch_add(1, std::memory_order_acq_rel);
    }
    MutexLock lock(mutex_);
    if (background) result_.thread_page_faults = ThreadMinorFaults() - faults_before;
    // The last worker out says how it ended (a helper that comes later
    // finds nothing to do and says the same).
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) SettleLocked();
  }

  // False ends the work (failure, recorded).
  bool FaultIn(const PrefaultRange& piece) {
    PrefaultMethod method = method_.load(std::memory_order_relaxed);
    if (method == PrefaultMethod::kAuto) {
      method = ReadFaultsMapAround(piece) ? PrefaultMethod::kTouch : PrefaultMethod::kPopulateWrite;
    }
    if (method == PrefaultMethod::kPopulateWrite) {
      const int error = PopulatePages(piece.data, piece.bytes, kMadvPopulateWrite);
      if (error == 0) {
        bytes_populated_.fetch_add(piece.bytes, std::memory_order_relaxed);
        return true;
      }
      if (error != EINVAL) {
        // EFAULT: a page past the file's end or beyond the file system's
        // space; touching it would raise SIGBUS. The other thread stops
        // too: what failed once likely fails again.
        stop_.store(true, std::memory_order_relaxed);
        Fail(std::string("madvise(MADV_POPULATE_WRITE) failed: ") + std::strerror(error));
        return false;
      }
      method_.store(PrefaultMethod::kTouch, std::memory_order_relaxed);  // kernel before 5.14
    }
    TouchPagesForWrite(piece.data, piece.bytes);
    return true;
  }

  // Whether read faults in `piece` map more than their own page: reads its
  // first page, then its second, which fault-around (up to 16 pages, aligned
  // in the address space, as pieces are) has mapped if it could.
  // A touch like TouchPagesForWrite's: not seen by ThreadSanitizer.
  PMSNAP_PREFAULT_TOUCH static bool ReadFaultsMapAround(const PrefaultRange& piece) {
    const std::uintptr_t page = PageBytes();
    const auto first = reinterpret_cast<std::uintptr_t>(piece.data) / page * page;
    if (first + page >= reinterpret_cast<std::uintptr_t>(piece.data) + piece.bytes) return true;
    (void)__atomic_load_n(reinterpret_cast<const unsigned char*>(first), __ATOMIC_RELAXED);
    const std::uint64_t before = ThreadMinorFaults();
    (void)__atomic_load_n(reinterpret_cast<const unsigned char*>(first + page), __ATOMIC_RELAXED);
    return ThreadMinorFaults() == before;
  }

  void Fail(const std::string& problem) PMSNAP_EXCLUDES(mutex_) {
    MutexLock lock(mutex_);
    if (result_.problem.empty()) result_.problem = problem;
    failed_ = true;
    if (active_.load(std::memory_order_acquire) == 0) SettleLocked();
  }

  void Settle() PMSNAP_EXCLUDES(mutex_) {
    MutexLock lock(mutex_);
    SettleLocked();
  }

  void SettleLocked() PMSNAP_REQUIRES(mutex_) {
    using State = PrefaultProgress::State;
    if (pieces_done_.load(std::memory_order_acquire) == pieces_.size()) {
      result_.state = State::kDone;
    } else {
      result_.state = failed_ ? State::kFailed : State::kStopped;
    }
    result_.seconds = SecondsSinceStart();
    settled_ = true;
    settled_changed_.NotifyAll();
  }

  std::vector<PrefaultRange> pieces_;
  std::uint64_t bytes_total_ = 0;
  std::atomic<PrefaultMethod> method_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> next_{0};         // next piece to hand out
  std::atomic<std::size_t> pieces_done_{0};  // pieces finished
  std::atomic<std::uint64_t> bytes_done_{0};
  std::atomic<std::uint64_t> bytes_populated_{0};
  std::atomic<int> active_{0};  // threads inside Work
  std::atomic<int> pauses_{0};  // outstanding Pause calls
  std::atomic<std::int64_t> last_resume_ns_{std::numeric_limits<std::int64_t>::min() / 2};
  std::chrono::steady_clock::time_point started_;

  mutable Mutex mutex_;
  mutable CondVar settled_changed_;
  PrefaultProgress result_ PMSNAP_GUARDED_BY(mutex_);
  bool failed_ PMSNAP_GUARDED_BY(mutex_) = false;
  bool settled_ PMSNAP_GUARDED_BY(mutex_) = false;

  std::thread thread_;
};

}  // namespace pmsnap
