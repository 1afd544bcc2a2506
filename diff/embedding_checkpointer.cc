#include "pmsnap/diff/embedding_checkpointer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "pmsnap/common/mutex.h"
#include "detail/chunk_format.h"
#include "detail/encoding_policies.h"
#include "pmsnap/quant/param_search.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::diff {
namespace {

using Clock = std::chrono::steady_clock;
using detail::ChunkReader;
using detail::ChunkRef;
using detail::DataChunkView;
using detail::ListNode;
using detail::RetainedCheckpoint;
using detail::TableIndex;

constexpr std::uint64_t kKindData = 1;
constexpr std::uint64_t kKindBundle = 2;
constexpr std::uint64_t kKindIndex = 3;

std::uint64_t Tag(std::uint32_t unit, std::uint64_t kind) {
  return (static_cast<std::uint64_t>(unit) << 8) | kind;
}
std::uint32_t TagUnit(std::uint64_t tag) { return static_cast<std::uint32_t>(tag >> 8); }
std::uint64_t TagKind(std::uint64_t tag) { return tag & 0xff; }

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string What(const std::string& table, std::uint64_t epoch) {
  return "table '" + table + "' checkpoint " + std::to_string(epoch);
}

// Index chunks of `unit` committed no later than `limit`, newest first.
std::vector<layout::ChunkInfo> IndexChunks(const layout::ChunkHeap& chunks, std::uint32_t unit,
                                           std::uint64_t limit) {
  std::vector<layout::ChunkInfo> out;
  for (const layout::ChunkInfo& c : chunks.List()) {
    if (c.sealed && TagUnit(c.tag) == unit && TagKind(c.tag) == kKindIndex && c.epoch <= limit) {
      out.push_back(c);
    }
  }
  std::sort(out.begin(), out.end(), [](const layout::ChunkInfo& a, const layout::ChunkInfo& b) {
    return a.epoch > b.epoch;
  });
  return out;
}

Result<TableIndex> ReadIndex(const layout::ChunkHeap& chunks, const layout::ChunkInfo& chunk,
                             const std::string& table) {
  const std::string what = "index of " + What(table, chunk.epoch);
  auto bytes = chunks.Read(chunk.id);
  if (!bytes.ok()) return Status(bytes.status().code(), what + ": " + bytes.status().message());
  return detail::ParseIndex(*bytes, what);
}

struct TableShape {
  std::uint64_t rows = 0;
  std::vector<std::uint32_t> elems_per_row;
};

Result<TableShape> ShapeOf(const layout::UnitSpec& unit) {
  TableShape shape;
  for (const layout::TensorSpec& t : unit.tensors) {
    if (t.dtype != layout::DType::kFloat32 || t.shape.empty() || t.shape.size() > 2 ||
        t.shape[0] <= 0) {
      return Status(StatusCode::kInvalidArgument,
                    "embedding table '" + unit.name + "' tensor '" + t.name +
                        "': expected float32 [rows] or [rows, dim], got " +
                        layout::DTypeName(t.dtype) + " " + layout::ShapeToString(t.shape));
    }
    const auto rows = static_cast<std::uint64_t>(t.shape[0]);
    if (shape.rows != 0 && rows != shape.rows) {
      return Status(StatusCode::kInvalidArgument, "embedding table '" + unit.name + "' tensor '" +
                                                      t.name + "' has " + std::to_string(rows) +
                                                      " rows, the first tensor " +
                                                      std::to_string(shape.rows));
    }
    shape.rows = rows;
    shape.elems_per_row.push_back(t.shape.size() == 2 ? static_cast<std::uint32_t>(t.shape[1]) : 1);
  }
  return shape;
}

// Applies `refs` in order into dense per-tensor outputs.
Status Rebuild(ChunkReader& reader, const std::vector<ChunkRef>& refs, const TableShape& shape,
               std::vector<std::vector<float>>* out, RecoveryStats* stats = nullptr) {
  RecoveryStats local;
  stats = stats != nullptr ? stats : &local;
  auto phase_start = Clock::now();
  out->assign(shape.elems_per_row.size(), {});
  for (std::size_t t = 0; t < out->size(); ++t) {
    (*out)[t].assign(shape.rows * shape.elems_per_row[t], 0.0f);
  }
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const ChunkRef& ref = refs[i];
    if (i == 1) {
      stats->baseline_seconds += Since(phase_start);
      phase_start = Clock::now();
    }
    (i == 0 ? stats->baseline_bytes : stats->increment_bytes) += ref.length;
    stats->chunks_read += 1;
    PMSNAP_ASSIGN_OR_RETURN(DataChunkView view, reader.Read(ref));
    if (view.tensors.size() != shape.elems_per_row.size()) {
      return Status(StatusCode::kCorruption, "chunk holds " + std::to_string(view.tensors.size()) +
                                                 " tensors, the table has " +
                                                 std::to_string(shape.elems_per_row.size()));
    }
    for (std::size_t t = 0; t < view.tensors.size(); ++t) {
      const detail::TensorBlock& block = view.tensors[t];
      if (!view.keys.empty() && block.elems_per_row != shape.elems_per_row[t]) {
        return Status(StatusCode::kCorruption, "chunk row width differs from the table's");
      }
      const std::uint32_t elems = shape.elems_per_row[t];
      for (std::size_t r = 0; r < view.keys.size();) {
        if (view.keys[r] >= shape.rows) {
          return Status(StatusCode::kCorruption,
                        "row id " + std::to_string(view.keys[r]) + " outside the table");
        }
        // Raw rows with consecutive ids (a baseline, dense runs) copy as one block.
        std::size_t end = r + 1;
        if (!block.quantized) {
          // Ascending ids: stop the run before any id outside the table (the
          // next pass reports it).
          while (end < view.keys.size() && view.keys[end] == view.keys[end - 1] + 1 &&
                 view.keys[end] < shape.rows) {
            ++end;
          }
          std::memcpy((*out)[t].data() + view.keys[r] * elems, block.raw.data() + r * elems,
                      (end - r) * elems * sizeof(float));
        } else {
          PMSNAP_RETURN_IF_ERROR(block.ReadRow(r, (*out)[t].data() + view.keys[r] * elems));
        }
        r = end;
      }
    }
  }
  (refs.size() > 1 ? stats->increment_seconds : stats->baseline_seconds) += Since(phase_start);
  return Status::Ok();
}

