// libFuzzer target: the pool's manifest decoder (Manifest::Parse, FORMAT.md
// "Manifest"), the first structure a pool open decodes from the file. A
// manifest that parses must validate, serialize back to a manifest that
// parses equal, and lay out without surprises.
#include <cstdint>
#include <span>

#include "fuzz_check.h"
#include "pmsnap/pmem_layout/manifest.h"

namespace {

// Laying out a manifest allocates one entry per part: keep the runs fast.
constexpr std::uint64_t kMaxLaidOutBytes = 64ull << 20;

bool SmallEnoughToLayOut(const pmsnap::layout::Manifest& manifest) {
  std::uint64_t total = 0;
  for (const pmsnap::layout::UnitSpec& unit : manifest.units) {
    for (const pmsnap::layout::TensorSpec& tensor : unit.tensors) {
      for (std::int64_t dim : tensor.shape) {
        if (dim > static_cast<std::int64_t>(kMaxLaidOutBytes)) return false;
      }
      total += tensor.bytes();
      if (total > kMaxLaidOutBytes) return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pmsnap::layout;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto manifest = Manifest::Parse(bytes, "fuzz input");
  if (!manifest.ok()) return 0;
  FUZZ_CHECK_OK(manifest->Validate());
  const std::vector<std::byte> serialized = manifest->Serialize();
  auto again = Manifest::Parse(serialized, "reserialized fuzz input");
  FUZZ_CHECK_OK(again.status());
  FUZZ_CHECK(again->units == manifest->units);
  FUZZ_CHECK(again->Signature() == manifest->Signature());
  FUZZ_CHECK(manifest->FirstDifference(*again).empty());
  if (SmallEnoughToLayOut(*manifest)) {
    const SlotLayout slot_layout = ComputeLayout(*manifest, 4096);
    for (const PartLayout& part : slot_layout.parts) {
      FUZZ_CHECK(part.bytes <= 4096);
      FUZZ_CHECK(part.slot_offset + part.bytes <= slot_layout.slot_bytes);
    }
  }
  return 0;
}
