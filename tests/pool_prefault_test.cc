// Prefaulting memory for writing (pmsnap/common/page_prefault.h) and the
// pool's background prefault of its mapping (OpenOptions::prefault_mapping):
// every page is faulted in for writing, no byte changes (also beside
// writers), destruction stops it promptly, and with the option off nothing
// is faulted in.
//
// "Faulted in for writing" is checked where it matters: a write into every
// page afterwards takes no page fault (getrusage RUSAGE_THREAD). The page
// table's present bits (/proc/self/pagemap) are checked too. mincore is not
// enough on its own: for a file mapping it reports the page cache, and a
// pool file is allocated in full at creation.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <thread>
#include <vector>

#include "detail/prefault_order.h"
#include "pmsnap/common/page_prefault.h"
#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using Clock = std::chrono::steady_clock;
using pmsnap::PoolDirectory;
using pmsnap::testing::CheckSeededView;
using pmsnap::testing::MakeManifest;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::WriteSeededEpoch;
using State = PrefaultProgress::State;

constexpr auto kSettleTimeout = std::chrono::seconds(60);

std::uint64_t ThreadMinorFaults() {
  rusage usage{};
  ::getrusage(RUSAGE_THREAD, &usage);
  return static_cast<std::uint64_t>(usage.ru_minflt);
}

// Minor faults this thread takes writing one byte (unchanged) into every
// page of [data, data + bytes). Writes without reading first: a read fault
// of a shared tmpfs mapping maps up to 16 pages around it (fault-around),
// writable. A compare-and-swap writes even when it fails (x86 `lock
// cmpxchg`), and then writes back the value it found. Not instrumented by
// the sanitizers (scripts/sanitize.sh): their check of each store reads the
// shadow memory of the page, whose first read is a fault of its own (one per
// 8 pages under ASan), counted here as if the prefault had missed the page.
__attribute__((no_sanitize("address", "thread")))
std::uint64_t FaultsWritingEveryPage(std::byte* data, std::size_t bytes) {
  const std::uint64_t before = ThreadMinorFaults();
  for (std::size_t offset = 0; offset < bytes; offset += PageBytes()) {
    unsigned char guess = 0;
    __atomic_compare_exchange_n(reinterpret_cast<unsigned char*>(data + offset), &guess, guess,
                                /*weak=*/false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  }
  return ThreadMinorFaults() - before;
}

// Pages of [data, data + bytes) whose page-table entry is present, or -1
// when /proc/self/pagemap cannot be read here.
long PresentPages(const std::byte* data, std::size_t bytes) {
  const std::uintptr_t page = PageBytes();
  const auto first = reinterpret_cast<std::uintptr_t>(data) / page;
  const std::size_t count = bytes / page;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY);
  if (fd < 0) return -1;
  std::vector<std::uint64_t> entries(count);
  const ssize_t got =
      ::pread(fd, entries.data(), count * 8, static_cast<off_t>(first * sizeof(std::uint64_t)));
  ::close(fd);
  if (got != static_cast<ssize_t>(count * 8)) return -1;
  long present = 0;
  for (std::uint64_t entry : entries) present += (entry >> 63) & 1;
  return present;
}

// Pages of [data, data + bytes) that mincore reports resident.
std::size_t ResidentPages(std::byte* data, std::size_t bytes) {
  const std::size_t count = bytes / PageBytes();
  std::vector<unsigned char> resident(count);
  if (::mincore(data, bytes, resident.data()) != 0) return 0;
  std::size_t n = 0;
  for (unsigned char r : resident) n += r & 1;
  return n;
}

// Page faults are counted reliably only where nothing write-protects pages
// behind our back (a disk file system's writeback does).
bool PoolDirIsTmpfs() {
  struct statfs fs {};
  return ::statfs(PoolDirectory().c_str(), &fs) == 0 && fs.f_type == TMPFS_MAGIC;
}

std::vector<char> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