const RetainedCheckpoint* FindRetained(const TableIndex& index, std::uint64_t epoch) {
  for (const RetainedCheckpoint& c : index.retained) {
    if (c.epoch == epoch) return &c;
  }
  return nullptr;
}

}  // namespace

const char* PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kFull:
      return "full";
    case Policy::kOneShotDifferential:
      return "one-shot-differential";
    case Policy::kConsecutiveIncremental:
      return "consecutive-incremental";
    case Policy::kIntermittentDifferential:
      return "intermittent-differential";
    case Policy::kIncrCP:
      return "incrcp-2d";
    case Policy::kMostFrequentlyUsed:
      return "cpr-mfu";
    case Policy::kSubSampledUsed:
      return "cpr-ssu";
  }
  return "unknown";
}

struct EmbeddingCheckpointer::Table {
  Table(std::uint32_t u, std::string n, TableShape s, std::vector<runtime::TensorView> t)
      : unit(u),
        name(std::move(n)),
        shape(std::move(s)),
        tensors(std::move(t)),
        tracker(name, shape.rows),
        cumulative(shape.rows),
        interval(shape.rows),
        carry_over(shape.rows),
        pending_cumulative(shape.rows) {}

  std::uint32_t unit;
  std::string name;
  TableShape shape;
  std::vector<runtime::TensorView> tensors;
  RowTracker tracker;  // training thread

