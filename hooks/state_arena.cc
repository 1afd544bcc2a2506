#include "state_arena.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <system_error>

namespace pmsnap::hooks {

struct StateArena::Region {
  explicit Region(std::size_t usable_bytes) : bytes(usable_bytes) {
    // One huge page of slack to align the start.
    mapped_bytes = bytes + kHugePageBytes;
    mapped = ::mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(mapped != MAP_FAILED, "pmsnap: cannot reserve ", mapped_bytes,
                " bytes for optimizer state: ", std::strerror(errno));
    const auto address = reinterpret_cast<std::uintptr_t>(mapped);
    base = reinterpret_cast<std::byte*>((address + kHugePageBytes - 1) / kHugePageBytes *
                                        kHugePageBytes);
    // Only a hint: without transparent huge pages ("never") the region is
    // simply 4 KiB pages.
    (void)::madvise(base, bytes, MADV_HUGEPAGE);
  }
  ~Region() { ::munmap(mapped, mapped_bytes); }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  void* mapped = nullptr;
  std::size_t mapped_bytes = 0;
  std::byte* base = nullptr;
  std::size_t bytes = 0;
};

torch::Tensor StateArena::EmptyLike(const torch::Tensor& like) {
  if (!like.device().is_cpu()) return torch::empty_like(like, at::MemoryFormat::Contiguous);
  constexpr std::size_t kAlignment = 64;  // as libtorch's CPU allocator
  const std::size_t bytes =
      (static_cast<std::size_t>(like.nbytes()) + kAlignment - 1) / kAlignment * kAlignment;
  if (region_ == nullptr || used_ + bytes > region_->bytes) {
    const std::size_t wanted = std::max(region_bytes_, bytes);
    region_ =
        std::make_shared<Region>((wanted + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes);
    used_ = 0;
  }
  void* data = region_->base + used_;
  used_ += bytes;
  // The tensor's storage keeps its region mapped.
  return torch::from_blob(
      data, like.sizes(), [region = region_](void*) {}, like.options());
}

PageWarmer::PageWarmer(const std::vector<std::pair<std::byte*, std::size_t>>& ranges) {
  for (const auto& [data, bytes] : ranges) {
    auto start = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t end = start + bytes;
    while (start < end) {
      constexpr std::uintptr_t kPiece = StateArena::kHugePageBytes;
      const std::uintptr_t piece_end = std::min<std::uintptr_t>(end, (start / kPiece + 1) * kPiece);
      pieces_.emplace_back(reinterpret_cast<std::byte*>(start), piece_end - start);
      start = piece_end;
    }
  }
  if (pieces_.empty()) return;
  try {
    thread_ = std::jthread([this] { Work(); });
  } catch (const std::system_error&) {
    // No thread to spare: Finish does all the work on the caller's.
  }
}

void PageWarmer::Work() {
  static const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (std::size_t i = next_.fetch_add(1); i < pieces_.size(); i = next_.fetch_add(1)) {
    const auto start = reinterpret_cast<std::uintptr_t>(pieces_[i].first);
    const std::uintptr_t end = start + pieces_[i].second;
    // One write per page, inside the range, that leaves the byte as it was
    // even if someone else wrote it: a compare-and-swap of the value with
    // itself, which compilers keep as a write (clang turns an atomic
    // `or 0` into a plain load, and a read fault maps only the shared zero
    // page). A plain fault rather than MADV_POPULATE_WRITE: beside
    // libpmemobj's open (which maps and unmaps) that madvise ran up to ten
    // times slower on a 740 MB state.
    for (std::uintptr_t at = start; at < end; at = (at / page + 1) * page) {
      auto* byte = reinterpret_cast<unsigned char*>(at);
      unsigned char value = __atomic_load_n(byte, __ATOMIC_RELAXED);
      while (!__atomic_compare_exchange_n(byte, &value, value, /*weak=*/false, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED)) {
      }
    }
  }
}

void PageWarmer::Finish() {
  Work();
  if (thread_.joinable()) thread_.join();
}

}  // namespace pmsnap::hooks
