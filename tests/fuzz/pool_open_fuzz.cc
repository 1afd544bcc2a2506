// libFuzzer target: opening a damaged pool file gives a Status error or a
// consistent pool, never a crash, a hang or undefined behaviour.
//
// A pool is tens of MiB and libpmemobj checks its own headers, so the input
// is not a pool file but a list of patches applied to a real pool (built at
// start-up from seed_pools.h's recipes, one scratch file per recipe in
// $PMSNAP_POOL_DIR or /dev/shm):
//
//   byte 0     recipe (modulo the number of recipes)
//   byte 1     bit 0: open without data verification; bit 1: deferred
//              verification; bits 2-7: which checksums to recompute after
//              patching (pool_reseal.h, ResealFlags >> 0 shifted by 2)
//   then patches, each: region u8 (header, manifest, commit records, slot
//   data, chunk-heap root, one chunk; modulo their number),
//   offset u32 LE (modulo the region's size), length u8, that many bytes.
//
// After a successful open it reads everything a restart reads (both slots,
// every part, the extra state, every chunk, every retained checkpoint of the
// embedding table) and starts and abandons one epoch, which frees orphan
// chunks through the chunk list it mirrored.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "fuzz_check.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/hooks/extra_state.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pool_reseal.h"
#include "seed_pools.h"

