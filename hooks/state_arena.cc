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

}  // namespace pmsnap::hooks
