#include "pool_reseal.h"

#include <cstddef>
#include <cstring>
#include <optional>

#include "detail/format.h"
#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/manifest.h"

namespace pmsnap::fuzz {
namespace {

using layout::Checksum64;
using layout::detail::ChunkHeader;
using layout::detail::PoolHeader;
using layout::detail::PoolRoot;
using layout::detail::SlotRecordHeader;

// A chunk list this long is a loop the fuzzer made; the pool stops there too.
constexpr int kMaxChunksWalked = 4096;

class Image {
 public:
  explicit Image(std::span<std::byte> bytes) : bytes_(bytes) {}
  bool Fits(std::uint64_t offset, std::uint64_t length) const {
    return offset <= bytes_.size() && length <= bytes_.size() - offset;
  }
  std::uint64_t Load64(std::uint64_t offset) const {
    std::uint64_t value = 0;
    std::memcpy(&value, bytes_.data() + offset, sizeof(value));
    return value;
  }
  void Store64(std::uint64_t offset, std::uint64_t value) {
    std::memcpy(bytes_.data() + offset, &value, sizeof(value));
  }
  std::uint64_t Hash(std::uint64_t offset, std::uint64_t length) const {
    return Checksum64(bytes_.data() + offset, length);
  }
  std::span<const std::byte> Bytes(std::uint64_t offset, std::uint64_t length) const {
    return std::span<const std::byte>(bytes_).subspan(offset, length);
  }