namespace pmsnap::fuzz {
namespace {

struct BasePool {
  std::vector<std::byte> image;             // the pool file as built
  std::uint64_t root_offset = 0;            // regions().header.offset
  std::vector<layout::FileRegion> regions;  // where patches go
  std::string scratch_path;                 // what each run opens
  std::byte* scratch = nullptr;             // scratch file, mapped shared
};

std::vector<BasePool>& Bases() {
  static std::vector<BasePool> bases;
  return bases;
}

void RemoveScratchFiles() {
  for (const BasePool& base : Bases()) std::remove(base.scratch_path.c_str());
}

BasePool MakeBase(const SeedPoolRecipe& recipe) {
  const std::string prefix =
      PoolDirectory() + "/pmsnap-fuzz-" + std::to_string(::getpid()) + "-" + recipe.name;
  BasePool base;
  const std::string built = prefix + ".seed.pool";
  std::remove(built.c_str());
  FUZZ_CHECK_OK(BuildSeedPool(built, recipe));
  {
    auto pool = layout::Pool::Open(built);
    FUZZ_CHECK_OK(pool.status());
    const layout::FileRegions regions = (*pool)->regions();
    base.root_offset = regions.header.offset;
    base.regions = {regions.header,         regions.manifest,     regions.record[0],
                    regions.record[1],      regions.slot_data[0], regions.slot_data[1],
                    regions.chunk_heap_root};
    // pmsnap's structures only, not libpmemobj's own metadata: libpmemobj
    // 1.12 does not check its heap metadata at open and crashes on some
    // damaged bytes there (bench/RESULTS.md, "Fuzzing"), which is not
    // pmsnap's to fix and would stop every run.
    for (const layout::ChunkInfo& chunk : (*pool)->chunk_heap().List()) {
      base.regions.push_back({chunk.id, 128 + chunk.bytes});
    }
  }
  base.image.resize(std::filesystem::file_size(built));
  std::ifstream in(built, std::ios::binary);
  in.read(reinterpret_cast<char*>(base.image.data()),
          static_cast<std::streamsize>(base.image.size()));
  FUZZ_CHECK(in.good());
  std::remove(built.c_str());
  FUZZ_CHECK(!base.image.empty());

  base.scratch_path = prefix + ".scratch.pool";
  const int fd = ::open(base.scratch_path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  FUZZ_CHECK(fd >= 0);
  FUZZ_CHECK(::ftruncate(fd, static_cast<off_t>(base.image.size())) == 0);
  void* mapping = ::mmap(nullptr, base.image.size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  FUZZ_CHECK(mapping != MAP_FAILED);
  base.scratch = static_cast<std::byte*>(mapping);
  return base;
}

class InputReader {
 public:
  InputReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool Byte(std::uint8_t* out) {
    if (pos_ >= size_) return false;
    *out = data_[pos_++];
    return true;
  }
  bool U32(std::uint32_t* out) {
    if (size_ - pos_ < 4) return false;
    std::memcpy(out, data_ + pos_, 4);
    pos_ += 4;
    return true;
  }
  std::span<const std::uint8_t> Rest(std::size_t at_most) {
    const std::size_t n = std::min(at_most, size_ - pos_);
    std::span<const std::uint8_t> out(data_ + pos_, n);
    pos_ += n;
    return out;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

void ApplyPatches(BasePool& base, InputReader& input) {
  std::uint8_t region_index = 0;
  std::uint32_t offset = 0;
  std::uint8_t length = 0;
  while (input.Byte(&region_index) && input.U32(&offset) && input.Byte(&length)) {
    const layout::FileRegion& region = base.regions[region_index % base.regions.size()];
    if (region.bytes == 0) continue;
    const std::uint64_t at = region.offset + offset % region.bytes;
    const std::span<const std::uint8_t> bytes = input.Rest(length);
    const std::size_t n = std::min<std::uint64_t>(bytes.size(), base.image.size() - at);
    std::memcpy(base.scratch + at, bytes.data(), n);
  }
}

// Everything a restarted trainer reads, plus one epoch started and abandoned.
void ExerciseOpenPool(layout::Pool& pool, bool fully_verified) {
  for (int slot = 0; slot < 2; ++slot) {
    (void)pool.slot_info(slot);
    auto view = pool.Slot(slot);
    if (view.ok()) (void)hooks::UnpackExtraState(view->extra_state());
  }
  auto latest = pool.Latest();
  if (latest.ok()) {
    // The largest part, not options().part_bytes: a resealed header may
    // carry any valid part size, far above what its tensors need.
    std::uint64_t largest_part = 1;
    for (const layout::PartLayout& part : pool.layout().parts) {
      largest_part = std::max(largest_part, part.bytes);
    }
    std::vector<std::byte> buffer(largest_part);
    for (std::uint32_t p = 0; p < pool.layout().parts.size(); ++p) {
      const Status read = pool.ReadPart(*latest, p, buffer.data());
      // The open checked every part of this slot: reading one back must agree.
      if (fully_verified) FUZZ_CHECK_OK(read);
    }
    (void)hooks::UnpackExtraState(latest->extra_state());
  }
  const layout::VerifyReport report = pool.Verify(/*deep=*/true);
  if (fully_verified && latest.ok()) {
    FUZZ_CHECK(report.recoverable_slot.has_value());
  }
  for (const layout::ChunkInfo& chunk : pool.chunk_heap().List()) (void)pool.chunk_heap().Read(chunk.id);
  for (const layout::UnitSpec& unit : pool.manifest().units) {
    if ((unit.flags & layout::kUnitFlagEncoded) == 0) continue;
    auto checkpoints = diff::ListCheckpoints(pool, unit.name);
    if (!checkpoints.ok()) continue;
    for (const diff::CheckpointInfo& checkpoint : *checkpoints) {
      (void)diff::RecoverTable(pool, unit.name, checkpoint.epoch);
    }
  }
  const std::uint64_t next = latest.ok() ? latest->iteration() + 1 : 1;
  if (pool.BeginEpoch(next).ok()) pool.Abandon();
}

}  // namespace
}  // namespace pmsnap::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace pmsnap::fuzz;
  pmsnap::layout::SetWarningSink([](const std::string&) {});
  for (const SeedPoolRecipe& recipe : SeedPoolRecipes()) Bases().push_back(MakeBase(recipe));
  std::atexit(RemoveScratchFiles);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pmsnap;
  using namespace pmsnap::fuzz;
  fuzz::InputReader input(data, size);
  std::uint8_t recipe = 0, flags = 0;
  if (!input.Byte(&recipe) || !input.Byte(&flags)) return 0;
  BasePool& base = Bases()[recipe % Bases().size()];
  std::memcpy(base.scratch, base.image.data(), base.image.size());
  ApplyPatches(base, input);
  const unsigned reseal = flags >> 2;
  if (reseal != 0) {
    ResealPool({base.scratch, base.image.size()}, base.root_offset, reseal);
  }

  layout::OpenOptions options;
  options.verify_data = (flags & 1) == 0;
  options.defer_data_verification = (flags & 2) != 0;
  options.prefault_mapping = false;
  auto pool = layout::Pool::Open(base.scratch_path, options);
  if (!pool.ok()) return 0;
  ExerciseOpenPool(**pool, options.verify_data && !options.defer_data_verification);
  return 0;
}