  Mutex mutex;
  TableIndex index PMSNAP_GUARDED_BY(mutex);  // newest committed (epoch 0: none)
  TableIndex previous PMSNAP_GUARDED_BY(mutex);
  std::uint64_t index_chunk PMSNAP_GUARDED_BY(mutex) = 0;
  std::uint64_t previous_index_chunk PMSNAP_GUARDED_BY(mutex) = 0;
  BitVector cumulative PMSNAP_GUARDED_BY(mutex);  // rows changed since the baseline (committed)
  // Captured for the epoch in flight.
  BitVector interval PMSNAP_GUARDED_BY(mutex);
  // Rows of an abandoned epoch, merged into the next interval.
  BitVector carry_over PMSNAP_GUARDED_BY(mutex);
  std::uint64_t capture_epoch PMSNAP_GUARDED_BY(mutex) = 0;
  std::uint64_t capture_iteration PMSNAP_GUARDED_BY(mutex) = 0;
  // Encoded, not yet committed.
  std::optional<TableIndex> pending PMSNAP_GUARDED_BY(mutex);
  std::uint64_t pending_index_chunk PMSNAP_GUARDED_BY(mutex) = 0;
  BitVector pending_cumulative PMSNAP_GUARDED_BY(mutex);
  TableCheckpointStats pending_stats PMSNAP_GUARDED_BY(mutex);
  TableCheckpointStats last_stats PMSNAP_GUARDED_BY(mutex);
  // MFU / SSU: rows taken at capture for the epoch in flight, and those of an
  // abandoned epoch (handed back to the tracker at the next capture).
  std::vector<std::uint64_t> priority_rows PMSNAP_GUARDED_BY(mutex);
  std::vector<std::uint64_t> priority_carry PMSNAP_GUARDED_BY(mutex);
  double select_seconds PMSNAP_GUARDED_BY(mutex) = 0;
  std::uint64_t access_record_bytes PMSNAP_GUARDED_BY(mutex) = 0;
  // The rows a data chunk is built from, per tensor, and a written chunk's
  // image to build the next in, kept between epochs while all tables' kept
  // buffers fit in kKeptBufferBytes: buffers freed after each epoch go back
  // to the OS when glibc trims the worker's heap and are faulted in again
  // by the next, 4 KiB at a time (172 faults, about 2.6 ms of a worker's
  // time per step on the DLRM example; bench/RESULTS.md, eighth session).
  std::vector<std::vector<float>> gathered PMSNAP_GUARDED_BY(mutex);
  std::vector<std::byte> spare_image PMSNAP_GUARDED_BY(mutex);
  std::uint64_t kept_bytes PMSNAP_GUARDED_BY(mutex) = 0;  // their capacity
};

namespace {

using Table = EmbeddingCheckpointer::Table;

// The tables' gather and image buffers stay allocated between epochs up to
// this much in all; beyond it (a full checkpoint of a big table, many
// tables) a table's are freed after use.
constexpr std::uint64_t kKeptBufferBytes = std::uint64_t{64} << 20;

// Gathers `rows` of every tensor of `table` from device memory into
// `out` (their buffers reused), coalescing consecutive rows into one copy.
Status Gather(const Table& table, runtime::Device& device, const std::vector<std::uint64_t>& rows,
              std::vector<std::vector<float>>* out) {
  out->resize(table.tensors.size());
  for (std::size_t t = 0; t < table.tensors.size(); ++t) {
    const std::uint32_t elems = table.shape.elems_per_row[t];
    (*out)[t].resize(rows.size() * elems);
    const auto* src = static_cast<const float*>(table.tensors[t].data);
    for (std::size_t i = 0; i < rows.size();) {
      std::size_t j = i + 1;
      while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
      PMSNAP_RETURN_IF_ERROR(device.CopyToHost((*out)[t].data() + i * elems, src + rows[i] * elems,
                                               (j - i) * elems * sizeof(float)));
      i = j;
    }
  }
  return Status::Ok();
}

// Makes the table's newest index the newest committed no later than
// `limit`, and its previous one the index before that (none when the heap
// holds no such index).
Status LoadIndexes(Table& table, const layout::ChunkHeap& chunks, std::uint64_t limit)
    PMSNAP_REQUIRES(table.mutex) {
  table.index = TableIndex{};
  table.index_chunk = 0;
  table.previous = TableIndex{};
  table.previous_index_chunk = 0;
  std::vector<layout::ChunkInfo> indexes = IndexChunks(chunks, table.unit, limit);
  if (indexes.empty()) return Status::Ok();
  PMSNAP_ASSIGN_OR_RETURN(table.index, ReadIndex(chunks, indexes[0], table.name));
  table.index_chunk = indexes[0].id;
  if (indexes.size() > 1) {
    PMSNAP_ASSIGN_OR_RETURN(table.previous, ReadIndex(chunks, indexes[1], table.name));
    table.previous_index_chunk = indexes[1].id;
  }
  return Status::Ok();
}

}  // namespace

