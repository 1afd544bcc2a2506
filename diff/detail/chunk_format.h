// Payload formats inside the pool's chunk heap for embedding checkpoints.
//
// Data chunk (one "logical chunk"; several may share one heap chunk, a
// bundle, each addressed by a ChunkRef {heap chunk, offset, length}):
//   DataHeader (64 B) | keys u64[rows] | bloom u64[bloom_words] |
//   per tensor: u64 block bytes, u64 kind (0 raw float32 rows, 1 quantized:
//   quant/format.h serialized form), block, zero padding to 8 bytes.
// Index chunk (one per table per epoch): the retained checkpoints with the
// ordered chunk refs that rebuild each, plus the policy's state (baseline,
// differential sizes, IncrCP's 2-D list, timings), so a restarted process
// resumes without any DRAM state.
//
// Thread-safety: pure functions over caller buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/quant/quant.h"

namespace pmsnap::diff::detail {

struct ChunkRef {
  std::uint64_t heap_id = 0;
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
  bool operator==(const ChunkRef&) const = default;
};

// One tensor's rows inside a data chunk.
struct TensorBlock {
  bool quantized = false;
  std::uint32_t elems_per_row = 0;
  std::span<const float> raw;           // rows * elems_per_row, when !quantized
  quant::QuantizedView quantized_view;  // when quantized
  // Bytes of one row's record (raw floats or quantized codes + params).
  std::uint64_t row_record_bytes() const {
    return quantized ? quantized_view.spec.row_bytes() : elems_per_row * sizeof(float);
  }
  const std::uint8_t* row_record(std::uint64_t r) const {
    return quantized ? quantized_view.row(r)
                     : reinterpret_cast<const std::uint8_t*>(raw.data() + r * elems_per_row);
  }
  // Writes row r as floats (dequantizing if needed).
  Status ReadRow(std::uint64_t r, float* out) const;
};

struct DataChunkView {
  std::uint64_t epoch = 0;
  std::span<const std::uint64_t> keys;   // ascending row ids
  std::span<const std::uint64_t> bloom;  // empty: no bloom filter
  std::vector<TensorBlock> tensors;
  std::uint64_t min_key() const { return keys.empty() ? 0 : keys.front(); }
  std::uint64_t max_key() const { return keys.empty() ? 0 : keys.back(); }
};

// Tensor rows to encode: `elems_per_row` floats per row for `keys.size()`
// rows, gathered densely in `rows`.
struct TensorInput {
  std::uint32_t elems_per_row = 0;
  std::span<const float> rows;
};

struct EncodeOptions {
  bool quantize = false;
  quant::QuantOptions quant;  // when quantize: applied to tensors with elems_per_row >= 2
  std::uint32_t bloom_bits_per_key = 0;  // 0: no bloom filter
};

// Builds a data chunk image, in `buffer`'s memory (its contents dropped):
// an earlier image's, so that no new memory is faulted in.
Result<std::vector<std::byte>> BuildDataChunk(std::uint64_t epoch,
                                              std::span<const std::uint64_t> keys,
                                              std::span<const TensorInput> tensors,
                                              const EncodeOptions& options,
                                              const std::string& table,
                                              std::vector<std::byte> buffer = {});

// The subset `positions` (ascending indices into `source.keys`) of a data
// chunk, keeping each row's record bytes as they are (no re-quantization).
Result<std::vector<std::byte>> SliceDataChunk(const DataChunkView& source,
                                              std::span<const std::uint64_t> positions,
                                              std::uint32_t bloom_bits_per_key);

// Validates and views a data chunk image. `what` names table and checkpoint.
Result<DataChunkView> ParseDataChunk(std::span<const std::byte> bytes, const std::string& what);

// The words of the bloom filter BuildBloom makes for `keys` keys (0: none).
std::uint64_t BloomWords(std::uint64_t keys, std::uint32_t bits_per_key);

// Bloom filter over the keys: k hashes by double hashing.
std::vector<std::uint64_t> BuildBloom(std::span<const std::uint64_t> keys,
                                      std::uint32_t bits_per_key);
bool BloomMayContain(std::span<const std::uint64_t> bloom, std::uint64_t key);

// --- index ---

struct RetainedCheckpoint {
  std::uint64_t epoch = 0;
  std::uint64_t iteration = 0;
  std::vector<ChunkRef> refs;  // applied in order; later chunks override earlier rows
};

// IncrCP 2-D list node: a logical chunk with its column (the interval whose
// values it holds) and row (0, or the epoch whose insertion extracted it).
struct ListNode {
  ChunkRef ref;
  std::uint64_t column = 0;
  std::uint64_t row_epoch = 0;  // 0: Row 0
  std::uint64_t min_key = 0;
  std::uint64_t max_key = 0;
  std::uint64_t count = 0;
};

struct TableIndex {
  std::uint32_t policy = 0;
  std::uint64_t epoch = 0;
  std::uint64_t baseline_epoch = 0;  // 0: none yet
  ChunkRef baseline;
  std::vector<double> diff_sizes;            // intermittent: S_1..S_i as fractions of the table
  double baseline_seconds = 0;               // C_base (IncrCP reset rule)
  double increment_seconds = 0;              // C_incre
  double read_bytes_per_second = 0;          // measured while extracting
  std::vector<RetainedCheckpoint> retained;  // ascending epochs
  std::vector<ListNode> nodes;               // IncrCP current generation
};

std::vector<std::byte> SerializeIndex(const TableIndex& index);
Result<TableIndex> ParseIndex(std::span<const std::byte> bytes, const std::string& what);

}  // namespace pmsnap::diff::detail
