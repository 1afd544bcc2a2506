// Bad environments around a pool: a file system that fills up during Pool::Create
// or whose chunk heap runs dry, a read-only mount, a directory or file the
// process may not write, a file system that cannot hold a mapped file. Each
// must give a Status with a code the caller can act on and a message naming
// the file, and lose nothing: no half-created file left behind, and a pool
// already in the same directory still opens to its last committed epoch and
// verifies in full.
//
// Needs root for mount(2) and for dropping to uid 65534: as a normal user the
// mount tests skip (GTEST_SKIP says why) and the permission tests run as the
// user itself, whom mode bits already bind.
//
// A file system where a pool file can be created, written and preallocated
// but not mapped shared is a real FUSE file system served by the test
// itself (testutil/direct_io_fuse.h: files opened with FOPEN_DIRECT_IO, so
// the kernel fails mmap(MAP_SHARED) with ENODEV, as for sshfs -o direct_io);
// no libfuse needed, but mounting needs root like the other mount tests.
// mqueue accepts the file but fails posix_fallocate before the mmap
// (tested, refused up front by its statfs type); proc and sysfs refuse the
// file itself (tested).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>

#include "detail/file_system.h"
#include "pmsnap/pmem_layout/pool.h"
#include "testutil/direct_io_fuse.h"
#include "testutil/pool_fixtures.h"
#include "testutil/scratch_mount.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CheckSeededView;
using pmsnap::testing::ChildStatus;
using pmsnap::testing::DirectIoFuseMount;
using pmsnap::testing::DirectoryEntries;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::RunStatusAsNobody;
using pmsnap::testing::ScratchMount;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::WriteSeededEpoch;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

const Manifest& TestManifest() {
  static const Manifest manifest = MakeManifest(2, 1000);
  return manifest;
}

std::uint64_t TestPoolBytes(const PoolOptions& options = {}) {
  return Pool::RequiredBytes(TestManifest(), options).value();
}

// A closed pool at `path` with epochs 1 and 2 committed.
Status MakeCommittedPool(const std::string& path, const PoolOptions& options = {}) {
  auto pool = Pool::Create(path, TestManifest(), options);
  if (!pool.ok()) return pool.status();
  PMSNAP_RETURN_IF_ERROR(WriteSeededEpoch(**pool, 1, 10, "one"));
  return WriteSeededEpoch(**pool, 2, 20, "two");
}

// "" when the pool at `path` opens to epoch 2 with seed 2's bytes and
// verifies in full (records, data, chunks); else what is wrong.
std::string CommittedPoolProblem(const std::string& path) {
  auto pool = Pool::Open(path, TestManifest());
  if (!pool.ok()) return pool.status().ToString();
  auto latest = (*pool)->Latest();
  if (!latest.ok()) return latest.status().ToString();
  if (latest->epoch() != 2) return "latest epoch is " + std::to_string(latest->epoch());
  const std::string content = CheckSeededView(TestManifest(), *latest, 2);
  if (!content.empty()) return content;
  if (!(*pool)->Verify(/*deep=*/true).ok()) return "deep verification failed";
  return "";
}

// Mounts or skips the test (not root) or fails it (mount refused otherwise).
#define MOUNT_OR_SKIP(mount, type, options)                         \
  do {                                                              \
    const std::string why = (mount).Mount(type, options);           \
    if (why.rfind("skip: ", 0) == 0) GTEST_SKIP() << why.substr(6); \
    ASSERT_EQ(why, "");                                             \
  } while (0)

std::string SizeOption(std::uint64_t bytes) { return "size=" + std::to_string(bytes); }

// --- 1. The file system fills up during Pool::Create ---

TEST(PoolFullFileSystemTest, CreateWithoutPrecheckIsNoSpaceLeavesNothingAndCanBeRetried) {
  ScratchMount mount("full");
  const std::uint64_t pool_bytes = TestPoolBytes();
  // Room for one pool and a little more: the second cannot fit.
  MOUNT_OR_SKIP(mount, "tmpfs", SizeOption(pool_bytes + (4 << 20)));
  const std::string kept = mount.Path("kept.pool");
  ASSERT_TRUE(MakeCommittedPool(kept).ok());

  // Without the free-space check libpmemobj itself meets ENOSPC: what
  // happens when the space goes between the check and the allocation.
  const std::string path = mount.Path("new.pool");
  PoolOptions options;
  options.check_free_space = false;
  auto pool = Pool::Create(path, TestManifest(), options);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kNoSpace) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr(std::to_string(pool_bytes) + " bytes"));
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + mount.dir() + "' has "));
  EXPECT_THAT(DirectoryEntries(mount.dir()), ElementsAre("kept.pool"));
  EXPECT_EQ(CommittedPoolProblem(kept), "");

  // Nothing left behind blocks a retry once there is room.
  ASSERT_EQ(mount.Remount(SizeOption(2 * pool_bytes + (4 << 20)), /*read_only=*/false), "");
  EXPECT_TRUE(Pool::Create(path, TestManifest(), options).ok());
  EXPECT_EQ(CommittedPoolProblem(kept), "");
}

