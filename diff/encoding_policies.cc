#include "detail/encoding_policies.h"

#include <algorithm>
#include <chrono>

#include "detail/policy_rules.h"

namespace pmsnap::diff::detail {
namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// A data chunk of `rows` written alone; its ref.
Result<ChunkRef> WriteRows(const EncodeStep& step, const std::vector<std::uint64_t>& rows,
                           std::uint32_t bloom_bits) {
  PMSNAP_ASSIGN_OR_RETURN(std::vector<std::byte> image, step.data_chunk(rows, bloom_bits));
  PMSNAP_ASSIGN_OR_RETURN(std::vector<ChunkRef> refs, step.write({image}, false));
  if (step.recycle) step.recycle(std::move(image));
  return refs[0];
}

class FullEncoding final : public EncodingPolicy {
 public:
  bool TakesFull(const TableIndex&) const override { return true; }
  Status WriteIncrement(const EncodeStep& step, TableIndex&, RetainedCheckpoint&,
                        TableCheckpointStats&) const override {
    return Status(StatusCode::kInternal, step.what + ": the full policy writes no increments");
  }
};

// Check-N-Run's differentials: every row changed since the baseline, on top
// of the baseline alone. Intermittent: back to a full checkpoint when the
// chain's sizes say a new baseline is cheaper (IntermittentTakesFull).
class DifferentialEncoding final : public EncodingPolicy {
 public:
  explicit DifferentialEncoding(bool intermittent) : intermittent_(intermittent) {}
  bool TakesFull(const TableIndex& index) const override {
    return intermittent_ && IntermittentTakesFull(index.diff_sizes);
  }
  Status WriteIncrement(const EncodeStep& step, TableIndex& index, RetainedCheckpoint& checkpoint,
                        TableCheckpointStats&) const override {
    const std::vector<std::uint64_t> rows = step.cumulative->SetIndices();
    PMSNAP_ASSIGN_OR_RETURN(const ChunkRef ref, WriteRows(step, rows, 0));
    checkpoint.refs = {index.baseline, ref};
    index.diff_sizes.push_back(static_cast<double>(rows.size()) / step.table_rows);
    return Status::Ok();
  }
  bool DifferentialSinceBaseline() const override { return true; }

 private:
  bool intermittent_;
};

// A chain of consecutive increments, each on top of the previous checkpoint:
// every row changed since it, or (CPR's MFU / SSU) the rows chosen at
// capture, with a full baseline after `baseline_every` increments.
class IncrementalEncoding final : public EncodingPolicy {
 public:
  explicit IncrementalEncoding(std::optional<std::uint32_t> prioritised_baseline_every)
      : baseline_every_(prioritised_baseline_every) {}
  bool TakesFull(const TableIndex& index) const override {
    return baseline_every_ && !index.retained.empty() &&
           index.retained.back().refs.size() > *baseline_every_;
  }
  Status WriteIncrement(const EncodeStep& step, TableIndex& index, RetainedCheckpoint& checkpoint,
                        TableCheckpointStats&) const override {
    PMSNAP_ASSIGN_OR_RETURN(
        const ChunkRef ref,
        WriteRows(step, baseline_every_ ? *step.priority_rows : step.interval_rows, 0));
    checkpoint.refs = index.retained.empty() ? std::vector<ChunkRef>{index.baseline}
                                             : index.retained.back().refs;
    checkpoint.refs.push_back(ref);
    return Status::Ok();
  }

 private:
  std::optional<std::uint32_t> baseline_every_;  // set for MFU / SSU
};

// IncrCP: each increment is a new column of a 2-D list; rows it rewrites
// are extracted from older Row 0 chunks into a Row 1 chunk of this epoch
// (Bloom filter, then the keys), and a new baseline is taken when reading
// the chain would cost more than writing one (IncrCPResetsBaseline).
class IncrCPEncoding final : public EncodingPolicy {
 public:
  explicit IncrCPEncoding(IncrCPOptions options) : options_(options) {}

