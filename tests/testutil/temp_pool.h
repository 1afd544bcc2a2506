// Test helpers: unique pool paths under PoolDirectory() ($PMSNAP_POOL_DIR,
// default /dev/shm), removed when the owner goes out of scope.
#pragma once

#include <cstdint>
#include <string>

#include "pmsnap/common/pool_directory.h"

namespace pmsnap::testing {

// Flips one bit of the byte at `offset` of a closed file (fault injection);
// a gtest failure if the file cannot be read or written there.
void FlipBit(const std::string& path, std::uint64_t offset, int bit = 3);

// A unique file path for one test; the file (if created) is removed on
// destruction. Not thread-safe to share; cheap to create per test.
class TempPoolPath {
 public:
  explicit TempPoolPath(const std::string& tag);
  ~TempPoolPath();
  TempPoolPath(const TempPoolPath&) = delete;
  TempPoolPath& operator=(const TempPoolPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace pmsnap::testing