TEST(PoolFullFileSystemTest, CreateWhenInodesRunOutIsNoSpaceThoughThePrecheckPassed) {
  ScratchMount mount("inodes");
  const std::uint64_t pool_bytes = TestPoolBytes();
  // Bytes for two pools, inodes for the root directory and one file.
  MOUNT_OR_SKIP(mount, "tmpfs", SizeOption(2 * pool_bytes + (8 << 20)) + ",nr_inodes=2");
  const std::string kept = mount.Path("kept.pool");
  ASSERT_TRUE(MakeCommittedPool(kept).ok());

  const std::string path = mount.Path("new.pool");
  auto pool = Pool::Create(path, TestManifest());  // free-space check on, and passes
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kNoSpace) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr(" 0 inodes free"));
  EXPECT_THAT(DirectoryEntries(mount.dir()), ElementsAre("kept.pool"));
  EXPECT_EQ(CommittedPoolProblem(kept), "");
}

// --- 2. The chunk heap runs dry ---

TEST(PoolChunkHeapFullTest, BudgetExhaustedIsNoSpaceAndCommittedEpochsSurvive) {
  TempPoolPath path("chunk-heap-full");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  ASSERT_TRUE(MakeCommittedPool(path.path(), options).ok());
  {
    auto pool = Pool::Open(path.path(), TestManifest());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    auto epoch = (*pool)->BeginEpoch(30);
    ASSERT_TRUE(epoch.ok());
    // 100 KiB chunks take 256 KiB of heap each: four fit in 1 MiB.
    Result<ChunkInfo> chunk = Status(StatusCode::kInternal, "no allocation yet");
    int allocated = 0;
    for (; allocated < 10; ++allocated) {
      chunk = (*pool)->chunk_heap().Alloc(100 << 10, *epoch, 7);
      if (!chunk.ok()) break;
    }
    EXPECT_EQ(allocated, 4);
    EXPECT_EQ(chunk.status().code(), StatusCode::kNoSpace) << chunk.status().ToString();
    EXPECT_THAT(chunk.status().message(), HasSubstr("'" + path.path() + "'"));
    EXPECT_THAT(chunk.status().message(), HasSubstr("needs 262144 bytes, 0 of 1048576 free"));
    EXPECT_EQ((*pool)->chunk_heap().List().size(), 4u);
    // A writer that cannot fit its chunks gives the epoch up.
    (*pool)->Abandon();
  }
  EXPECT_EQ(CommittedPoolProblem(path.path()), "");
  // The next epoch frees the abandoned epoch's chunks: the heap is whole again.
  auto pool = Pool::Open(path.path(), TestManifest());
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE((*pool)->BeginEpoch(30).ok());
  EXPECT_EQ((*pool)->chunk_heap().used_bytes(), 0u);
  EXPECT_TRUE((*pool)->chunk_heap().Alloc(900 << 10, 3, 7).ok());
}

