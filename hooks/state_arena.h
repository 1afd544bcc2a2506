// StateArena: the optimizer state that pmsnap allocates itself (a fresh
// optimizer, or a restore into one) packed into 2 MiB-aligned regions that
// are advised for transparent huge pages.
//
// Why: a restarted trainer first touches all of its optimizer state inside
// Restore's copy, one page fault per page. Tensors allocated one by one
// (libtorch aligns to 64 bytes) get huge pages only for the 2 MiB-aligned
// pages that fit inside each tensor, so none for a 1 MiB tensor and one for
// a 3 MiB tensor at best; packed regions are huge-page backed end to end (a
// transformer's cold restore measured ~25% faster). Regions are reserved
// address space: only touched pages cost memory, so packing wastes at most
// the tail of one 2 MiB page per region.
//
// Thread-safety: one owner thread (the stepper's). Tensors it returns are
// ordinary CPU tensors and may be used and freed from any thread; a region is
// unmapped when its last tensor is freed.
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

namespace pmsnap::hooks {

class StateArena {
 public:
  static constexpr std::size_t kHugePageBytes = 2u << 20;
  static constexpr std::size_t kDefaultRegionBytes = 64u << 20;

  explicit StateArena(std::size_t region_bytes = kDefaultRegionBytes)
      : region_bytes_(region_bytes) {}

  // An uninitialized contiguous tensor with `like`'s sizes and options.
  // CPU tensors come from the arena; others (a CUDA parameter) from libtorch.
  // Throws c10::Error like torch::empty when the address space runs out.
  torch::Tensor EmptyLike(const torch::Tensor& like);

 private:
  struct Region;
  std::size_t region_bytes_;
  std::shared_ptr<Region> region_;  // the one being filled
  std::size_t used_ = 0;
};

}  // namespace pmsnap::hooks
