// Mutex, MutexLock and CondVar: std::mutex, a scoped lock and
// std::condition_variable with clang's thread-safety annotations
// (thread_annotations.h), so that the state a mutex guards is declared with
// PMSNAP_GUARDED_BY and checked by the compiler.
//
//   mutable Mutex mutex_;
//   CondVar changed_;
//   std::uint64_t done_ PMSNAP_GUARDED_BY(mutex_) = 0;
//
//   void WaitDone(std::uint64_t n) PMSNAP_EXCLUDES(mutex_) {
//     MutexLock lock(mutex_);
//     while (done_ < n) changed_.Wait(lock);
//   }
//
// Condition-variable waits are written as loops around Wait, not with a
// predicate lambda: the analysis checks a lambda's body on its own, without
// the lock its caller holds.
//
// Thread-safety: as std::mutex and std::condition_variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "pmsnap/common/thread_annotations.h"

namespace pmsnap {

class PMSNAP_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() PMSNAP_ACQUIRE() { mutex_.lock(); }
  void unlock() PMSNAP_RELEASE() { mutex_.unlock(); }

 private:
  friend class MutexLock;
  std::mutex mutex_;
};

// Holds `mutex` from construction to destruction; Unlock and Lock release
// and take it again in between (a worker that drops the lock around slow
// work).
class PMSNAP_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mutex) PMSNAP_ACQUIRE(mutex) : lock_(mutex.mutex_) {}
  ~MutexLock() PMSNAP_RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() PMSNAP_RELEASE() { lock_.unlock(); }
  void Lock() PMSNAP_ACQUIRE() { lock_.lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

class CondVar {
 public:
  // Releases `lock`'s mutex until notified (or woken spuriously), then takes
  // it again: callers loop on their condition.
  void Wait(MutexLock& lock) { changed_.wait(lock.lock_); }
  // As Wait, returning no later than `deadline`; false once it has passed.
  bool WaitUntil(MutexLock& lock, std::chrono::steady_clock::time_point deadline) {
    return changed_.wait_until(lock.lock_, deadline) == std::cv_status::no_timeout;
  }
  void NotifyOne() { changed_.notify_one(); }
  void NotifyAll() { changed_.notify_all(); }

 private:
  std::condition_variable changed_;
};

}  // namespace pmsnap
