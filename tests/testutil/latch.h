// A one-shot gate for tests that order work across threads without timing:
// Wait() blocks until Open(). OpenAfter(seconds) is a hang guard: it opens
// the gate if the test has not by then, and says so (opened_by_guard).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace pmsnap::testing {

class Latch {
 public:
  ~Latch() {
    Open();
    if (guard_.joinable()) guard_.join();
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    opened_.wait(lock, [this] { return open_; });
  }
  bool is_open() {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_;
  }
  // A deadlock guard, not a speed expectation: a correct program opens the
  // latch long before; a broken one would otherwise hang the test.
  void OpenAfter(std::chrono::seconds limit) {
    guard_ = std::thread([this, limit] {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!opened_.wait_for(lock, limit, [this] { return open_; })) {
        opened_by_guard_ = true;
        open_ = true;
        opened_.notify_all();
      }
    });
  }
  bool opened_by_guard() const { return opened_by_guard_.load(); }

 private:
  std::mutex mutex_;  // guards open_
  std::condition_variable opened_;
  bool open_ = false;
  std::atomic<bool> opened_by_guard_{false};
  std::thread guard_;
};

}  // namespace pmsnap::testing