EmbeddingCheckpointer::EmbeddingCheckpointer(EmbeddingOptions options)
    : options_(options), encoding_(detail::MakeEncodingPolicy(options_)) {
  if (options_.retain == 0) options_.retain = 1;
}
EmbeddingCheckpointer::~EmbeddingCheckpointer() = default;

RowTracker* EmbeddingCheckpointer::tracker(const std::string& table) {
  for (auto& t : tables_) {
    if (t->name == table) return &t->tracker;
  }
  return nullptr;
}

TableCheckpointStats EmbeddingCheckpointer::last_checkpoint(const std::string& table) const {
  for (const auto& t : tables_) {
    if (t->name == table) {
      MutexLock lock(t->mutex);
      return t->last_stats;
    }
  }
  return {};
}

std::uint64_t EmbeddingCheckpointer::bytes_written() const { return committed_bytes_.load(); }

Status EmbeddingCheckpointer::Attach(layout::ChunkHeap& chunks, const layout::Manifest& manifest,
                                     std::uint64_t last_committed_epoch,
                                     const std::vector<runtime::UnitRegistration>& units,
                                     const std::vector<std::uint32_t>& encoded_units,
                                     runtime::Device& device) {
  chunks_ = &chunks;
  device_ = &device;
  table_of_unit_.assign(units.size(), -1);
  for (std::uint32_t u : encoded_units) {
    PMSNAP_ASSIGN_OR_RETURN(TableShape shape, ShapeOf(manifest.units[u]));
    auto table = std::make_unique<Table>(u, units[u].name, shape, units[u].tensors);
    // Nobody else has the table yet; the lock is for the analysis.
    MutexLock lock(table->mutex);
    PMSNAP_RETURN_IF_ERROR(LoadIndexes(*table, chunks, last_committed_epoch));
    // Rows changed since the baseline = the newest differential's rows.
    if (encoding_->DifferentialSinceBaseline() && !table->index.retained.empty() &&
        table->index.retained.back().refs.size() == 2) {
      ChunkReader reader(chunks, What(table->name, table->index.epoch));
      PMSNAP_ASSIGN_OR_RETURN(DataChunkView diff,
                              reader.Read(table->index.retained.back().refs[1]));
      for (std::uint64_t key : diff.keys) table->cumulative.Set(key);
    }
    if (IsPrioritised(options_.policy)) {
      const double r = options_.priority.ratio;
      if (!(r > 0 && r <= 1)) {
        return Status(StatusCode::kInvalidArgument,
                      "embedding table '" + table->name + "': " + PolicyName(options_.policy) +
                          " needs a ratio r in (0, 1], got " + std::to_string(r));
      }
      const auto capacity = static_cast<std::uint64_t>(
          std::ceil(r * static_cast<double>(table->shape.rows)));
      PMSNAP_RETURN_IF_ERROR(table->tracker.EnableAccessRecord(
          options_.policy == Policy::kMostFrequentlyUsed ? AccessRecord::kMostFrequentlyUsed
                                                         : AccessRecord::kSubSampledUsed,
          capacity, options_.priority.ssu_period, options_.priority.seed ^ u));
    }
    table_of_unit_[u] = static_cast<int>(tables_.size());
    tables_.push_back(std::move(table));
  }
  return Status::Ok();
}