TEST(PoolChunkHeapFullTest, FragmentedHeapIsNoSpaceFromLibpmemobjWithTheBudgetFigures) {
  TempPoolPath path("chunk-heap-fragmented");
  PoolOptions options;
  options.chunk_heap_bytes = 64ull << 20;
  ASSERT_TRUE(MakeCommittedPool(path.path(), options).ok());
  auto pool = Pool::Open(path.path(), TestManifest());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto epoch = (*pool)->BeginEpoch(30);
  ASSERT_TRUE(epoch.ok());
  // Fill the budget with 4 KiB chunks, then free all but every 32nd: each
  // run of small chunks (64+ units) keeps one, so libpmemobj cannot hand its
  // space to a large chunk although the budget is nearly all free.
  std::uint64_t small_chunks = 0;
  for (;; ++small_chunks) {
    auto chunk = (*pool)->chunk_heap().Alloc(1024, *epoch, 1);
    if (!chunk.ok()) {
      ASSERT_EQ(chunk.status().code(), StatusCode::kNoSpace) << chunk.status().ToString();
      break;
    }
  }
  ASSERT_EQ(small_chunks, options.chunk_heap_bytes / 4096);
  std::vector<ChunkInfo> chunks = (*pool)->chunk_heap().List();  // by id: offset in the pool
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    if (i % 32 == 0) continue;
    ASSERT_TRUE((*pool)->chunk_heap().Free(chunks[i].id).ok());
  }
  const std::uint64_t used = (*pool)->chunk_heap().used_bytes();
  ASSERT_EQ(used, (chunks.size() + 31) / 32 * 4096);

  const std::uint64_t large = 56ull << 20;  // within the budget's free bytes
  auto chunk = (*pool)->chunk_heap().Alloc(large, *epoch, 2);
  ASSERT_FALSE(chunk.ok()) << "libpmemobj found " << large << " bytes: the heap was not fragmented";
  EXPECT_EQ(chunk.status().code(), StatusCode::kNoSpace) << chunk.status().ToString();
  EXPECT_THAT(chunk.status().message(), HasSubstr("'" + path.path() + "'"));
  EXPECT_THAT(chunk.status().message(), HasSubstr("chunk of " + std::to_string(large) + " bytes"));
  EXPECT_THAT(chunk.status().message(),
              HasSubstr(std::to_string(options.chunk_heap_bytes - used) + " of " +
                        std::to_string(options.chunk_heap_bytes) + " bytes free"));
  // The failed transaction changed nothing: the heap mirror and the pool agree.
  EXPECT_EQ((*pool)->chunk_heap().used_bytes(), used);
  EXPECT_EQ((*pool)->chunk_heap().List().size(), (chunks.size() + 31) / 32);
  (*pool)->Abandon();
  pool->reset();
  EXPECT_EQ(CommittedPoolProblem(path.path()), "");
}

// --- 3. A read-only file system ---

class PoolReadOnlyMountTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MOUNT_OR_SKIP(mount_, "tmpfs", SizeOption(2 * TestPoolBytes() + (8 << 20)));
    ASSERT_TRUE(MakeCommittedPool(kept_).ok());
    ASSERT_EQ(mount_.Remount("", /*read_only=*/true), "");
  }

  ScratchMount mount_{"ro"};
  // The words libpmemobj's messages are searched for ("layout", "size") are
  // in the name on purpose: they must not decide the code.
  const std::string kept_ = mount_.Path("layout-size-kept.pool");
};

TEST_F(PoolReadOnlyMountTest, CreateIsFailedPreconditionNamingThePath) {
  const std::string path = mount_.Path("new.pool");
  auto pool = Pool::Create(path, TestManifest());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kFailedPrecondition) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr("read-only"));
  EXPECT_THAT(DirectoryEntries(mount_.dir()), ElementsAre("layout-size-kept.pool"));
}

TEST_F(PoolReadOnlyMountTest, OpenIsFailedPreconditionAndThePoolSurvives) {
  auto pool = Pool::Open(kept_, TestManifest());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kFailedPrecondition) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + kept_ + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr("read-only"));
  ASSERT_EQ(mount_.Remount("", /*read_only=*/false), "");
  EXPECT_EQ(CommittedPoolProblem(kept_), "");
}

// --- 4. Permission denied ---

// A directory with a committed pool, then write permission taken away:
// directory r-x, pool r--, for everyone (root's child drops to 'nobody').
class PoolPermissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::create_directory(dir_.path()));
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
    ASSERT_TRUE(MakeCommittedPool(kept_).ok());
    ASSERT_EQ(::chmod(kept_.c_str(), 0444), 0);
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0555), 0);
  }
  void TearDown() override { GiveWriteBack(); }

  // Before checking the pool (a normal user needs write access to open it)
  // and before TempPoolPath removes the directory.
  void GiveWriteBack() {
    ::chmod(dir_.path().c_str(), 0755);
    ::chmod(kept_.c_str(), 0644);
  }

  TempPoolPath dir_{"no-write-dir"};
  const std::string kept_ = dir_.path() + "/kept.pool";
};

