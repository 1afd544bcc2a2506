// Bad or damaged pool files: each gives its own clear error naming the file
// and what is wrong, never a crash and never a partial load.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <libpmemobj.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "detail/file_system.h"
#include "detail/format.h"
#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/pool.h"
#include "testutil/manifest_rewrite.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CheckSeededView;
using pmsnap::testing::FlipBit;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::WriteSeededEpoch;
using ::testing::HasSubstr;

class DamagedPoolTest : public ::testing::Test {
 protected:
  // A pool with epochs 1 (slot 1) and 2 (slot 0) committed, closed.
  void SetUp() override {
    auto pool = Pool::Create(path_.path(), manifest_);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10, "one").ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20, "two").ok());
    regions_ = (*pool)->regions();
    SetWarningSink([this](const std::string& w) { warnings_.push_back(w); });
  }
  void TearDown() override { SetWarningSink(nullptr); }

  TempPoolPath path_{"damaged"};
  Manifest manifest_ = MakeManifest(3, 3000);
  FileRegions regions_;
  std::vector<std::string> warnings_;
};

TEST(PoolOpenTest, MissingFileIsNotFound) {
  auto pool = Pool::Open(pmsnap::PoolDirectory() + "/pmsnap-does-not-exist.pool");
  EXPECT_EQ(pool.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(pool.status().message(), HasSubstr("pmsnap-does-not-exist.pool"));
}

TEST(PoolOpenTest, DirectoryIsRejected) {
  TempPoolPath path("dir");
  std::filesystem::create_directory(path.path());
  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("is a directory"));
}

TEST(PoolOpenTest, EmptyFileIsNotAPool) {
  TempPoolPath path("empty");
  std::ofstream(path.path()).close();
  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kNotAPool);
  EXPECT_THAT(pool.status().message(), HasSubstr("empty"));
}

TEST(PoolOpenTest, ArbitraryFileIsNotAPool) {
  TempPoolPath path("text");
  std::ofstream out(path.path());
  for (int i = 0; i < 400000; ++i) out << "not a pool ";
  out.close();
  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kNotAPool);
  EXPECT_THAT(pool.status().message(), HasSubstr(path.path()));
}

TEST(PoolOpenTest, PmdkPoolOfAnotherProgramIsNotAPool) {
  TempPoolPath path("other-layout");
  PMEMobjpool* pop = pmemobj_create(path.path().c_str(), "someone-else", PMEMOBJ_MIN_POOL, 0644);
  ASSERT_NE(pop, nullptr) << pmemobj_errormsg();
  pmemobj_close(pop);
  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kNotAPool) << pool.status().ToString();
}

TEST(PoolOpenTest, HalfCreatedPoolWithoutHeaderIsNotAPool) {
  TempPoolPath path("half-created");
  PMEMobjpool* pop = pmemobj_create(path.path().c_str(), kPoolLayoutName, PMEMOBJ_MIN_POOL, 0644);
  ASSERT_NE(pop, nullptr) << pmemobj_errormsg();
  pmemobj_root(pop, sizeof(detail::PoolRoot));
  pmemobj_close(pop);
  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kNotAPool);
  EXPECT_THAT(pool.status().message(), HasSubstr("never completely created"));
}

TEST(PoolOpenTest, PoolOpenTwiceIsBusy) {
  TempPoolPath path("twice");
  auto first = Pool::Create(path.path(), MakeManifest(1, 10));
  ASSERT_TRUE(first.ok());
  auto second = Pool::Open(path.path());
  EXPECT_EQ(second.status().code(), StatusCode::kBusy) << second.status().ToString();
}

TEST(PoolCreateTest, ExistingFileIsNeverOverwritten) {
  TempPoolPath path("exists");
  std::ofstream(path.path()) << "precious";
  auto pool = Pool::Create(path.path(), MakeManifest(1, 10));
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  std::ifstream in(path.path());
  std::string content;
  in >> content;
  EXPECT_EQ(content, "precious");
}

