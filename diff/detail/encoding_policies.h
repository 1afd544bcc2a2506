// The embedding policies (diff::Policy) as objects behind one interface:
// what each does when EmbeddingCheckpointer::Encode writes a table's
// checkpoint. Encode itself does what every policy shares (a full
// checkpoint when there is no baseline yet or the policy asks for one, the
// retention window, the index chunk); a policy decides when a checkpoint is
// full and writes the ones that are not:
//
//   FullEncoding          every checkpoint full
//   DifferentialEncoding  one-shot / intermittent differential (Check-N-Run):
//                         the rows changed since the baseline
//   IncrementalEncoding   consecutive increments, and CPR's MFU / SSU
//                         (the rows chosen at capture)
//   IncrCPEncoding        IncrCP's 2-D list with extraction and concatenation
//
// Thread-safety: Encode calls a policy with the table's mutex held; a policy
// keeps no state of its own beyond its options.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "detail/chunk_format.h"
#include "pmsnap/common/status.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/diff/row_tracker.h"
#include "pmsnap/pmem_layout/chunk_heap.h"

namespace pmsnap::diff::detail {

// Reads logical chunks, verifying each heap chunk's checksum once.
class ChunkReader {
 public:
  ChunkReader(const layout::ChunkHeap& chunks, std::string what)
      : chunks_(chunks), what_(std::move(what)) {}
  // The data chunk `ref` names; the heap chunk's error (named with `what`),
  // or kCorruption for a reference outside its heap chunk.
  Result<DataChunkView> Read(const ChunkRef& ref);
  std::uint64_t bytes_read() const { return bytes_read_; }

 private:
  const layout::ChunkHeap& chunks_;
  std::string what_;
  std::unordered_map<std::uint64_t, std::span<const std::byte>> verified_;
  std::uint64_t bytes_read_ = 0;
};

// What one Encode hands its policy.
struct EncodeStep {
  std::uint64_t epoch = 0;
  std::chrono::steady_clock::time_point started;
  const layout::ChunkHeap* chunks = nullptr;
  std::string what;  // "embedding table 'name' epoch e", for errors
  std::uint64_t table_rows = 0;
  std::vector<std::uint64_t> interval_rows;  // changed since the previous checkpoint
  // Changed since the baseline, this checkpoint's rows included.
  const BitVector* cumulative = nullptr;
  const std::vector<std::uint64_t>* priority_rows = nullptr;  // MFU / SSU: chosen at capture
  // A data chunk's image of `rows` read from the live tensors, with a Bloom
  // filter of `bloom_bits` bits per key (0: none).
  std::function<Result<std::vector<std::byte>>(const std::vector<std::uint64_t>& rows,
                                               std::uint32_t bloom_bits)>
      data_chunk;
  // Takes an image back once written, for the next data_chunk to build in
  // (optional: an image dropped instead is only freed).
  std::function<void(std::vector<std::byte>&& image)> recycle;
  // Writes `images` as one heap chunk (a bundle when `bundle`); their refs.
  // Views, not copies: an image is a table's changed rows, megabytes.
  std::function<Result<std::vector<ChunkRef>>(const std::vector<std::span<const std::byte>>& images,
                                              bool bundle)>
      write;
};

class EncodingPolicy {
 public:
  virtual ~EncodingPolicy() = default;
  // Whether the checkpoint about to be written on top of `index` (which has
  // a baseline) is a full one.
  virtual bool TakesFull(const TableIndex& index) const = 0;
  // Writes a checkpoint that is not full: its chunks, the refs a recovery
  // of it reads (`checkpoint`), and what `index` keeps for the next one.
  // Adds to `stats`. The first error of a chunk write or read.
  virtual Status WriteIncrement(const EncodeStep& step, TableIndex& index,
                                RetainedCheckpoint& checkpoint,
                                TableCheckpointStats& stats) const = 0;
  // After the new checkpoint joined index.retained (and before the window
  // is cut to `retain`): rebuilds the retained checkpoints' refs where the
  // policy moves rows between chunks (IncrCP).
  virtual void RebuildRetained(TableIndex& /*index*/) const {}
  // Whether a checkpoint of two refs is the baseline plus every row changed
  // since it (the differentials): reopening or restoring one seeds the rows
  // the next differential must include from its second ref.
  virtual bool DifferentialSinceBaseline() const { return false; }
};

// The object for options.policy.
std::unique_ptr<EncodingPolicy> MakeEncodingPolicy(const EmbeddingOptions& options);

}  // namespace pmsnap::diff::detail
