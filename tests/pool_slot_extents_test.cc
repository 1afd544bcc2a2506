// Slots stored in extents (PoolOptions::slot_extent_bytes, format version
// 2): libpmemobj allocates at most one zone (just under 16 GiB) in one
// piece, so a 1.3B-parameter model with AdamW (17 GB of state per slot)
// could not get a pool at all ("allocating pool structures: out of memory",
// first seen on an H200). A larger slot is now split into extents that no
// tensor crosses. Small extents here stand in for the 7.5 GiB default:
//  - a slot larger than an extent is stored in several, written, committed,
//    reopened (also read-only) and verified bit-exact, every tensor
//    contiguous in the file at SlotFileOffset;
//  - a tensor larger than the preferred extent widens it; one larger than
//    libpmemobj can allocate is refused naming it;
//  - a slot that fits in one extent keeps format version 1 (older builds
//    read it); a damaged extent table is reported as such;
//  - with PMSNAP_LARGE_POOL_DIR set (a file system with ~40 GB free, not
//    tmpfs), a pool whose slots exceed 16 GiB is created for real.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "detail/format.h"
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

constexpr std::uint64_t kExtent = 64 << 10;

PoolOptions SmallExtents() {
  PoolOptions options;
  options.part_bytes = 16 << 10;
  options.slot_extent_bytes = kExtent;
  return options;
}

detail::PoolHeader ReadHeader(const std::string& path, std::uint64_t header_offset) {
  detail::PoolHeader header{};
  const int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, &header, sizeof(header), static_cast<off_t>(header_offset)),
            static_cast<ssize_t>(sizeof(header)));
  ::close(fd);
  return header;
}

std::vector<char> FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every tensor of `view` against the file's bytes at SlotFileOffset, and no
// tensor across an extent boundary.
void ExpectTensorsContiguousInTheFile(const Pool& pool, const SnapshotView& view) {
  const std::vector<char> file = FileBytes(pool.path());
  const SlotLayout& slot = pool.layout();
  for (std::uint32_t u = 0; u < slot.units.size(); ++u) {
    for (std::uint32_t t = 0; t < slot.units[u].tensors.size(); ++t) {
      const TensorLayout& tensor = slot.units[u].tensors[t];
      if (tensor.bytes == 0) continue;
      EXPECT_EQ(tensor.slot_offset / slot.extent_bytes,
                (tensor.slot_offset + tensor.bytes - 1) / slot.extent_bytes)
          << "unit " << u << " tensor " << t << " crosses an extent";
      const std::uint64_t at = pool.SlotFileOffset(view.slot(), tensor.slot_offset);
      ASSERT_LE(at + tensor.bytes, file.size());
      EXPECT_EQ(std::memcmp(file.data() + at, view.tensor(u, t).data(), tensor.bytes), 0)
          << "unit " << u << " tensor " << t;
    }
  }
}

TEST(PoolSlotExtents, ASlotLargerThanAnExtentIsStoredInExtentsAndReadsBackBitExact) {
  TempPoolPath path("extents");
  // 6 units of two 32 KiB tensors and a step: about 6 x 64 KiB of slot.
  const Manifest manifest = MakeManifest(6, 8192);
  {
    auto pool = Pool::Create(path.path(), manifest, SmallExtents());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    const FileRegions regions = (*pool)->regions();
    ASSERT_GT(regions.slot_extents[0].size(), 1u);
    ASSERT_EQ(regions.slot_extents[1].size(), regions.slot_extents[0].size());
    EXPECT_EQ((*pool)->slot_extents(0).size(), regions.slot_extents[0].size());
    EXPECT_EQ(ReadHeader(path.path(), regions.header.offset).format_version,
              kFormatVersionSlotExtents);
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20, "extra").ok());
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(CheckSeededView(manifest, *latest, 2), "");
  }
  for (const bool read_only : {false, true}) {
    OpenOptions options;
    options.verify_data = true;
    options.read_only = read_only;
    auto pool = Pool::Open(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok()) << latest.status().ToString();
    EXPECT_EQ(latest->iteration(), 20u);
    EXPECT_EQ(CheckSeededView(manifest, *latest, 2), "") << "read_only " << read_only;
    EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
    ExpectTensorsContiguousInTheFile(**pool, *latest);
  }
  // The older epoch, in the other slot, after a third overwrote the first.
  auto pool = Pool::Open(path.path(), manifest, OpenOptions{});
  ASSERT_TRUE(pool.ok());
  ASSERT_TRUE(WriteSeededEpoch(**pool, 3, 30).ok());
  auto latest = (*pool)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(CheckSeededView(manifest, *latest, 3), "");
  ExpectTensorsContiguousInTheFile(**pool, *latest);
}