// [architecture2]: the existence check and the final rename are apart, and
// a plain rename replaced a file created between them.
TEST(PoolCreateTest, AFileThatAppearsWhileThePoolIsBuiltIsNeverReplaced) {
  TempPoolPath path("create-race");
  detail::SetBeforeCreateRenameForTesting([](const char* target) {
    std::ofstream(target) << "squatter";
  });
  auto pool = Pool::Create(path.path(), MakeManifest(1, 64));
  detail::SetBeforeCreateRenameForTesting(nullptr);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("already exists"));
  std::ifstream in(path.path());
  const std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "squatter");
  const std::filesystem::path dir = std::filesystem::path(path.path()).parent_path();
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().string().find(path.path() + ".creating-"), std::string::npos)
        << entry.path();
  }
}

TEST(PoolCreateTest, FileSystemTooSmallReportsNeededAndFreeBytes) {
  TempPoolPath path("too-big");
  Manifest manifest;
  for (int u = 0; u < 11; ++u) {  // 11 x 64 tensors of 6 GiB: 4.1 TiB
    UnitSpec unit{"huge" + std::to_string(u), {}, 0};
    for (int t = 0; t < 64; ++t) {
      unit.tensors.push_back({"t" + std::to_string(t), DType::kFloat32, {1536, 1ll << 20}});
    }
    manifest.units.push_back(unit);
  }
  auto pool = Pool::Create(path.path(), manifest);
  EXPECT_EQ(pool.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(pool.status().message(), HasSubstr("needs"));
  EXPECT_THAT(pool.status().message(), HasSubstr("free"));
  EXPECT_FALSE(std::filesystem::exists(path.path()));
}

TEST(PoolCreateTest, HugetlbfsIsRefusedBeforeLibpmemobjCanAbort) {
  EXPECT_THAT(detail::PoolFileSystemProblem(HUGETLBFS_MAGIC), HasSubstr("hugetlbfs"));
  EXPECT_EQ(detail::PoolFileSystemProblem(TMPFS_MAGIC), "");
  EXPECT_EQ(detail::PoolFileSystemProblem(EXT4_SUPER_MAGIC), "");

  // End to end where a hugetlbfs mount exists (mounting one needs root and
  // reserved huge pages; CI machines have none).
  std::ifstream mounts("/proc/mounts");
  std::string line, mount_point;
  while (std::getline(mounts, line)) {
    std::istringstream fields(line);
    std::string device, where, type;
    fields >> device >> where >> type;
    if (type == "hugetlbfs" && ::access(where.c_str(), W_OK) == 0) mount_point = where;
  }
  if (mount_point.empty()) GTEST_SKIP() << "no writable hugetlbfs mount";
  const std::string path = mount_point + "/pmsnap-hugetlbfs-test.pool";
  auto pool = Pool::Create(path, MakeManifest(1, 10));
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument) << pool.status().ToString();
  EXPECT_THAT(pool.status().message(), HasSubstr(path));
  EXPECT_THAT(pool.status().message(), HasSubstr("hugetlbfs"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(PoolCreateTest, LeftoversOfAKilledCreationAreRemoved) {
  TempPoolPath path("leftover");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a pid that no longer runs
  const std::string leftover = path.path() + ".creating-" + std::to_string(child);
  std::ofstream(leftover) << "half a pool";
  ASSERT_TRUE(Pool::Create(path.path(), MakeManifest(1, 10)).ok());
  EXPECT_FALSE(std::filesystem::exists(leftover));
}

TEST(PoolCreateTest, InvalidManifestIsRejected) {
  TempPoolPath path("invalid");
  Manifest manifest = MakeManifest(2, 10);
  manifest.units[1].name = manifest.units[0].name;
  auto pool = Pool::Create(path.path(), manifest);
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(pool.status().message(), HasSubstr("duplicate"));
}

TEST(PoolCommitTest, ExtraStateLargerThanConfiguredIsRefusedAndEpochStaysOpen) {
  TempPoolPath path("extra");
  PoolOptions options;
  options.extra_state_capacity = 16;
  const Manifest manifest = MakeManifest(1, 10);
  auto pool = Pool::Create(path.path(), manifest, options);
  ASSERT_TRUE(pool.ok());
  Status too_big = WriteSeededEpoch(**pool, 1, 1, std::string(17, 'x'));
  EXPECT_EQ(too_big.code(), StatusCode::kCapacityExceeded);
  EXPECT_THAT(too_big.message(), HasSubstr("17 bytes"));
  EXPECT_TRUE((*pool)->open_epoch().has_value());
  std::string fits(16, 'y');
  EXPECT_TRUE((*pool)->Commit({reinterpret_cast<const std::byte*>(fits.data()), fits.size()}).ok());
}

TEST_F(DamagedPoolTest, TruncatedPoolIsReportedNotMapped) {
  std::filesystem::resize_file(path_.path(), std::filesystem::file_size(path_.path()) / 2);
  auto pool = [&] {
#if defined(__SANITIZE_ADDRESS__)
    // libpmemobj 1.12 leaks what it allocated when pmemobj_open rejects the
    // truncated file; LeakSanitizer would blame this test for it.
    __lsan::ScopedDisabler pmdk_leaks_on_this_path;
#endif
    return Pool::Open(path_.path());
  }();
  ASSERT_FALSE(pool.ok());
  EXPECT_THAT(pool.status().message(), HasSubstr(path_.path()));
}

TEST_F(DamagedPoolTest, TruncatedBelowMinimumPoolSizeIsCorruption) {
  std::filesystem::resize_file(path_.path(), 1 << 20);
  auto pool = Pool::Open(path_.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(pool.status().message(), HasSubstr("truncated"));
}

TEST_F(DamagedPoolTest, UnknownFormatVersionIsUnsupported) {
  // A well-formed header from a future version: valid checksum, version 99.
  detail::PoolHeader header{};
  const int fd = ::open(path_.path().c_str(), O_RDWR);
  ASSERT_EQ(::pread(fd, &header, sizeof(header), regions_.header.offset),
            static_cast<ssize_t>(sizeof(header)));
  header.format_version = 99;
  header.header_checksum = 0;
  header.header_checksum = Checksum64(&header, sizeof(header));
  ASSERT_EQ(::pwrite(fd, &header, sizeof(header), regions_.header.offset),
            static_cast<ssize_t>(sizeof(header)));
  ::close(fd);
  auto pool = Pool::Open(path_.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kUnsupportedVersion);
  EXPECT_THAT(pool.status().message(), HasSubstr("version 99"));
}

TEST_F(DamagedPoolTest, FlippedBitInHeaderIsCorruption) {
  for (std::uint64_t field : {8ull, 24ull, 40ull, 100ull, 140ull}) {
    FlipBit(path_.path(), regions_.header.offset + field);
    auto pool = Pool::Open(path_.path());
    EXPECT_EQ(pool.status().code(), StatusCode::kCorruption) << field;
    EXPECT_THAT(pool.status().message(), HasSubstr("header")) << field;
    FlipBit(path_.path(), regions_.header.offset + field);
  }
  EXPECT_TRUE(Pool::Open(path_.path()).ok());
}

// Found by tests/fuzz/pool_open_fuzz.cc (a timeout): a manifest whose shapes
// were changed under valid checksums made the open lay out billions of parts
// (hanging, then running out of memory) before it compared the layout with
// the header. The open must refuse it at once, naming the slot size.
TEST(PoolOpenTest, ManifestTooLargeForItsSlotIsCorruption) {
  TempPoolPath path("huge-manifest");
  const Manifest manifest = MakeManifest(2, 3000);
  PoolOptions options;
  options.part_bytes = 4096;
  FileRegions regions;
  {
    auto pool = Pool::Create(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    regions = (*pool)->regions();
  }
  // Same encoded length (dims are fixed-width), 2^46 bytes for one tensor.
  Manifest huge = manifest;
  huge.units[0].tensors[0].shape = {16, std::int64_t{1} << 40};
  pmsnap::testing::RewriteManifest(path.path(), regions.header.offset, huge);

  auto pool = Pool::Open(path.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(pool.status().message(), HasSubstr("need more than the header's slot"));
  EXPECT_THAT(pool.status().message(), HasSubstr(path.path()));
}

// Found by tests/fuzz/pool_open_fuzz.cc (undefined behaviour under UBSan):
// a damaged chunk-list head pointing one byte past a chunk made the open read
// a ChunkHeader at a misaligned address. Only the UBSan build and the fuzz
// build saw the old failure; here the open must keep the slots and report
// the damaged list, with no chunks.
TEST(PoolOpenTest, MisalignedChunkListHeadIsADamagedList) {
  TempPoolPath path("misaligned-chunk");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  FileRegions regions;
  std::uint64_t chunk_id = 0;
  {
    auto pool = Pool::Create(path.path(), MakeManifest(1, 1000), options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    auto chunk = (*pool)->chunk_heap().Alloc(100, 1, 7);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    ASSERT_TRUE((*pool)->chunk_heap().Seal(chunk->id).ok());
    chunk_id = chunk->id;
    regions = (*pool)->regions();
  }
  const std::uint64_t misaligned_head = chunk_id + 1;
  const int fd = ::open(path.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, &misaligned_head, sizeof(misaligned_head),
                     regions.chunk_heap_root.offset + offsetof(detail::ChunkHeapRoot, head_offset)),
            static_cast<ssize_t>(sizeof(misaligned_head)));
  ::close(fd);

  std::vector<std::string> warnings;
  SetWarningSink([&warnings](const std::string& w) { warnings.push_back(w); });
  auto pool = Pool::Open(path.path());
  SetWarningSink(nullptr);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->Latest().ok());
  EXPECT_TRUE((*pool)->chunk_heap().List().empty());
  ASSERT_FALSE(warnings.empty());
  EXPECT_THAT(warnings.front(), HasSubstr("chunk list is damaged"));
}

// Found by tests/fuzz/pool_open_fuzz.cc (pointer overflow under UBSan): the
// open's walk of a damaged chunk list stops at the damage, but the last chunk
// it kept still points on. Freeing that chunk (the orphan sweep of the next
// BeginEpoch) wrote its prev offset into whatever the damaged pointer named:
// here the committed slot's data, which then failed its checksum.
TEST(PoolOpenTest, FreeingTheLastChunkBeforeADamagedLinkWritesNothingElse) {
  TempPoolPath path("damaged-next");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  FileRegions regions;
  std::uint64_t orphan = 0;
  {
    auto pool = Pool::Create(path.path(), MakeManifest(1, 1000), options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    // Epoch 2 never commits: the next BeginEpoch frees this chunk.
    auto chunk = (*pool)->chunk_heap().Alloc(100, 2, 7);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    orphan = chunk->id;
    regions = (*pool)->regions();
  }
  const int latest_slot = 1;  // epoch 1
  const std::uint64_t into_slot_data = regions.slot_data[latest_slot].offset;
  const int fd = ::open(path.path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, &into_slot_data, sizeof(into_slot_data),
                     orphan + offsetof(detail::ChunkHeader, next_offset)),
            static_cast<ssize_t>(sizeof(into_slot_data)));
  ::close(fd);

  SetWarningSink([](const std::string&) {});
  {
    auto pool = Pool::Open(path.path());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_EQ((*pool)->chunk_heap().List().size(), 1u);
    ASSERT_TRUE((*pool)->BeginEpoch(20).ok());  // sweeps the orphan
    (*pool)->Abandon();
    EXPECT_TRUE((*pool)->chunk_heap().List().empty());
  }
  auto pool = Pool::Open(path.path());
  SetWarningSink(nullptr);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_EQ(latest->slot(), latest_slot);
  EXPECT_EQ(CheckSeededView((*pool)->manifest(), *latest, 1), "");
}

TEST_F(DamagedPoolTest, FlippedBitInManifestIsCorruption) {
  FlipBit(path_.path(), regions_.manifest.offset + regions_.manifest.bytes / 2);
  auto pool = Pool::Open(path_.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(pool.status().message(), HasSubstr("manifest"));
}

TEST_F(DamagedPoolTest, FlippedBitInNewestCommitRecordFallsBackWithWarning) {
  FlipBit(path_.path(), regions_.record[0].offset + 8);  // iteration of epoch 2
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->epoch(), 1u);
  EXPECT_EQ(CheckSeededView(manifest_, *latest, 1), "");
  ASSERT_EQ((*pool)->warnings().size(), 1u);
  EXPECT_THAT((*pool)->warnings()[0], HasSubstr("falling back"));
  EXPECT_THAT((*pool)->warnings()[0], HasSubstr("commit record"));
  ASSERT_EQ(warnings_.size(), 1u);  // also reported through the sink
}

TEST_F(DamagedPoolTest, FlippedBitInPartChecksumTableFallsBack) {
  FlipBit(path_.path(), regions_.record[0].offset + 64 + 8);
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->Latest()->epoch(), 1u);
}

TEST_F(DamagedPoolTest, FlippedBitInUnitDataFallsBackAndNamesTheUnit) {
  const std::uint64_t offset = regions_.slot_data[0].offset + regions_.slot_data[0].bytes / 2;
  FlipBit(path_.path(), offset);
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->Latest()->epoch(), 1u);
  EXPECT_EQ(CheckSeededView(manifest_, *(*pool)->Latest(), 1), "");
  ASSERT_EQ((*pool)->warnings().size(), 1u);
  EXPECT_THAT((*pool)->warnings()[0], HasSubstr("layer1.weight"));
  VerifyReport report = (*pool)->Verify(/*deep=*/true);
  EXPECT_FALSE(report.ok());
  EXPECT_EQ(report.slots[0].problems.size(), 1u);
  EXPECT_TRUE(report.slots[1].problems.empty());
  EXPECT_EQ(report.recoverable_slot, std::optional<int>(1));
}

TEST_F(DamagedPoolTest, NextEpochAfterFallbackOverwritesTheDamagedSlot) {
  FlipBit(path_.path(), regions_.slot_data[0].offset + 5);
  {
    auto pool = Pool::Open(path_.path());
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 22, 21).ok());
    EXPECT_EQ((*pool)->Latest()->epoch(), 2u);
    EXPECT_EQ((*pool)->Latest()->slot(), 0);
  }
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_TRUE((*pool)->warnings().empty());
  EXPECT_EQ(CheckSeededView(manifest_, *(*pool)->Latest(), 22), "");
}

OpenOptions Deferred() {
  OpenOptions options;
  options.defer_data_verification = true;
  return options;
}

// The first part of `view` that fails ReadPart, if any.
std::optional<std::uint32_t> FirstDamagedPart(const Pool& pool, const SnapshotView& view) {
  for (std::uint32_t p = 0; p < pool.layout().parts.size(); ++p) {
    std::vector<std::byte> buffer(pool.layout().parts[p].bytes);
    Status read = pool.ReadPart(view, p, buffer.data());
    if (read.code() == StatusCode::kCorruption) return p;
    EXPECT_TRUE(read.ok()) << read.ToString();
  }
  return std::nullopt;
}

TEST_F(DamagedPoolTest, DeferredVerificationFindsDamagedDataWhileReadingAndFallsBack) {
  FlipBit(path_.path(), regions_.slot_data[0].offset + regions_.slot_data[0].bytes / 2);
  auto pool = Pool::Open(path_.path(), Deferred());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->warnings().empty());
  ASSERT_EQ((*pool)->Latest()->epoch(), 2u);
  std::optional<std::uint32_t> damaged = FirstDamagedPart(**pool, *(*pool)->Latest());
  ASSERT_TRUE(damaged.has_value());
  EXPECT_TRUE((*pool)->data_verification_pending());
  ASSERT_TRUE((*pool)->RejectLatest(*damaged).ok());
  EXPECT_FALSE((*pool)->data_verification_pending());
  EXPECT_EQ((*pool)->Latest()->epoch(), 1u);
  EXPECT_EQ(CheckSeededView(manifest_, *(*pool)->Latest(), 1), "");
  ASSERT_EQ((*pool)->warnings().size(), 1u);
  EXPECT_THAT((*pool)->warnings()[0], HasSubstr("falling back"));
  EXPECT_THAT((*pool)->warnings()[0], HasSubstr("layer1.weight"));
  EXPECT_EQ(FirstDamagedPart(**pool, *(*pool)->Latest()), std::nullopt);
}

