#include "testutil/temp_pool.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>

namespace pmsnap::testing {

void FlipBit(const std::string& path, std::uint64_t offset, int bit) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << "cannot open " << path;
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1) << path << " @" << offset;
  byte ^= static_cast<unsigned char>(1u << bit);
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1) << path << " @" << offset;
  ::close(fd);
}

TempPoolPath::TempPoolPath(const std::string& tag) {
  static std::atomic<int> counter{0};
  path_ = PoolDirectory() + "/pmsnap-test-" + tag + "-" + std::to_string(::getpid()) + "-" +
          std::to_string(counter.fetch_add(1)) + ".pool";
  std::filesystem::remove_all(path_);
}

TempPoolPath::~TempPoolPath() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
  // Crash tests kill children inside Pool::Create: drop their temporaries.
  const std::filesystem::path pool(path_);
  const std::string prefix = pool.filename().string() + ".creating-";
  for (const auto& entry : std::filesystem::directory_iterator(pool.parent_path(), ignored)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) {
      std::filesystem::remove(entry.path(), ignored);
    }
  }
}

}  // namespace pmsnap::testing
