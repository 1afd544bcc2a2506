#include "testutil/temp_pool.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

namespace pmsnap::testing {

std::string PoolDir() {
  const char* dir = std::getenv("PMSNAP_POOL_DIR");
  return (dir != nullptr && *dir != '\0') ? dir : "/dev/shm";
}

TempPoolPath::TempPoolPath(const std::string& tag) {
  static std::atomic<int> counter{0};
  path_ = PoolDir() + "/pmsnap-test-" + tag + "-" + std::to_string(::getpid()) + "-" +
          std::to_string(counter.fetch_add(1)) + ".pool";
  std::filesystem::remove_all(path_);
}

TempPoolPath::~TempPoolPath() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace pmsnap::testing