  bool TakesFull(const TableIndex& index) const override {
    if (!options_.reset_baseline || index.read_bytes_per_second <= 0 || index.retained.empty()) {
      return false;
    }
    std::uint64_t increment_bytes = 0;
    for (const ChunkRef& ref : index.retained.back().refs) {
      if (!(ref == index.baseline)) increment_bytes += ref.length;
    }
    return IncrCPResetsBaseline(index.baseline_seconds, index.increment_seconds, increment_bytes,
                                index.read_bytes_per_second);
  }

  Status WriteIncrement(const EncodeStep& step, TableIndex& index, RetainedCheckpoint&,
                        TableCheckpointStats& stats) const override {
    const std::vector<std::uint64_t>& rows = step.interval_rows;
    PMSNAP_ASSIGN_OR_RETURN(const ChunkRef k_ref,
                            WriteRows(step, rows, options_.bloom_bits_per_key));
    const ListNode k_node{k_ref,
                          step.epoch,
                          0,
                          rows.empty() ? 0 : rows.front(),
                          rows.empty() ? 0 : rows.back(),
                          rows.size()};
    // Extraction: duplicates of the new chunk's keys leave the Row 0 chunks
    // they were in for a chunk in the new Row 1 (with row_epoch = epoch).
    ChunkReader reader(*step.chunks, step.what);
    const auto read_start = std::chrono::steady_clock::now();
    std::vector<std::vector<std::byte>> row0_images, row1_images;
    std::vector<ListNode> row0_nodes, row1_nodes, kept;
    for (const ListNode& node : index.nodes) {
      const bool candidate = node.row_epoch == 0 && node.count > 0 && !rows.empty() &&
                             node.min_key <= k_node.max_key && k_node.min_key <= node.max_key;
      if (!candidate) {  // stage 1: key ranges do not overlap
        kept.push_back(node);
        continue;
      }
      PMSNAP_ASSIGN_OR_RETURN(DataChunkView old, reader.Read(node.ref));
      const double needed = options_.duplicate_ratio_threshold * static_cast<double>(node.count);
      std::uint64_t hits = 0;  // stage 2: Bloom filter hit ratio
      for (std::uint64_t key : rows) hits += BloomMayContain(old.bloom, key) ? 1 : 0;
      if (static_cast<double>(hits) < needed || hits == 0) {
        kept.push_back(node);
        continue;
      }
      std::vector<std::uint64_t> duplicates, keep;  // stage 3: actual duplicates
      std::size_t j = 0;
      for (std::size_t i = 0; i < old.keys.size(); ++i) {
        while (j < rows.size() && rows[j] < old.keys[i]) ++j;
        (j < rows.size() && rows[j] == old.keys[i] ? duplicates : keep).push_back(i);
      }
      if (static_cast<double>(duplicates.size()) < needed || duplicates.empty()) {
        kept.push_back(node);
        continue;
      }
      ++stats.extractions;
      if (!keep.empty()) {
        PMSNAP_ASSIGN_OR_RETURN(std::vector<std::byte> image,
                                SliceDataChunk(old, keep, options_.bloom_bits_per_key));
        row0_images.push_back(std::move(image));
        row0_nodes.push_back(
            {{}, node.column, 0, old.keys[keep.front()], old.keys[keep.back()], keep.size()});
      }
      PMSNAP_ASSIGN_OR_RETURN(std::vector<std::byte> image, SliceDataChunk(old, duplicates, 0));
      row1_images.push_back(std::move(image));
      row1_nodes.push_back({{},
                            node.column,
                            step.epoch,
                            old.keys[duplicates.front()],
                            old.keys[duplicates.back()],
                            duplicates.size()});
    }
    if (reader.bytes_read() > 0) {
      index.read_bytes_per_second = reader.bytes_read() / std::max(Since(read_start), 1e-6);
    } else if (index.read_bytes_per_second == 0) {
      index.read_bytes_per_second = 5e9;  // until measured: a PM read bandwidth
    }
    PMSNAP_RETURN_IF_ERROR(Place(step, row0_images, row0_nodes));
    PMSNAP_RETURN_IF_ERROR(Place(step, row1_images, row1_nodes));
    index.nodes = std::move(kept);
    index.nodes.insert(index.nodes.end(), row0_nodes.begin(), row0_nodes.end());
    index.nodes.insert(index.nodes.end(), row1_nodes.begin(), row1_nodes.end());
    index.nodes.push_back(k_node);
    index.increment_seconds = Since(step.started);
    return Status::Ok();
  }