void ExpectPermissionDenied(const ChildStatus& child, const std::string& path) {
  ASSERT_EQ(child.problem, "");
  EXPECT_EQ(child.status.code(), StatusCode::kFailedPrecondition) << child.status.ToString();
  EXPECT_THAT(child.status.message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(child.status.message(), HasSubstr("permission denied for uid "));
}

TEST_F(PoolPermissionTest, CreateInADirectoryTheUserMayNotWrite) {
  const std::string path = dir_.path() + "/new.pool";
  ExpectPermissionDenied(
      RunStatusAsNobody([&] { return Pool::Create(path, TestManifest()).status(); }), path);
  EXPECT_THAT(DirectoryEntries(dir_.path()), ElementsAre("kept.pool"));
  GiveWriteBack();
  EXPECT_EQ(CommittedPoolProblem(kept_), "");
}

TEST_F(PoolPermissionTest, OpenOfAPoolTheUserMayReadButNotWrite) {
  // libpmemobj opens and maps read-write even to read a pool.
  ExpectPermissionDenied(RunStatusAsNobody([&] { return Pool::Open(kept_).status(); }), kept_);
  GiveWriteBack();
  EXPECT_EQ(CommittedPoolProblem(kept_), "");
}

TEST_F(PoolPermissionTest, OpenOfAPoolTheUserMayNotRead) {
  ASSERT_EQ(::chmod(kept_.c_str(), 0), 0);
  ExpectPermissionDenied(RunStatusAsNobody([&] { return Pool::Open(kept_).status(); }), kept_);
  GiveWriteBack();
  EXPECT_EQ(CommittedPoolProblem(kept_), "");
}

TEST_F(PoolPermissionTest, DirectoryTheUserMayNotSearchIsNotReportedMissing) {
  const std::string inner = dir_.path() + "/inner";
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0755), 0);
  ASSERT_TRUE(std::filesystem::create_directory(inner));
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0), 0);  // inner exists, out of reach

  const std::string path = inner + "/new.pool";
  ChildStatus created =
      RunStatusAsNobody([&] { return Pool::Create(path, TestManifest()).status(); });
  ExpectPermissionDenied(created, path);
  EXPECT_THAT(created.status.message(), HasSubstr("cannot reach directory '" + inner + "'"));
  ExpectPermissionDenied(RunStatusAsNobody([&] { return Pool::Open(path).status(); }), path);

  GiveWriteBack();
  EXPECT_THAT(DirectoryEntries(inner), IsEmpty());
  EXPECT_EQ(CommittedPoolProblem(kept_), "");
}

// --- 5. File systems that cannot hold a mapped pool ---

TEST(PoolUnmappableFileSystemTest, CreateOnMqueueIsInvalidArgumentAndLeavesNothing) {
  ScratchMount mount("mqueue");
  MOUNT_OR_SKIP(mount, "mqueue", "");
  // Every mqueue mount of an IPC namespace shows the same queues (other
  // test processes' too): names are per process, and so is the check.
  const std::string name = "pmsnap-test-" + std::to_string(::getpid());
  const std::string path = mount.Path(name + ".pool");
  auto pool = Pool::Create(path, TestManifest());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr("mqueue"));
  for (const std::string& entry : DirectoryEntries(mount.dir())) {
    EXPECT_NE(entry.rfind(name, 0), 0u) << entry << " left behind";
  }

  // An mqueue file (a message queue) given as a pool: its content is not a
  // pool's, so Open stops before libpmemobj would fail to map it.
  const std::string queue = mount.Path(name + "-queue");
  const int fd = ::open(queue.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ::close(fd);
  auto opened = Pool::Open(queue);
  ::unlink(queue.c_str());  // the queue would outlive the mount
  EXPECT_EQ(opened.status().code(), StatusCode::kNotAPool) << opened.status().ToString();
  EXPECT_THAT(opened.status().message(), HasSubstr("'" + queue + "'"));
}

TEST(PoolUnmappableFileSystemTest, CreateUnderProcOrSysfsIsInvalidArgument) {
  for (const auto& [dir, name] : {std::pair<std::string, std::string>{"/proc", "proc"},
                                  std::pair<std::string, std::string>{"/sys", "sysfs"}}) {
    struct statfs fs {};
    if (::statfs(dir.c_str(), &fs) != 0 ||
        (fs.f_type != PROC_SUPER_MAGIC && fs.f_type != SYSFS_MAGIC)) {
      continue;  // not mounted here (some containers)
    }
    const std::string path = dir + "/pmsnap-test.pool";
    auto pool = Pool::Create(path, TestManifest());
    EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument) << pool.status().ToString();
    EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
    EXPECT_THAT(pool.status().message(), HasSubstr("it is on " + name));
    EXPECT_FALSE(std::filesystem::exists(path));
  }
}

// Mounts `fuse` or skips the test (not root, no /dev/fuse).
#define FUSE_MOUNT_OR_SKIP(fuse)                                    \
  do {                                                              \
    const std::string why = (fuse).Mount();                         \
    if (why.rfind("skip: ", 0) == 0) GTEST_SKIP() << why.substr(6); \
    ASSERT_EQ(why, "");                                             \
  } while (0)