bool KernelHasPopulateWrite() {
  void* page =
      ::mmap(nullptr, PageBytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  const bool has =
      PopulatePages(static_cast<std::byte*>(page), PageBytes(), kMadvPopulateWrite) != EINVAL;
  ::munmap(page, PageBytes());
  return has;
}

// A file in the pool directory of `bytes` seeded bytes, written with write()
// so that a fresh mapping of it has no page-table entries yet.
class SeededFileMapping {
 public:
  SeededFileMapping(const std::string& tag, std::size_t bytes)
      : path_(PoolDirectory() + "/pmsnap-prefault-" + tag + "-" + std::to_string(::getpid())),
        bytes_(bytes),
        expected_(bytes) {
    for (std::size_t i = 0; i < bytes; ++i) {
      expected_[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
    }
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return;
    const bool written = ::write(fd, expected_.data(), bytes) == static_cast<ssize_t>(bytes);
    void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (written && mapped != MAP_FAILED) data_ = static_cast<std::byte*>(mapped);
  }
  ~SeededFileMapping() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
    std::filesystem::remove(path_);
  }
  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  bool unchanged() const { return std::memcmp(data_, expected_.data(), bytes_) == 0; }

 private:
  std::string path_;
  std::size_t bytes_;
  std::vector<std::byte> expected_;
  std::byte* data_ = nullptr;
};

class PagePrefaulterTest : public ::testing::TestWithParam<PrefaultMethod> {};

TEST_P(PagePrefaulterTest, FaultsInTheRangesPagesForWritingAndChangesNoByte) {
  const std::size_t page = PageBytes();
  SeededFileMapping memory("exact", 96 * page);
  ASSERT_NE(memory.data(), nullptr);
  // Two ranges with ragged ends, across a piece boundary (pieces of 4
  // pages), both within the first 40 pages.
  std::byte* base = memory.data();
  PagePrefaulter prefaulter(
      {{base + 30 * page + 100, 10 * page - 200}, {base + page + 7, 10 * page - 7}}, GetParam(),
      4 * page);
  ASSERT_TRUE(prefaulter.WaitUntilSettled(kSettleTimeout));
  const PrefaultProgress progress = prefaulter.progress();
  EXPECT_EQ(progress.state, State::kDone) << progress.problem;
  EXPECT_EQ(progress.bytes_done, progress.bytes_total);
  EXPECT_EQ(progress.bytes_total, 20 * page - 207);
  // Before anything reads the memory (a read maps pages too).
  const long present = PresentPages(base, memory.bytes());
  if (present >= 0) {
    EXPECT_EQ(PresentPages(base + page, 10 * page), 10);
    EXPECT_EQ(PresentPages(base + 30 * page, 10 * page), 10);
    // A read fault maps the cached pages of its 16-page block (aligned in
    // the address space) too (fault-around); write faults map only their
    // page. Pages 64.. are out of reach of either.
    if (GetParam() == PrefaultMethod::kPopulateWrite) {
      EXPECT_EQ(present, 20);
    }
    EXPECT_EQ(PresentPages(base + 64 * page, 32 * page), 0);
  }
  if (PoolDirIsTmpfs()) {
    EXPECT_EQ(FaultsWritingEveryPage(base + page, 10 * page), 0u);
    EXPECT_EQ(FaultsWritingEveryPage(base + 30 * page, 10 * page), 0u);
    EXPECT_EQ(FaultsWritingEveryPage(base + 64 * page, 32 * page), 32u)
        << "the check cannot see faults";
  }
  EXPECT_TRUE(memory.unchanged());
}

TEST_P(PagePrefaulterTest, LeavesBytesThatOtherThreadsWriteMeanwhile) {
  const std::size_t page = PageBytes();
  constexpr std::size_t kPages = 64;
  SeededFileMapping memory("concurrent", kPages * page);
  ASSERT_NE(memory.data(), nullptr);
  // A writer changes the very bytes the prefault touches (the first of each
  // page) while prefaults run over the memory again and again, and checks
  // before each store that the byte still holds its previous store: a
  // prefault that wrote back a value it had read earlier would revert one.
  std::atomic<bool> stop_writing{false};
  std::uint64_t reverted = 0;
  std::atomic<std::uint64_t> stores{0};
  std::thread writer([&] {
    std::vector<unsigned char> last(kPages);
    for (std::size_t p = 0; p < kPages; ++p) {
      last[p] = __atomic_load_n(reinterpret_cast<unsigned char*>(memory.data() + p * page),
                                __ATOMIC_RELAXED);
    }
    while (!stop_writing.load(std::memory_order_relaxed)) {
      for (std::size_t p = 0; p < kPages; ++p) {
        auto* byte = reinterpret_cast<unsigned char*>(memory.data() + p * page);
        if (__atomic_load_n(byte, __ATOMIC_RELAXED) != last[p]) ++reverted;
        last[p] = static_cast<unsigned char>(last[p] + 1);
        __atomic_store_n(byte, last[p], __ATOMIC_RELAXED);
        stores.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });
  // Prefaults go on until the writer has made ten passes over the pages
  // beside them (and at least 11 prefaults ran): measured by what the writer
  // did, not by how long that takes on this machine.
  const std::uint64_t stores_before = stores.load(std::memory_order_relaxed);
  int rounds = 0;
  for (; rounds <= 10 || stores.load(std::memory_order_relaxed) - stores_before < 10 * kPages;
       ++rounds) {
    PagePrefaulter prefaulter({{memory.data(), memory.bytes()}}, GetParam(), 16 * page);
    ASSERT_TRUE(prefaulter.WaitUntilSettled(kSettleTimeout));
  }
  stop_writing = true;
  writer.join();
  EXPECT_EQ(reverted, 0u) << "in " << stores.load() << " stores beside " << rounds << " prefaults";
  EXPECT_GT(rounds, 10);
}

TEST_P(PagePrefaulterTest, StopReturnsWithoutWaitingForTheWholeWork) {
  // 256 MiB: seconds where a page fault costs ~20 us (some VMs), tens of
  // milliseconds on bare metal; Stop waits for one 2 MiB piece at most.
  SeededFileMapping memory("stop", 256u << 20);
  ASSERT_NE(memory.data(), nullptr);
  std::optional<PagePrefaulter> prefaulter;
  prefaulter.emplace(std::vector<PrefaultRange>{{memory.data(), memory.bytes()}}, GetParam());
  const auto stop_start = Clock::now();
  prefaulter->Stop();
  const double stop_seconds = std::chrono::duration<double>(Clock::now() - stop_start).count();
  const PrefaultProgress progress = prefaulter->progress();
  EXPECT_EQ(progress.state, State::kStopped);
  EXPECT_LT(progress.bytes_done, progress.bytes_total);
  EXPECT_LT(stop_seconds, 0.5);
  EXPECT_TRUE(prefaulter->WaitUntilSettled(std::chrono::seconds(0)));
  prefaulter.reset();
  EXPECT_TRUE(memory.unchanged());
}

TEST_P(PagePrefaulterTest, PauseHoldsTheThreadBackUntilResume) {
  constexpr std::uint64_t kPiece = 1u << 20;
  // The check needs work left beyond the one piece that may be in flight
  // when Pause comes. A test thread descheduled right after the
  // constructor (a loaded machine; CI once found the prefault done) comes
  // too late: then it tries again, on fresh pages.
  std::optional<SeededFileMapping> memory;
  std::optional<PagePrefaulter> prefaulter;
  std::uint64_t paused_at = 0;
  for (int attempt = 0; attempt < 20; ++attempt) {
    prefaulter.reset();
    memory.emplace("pause-" + std::to_string(attempt), 64u << 20);
    ASSERT_NE(memory->data(), nullptr);
    prefaulter.emplace(std::vector<PrefaultRange>{{memory->data(), memory->bytes()}},
                       GetParam(), kPiece);
    prefaulter->Pause();
    prefaulter->Pause();  // counted
    // The one piece in progress when Pause came may still finish, on a fast
    // machine or a slow one; no other piece may start. Bounded by what was
    // done at Pause, not by how long the piece takes here.
    paused_at = prefaulter->progress().bytes_done;
    if (paused_at + kPiece < memory->bytes()) break;
  }
  ASSERT_LT(paused_at + kPiece, memory->bytes()) << "the prefault always finished before Pause";
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_LE(prefaulter->progress().bytes_done, paused_at + kPiece);
  prefaulter->Resume();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_LE(prefaulter->progress().bytes_done, paused_at + kPiece);
  EXPECT_EQ(prefaulter->progress().state, State::kRunning);
  prefaulter->Resume();
  ASSERT_TRUE(prefaulter->WaitUntilSettled(kSettleTimeout));
  EXPECT_EQ(prefaulter->progress().state, State::kDone);
  EXPECT_EQ(prefaulter->progress().bytes_done, memory->bytes());
  prefaulter.reset();
  EXPECT_TRUE(memory->unchanged());
}

TEST_P(PagePrefaulterTest, FinishHelpsAndEmptyWorkIsDoneAtOnce) {
  SeededFileMapping memory("finish", 8u << 20);
  ASSERT_NE(memory.data(), nullptr);
  PagePrefaulter prefaulter({{memory.data(), memory.bytes()}}, GetParam(), 64u << 10);
  prefaulter.Finish();
  EXPECT_EQ(prefaulter.progress().state, State::kDone);
  EXPECT_EQ(prefaulter.progress().bytes_done, memory.bytes());
  EXPECT_TRUE(memory.unchanged());

  PagePrefaulter idle({});
  EXPECT_TRUE(idle.WaitUntilSettled(std::chrono::seconds(0)));
  EXPECT_EQ(idle.progress().state, State::kDone);
}

INSTANTIATE_TEST_SUITE_P(Methods, PagePrefaulterTest,
                         ::testing::Values(PrefaultMethod::kAuto, PrefaultMethod::kPopulateWrite,
                                           PrefaultMethod::kTouch),
                         [](const ::testing::TestParamInfo<PrefaultMethod>& info) {
                           switch (info.param) {
                             case PrefaultMethod::kAuto:
                               return "Auto";
                             case PrefaultMethod::kPopulateWrite:
                               return "PopulateWrite";
                             case PrefaultMethod::kTouch:
                               return "Touch";
                           }
                           return "Invalid";
                         });

TEST(PagePrefaulterAutoTest, PopulatesNewPagesAndTouchesPagesAlreadyCached) {
  if (!PoolDirIsTmpfs()) GTEST_SKIP() << "page-cache behaviour checked on tmpfs";
  const std::size_t bytes = 8u << 20;
  // Written: every page is in the page cache, read faults map 16 at once.
  SeededFileMapping cached("auto-cached", bytes);
  ASSERT_NE(cached.data(), nullptr);
  PagePrefaulter on_cached({{cached.data(), bytes}}, PrefaultMethod::kAuto);
  ASSERT_TRUE(on_cached.WaitUntilSettled(kSettleTimeout));
  EXPECT_EQ(on_cached.progress().state, State::kDone);
  EXPECT_EQ(on_cached.progress().bytes_populated, 0u);
  EXPECT_EQ(FaultsWritingEveryPage(cached.data(), bytes), 0u);

  // Allocated but never written (as a new pool's slots): each page is zeroed
  // on its first fault, one at a time.
  const std::string path =
      PoolDirectory() + "/pmsnap-prefault-auto-new-" + std::to_string(::getpid());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(bytes)), 0);
  void* mapped = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* fresh = static_cast<std::byte*>(mapped);
  {
    PagePrefaulter on_fresh({{fresh, bytes}}, PrefaultMethod::kAuto);
    ASSERT_TRUE(on_fresh.WaitUntilSettled(kSettleTimeout));
    EXPECT_EQ(on_fresh.progress().state, State::kDone);
    EXPECT_EQ(on_fresh.progress().bytes_populated, KernelHasPopulateWrite() ? bytes : 0u);
  }
  EXPECT_EQ(FaultsWritingEveryPage(fresh, bytes), 0u);
  for (std::size_t i = 0; i < bytes; i += 4096) ASSERT_EQ(fresh[i], std::byte{0}) << i;
  ::munmap(mapped, bytes);
  std::filesystem::remove(path);
}

TEST(PrefaultOrderTest, NamedRegionsComeFirstWholePagesEachPageOnce) {
  const std::uint64_t page = 4096;
  const std::uint64_t file = 100 * page;
  // Ragged, overlapping and past-the-end regions.
  const FileRegion wanted[] = {{40 * page + 10, 5 * page},   // pages 40..45
                               {42 * page, 2 * page},        // already given
                               {10 * page, page + 1},        // pages 10, 11
                               {98 * page + 5, 10 * page}};  // clipped: 98, 99
  const std::vector<FileRegion> order = detail::PrefaultOrder(wanted, file, page);
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> expected = {
      {40, 6}, {10, 2}, {98, 2}, {0, 10}, {12, 28}, {46, 52}};
  ASSERT_EQ(order.size(), expected.size());
  for (std::size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(order[i].offset, expected[i].first * page) << i;
    EXPECT_EQ(order[i].bytes, expected[i].second * page) << i;
  }
  EXPECT_TRUE(detail::PrefaultOrder({}, 0, page).empty());
  const std::vector<FileRegion> whole = detail::PrefaultOrder({}, file, page);
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(whole[0].bytes, file);
}

// The whole mapping of an open pool (pool offsets are file offsets).
std::span<std::byte> Mapping(const Pool& pool) {
  std::byte* base = pool.slot_extents(0)[0].data() - pool.regions().slot_data[0].offset;
  return {base, pool.file_bytes()};
}

// Manifest of `units` units of 4 MiB floats (plus small tensors).
Manifest LargeManifest(int units) { return MakeManifest(units, 1 << 20); }

TEST(PoolPrefaultTest, FreshPoolMappingIsFaultedInForWritingWithoutChangingAByte) {
  TempPoolPath path("prefault-fresh");
  const Manifest manifest = LargeManifest(4);
  auto pool = Pool::Create(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ASSERT_TRUE((*pool)->WaitForPrefault(kSettleTimeout));
  const PrefaultProgress progress = (*pool)->prefault_progress();
  ASSERT_EQ(progress.state, State::kDone) << progress.problem;
  EXPECT_EQ(progress.bytes_total, (*pool)->file_bytes());
  EXPECT_EQ(progress.bytes_done, progress.bytes_total);
  EXPECT_GT(progress.seconds, 0);
  EXPECT_NE(std::string(progress.method), "off");
  if (PoolDirIsTmpfs() && KernelHasPopulateWrite()) {
    // Create leaves the slots' pages untouched (new pages): kAuto populates
    // them rather than read-faulting each.
    const std::uint64_t slot_bytes = (*pool)->layout().slot_bytes;
    EXPECT_GE(progress.bytes_populated, 2 * slot_bytes - (4u << 20));
  }

  const std::span<std::byte> mapping = Mapping(**pool);
  const std::size_t pages = mapping.size() / PageBytes();
  EXPECT_EQ(ResidentPages(mapping.data(), mapping.size()), pages);
  const long present = PresentPages(mapping.data(), mapping.size());
  if (present >= 0) {
    EXPECT_EQ(static_cast<std::size_t>(present), pages);
  }
  if (PoolDirIsTmpfs()) {
    // Fails when the prefault is off: thousands of faults.
    EXPECT_EQ(FaultsWritingEveryPage(mapping.data(), mapping.size()), 0u);
  }
  ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
  EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
}

TEST(PoolPrefaultTest, OpenPrefaultsTheMappingAndChangesNoByteOfThePool) {
  TempPoolPath path("prefault-open");
  TempPoolPath copy_off("prefault-open-off");
  TempPoolPath copy_on("prefault-open-on");
  const Manifest manifest = LargeManifest(3);
  {
    PoolOptions options;
    options.chunk_heap_bytes = 4 << 20;
    auto pool = Pool::Create(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10, "one").ok());
    ASSERT_TRUE(WriteSeededEpoch(**pool, 2, 20, "two").ok());
    auto chunk = (*pool)->chunk_heap().Alloc(100000, 2, 7);
    ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
    ASSERT_TRUE((*pool)->chunk_heap().Seal(chunk->id).ok());
  }
  std::filesystem::copy_file(path.path(), copy_off.path());
  std::filesystem::copy_file(path.path(), copy_on.path());
  // The same open and close with and without the prefault. libpmemobj
  // stores run-time pointers in its own metadata at open, so the files are
  // compared where pmsnap keeps its data: header, manifest, commit records,
  // slots and chunks.
  std::vector<FileRegion> compared;
  {
    OpenOptions off;
    off.prefault_mapping = false;
    auto pool = Pool::Open(copy_off.path(), manifest, off);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    EXPECT_EQ((*pool)->prefault_progress().bytes_total, 0u);
    const FileRegions regions = (*pool)->regions();
    compared = {regions.header,         regions.manifest,     regions.record[0],
                regions.record[1],      regions.slot_data[0], regions.slot_data[1],
                regions.chunk_heap_root};
    for (const ChunkInfo& chunk : (*pool)->chunk_heap().List()) {
      compared.push_back({chunk.id, 128 + chunk.bytes});  // ChunkHeader + payload
    }
  }
  {
    auto pool = Pool::Open(copy_on.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE((*pool)->WaitForPrefault(kSettleTimeout));
    EXPECT_EQ((*pool)->prefault_progress().state, State::kDone);
    const std::span<std::byte> mapping = Mapping(**pool);
    if (PoolDirIsTmpfs()) {
      EXPECT_EQ(FaultsWritingEveryPage(mapping.data(), mapping.size()), 0u);
    }
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(CheckSeededView(manifest, *latest, 2), "");
    EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
  }
  const std::vector<char> bytes_off = ReadFile(copy_off.path());
  const std::vector<char> bytes_on = ReadFile(copy_on.path());
  ASSERT_EQ(bytes_off.size(), bytes_on.size());
  ASSERT_EQ(compared.size(), 8u);
  for (const FileRegion& region : compared) {
    ASSERT_LE(region.offset + region.bytes, bytes_on.size());
    EXPECT_EQ(std::memcmp(bytes_off.data() + region.offset, bytes_on.data() + region.offset,
                          region.bytes),
              0)
        << "the prefault changed bytes in [" << region.offset << ", "
        << region.offset + region.bytes << ")";
  }
}

TEST(PoolPrefaultTest, WritersBesideThePrefaultKeepEveryByte) {
  TempPoolPath path("prefault-writers");
  const Manifest manifest = LargeManifest(16);
  PoolOptions options;
  options.part_bytes = 1 << 20;
  auto pool = Pool::Create(path.path(), manifest, options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  // Epochs written from two threads right away, while the prefault works
  // through the same slots.
  const auto& parts = (*pool)->layout().parts;
  for (std::uint64_t epoch = 1; epoch <= 3; ++epoch) {
    ASSERT_TRUE((*pool)->BeginEpoch(epoch * 10).ok());
    std::vector<std::vector<std::byte>> tensors;
    for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
      for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
        tensors.push_back(pmsnap::testing::SeededTensor(manifest, epoch, u, t));
      }
    }
    auto write_share = [&](std::size_t first) {
      for (std::size_t p = first; p < parts.size(); p += 2) {
        const PartLayout& part = parts[p];
        const std::size_t tensor_index = part.unit * 3 + part.tensor;
        ASSERT_TRUE((*pool)
                        ->WritePart(static_cast<std::uint32_t>(p),
                                    tensors[tensor_index].data() + part.offset_in_tensor)
                        .ok());
      }
    };
    std::thread other(write_share, 1);
    write_share(0);
    other.join();
    ASSERT_TRUE((*pool)->Commit().ok());
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok());
    EXPECT_EQ(CheckSeededView(manifest, *latest, epoch), "") << "epoch " << epoch;
  }
  ASSERT_TRUE((*pool)->WaitForPrefault(kSettleTimeout));
  EXPECT_EQ((*pool)->prefault_progress().state, State::kDone);
  EXPECT_TRUE((*pool)->Verify(/*deep=*/true).ok());
  pool->reset();
  auto reopened = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  auto latest = (*reopened)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(latest->epoch(), 3u);
  EXPECT_EQ(CheckSeededView(manifest, *latest, 3), "");
}

