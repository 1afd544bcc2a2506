// StateArena (hooks/state_arena.h): optimizer state packed into huge-page
// advised regions. Checks the packing, the alignment the kernel needs for
// huge pages, and that the memory lives exactly as long as its tensors.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <vector>

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

}  // namespace
}  // namespace pmsnap::hooks
