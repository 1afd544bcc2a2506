// Random delays before a crash test kills its child. On a loaded or
// sanitized machine a child may not reach its first commit within the drawn
// delay, and a trial without progress tests nothing: the delays grow (up to
// 16x) while the children make none, and drop back once one does.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <random>

namespace pmsnap::testing {

class KillDelay {
 public:
  KillDelay(int min_us, int max_us) : draw_(min_us, max_us) {}

  // `progress` is a count that grows whenever a child got somewhere (trials
  // that committed, the newest committed iteration).
  template <class Rng>
  useconds_t Next(Rng& rng, std::uint64_t progress) {
    if (drawn_) slowdown_ = progress > last_progress_ ? 1 : std::min(slowdown_ * 2, kMaxSlowdown);
    drawn_ = true;
    last_progress_ = progress;
    return static_cast<useconds_t>(draw_(rng) * slowdown_);
  }

 private:
  static constexpr int kMaxSlowdown = 16;
  std::uniform_int_distribution<int> draw_;
  int slowdown_ = 1;
  bool drawn_ = false;
  std::uint64_t last_progress_ = 0;
};

}  // namespace pmsnap::testing