TEST_F(DamagedPoolTest, DeferredVerificationEndsBeforeTheFirstEpochOverwritesASlot) {
  FlipBit(path_.path(), regions_.slot_data[0].offset + 5);
  {
    auto pool = Pool::Open(path_.path(), Deferred());
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->Latest()->epoch(), 2u);  // not known to be damaged yet
    ASSERT_TRUE(WriteSeededEpoch(**pool, 22, 21).ok());
    EXPECT_EQ((*pool)->Latest()->epoch(), 2u);  // epoch 2 again, over the damaged slot
    EXPECT_EQ((*pool)->Latest()->slot(), 0);
    EXPECT_THAT((*pool)->warnings(), ::testing::Contains(HasSubstr("falling back")));
  }
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_TRUE((*pool)->warnings().empty());
  EXPECT_EQ(CheckSeededView(manifest_, *(*pool)->Latest(), 22), "");
  EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());  // epoch 1 in slot 1 untouched
}

TEST_F(DamagedPoolTest, DeferredVerificationWithBothSlotsDamagedIsCorruptionWhenRejecting) {
  FlipBit(path_.path(), regions_.slot_data[0].offset + 5);
  FlipBit(path_.path(), regions_.record[1].offset + 16);
  auto pool = Pool::Open(path_.path(), Deferred());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  std::optional<std::uint32_t> damaged = FirstDamagedPart(**pool, *(*pool)->Latest());
  ASSERT_TRUE(damaged.has_value());
  Status rejected = (*pool)->RejectLatest(*damaged);
  EXPECT_EQ(rejected.code(), StatusCode::kCorruption);
  EXPECT_THAT(rejected.message(), HasSubstr("no committed slot verifies"));
  EXPECT_THAT(rejected.message(), HasSubstr("slot 0"));
  EXPECT_THAT(rejected.message(), HasSubstr("slot 1"));
  EXPECT_EQ((*pool)->Latest().status().code(), StatusCode::kNotFound);
  // Later epochs number on past the damaged ones.
  ASSERT_TRUE(WriteSeededEpoch(**pool, 3, 30).ok());
  EXPECT_EQ((*pool)->Latest()->epoch(), 3u);
}