  // Retained checkpoints of the current generation are rebuilt from the 2-D
  // list: columns <= i, Row 0 or rows extracted after i, in column order.
  void RebuildRetained(TableIndex& index) const override {
    for (RetainedCheckpoint& c : index.retained) {
      if (c.epoch < index.baseline_epoch) continue;  // an older generation: unchanged
      std::vector<const ListNode*> in_rectangle;
      for (const ListNode& node : index.nodes) {
        if (node.column <= c.epoch && (node.row_epoch == 0 || node.row_epoch > c.epoch)) {
          in_rectangle.push_back(&node);
        }
      }
      std::stable_sort(in_rectangle.begin(), in_rectangle.end(),
                       [](const ListNode* a, const ListNode* b) { return a->column < b->column; });
      c.refs = {index.baseline};
      for (const ListNode* node : in_rectangle) c.refs.push_back(node->ref);
    }
  }

 private:
  // Concatenation: one bundle per row for this extraction's outputs (or one
  // chunk each without it); sets each node's ref.
  Status Place(const EncodeStep& step, const std::vector<std::vector<std::byte>>& images,
               std::vector<ListNode>& nodes) const {
    if (options_.concatenate) {
      const std::vector<std::span<const std::byte>> views(images.begin(), images.end());
      PMSNAP_ASSIGN_OR_RETURN(std::vector<ChunkRef> refs, step.write(views, images.size() > 1));
      for (std::size_t i = 0; i < refs.size(); ++i) nodes[i].ref = refs[i];
      return Status::Ok();
    }
    for (std::size_t i = 0; i < images.size(); ++i) {
      PMSNAP_ASSIGN_OR_RETURN(std::vector<ChunkRef> refs, step.write({images[i]}, false));
      nodes[i].ref = refs[0];
    }
    return Status::Ok();
  }

  IncrCPOptions options_;
};

}  // namespace

Result<DataChunkView> ChunkReader::Read(const ChunkRef& ref) {
  auto it = verified_.find(ref.heap_id);
  if (it == verified_.end()) {
    auto bytes = chunks_.Read(ref.heap_id);
    if (!bytes.ok()) return Status(bytes.status().code(), what_ + ": " + bytes.status().message());
    it = verified_.emplace(ref.heap_id, *bytes).first;
  }
  if (ref.offset > it->second.size() || ref.length > it->second.size() - ref.offset) {
    return Status(StatusCode::kCorruption, what_ + ": chunk reference outside its heap chunk " +
                                               std::to_string(ref.heap_id));
  }
  bytes_read_ += ref.length;
  return ParseDataChunk(it->second.subspan(ref.offset, ref.length), what_);
}

std::unique_ptr<EncodingPolicy> MakeEncodingPolicy(const EmbeddingOptions& options) {
  switch (options.policy) {
    case Policy::kFull:
      return std::make_unique<FullEncoding>();
    case Policy::kOneShotDifferential:
      return std::make_unique<DifferentialEncoding>(false);
    case Policy::kIntermittentDifferential:
      return std::make_unique<DifferentialEncoding>(true);
    case Policy::kConsecutiveIncremental:
      return std::make_unique<IncrementalEncoding>(std::nullopt);
    case Policy::kMostFrequentlyUsed:
    case Policy::kSubSampledUsed:
      return std::make_unique<IncrementalEncoding>(options.priority.baseline_every);
    case Policy::kIncrCP:
      return std::make_unique<IncrCPEncoding>(options.incrcp);
  }
  return std::make_unique<FullEncoding>();
}

}  // namespace pmsnap::diff::detail
