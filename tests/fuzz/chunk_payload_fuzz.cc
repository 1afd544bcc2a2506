// libFuzzer target: the decoders of chunk payloads an embedding recovery
// reads from the chunk heap (diff/detail/chunk_format.h: data chunks and
// index chunks) and the serialized quantized tables inside data chunks
// (quant/format.h). Byte 0 picks the decoder:
//   0  ParseDataChunk; each row read back (dequantized), the chunk sliced
//      and parsed again
//   1  ParseIndex; serialized back it must equal what was parsed
//   2  quant::Parse; dequantized, serialized back it must equal the input
//   3  as 2, with both CRC-32C fields recomputed first, so mutations reach
//      the field checks behind the checksums
// The rest is the payload, copied to 8-byte-aligned memory as a chunk's
// payload is in the pool.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "detail/chunk_format.h"
#include "fuzz_check.h"
#include "pmsnap/quant/format.h"

namespace {

using namespace pmsnap;
using diff::detail::DataChunkView;

// Bits per key of the slices' bloom filters, as the IncrCP policy uses.
constexpr std::uint32_t kBloomBitsPerKey = 10;

void FuzzDataChunk(std::span<const std::byte> bytes) {
  auto view = diff::detail::ParseDataChunk(bytes, "fuzz data chunk");
  if (!view.ok()) return;
  std::vector<float> row;
  for (const diff::detail::TensorBlock& block : view->tensors) {
    // Never empty: a zero-width block still gets a real destination, as the
    // recovery's table buffers are.
    row.resize(std::max<std::uint32_t>(1, block.elems_per_row));
    for (std::uint64_t r = 0; r < view->keys.size(); ++r) (void)block.ReadRow(r, row.data());
  }
  std::vector<std::uint64_t> positions(view->keys.size());
  for (std::uint64_t i = 0; i < positions.size(); ++i) positions[i] = i;
  auto slice = diff::detail::SliceDataChunk(*view, positions, kBloomBitsPerKey);
  FUZZ_CHECK_OK(slice.status());
  auto sliced = diff::detail::ParseDataChunk(*slice, "sliced fuzz data chunk");
  FUZZ_CHECK_OK(sliced.status());
  FUZZ_CHECK(sliced->keys.size() == view->keys.size());
  FUZZ_CHECK(sliced->tensors.size() == view->tensors.size());
  for (std::uint64_t i = 0; i < view->keys.size(); ++i) {
    FUZZ_CHECK(sliced->keys[i] == view->keys[i]);
    FUZZ_CHECK(diff::detail::BloomMayContain(sliced->bloom, view->keys[i]));
    for (std::size_t t = 0; t < view->tensors.size(); ++t) {
      const std::uint64_t record = view->tensors[t].row_record_bytes();
      FUZZ_CHECK(sliced->tensors[t].row_record_bytes() == record);
      FUZZ_CHECK(std::memcmp(sliced->tensors[t].row_record(i), view->tensors[t].row_record(i),
                             record) == 0);
    }
  }
}

void FuzzIndex(std::span<const std::byte> bytes) {
  auto index = diff::detail::ParseIndex(bytes, "fuzz index chunk");
  if (!index.ok()) return;
  const std::vector<std::byte> serialized = diff::detail::SerializeIndex(*index);
  // ParseIndex reads a prefix; what it read must come back byte for byte.
  FUZZ_CHECK(serialized.size() <= bytes.size());
  FUZZ_CHECK(std::memcmp(serialized.data(), bytes.data(), serialized.size()) == 0);
}

void FuzzQuantized(std::span<std::uint8_t> bytes, bool reseal) {
  if (reseal && bytes.size() >= quant::kSerializedHeaderBytes) {
    const std::uint32_t payload_crc = quant::Crc32c(bytes.subspan(quant::kSerializedHeaderBytes));
    std::memcpy(bytes.data() + 48, &payload_crc, 4);
    const std::uint32_t header_crc = quant::Crc32c(bytes.first(60));
    std::memcpy(bytes.data() + 60, &header_crc, 4);
  }
  auto view = quant::Parse(bytes);
  if (!view.ok()) return;
  std::vector<float> rows(view->spec.rows * view->spec.dim);
  (void)quant::Dequantize(*view, rows.data());
  const std::vector<std::uint8_t> serialized = quant::Serialize(*view);
  FUZZ_CHECK(serialized.size() == bytes.size());
  FUZZ_CHECK(std::memcmp(serialized.data(), bytes.data(), bytes.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t payload_bytes = size - 1;
  std::vector<std::uint64_t> aligned((payload_bytes + 7) / 8);
  if (payload_bytes != 0) std::memcpy(aligned.data(), data + 1, payload_bytes);
  auto* payload = reinterpret_cast<std::byte*>(aligned.data());
  switch (data[0] % 4) {
    case 0:
      FuzzDataChunk({payload, payload_bytes});
      break;
    case 1:
      FuzzIndex({payload, payload_bytes});
      break;
    default:
      FuzzQuantized({reinterpret_cast<std::uint8_t*>(payload), payload_bytes}, data[0] % 4 == 3);
      break;
  }
  return 0;
}