TEST_F(DamagedPoolTest, BothSlotsDamagedIsCorruptionNeverAPartialLoad) {
  FlipBit(path_.path(), regions_.slot_data[0].offset + 5);
  FlipBit(path_.path(), regions_.record[1].offset + 16);
  auto pool = Pool::Open(path_.path());
  EXPECT_EQ(pool.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(pool.status().message(), HasSubstr("no committed slot verifies"));
  EXPECT_THAT(pool.status().message(), HasSubstr("slot 0"));
  EXPECT_THAT(pool.status().message(), HasSubstr("slot 1"));
}

TEST_F(DamagedPoolTest, FlippedBitInExtraStateFallsBack) {
  const std::uint64_t parts = 9;  // 3 units x 3 tensors, each one part
  FlipBit(path_.path(), regions_.record[0].offset + 64 + 8 * parts + 1);  // inside "two"
  auto pool = Pool::Open(path_.path());
  ASSERT_TRUE(pool.ok());
  EXPECT_EQ((*pool)->Latest()->epoch(), 1u);
}

TEST_F(DamagedPoolTest, PoolOfAnotherModelNamesTheFirstDifferentUnit) {
  Manifest other = manifest_;
  other.units[2].tensors[0].shape = {16, 999};
  auto pool = Pool::Open(path_.path(), other);
  EXPECT_EQ(pool.status().code(), StatusCode::kModelMismatch);
  EXPECT_THAT(pool.status().message(), HasSubstr("layer2.weight"));
  EXPECT_THAT(pool.status().message(), HasSubstr("shape"));

  Manifest fewer = manifest_;
  fewer.units.pop_back();
  auto pool2 = Pool::Open(path_.path(), fewer);
  EXPECT_EQ(pool2.status().code(), StatusCode::kModelMismatch);
  EXPECT_THAT(pool2.status().message(), HasSubstr("layer2.weight"));
}

TEST(ChunkCorruptionTest, DamagedChunkPayloadIsCorruptionNamingTheChunk) {
  TempPoolPath path("chunk-damaged");
  PoolOptions options;
  options.chunk_heap_bytes = 1 << 20;
  std::uint64_t id = 0;
  {
    auto pool = Pool::Create(path.path(), MakeManifest(1, 16), options);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 1).ok());
    auto chunk = (*pool)->chunk_heap().Alloc(512, 1, 77);
    ASSERT_TRUE(chunk.ok());
    id = chunk->id;
    std::memset((*pool)->chunk_heap().Payload(id)->data(), 0x5a, 512);
    ASSERT_TRUE((*pool)->chunk_heap().Seal(id).ok());
  }
  FlipBit(path.path(), id + 128 + 100);
  auto pool = Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  auto payload = (*pool)->chunk_heap().Read(id);
  EXPECT_EQ(payload.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(payload.status().message(), HasSubstr("tag 77"));
  EXPECT_FALSE((*pool)->Verify(true).ok());
}

}  // namespace
}  // namespace pmsnap::layout
