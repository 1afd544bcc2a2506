// StateArena (hooks/state_arena.h): optimizer state packed into huge-page
// advised regions. Checks the packing, the alignment the kernel needs for
// huge pages, and that the memory lives exactly as long as its tensors.
// The state warm-up (a touching PagePrefaulter): faults in exactly its
// ranges' pages and changes no byte.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "pmsnap/common/page_prefault.h"
#include "state_arena.h"

namespace pmsnap::hooks {
namespace {

std::uintptr_t Address(const torch::Tensor& t) {
  return reinterpret_cast<std::uintptr_t>(t.data_ptr());
}

bool IsMapped(std::uintptr_t address) {
  const long page = ::sysconf(_SC_PAGESIZE);
  unsigned char resident = 0;
  void* start = reinterpret_cast<void*>(address / page * page);
  return ::mincore(start, 1, &resident) == 0 || errno != ENOMEM;
}

TEST(StateArenaTest, TensorsMatchTheirModelAndDoNotOverlap) {
  StateArena arena;
  const std::vector<torch::Tensor> models = {
      torch::zeros({512, 512}), torch::zeros({3}), torch::zeros({7, 5}, torch::kFloat64),
      torch::zeros({2048, 512}), torch::zeros({1}, torch::kInt64)};
  std::vector<torch::Tensor> made;
  for (const auto& m : models) {
    torch::Tensor t = arena.EmptyLike(m);
    EXPECT_EQ(t.sizes(), m.sizes());
    EXPECT_EQ(t.dtype(), m.dtype());
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(Address(t) % 64, 0u) << "libtorch's CPU alignment";
    made.push_back(t);
  }
  for (std::size_t i = 0; i < made.size(); ++i) made[i].fill_(static_cast<double>(i + 1));
  for (std::size_t i = 0; i < made.size(); ++i) {
    EXPECT_TRUE(torch::all(made[i] == static_cast<double>(i + 1)).item<bool>())
        << "tensor " << i << " was overwritten by a neighbour";
  }
}

TEST(StateArenaTest, RegionsStartOnHugePageBoundariesAndLargeTensorsGetTheirOwn) {
  constexpr std::size_t kRegion = 4u << 20;
  StateArena arena(kRegion);
  torch::Tensor first = arena.EmptyLike(torch::zeros({1000}));
  EXPECT_EQ(Address(first) % StateArena::kHugePageBytes, 0u);
  torch::Tensor second = arena.EmptyLike(torch::zeros({1000}));
  EXPECT_EQ(Address(second), Address(first) + 4032) << "packed: 4000 bytes rounded up to 64";
  // 12 MiB: more than a region, so a region of its own, huge-page aligned.
  torch::Tensor large = arena.EmptyLike(torch::zeros({3 << 20}));
  EXPECT_EQ(Address(large) % StateArena::kHugePageBytes, 0u);
  large.fill_(2.0f);
  EXPECT_EQ(large.sum().item<float>(), 2.0f * (3 << 20));
  // The next small tensor does not fit after `large`: a fresh region.
  torch::Tensor after = arena.EmptyLike(torch::zeros({1000}));
  EXPECT_EQ(Address(after) % StateArena::kHugePageBytes, 0u);
}

TEST(StateArenaTest, TensorsOutliveTheArenaAndTheLastOneUnmapsTheRegion) {
  torch::Tensor survivor;
  std::uintptr_t address = 0;
  {
    StateArena arena(2u << 20);
    torch::Tensor dropped = arena.EmptyLike(torch::zeros({100}));
    survivor = arena.EmptyLike(torch::zeros({100}));
    address = Address(survivor);
    survivor.fill_(5.0f);
  }  // arena and `dropped` gone
  EXPECT_TRUE(IsMapped(address));
  EXPECT_EQ(survivor.sum().item<float>(), 500.0f);
  survivor = torch::Tensor();
  EXPECT_FALSE(IsMapped(address)) << "the region stayed mapped after its last tensor";
}

TEST(StateArenaTest, NonCpuTensorsComeFromLibtorch) {
  StateArena arena;
  torch::Tensor meta = arena.EmptyLike(torch::empty({4, 4}, torch::Device(torch::kMeta)));
  EXPECT_TRUE(meta.is_meta());
  EXPECT_EQ(meta.sizes(), (std::vector<std::int64_t>{4, 4}));
}

// Anonymous memory in 4 KiB pages (no huge page makes one touch fault in
// its neighbours), unmapped on destruction.
class SmallPages {
 public:
  explicit SmallPages(std::size_t pages)
      : page_(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))), bytes_(pages * page_) {
    base_ = static_cast<std::byte*>(
        ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(base_, MAP_FAILED);
    (void)::madvise(base_, bytes_, MADV_NOHUGEPAGE);
  }
  ~SmallPages() { ::munmap(base_, bytes_); }
  std::byte* page(std::size_t i) const { return base_ + i * page_; }
  std::size_t page_bytes() const { return page_; }
  std::set<std::size_t> Resident() const {
    std::vector<unsigned char> residency(bytes_ / page_);
    EXPECT_EQ(::mincore(base_, bytes_, residency.data()), 0);
    std::set<std::size_t> resident;
    for (std::size_t i = 0; i < residency.size(); ++i) {
      if (residency[i] & 1) resident.insert(i);
    }
    return resident;
  }

 private:
  std::size_t page_;
  std::size_t bytes_;
  std::byte* base_;
};

long MinorFaultsOfThisThread() {
  rusage usage{};
  EXPECT_EQ(::getrusage(RUSAGE_THREAD, &usage), 0);
  return usage.ru_minflt;
}

// The stepper's state warm-up (ParameterStepper::StartPrefault and
// FinishPrefault) is a PagePrefaulter that touches each page.
TEST(StateWarmUpTest, FaultsInExactlyTheRangesPagesForWritingAndChangesNoByte) {
  SmallPages memory(16);
  const std::size_t page = memory.page_bytes();
  // Page 5 already holds data; the warmer must leave it as it is.
  std::memset(memory.page(5), 0xab, page);
  ASSERT_EQ(memory.Resident(), (std::set<std::size_t>{5}));
  {
    // Unaligned ends: pages 2 to 6 and one byte of page 10; then a range
    // that ends exactly where page 13 starts, and an empty one.
    PagePrefaulter warmer({{memory.page(2) + 100, 4 * page + 10 - 100},
                           {memory.page(10), 1},
                           {memory.page(12), page},
                           {memory.page(14), 0}},
                          PrefaultMethod::kTouch, StateArena::kHugePageBytes);
    warmer.Finish();
  }
  EXPECT_EQ(memory.Resident(), (std::set<std::size_t>{2, 3, 4, 5, 6, 10, 12}));
  for (std::size_t b = 0; b < page; ++b) {
    ASSERT_EQ(static_cast<unsigned char>(memory.page(5)[b]), 0xab) << "byte " << b;
  }
  for (std::size_t b = 0; b < page; ++b) {
    ASSERT_EQ(static_cast<unsigned char>(memory.page(2)[b]), 0) << "byte " << b;
  }
  // Mapped for writing, not just the kernel's shared zero page for reading
  // (which mincore counts as resident too): writes take no fault.
  const long faults_before = MinorFaultsOfThisThread();
  for (std::size_t i : {2, 3, 4, 6, 10, 12}) memory.page(i)[page - 1] = std::byte{1};
  EXPECT_EQ(MinorFaultsOfThisThread() - faults_before, 0);
}

TEST(StateWarmUpTest, FinishCompletesTheWorkAndAnEmptyWarmUpFinishesAtOnce) {
  constexpr std::size_t kPages = 4096;  // 16 MiB: several pieces for both threads
  SmallPages memory(kPages);
  {
    PagePrefaulter warmer({{memory.page(0), kPages * memory.page_bytes()}}, PrefaultMethod::kTouch,
                          StateArena::kHugePageBytes);
    warmer.Finish();
  }
  EXPECT_EQ(memory.Resident().size(), kPages);
  PagePrefaulter idle({}, PrefaultMethod::kTouch);
  idle.Finish();
  idle.Finish();
  EXPECT_EQ(idle.progress().state, PrefaultProgress::State::kDone);
}

}  // namespace
}  // namespace pmsnap::hooks
