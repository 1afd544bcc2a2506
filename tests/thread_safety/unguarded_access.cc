// The thread-safety lane's own check (scripts/thread_safety.sh): this file
// must NOT compile under clang -Wthread-safety -Werror. Each function breaks
// one rule the annotations state; were any of them accepted, the lane would
// pass code with the same fault.
#include "pmsnap/common/mutex.h"

namespace {

class Counter {
 public:
  // Reads and writes a guarded member without its mutex.
  void IncrementUnlocked() { ++count_; }
  // Calls a function that needs the mutex without holding it.
  void CallsWithoutTheLock() { AddLocked(1); }
  // Takes the mutex that a function it calls takes again.
  void TakesItTwice() {
    pmsnap::MutexLock lock(mutex_);
    Add(1);
  }

  void Add(int n) PMSNAP_EXCLUDES(mutex_) {
    pmsnap::MutexLock lock(mutex_);
    count_ += n;
  }

 private:
  void AddLocked(int n) PMSNAP_REQUIRES(mutex_) { count_ += n; }

  pmsnap::Mutex mutex_;
  int count_ PMSNAP_GUARDED_BY(mutex_) = 0;
};

}  // namespace

int main() {
  Counter counter;
  counter.IncrementUnlocked();
  counter.CallsWithoutTheLock();
  counter.TakesItTwice();
  return 0;
}