TEST(PoolPrefaultTest, DestroyingThePoolStopsThePrefaultPromptly) {
  TempPoolPath path("prefault-close");
  // ~530 MiB of mapping: long to fault in where faults are slow.
  const Manifest manifest = LargeManifest(32);
  {
    auto pool = Pool::Create(path.path(), manifest);
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_TRUE(WriteSeededEpoch(**pool, 1, 10).ok());
  }
  auto pool = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  // How fast this machine faults pages in: the time the prefault takes for
  // 8 MiB once it has started (the deadline only guards against a hang).
  const auto guard = Clock::now() + std::chrono::seconds(60);
  auto wait_for_bytes = [&](std::uint64_t bytes) {
    PrefaultProgress now = (*pool)->prefault_progress();
    while (now.state == State::kRunning && now.bytes_done < bytes && Clock::now() < guard) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      now = (*pool)->prefault_progress();
    }
    return std::make_pair(now, Clock::now());
  };
  const auto [started, started_at] = wait_for_bytes(1);
  const auto [before, measured_at] = wait_for_bytes(started.bytes_done + (8u << 20));
  const auto close_start = Clock::now();
  pool->reset();
  const double close_seconds = std::chrono::duration<double>(Clock::now() - close_start).count();
  auto reopened = Pool::Open(path.path(), manifest);
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_TRUE((*reopened)->Verify(/*deep=*/true).ok());
  auto latest = (*reopened)->Latest();
  ASSERT_TRUE(latest.ok());
  EXPECT_EQ(CheckSeededView(manifest, *latest, 1), "");
  // What closing costs with no prefault left to stop (libpmemobj's close,
  // the unmap): small here, but proportional to the mapping where unmapping
  // is expensive, e.g. 3.5 s under ThreadSanitizer, which resets the shadow
  // memory of the whole 530 MiB range.
  ASSERT_TRUE((*reopened)->WaitForPrefault(kSettleTimeout));
  const auto idle_close_start = Clock::now();
  reopened->reset();
  const double idle_close_seconds =
      std::chrono::duration<double>(Clock::now() - idle_close_start).count();
  if (before.state == State::kRunning && before.bytes_done > started.bytes_done) {
    // Stopped, not finished: closing takes a small part of what faulting in
    // the rest would take at the rate just observed (a piece, not ~500 MiB),
    // beyond what closing costs anyway.
    const double seconds_per_byte =
        std::chrono::duration<double>(measured_at - started_at).count() /
        static_cast<double>(before.bytes_done - started.bytes_done);
    const double rest_seconds =
        seconds_per_byte * static_cast<double>(before.bytes_total - before.bytes_done);
    // Where the whole prefault is that quick, it cannot tell stopping from
    // finishing.
    EXPECT_LT(close_seconds, std::max(0.5, rest_seconds / 4) + idle_close_seconds)
        << "after " << before.bytes_done << " of " << before.bytes_total << " bytes, "
        << rest_seconds << " s to finish, " << idle_close_seconds << " s to close when idle";
  }
}