Status EmbeddingCheckpointer::OnCaptured(std::uint32_t unit, std::uint64_t epoch,
                                         std::uint64_t iteration) {
  Table& table = *tables_[table_of_unit_[unit]];
  BitVector interval = table.tracker.TakeInterval();
  PriorityTake take;
  if (IsPrioritised(options_.policy)) {
    std::vector<std::uint64_t> carry;
    {
      MutexLock lock(table.mutex);
      carry.swap(table.priority_carry);
    }
    table.tracker.ReturnPriorityRows(carry);
    take = table.tracker.TakePriorityRows();
  }
  const std::uint64_t record_bytes = table.tracker.access_record_bytes();
  MutexLock lock(table.mutex);
  table.priority_rows = std::move(take.rows);
  table.select_seconds = take.select_seconds;
  table.access_record_bytes = record_bytes;
  interval.OrWith(table.carry_over);
  table.carry_over.Clear();
  table.interval = std::move(interval);
  table.capture_epoch = epoch;
  table.capture_iteration = iteration;
  return Status::Ok();
}

Status EmbeddingCheckpointer::Encode(std::uint32_t unit, std::uint64_t epoch) {
  Table& table = *tables_[table_of_unit_[unit]];
  MutexLock lock(table.mutex);
  const auto start = Clock::now();
  const std::string what = What(table.name, epoch);
  layout::ChunkHeap& chunks = *chunks_;
  TableCheckpointStats stats;
  stats.epoch = epoch;

  detail::EncodeOptions encode;
  if (options_.quantize.enabled) {
    const int bits = options_.quantize.bits != 0
                         ? options_.quantize.bits
                         : quant::BitsForExpectedResumes(options_.quantize.expected_resumes);
    encode.quantize = true;
    encode.quant.bits = bits;
    encode.quant.method = bits <= 4 ? quant::Method::kAdaptive : quant::Method::kAsymmetric;
    encode.quant.scale_type = options_.quantize.scale_type;
    encode.quant.max_threads = 1;  // already on a worker
  }

  // Writes images as one heap chunk (a bundle when more than one).
  auto write = [&](const std::vector<std::span<const std::byte>>& images,
                   bool bundle) -> Result<std::vector<ChunkRef>> {
    std::vector<ChunkRef> refs;
    if (images.empty()) return refs;
    std::uint64_t total = 0;
    for (const auto& image : images) total += image.size();
    PMSNAP_ASSIGN_OR_RETURN(
        layout::ChunkInfo chunk,
        chunks.Alloc(total, epoch, Tag(unit, bundle ? kKindBundle : kKindData)));
    PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, chunks.Payload(chunk.id));
    std::uint64_t offset = 0;
    for (const auto& image : images) {
      std::memcpy(payload.data() + offset, image.data(), image.size());
      refs.push_back({chunk.id, offset, image.size()});
      offset += image.size();
    }
    PMSNAP_RETURN_IF_ERROR(chunks.Seal(chunk.id));
    stats.bytes_written += total;
    return refs;
  };
  // The table's kept buffers (Table::gathered), lent to the lambdas below
  // (which the thread-safety analysis cannot see under the lock) and handed
  // back once the chunks are written.
  std::vector<std::vector<float>> gathered = std::move(table.gathered);
  std::vector<std::byte> spare_image = std::move(table.spare_image);
  // A data chunk of `rows` read from the live tensors.
  auto data_chunk = [&](const std::vector<std::uint64_t>& rows,
                        std::uint32_t bloom_bits) -> Result<std::vector<std::byte>> {
    PMSNAP_RETURN_IF_ERROR(Gather(table, *device_, rows, &gathered));
    std::vector<detail::TensorInput> inputs;
    for (std::size_t t = 0; t < gathered.size(); ++t) {
      inputs.push_back({table.shape.elems_per_row[t], gathered[t]});
    }
    detail::EncodeOptions options = encode;
    options.bloom_bits_per_key = bloom_bits;
    stats.rows_written += rows.size();
    return detail::BuildDataChunk(epoch, rows, inputs, options, table.name,
                                  std::move(spare_image));
  };
  auto recycle = [&spare_image](std::vector<std::byte>&& image) {
    spare_image = std::move(image);
  };
  auto all_rows = [&table]() {
    std::vector<std::uint64_t> rows(table.shape.rows);
    for (std::uint64_t r = 0; r < rows.size(); ++r) rows[r] = r;
    return rows;
  };

  TableIndex next = table.index;
  next.policy = static_cast<std::uint32_t>(options_.policy);
  next.epoch = epoch;
  BitVector cumulative = table.cumulative;
  cumulative.OrWith(table.interval);
  stats.select_seconds = table.select_seconds;
  stats.access_record_bytes = table.access_record_bytes;

  RetainedCheckpoint checkpoint{epoch, table.capture_iteration, {}};
  if (next.baseline_epoch == 0 || encoding_->TakesFull(next)) {
    PMSNAP_ASSIGN_OR_RETURN(std::vector<std::byte> image, data_chunk(all_rows(), 0));
    PMSNAP_ASSIGN_OR_RETURN(std::vector<ChunkRef> refs, write({image}, false));
    recycle(std::move(image));
    next.baseline = refs[0];
    next.baseline_epoch = epoch;
    next.diff_sizes.clear();
    next.nodes.clear();
    next.baseline_seconds = Since(start);
    checkpoint.refs = {refs[0]};
    cumulative.Clear();
    stats.full = true;
  } else {
    detail::EncodeStep step;
    step.epoch = epoch;
    step.started = start;
    step.chunks = &chunks;
    step.what = what;
    step.table_rows = table.shape.rows;
    step.interval_rows = table.interval.SetIndices();
    step.cumulative = &cumulative;
    step.priority_rows = &table.priority_rows;
    step.data_chunk = data_chunk;
    step.write = write;
    step.recycle = recycle;
    PMSNAP_RETURN_IF_ERROR(encoding_->WriteIncrement(step, next, checkpoint, stats));
  }
  std::uint64_t buffer_bytes = spare_image.capacity();
  for (const std::vector<float>& rows : gathered) buffer_bytes += rows.capacity() * sizeof(float);
  // Other tables' encodes update the total beside this one: the bound is
  // approximate by a table's buffers, never exceeded by more.
  const std::uint64_t others = kept_buffer_bytes_.load() - table.kept_bytes;
  const std::uint64_t kept = others + buffer_bytes <= kKeptBufferBytes ? buffer_bytes : 0;
  if (kept != 0) {
    table.gathered = std::move(gathered);
    table.spare_image = std::move(spare_image);
  }
  kept_buffer_bytes_.fetch_add(kept - table.kept_bytes);  // modulo 2^64: a decrease too
  table.kept_bytes = kept;
  next.retained.push_back(checkpoint);
  encoding_->RebuildRetained(next);
  while (next.retained.size() > options_.retain) next.retained.erase(next.retained.begin());

  const std::vector<std::byte> index_image = detail::SerializeIndex(next);
  PMSNAP_ASSIGN_OR_RETURN(layout::ChunkInfo index_chunk,
                          chunks.Alloc(index_image.size(), epoch, Tag(unit, kKindIndex)));
  PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, chunks.Payload(index_chunk.id));
  std::memcpy(payload.data(), index_image.data(), index_image.size());
  PMSNAP_RETURN_IF_ERROR(chunks.Seal(index_chunk.id));
  stats.bytes_written += index_image.size();

  stats.construction_seconds = Since(start);
  std::set<std::pair<std::uint64_t, std::uint64_t>> live;
  for (const RetainedCheckpoint& c : next.retained) {
    for (const ChunkRef& ref : c.refs) live.insert({ref.heap_id, ref.offset});
  }
  stats.live_chunks = live.size();
  table.pending = std::move(next);
  table.pending_index_chunk = index_chunk.id;
  table.pending_cumulative = std::move(cumulative);
  table.pending_stats = stats;
  return Status::Ok();
}