TEST(PoolSlotExtents, ATensorLargerThanTheExtentWidensIt) {
  TempPoolPath path("extents-wide");
  Manifest manifest = MakeManifest(3, 8192);  // 32 KiB tensors
  manifest.units[1].tensors[0].shape = {16, 8192};  // 512 KiB
  {
    auto pool = Pool::Create(path.path(), manifest, SmallExtents());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_EQ((*pool)->layout().extent_bytes, 512u << 10);
    ASSERT_GT((*pool)->layout().extent_used.size(), 1u);
    ASSERT_TRUE(WriteSeededEpoch(**pool, 5, 50).ok());
  }
  auto reopened = Pool::Open(path.path(), manifest, OpenOptions{});
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  auto latest = (*reopened)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(CheckSeededView(manifest, *latest, 5), "");
}

TEST(PoolSlotExtents, ATensorLargerThanLibpmemobjCanAllocateIsRefusedNamingIt) {
  Manifest manifest = MakeManifest(2, 1024);
  manifest.units[1].tensors[1].shape = {4, 1ll << 30};  // 16 GiB of floats
  auto required = Pool::RequiredBytes(manifest, PoolOptions{});
  ASSERT_FALSE(required.ok());
  EXPECT_EQ(required.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(required.status().message(), HasSubstr("unit 'layer1.weight' tensor 'exp_avg'"));
  EXPECT_THAT(required.status().message(), HasSubstr("split or shard"));
}

TEST(PoolSlotExtents, AnExtentSizeThatIsNotAPageMultipleIsRefused) {
  PoolOptions options;
  options.slot_extent_bytes = 5000;
  auto required = Pool::RequiredBytes(MakeManifest(2, 1024), options);
  ASSERT_FALSE(required.ok());
  EXPECT_THAT(required.status().message(), HasSubstr("slot_extent_bytes 5000"));
}

TEST(PoolSlotExtents, ASlotThatFitsInOneExtentKeepsFormatVersion1) {
  TempPoolPath path("extents-one");
  auto pool = Pool::Create(path.path(), MakeManifest(2, 1024), SmallExtents());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const FileRegions regions = (*pool)->regions();
  EXPECT_EQ(regions.slot_extents[0].size(), 1u);
  const detail::PoolHeader header = ReadHeader(path.path(), regions.header.offset);
  EXPECT_EQ(header.format_version, kFormatVersion);
  EXPECT_EQ(header.slot_extent_bytes, 0u);
  EXPECT_EQ(header.slot_extent_table_offset, 0u);
}

TEST(PoolSlotExtents, ADamagedExtentTableIsReportedAsCorruption) {
  TempPoolPath path("extents-damaged");
  const Manifest manifest = MakeManifest(6, 8192);
  std::uint64_t table = 0;
  {
    auto pool = Pool::Create(path.path(), manifest, SmallExtents());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
    table = ReadHeader(path.path(), (*pool)->regions().header.offset).slot_extent_table_offset;
  }
  ASSERT_NE(table, 0u);
  {
    std::fstream file(path.path(), std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(table + 9));
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(static_cast<std::streamoff>(table + 9));
    file.write(&byte, 1);
  }
  for (const bool read_only : {false, true}) {
    OpenOptions options;
    options.read_only = read_only;
    auto pool = Pool::Open(path.path(), manifest, options);
    ASSERT_FALSE(pool.ok()) << "read_only " << read_only;
    EXPECT_EQ(pool.status().code(), StatusCode::kCorruption);
    EXPECT_THAT(pool.status().message(), HasSubstr("slot extent table checksum mismatch"));
    EXPECT_THAT(pool.status().message(), HasSubstr(path.path()));
  }
}

// libpmemobj's own limit, for real: two slots of 18 GiB (before extents:
// "allocating pool structures: out of memory"). The file is preallocated,
// not written, so it needs a file system with room for it (not tmpfs).
TEST(PoolSlotExtents, SlotsOverLibpmemobjsLargestAllocationAreCreated) {
  const char* dir = std::getenv("PMSNAP_LARGE_POOL_DIR");
  if (dir == nullptr || *dir == '\0') {
    GTEST_SKIP() << "set PMSNAP_LARGE_POOL_DIR to a file system with ~40 GB free";
  }
  const std::string path = std::string(dir) + "/pmsnap-large-extents-" +
                           std::to_string(::getpid()) + ".pool";
  Manifest manifest;
  for (int u = 0; u < 3; ++u) {
    UnitSpec unit;
    unit.name = "layer" + std::to_string(u) + ".weight";
    unit.tensors.push_back({"param", DType::kFloat32, {1536, 1ll << 20}});  // 6 GiB
    manifest.units.push_back(unit);
  }
  PoolOptions options;
  options.prefault_mapping = false;
  {
    auto pool = Pool::Create(path, manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_EQ((*pool)->layout().extent_used.size(), 3u);  // 7.5 GiB extents, one tensor each
    EXPECT_GT((*pool)->layout().slot_bytes, 16ull << 30);
  }
  {
    OpenOptions open_options;
    open_options.prefault_mapping = false;
    auto reopened = Pool::Open(path, manifest, open_options);
    EXPECT_TRUE(reopened.ok()) << reopened.status().ToString();
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace pmsnap::layout