 private:
  std::span<std::byte> bytes_;
};

std::uint64_t RecordBytes(std::uint64_t part_count, std::uint64_t extra_capacity) {
  return (sizeof(SlotRecordHeader) + 8 * part_count + extra_capacity + 63) / 64 * 64;
}

// The layout the pool would recompute, when computing it is cheap and sane.
std::optional<layout::SlotLayout> LayoutOf(const Image& image, const PoolHeader& header,
                                           std::uint64_t image_bytes) {
  if (!image.Fits(header.manifest_offset, header.manifest_bytes)) return std::nullopt;
  auto manifest =
      layout::Manifest::Parse(image.Bytes(header.manifest_offset, header.manifest_bytes), "reseal");
  if (!manifest.ok() || !manifest->Validate().ok()) return std::nullopt;
  if (header.part_bytes < 4096 || header.part_bytes % layout::kTensorAlignment != 0) {
    return std::nullopt;
  }
  std::uint64_t slot_bytes = 0;
  for (const layout::UnitSpec& unit : manifest->units) {
    if ((unit.flags & layout::kUnitFlagEncoded) != 0) continue;
    for (const layout::TensorSpec& tensor : unit.tensors) {
      // numel() may wrap for absurd shapes: require each dimension small.
      for (std::int64_t dim : tensor.shape) {
        if (dim > static_cast<std::int64_t>(image_bytes)) return std::nullopt;
      }
      slot_bytes += tensor.bytes() + layout::kTensorAlignment;
      if (slot_bytes > image_bytes) return std::nullopt;
    }
  }
  return layout::ComputeLayout(*manifest, header.part_bytes, header.slot_extent_bytes);
}

void ResealRecord(Image& image, const PoolHeader& header, int slot,
                  const std::optional<layout::SlotLayout>& slot_layout, unsigned flags) {
  const std::uint64_t record = header.slot_record_offset[slot];
  if (!image.Fits(record, sizeof(SlotRecordHeader))) return;
  const std::uint64_t parts = header.part_count;
  const std::uint64_t table = record + sizeof(SlotRecordHeader);
  const bool table_fits = parts <= (1ull << 40) && image.Fits(table, 8 * parts);
  if ((flags & kResealParts) != 0 && slot_layout && table_fits &&
      slot_layout->parts.size() == parts && slot_layout->extent_bytes == 0 &&
      image.Fits(header.slot_data_offset[slot], slot_layout->slot_bytes)) {
    for (std::uint64_t p = 0; p < parts; ++p) {
      const layout::PartLayout& part = slot_layout->parts[p];
      image.Store64(table + 8 * p,
                    image.Hash(header.slot_data_offset[slot] + part.slot_offset, part.bytes));
    }
  }
  if ((flags & kResealRecords) == 0) return;
  auto field = [record](std::size_t index) { return record + 8 * index; };
  // SlotRecordHeader: commit_word, iteration, time, extra_bytes,
  // extra_checksum, parts_checksum, record_checksum (8 bytes each).
  if (table_fits) image.Store64(field(5), image.Hash(table, 8 * parts));
  const std::uint64_t extra = table + 8 * parts;
  const std::uint64_t extra_bytes = image.Load64(field(3));
  if (table_fits && extra_bytes <= header.extra_state_capacity && image.Fits(extra, extra_bytes)) {
    image.Store64(field(4), image.Hash(extra, extra_bytes));
  }
  const layout::detail::RecordChecksumInput input{
      layout::detail::CommitWordEpoch(image.Load64(field(0))),
      image.Load64(field(1)),
      image.Load64(field(2)),
      image.Load64(field(3)),
      image.Load64(field(4)),
      image.Load64(field(5))};
  image.Store64(field(6), Checksum64(&input, sizeof(input)));
}

void ResealChunks(Image& image, std::uint64_t root_offset) {
  std::uint64_t offset = image.Load64(root_offset + offsetof(PoolRoot, chunks));
  for (int walked = 0; offset != 0 && walked < kMaxChunksWalked; ++walked) {
    if (!image.Fits(offset, sizeof(ChunkHeader))) return;
    ChunkHeader chunk;
    std::memcpy(&chunk, image.Bytes(offset, sizeof(chunk)).data(), sizeof(chunk));
    const std::uint64_t fields[4] = {chunk.magic, chunk.epoch, chunk.tag, chunk.bytes};
    image.Store64(offset + offsetof(ChunkHeader, header_checksum),
                  Checksum64(fields, sizeof(fields)));
    if (chunk.sealed == 1 && image.Fits(offset + sizeof(ChunkHeader), chunk.bytes)) {
      image.Store64(offset + offsetof(ChunkHeader, payload_checksum),
                    image.Hash(offset + sizeof(ChunkHeader), chunk.bytes));
    }
    offset = chunk.next_offset;
  }
}

}  // namespace

void ResealPool(std::span<std::byte> bytes, std::uint64_t root_offset, unsigned flags) {
  Image image(bytes);
  if (!image.Fits(root_offset, sizeof(PoolRoot))) return;
  PoolHeader header;
  std::memcpy(&header, bytes.data() + root_offset, sizeof(header));

  std::optional<layout::SlotLayout> slot_layout;
  if ((flags & (kResealManifest | kResealLayout | kResealParts)) != 0) {
    slot_layout = LayoutOf(image, header, bytes.size());
  }
  if ((flags & kResealManifest) != 0 && image.Fits(header.manifest_offset, header.manifest_bytes)) {
    header.manifest_checksum = image.Hash(header.manifest_offset, header.manifest_bytes);
    auto manifest = layout::Manifest::Parse(
        image.Bytes(header.manifest_offset, header.manifest_bytes), "reseal");
    if (manifest.ok()) header.model_signature = manifest->Signature();
  }
  if ((flags & kResealLayout) != 0 && slot_layout) {
    header.unit_count = slot_layout->units.size();
    header.part_count = slot_layout->parts.size();
    header.slot_bytes = slot_layout->slot_bytes;
    header.record_bytes = RecordBytes(header.part_count, header.extra_state_capacity);
  }
  if ((flags & (kResealParts | kResealRecords)) != 0) {
    for (int slot = 0; slot < 2; ++slot) ResealRecord(image, header, slot, slot_layout, flags);
  }
  if ((flags & kResealChunks) != 0) ResealChunks(image, root_offset);
  if ((flags & kResealHeader) != 0) {
    header.header_checksum = 0;
    header.header_checksum = Checksum64(&header, sizeof(header));
  }
  std::memcpy(bytes.data() + root_offset, &header, sizeof(header));
}

}  // namespace pmsnap::fuzz