Status EmbeddingCheckpointer::OnCommitted(std::uint64_t epoch) {
  for (auto& t : tables_) {
    MutexLock lock(t->mutex);
    if (!t->pending || t->pending->epoch != epoch) continue;
    t->previous = std::move(t->index);
    t->previous_index_chunk = t->index_chunk;
    t->index = std::move(*t->pending);
    t->index_chunk = t->pending_index_chunk;
    t->pending.reset();
    t->cumulative = t->pending_cumulative;
    committed_bytes_ += t->pending_stats.bytes_written;
    t->last_stats = t->pending_stats;
  }
  // Free chunks that neither of the two newest indexes needs (the older one
  // stays usable if the newest dense slot is ever lost to corruption).
  std::unordered_set<std::uint64_t> referenced;
  for (auto& t : tables_) {
    MutexLock lock(t->mutex);
    referenced.insert(t->index_chunk);
    referenced.insert(t->previous_index_chunk);
    for (const TableIndex* index : {&t->index, &t->previous}) {
      for (const RetainedCheckpoint& c : index->retained) {
        for (const ChunkRef& ref : c.refs) referenced.insert(ref.heap_id);
      }
    }
  }
  for (const layout::ChunkInfo& chunk : chunks_->List()) {
    const std::uint32_t unit = TagUnit(chunk.tag);
    if (unit >= table_of_unit_.size() || table_of_unit_[unit] < 0) continue;
    if (chunk.epoch > epoch || referenced.count(chunk.id) != 0) continue;
    PMSNAP_RETURN_IF_ERROR(chunks_->Free(chunk.id));
  }
  return Status::Ok();
}