TEST(PoolPrefaultTest, OffFaultsNothingIn) {
  TempPoolPath path("prefault-off");
  const Manifest manifest = LargeManifest(4);
  PoolOptions options;
  options.prefault_mapping = false;
  auto pool = Pool::Create(path.path(), manifest, options);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_TRUE((*pool)->WaitForPrefault(std::chrono::seconds(0)));
  const PrefaultProgress progress = (*pool)->prefault_progress();
  EXPECT_STREQ(progress.method, "off");
  EXPECT_EQ(progress.bytes_total, 0u);
  EXPECT_EQ(progress.bytes_done, 0u);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // libpmemobj reads the allocation header in front of each slot, and a
  // read fault maps up to 16 pages around it.
  constexpr std::size_t kFaultAroundPages = 16;
  for (int slot = 0; slot < 2; ++slot) {
    const std::span<std::byte> data = (*pool)->slot_extents(slot)[0];  // one piece
    const std::size_t pages = data.size() / PageBytes();
    const long present = PresentPages(data.data(), pages * PageBytes());
    if (present >= 0) {
      EXPECT_LE(static_cast<std::size_t>(present), kFaultAroundPages) << "slot " << slot;
    }
    if (PoolDirIsTmpfs()) {
      EXPECT_GE(FaultsWritingEveryPage(data.data(), data.size()), pages - kFaultAroundPages)
          << "slot " << slot;
    }
  }
}

}  // namespace
}  // namespace pmsnap::layout