TEST(PoolUnmappableFileSystemTest, CreateWhereSharedMmapIsRefusedNamesThePathAndLeavesNothing) {
  TempPoolPath kept("fuse-kept");
  ASSERT_TRUE(MakeCommittedPool(kept.path()).ok());
  DirectIoFuseMount fuse("create");
  FUSE_MOUNT_OR_SKIP(fuse);
  // The file system works for everything but the shared mapping.
  const std::string probe = fuse.Path("probe");
  const int fd = ::open(probe.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::posix_fallocate(fd, 0, 1 << 20), 0);
  ASSERT_EQ(::pwrite(fd, "pmsnap", 6, 4096), 6);
  void* shared = ::mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int shared_errno = errno;
  void* private_map = ::mmap(nullptr, 1 << 20, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  ::unlink(probe.c_str());
  EXPECT_EQ(shared, MAP_FAILED);
  EXPECT_EQ(shared_errno, ENODEV) << std::strerror(shared_errno);
  ASSERT_NE(private_map, MAP_FAILED);
  ::munmap(private_map, 1 << 20);

  const std::string path = fuse.Path("model.pool");
  auto pool = Pool::Create(path, TestManifest());
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(pool.status().message(), HasSubstr("cannot map the file shared"));
  std::cout << pool.status().ToString() << "\n";
  EXPECT_THAT(fuse.files(), IsEmpty()) << "a failed create must leave no file behind";
  EXPECT_EQ(CommittedPoolProblem(kept.path()), "");
}

TEST(PoolUnmappableFileSystemTest, OpenWhereSharedMmapIsRefusedNamesThePathAndChangesNoByte) {
  TempPoolPath kept("fuse-kept");
  ASSERT_TRUE(MakeCommittedPool(kept.path()).ok());
  DirectIoFuseMount fuse("open");
  FUSE_MOUNT_OR_SKIP(fuse);
  // A committed pool copied onto the file system (a backup restored there,
  // or a directory moved to a network mount).
  const std::string path = fuse.Path("model.pool");
  std::error_code ec;
  std::filesystem::copy_file(kept.path(), path, ec);
  ASSERT_FALSE(ec) << ec.message();
  const auto before = fuse.files();
  ASSERT_EQ(before.count("model.pool"), 1u);

  auto opened = Pool::Open(path, TestManifest());
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kInvalidArgument) << opened.status().ToString();
  EXPECT_THAT(opened.status().message(), HasSubstr("'" + path + "'"));
  EXPECT_THAT(opened.status().message(), HasSubstr("cannot map the file shared"));
  std::cout << opened.status().ToString() << "\n";
  // Nothing lost: the refused pool keeps every byte, and copied back to a
  // file system that maps it, it opens to its last commit.
  EXPECT_TRUE(fuse.files() == before) << "the refused open changed the pool file";
  TempPoolPath copy("fuse-copy");
  std::filesystem::copy_file(path, copy.path(), ec);
  ASSERT_FALSE(ec) << ec.message();
  EXPECT_EQ(CommittedPoolProblem(copy.path()), "");
  EXPECT_EQ(CommittedPoolProblem(kept.path()), "");
}

TEST(PoolUnmappableFileSystemTest, FileSystemTypesAndErrnosMapToCodes) {
  EXPECT_THAT(detail::PoolFileSystemProblem(detail::kMqueueMagic), HasSubstr("mqueue"));
  EXPECT_THAT(detail::PoolFileSystemProblem(PROC_SUPER_MAGIC), HasSubstr("proc"));
  EXPECT_THAT(detail::PoolFileSystemProblem(SYSFS_MAGIC), HasSubstr("sysfs"));
  EXPECT_EQ(detail::PoolFileSystemProblem(TMPFS_MAGIC), "");
  // What the FUSE tests above get from libpmemobj's mmap.
  EXPECT_EQ(detail::ClassifyPoolOsError(ENODEV).code, StatusCode::kInvalidArgument);
  EXPECT_THAT(detail::ClassifyPoolOsError(ENODEV).hint, HasSubstr("map the file shared"));
  EXPECT_EQ(detail::ClassifyPoolOsError(ENOSPC).code, StatusCode::kNoSpace);
  EXPECT_EQ(detail::ClassifyPoolOsError(EDQUOT).code, StatusCode::kNoSpace);
  EXPECT_EQ(detail::ClassifyPoolOsError(EACCES).code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(detail::ClassifyPoolOsError(EPERM).code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(detail::ClassifyPoolOsError(EROFS).code, StatusCode::kFailedPrecondition);
  EXPECT_EQ(detail::ClassifyPoolOsError(EIO).code, StatusCode::kIOError);
}

}  // namespace
}  // namespace pmsnap::layout