void EmbeddingCheckpointer::OnAbandoned(std::uint64_t epoch) {
  for (auto& t : tables_) {
    MutexLock lock(t->mutex);
    if (t->capture_epoch != epoch) continue;
    // The rows of the lost interval are still changed: the next one takes them.
    t->carry_over.OrWith(t->interval);
    t->interval.Clear();
    t->priority_carry.insert(t->priority_carry.end(), t->priority_rows.begin(),
                             t->priority_rows.end());
    t->priority_rows.clear();
    t->pending.reset();
  }
}

Status EmbeddingCheckpointer::Restore(std::uint32_t unit, std::uint64_t epoch) {
  Table& table = *tables_[table_of_unit_[unit]];
  MutexLock lock(table.mutex);
  const std::string what = What(table.name, epoch);
  if (table.index.epoch > epoch) {
    // The ranks agreed on an iteration this rank committed before its newest
    // (Pool::RollBackLatest): the newer epoch is dropped, and the next
    // BeginEpoch frees its chunks and reuses its number. Attach read the
    // dropped epoch's index (its baseline, IncrCP's chunk list, the retained
    // chain); the next checkpoint must build on the restored epoch's.
    PMSNAP_RETURN_IF_ERROR(LoadIndexes(table, *chunks_, epoch));
  }
  const RetainedCheckpoint* checkpoint = FindRetained(table.index, epoch);
  if (checkpoint == nullptr) {
    return Status(StatusCode::kNotFound, what + " is not retained in the pool");
  }
  ChunkReader reader(*chunks_, what);
  std::vector<std::vector<float>> tensors;
  Status rebuilt = Rebuild(reader, checkpoint->refs, table.shape, &tensors);
  if (!rebuilt.ok()) return Status(rebuilt.code(), what + ": " + rebuilt.message());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    PMSNAP_RETURN_IF_ERROR(device_->CopyFromHost(table.tensors[t].data, tensors[t].data(),
                                                 tensors[t].size() * sizeof(float)));
  }
  // Training resumes from this checkpoint: later differentials build on it.
  table.cumulative.Clear();
  if (checkpoint->refs.size() == 2 && encoding_->DifferentialSinceBaseline()) {
    PMSNAP_ASSIGN_OR_RETURN(DataChunkView diff, reader.Read(checkpoint->refs[1]));
    for (std::uint64_t key : diff.keys) table.cumulative.Set(key);
  }
  return Status::Ok();
}

