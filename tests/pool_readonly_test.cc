// Read-only opens (OpenOptions::read_only), what every reader uses (pmsnap
// verify, info; list, export, load_state_dict): the first users found
// `pmsnap verify` and friends changing 134-171 bytes of the pool
// (libpmemobj's own open writes its run id and descriptors), and a reader
// running in a loop made trainer starts fail with Busy.
//
//  - a read-only open finds the root where libpmemobj put it and reads the
//    same checkpoint as a libpmemobj open;
//  - the file stays byte for byte as it was: healthy, damaged or truncated;
//  - it refuses writes, takes no lock (a trainer opens meanwhile), reports
//    a pool held open as kBusy naming the process, and notices a trainer
//    that opened the pool while it was being read.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using ::testing::HasSubstr;
using pmsnap::testing::CheckSeededView;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::WriteSeededEpoch;

OpenOptions ReadOnly() {
  OpenOptions options;
  options.read_only = true;
  options.verify_data = true;
  return options;
}

std::vector<char> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A pool with two committed epochs (seeds 1 and 2).
void MakePool(const std::string& path) {
  PoolOptions options;
  options.part_bytes = 16 << 10;
  options.chunk_heap_bytes = 1 << 20;
  auto pool = Pool::Create(path, MakeManifest(3, 8192), options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
  ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20, "extra").ok());
}

// Everything a reader does with a pool it opened.
void ReadEverything(Pool& pool) {
  (void)pool.Verify(/*deep=*/true);
  auto latest = pool.Latest();
  if (latest.ok()) {
    std::vector<std::byte> buffer(pool.options().part_bytes);
    for (std::uint32_t p = 0; p < pool.layout().parts.size(); ++p) {
      (void)pool.ReadPart(*latest, p, buffer.data());
    }
  }
  for (int s = 0; s < 2; ++s) (void)pool.Slot(s);
  for (const ChunkInfo& chunk : pool.chunk_heap().List()) (void)pool.chunk_heap().Read(chunk.id);
}

TEST(PoolReadOnlyTest, FindsTheRootWhereLibpmemobjPutsItAndReadsTheSameCheckpoint) {
  TempPoolPath path("readonly-root");
  MakePool(path.path());
  std::uint64_t header_offset = 0;
  {
    auto pool = Pool::Open(path.path());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    header_offset = (*pool)->regions().header.offset;
  }
  auto pool = Pool::Open(path.path(), ReadOnly());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->regions().header.offset, header_offset);
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->iteration(), 20u);
  EXPECT_EQ(CheckSeededView((*pool)->manifest(), *latest, 2), "");
  EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
  EXPECT_TRUE((*pool)->CheckUndisturbed().ok());
}

TEST(PoolReadOnlyTest, LeavesHealthyDamagedAndTruncatedPoolsByteForByteAsTheyWere) {
  TempPoolPath path("readonly-bytes");
  MakePool(path.path());
  std::uint64_t slot_data = 0;
  {
    auto pool = Pool::Open(path.path(), ReadOnly());
    ASSERT_TRUE(pool.ok());
    slot_data = (*pool)->regions().slot_data[0].offset;
  }
  auto check_unchanged = [&](const std::string& what) {
    const std::vector<char> before = FileBytes(path.path());
    for (int round = 0; round < 2; ++round) {
      auto pool = Pool::Open(path.path(), ReadOnly());
      if (pool.ok()) ReadEverything(**pool);
    }
    EXPECT_TRUE(FileBytes(path.path()) == before) << what << ": a read-only open wrote the file";
  };
  check_unchanged("healthy");
  // Damaged: a flipped byte in slot 0's data.
  {
    std::fstream file(path.path(), std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(static_cast<std::streamoff>(slot_data + 100));
    file.put('\x5a');
  }
  check_unchanged("damaged");
  auto damaged = Pool::Open(path.path(), ReadOnly());
  ASSERT_TRUE(damaged.ok());
  EXPECT_FALSE((*damaged)->Verify(/*deep=*/true).ok());
  damaged->reset();
  // Truncated: the reader says how long the file is and must be.
  const auto size = std::filesystem::file_size(path.path());
  std::filesystem::resize_file(path.path(), size / 2);
  check_unchanged("truncated");
  auto truncated = Pool::Open(path.path(), ReadOnly());
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(truncated.status().message(), HasSubstr(std::to_string(size / 2) + " bytes"));
  EXPECT_THAT(truncated.status().message(),
              HasSubstr("expected a file of " + std::to_string(size) + " bytes"));
  // The writers' open says so too (libpmemobj's own: "pool initialization failed").
  auto writer = Pool::Open(path.path());
  ASSERT_FALSE(writer.ok());
  EXPECT_THAT(writer.status().message(),
              HasSubstr("expected a file of " + std::to_string(size) + " bytes"));
}

TEST(PoolReadOnlyTest, RefusesEveryWrite) {
  TempPoolPath path("readonly-writes");
  MakePool(path.path());
  auto pool = Pool::Open(path.path(), ReadOnly());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->BeginEpoch(30).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*pool)->DiscardOlderEpoch().status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*pool)->ForgetEpochs("test").status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*pool)->chunk_heap().Alloc(64, 3, 0).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST(PoolReadOnlyTest, ReadersTakeNoLockAndReportAPoolHeldOpenAsBusy) {
  TempPoolPath path("readonly-busy");
  MakePool(path.path());
  {
    // A reader holds the pool: a trainer still opens it.
    auto reader = Pool::Open(path.path(), ReadOnly());
    ASSERT_TRUE(reader.ok());
    auto trainer = Pool::Open(path.path());
    ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
    // ...and the reader learns that what it reads may be torn.
    const Status disturbed = (*reader)->CheckUndisturbed();
    EXPECT_EQ(disturbed.code(), StatusCode::kBusy);
    EXPECT_THAT(disturbed.message(), HasSubstr(path.path()));
    // A reader opening now: busy, naming the process.
    auto late = Pool::Open(path.path(), ReadOnly());
    ASSERT_FALSE(late.ok());
    EXPECT_EQ(late.status().code(), StatusCode::kBusy);
    EXPECT_THAT(late.status().message(), HasSubstr("process " + std::to_string(::getpid())));
  }
  // The trainer closed: a reader that opened after it is undisturbed.
  auto reader = Pool::Open(path.path(), ReadOnly());
  ASSERT_TRUE(reader.ok());
  EXPECT_TRUE((*reader)->CheckUndisturbed().ok());
}

}  // namespace
}  // namespace pmsnap::layout