namespace {

Result<std::pair<std::uint32_t, TableShape>> FindTable(const layout::Pool& pool,
                                                       const std::string& table) {
  std::optional<std::uint32_t> unit = pool.FindUnit(table);
  if (!unit || (pool.manifest().units[*unit].flags & layout::kUnitFlagEncoded) == 0) {
    return Status(StatusCode::kNotFound,
                  "pool '" + pool.path() + "' has no embedding table '" + table + "'");
  }
  PMSNAP_ASSIGN_OR_RETURN(TableShape shape, ShapeOf(pool.manifest().units[*unit]));
  return std::make_pair(*unit, shape);
}

Result<TableIndex> NewestIndex(const layout::Pool& pool, std::uint32_t unit,
                               const std::string& table) {
  std::vector<layout::ChunkInfo> indexes =
      IndexChunks(pool.chunk_heap(), unit, pool.last_committed_epoch().value_or(0));
  if (indexes.empty()) {
    return Status(StatusCode::kNotFound, "table '" + table + "' has no committed checkpoint");
  }
  return ReadIndex(pool.chunk_heap(), indexes[0], table);
}

}  // namespace

Result<std::vector<CheckpointInfo>> ListCheckpoints(const layout::Pool& pool,
                                                    const std::string& table) {
  PMSNAP_ASSIGN_OR_RETURN(auto found, FindTable(pool, table));
  PMSNAP_ASSIGN_OR_RETURN(TableIndex index, NewestIndex(pool, found.first, table));
  std::vector<CheckpointInfo> out;
  for (const RetainedCheckpoint& c : index.retained) {
    CheckpointInfo info{c.epoch, c.iteration, c.refs.size(), 0,
                        static_cast<Policy>(index.policy)};
    for (const ChunkRef& ref : c.refs) info.chunk_bytes += ref.length;
    out.push_back(info);
  }
  return out;
}

Result<RecoveredTable> RecoverTable(const layout::Pool& pool, const std::string& table,
                                    std::optional<std::uint64_t> epoch) {
  PMSNAP_ASSIGN_OR_RETURN(auto found, FindTable(pool, table));
  PMSNAP_ASSIGN_OR_RETURN(TableIndex index, NewestIndex(pool, found.first, table));
  const std::uint64_t wanted =
      epoch.value_or(index.retained.empty() ? 0 : index.retained.back().epoch);
  const std::string what = What(table, wanted);
  const RetainedCheckpoint* checkpoint = FindRetained(index, wanted);
  if (checkpoint == nullptr) {
    std::string retained;
    for (const RetainedCheckpoint& c : index.retained) {
      retained += (retained.empty() ? "" : ", ") + std::to_string(c.epoch);
    }
    return Status(StatusCode::kNotFound, what + " is not retained (retained: " + retained + ")");
  }
  // Every retained checkpoint starts from a baseline holding every row, at
  // 2 bits per value at the least. A table that could not fit the chunk heap
  // even so comes from a damaged manifest: refuse it before allocating it.
  const TableShape& shape = found.second;
  std::uint64_t values_per_row = 0;
  for (std::uint32_t elems : shape.elems_per_row) values_per_row += elems;
  std::uint64_t values = 0;
  if (__builtin_mul_overflow(shape.rows, values_per_row, &values) ||
      values / 4 > pool.chunk_heap().capacity_bytes()) {
    return Status(StatusCode::kCorruption,
                  what + ": the manifest's table of " + std::to_string(shape.rows) +
                      " rows cannot fit the pool's chunk heap of " +
                      std::to_string(pool.chunk_heap().capacity_bytes()) + " bytes");
  }
  RecoveredTable out;
  out.epoch = checkpoint->epoch;
  out.iteration = checkpoint->iteration;
  out.rows = found.second.rows;
  out.elems_per_row = found.second.elems_per_row;
  ChunkReader reader(pool.chunk_heap(), what);
  Status rebuilt = Rebuild(reader, checkpoint->refs, found.second, &out.tensors, &out.stats);
  if (!rebuilt.ok()) {
    return Status(rebuilt.code(), rebuilt.message().rfind(what, 0) == 0
                                      ? rebuilt.message()
                                      : what + ": " + rebuilt.message());
  }
  return out;
}

}  // namespace pmsnap::diff
