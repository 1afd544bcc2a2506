// EmbeddingCheckpointer: differential, incremental and quantized checkpoints
// of embedding tables, as a runtime::Encoder on the same pipeline as the
// dense units (one commit covers both). Payloads live in the pool's chunk
// heap; each epoch also writes a per-table index chunk listing, for every
// retained checkpoint, the chunks that rebuild it, so any retained checkpoint
// is recoverable after a crash with no DRAM state.
//
// Policies (Check-N-Run 5.1, IncrCP 4):
//   kFull                      every checkpoint writes the whole table.
//   kOneShotDifferential       a baseline, then the rows changed since it.
//   kConsecutiveIncremental    a baseline, then the rows changed in each
//                              interval; recovery replays them all (naive).
//   kIntermittentDifferential  one-shot differential with Check-N-Run's
//                              predictor: a new full baseline when
//                              F_c = 1 + S_1 + ... + S_i <= I_c = (i + 1) S_i.
//   kIncrCP                    increments in IncrCP's 2-D chunk list:
//                              duplicates extracted from Row 0 into deeper
//                              rows after a key-range check, a Bloom-filter hit
//                              ratio and the actual duplicate ratio (each
//                              against R), outputs of one extraction
//                              concatenated into one bundle per row, and the
//                              baseline reset when T_base < T_incre.
//   kMostFrequentlyUsed        CPR-MFU (CPR 4.2): a baseline, then each
//                              checkpoint writes only the r*N rows with the
//                              most lookups since they were last saved (4-byte
//                              counter per row, cleared when saved).
//   kSubSampledUsed            CPR-SSU: a baseline, then each checkpoint writes
//                              the rows of a sub-sampled used-row list of at
//                              most r*N entries (random eviction on overflow).
//                              Both are approximate on purpose: rows changed
//                              but not chosen keep their older saved value;
//                              CPR's partial recovery accepts that loss and
//                              counts it in PLS. Recovery replays the chain;
//                              a new baseline every `baseline_every`
//                              checkpoints bounds it.
// Rows may be quantized (quant/) with a bit width from the expected number of
// resumes. Retention keeps the newest `retain` checkpoints; chunks no
// retained checkpoint of the two newest indexes needs are freed after each
// commit (a crash mid-way only delays that).
//
// Thread-safety: the runtime::Encoder contract. tracker() belongs to the
// training thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pmsnap/diff/row_tracker.h"
#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/quant/quant.h"
#include "pmsnap/runtime/encoder.h"

namespace pmsnap::diff {

enum class Policy : std::uint32_t {
  kFull = 1,
  kOneShotDifferential = 2,
  kConsecutiveIncremental = 3,
  kIntermittentDifferential = 4,
  kIncrCP = 5,
  kMostFrequentlyUsed = 6,
  kSubSampledUsed = 7,
};
// Whether `policy` saves only prioritised rows (CPR-MFU / CPR-SSU).
inline bool IsPrioritised(Policy policy) {
  return policy == Policy::kMostFrequentlyUsed || policy == Policy::kSubSampledUsed;
}
const char* PolicyName(Policy policy);

struct QuantizeOptions {
  bool enabled = false;
  // Bit width; 0: from expected_resumes (Check-N-Run thresholds).
  int bits = 0;
  double expected_resumes = 1;
  // Adaptive asymmetric for <= 4 bits, plain asymmetric for 8 (paper 5.2).
  quant::ScaleType scale_type = quant::ScaleType::kFp16;
};

struct IncrCPOptions {
  double duplicate_ratio_threshold = 0.02;  // R (paper 5.3)
  std::uint32_t bloom_bits_per_key = 10;
  bool concatenate = true;     // bundles per row per extraction
  bool reset_baseline = true;  // T_base < T_incre
};

// CPR-MFU / CPR-SSU (CPR 4.2, 5.1: r = 0.125, SSU sampling period 2).
struct PriorityOptions {
  double ratio = 0.125;              // r: rows per checkpoint = ceil(r * N)
  std::uint32_t ssu_period = 2;      // SSU: every n-th lookup is sampled
  std::uint32_t baseline_every = 32; // a full baseline after this many increments
  std::uint64_t seed = 0x5eed;       // SSU eviction (per table: seed ^ unit)
};

struct EmbeddingOptions {
  Policy policy = Policy::kIntermittentDifferential;
  std::uint32_t retain = 2;  // newest checkpoints kept recoverable (>= 1)
  QuantizeOptions quantize;
  IncrCPOptions incrcp;
  PriorityOptions priority;
};

// What one table's last checkpoint wrote (bench and tests read it).
struct TableCheckpointStats {
  std::uint64_t epoch = 0;
  std::uint64_t rows_written = 0;
  std::uint64_t bytes_written = 0;
  bool full = false;
  double construction_seconds = 0;
  std::uint64_t extractions = 0;  // IncrCP: chunks split this epoch
  std::uint64_t live_chunks = 0;  // logical chunks the newest index references
  // MFU / SSU: time choosing the rows (at capture) and the access record's
  // DRAM bytes then.
  double select_seconds = 0;
  std::uint64_t access_record_bytes = 0;
};

namespace detail {
class EncodingPolicy;
}  // namespace detail

class EmbeddingCheckpointer final : public runtime::Encoder {
 public:
  explicit EmbeddingCheckpointer(EmbeddingOptions options);
  ~EmbeddingCheckpointer() override;

  // The row tracker of an encoded table (after Engine::Open), or nullptr.
  RowTracker* tracker(const std::string& table);
  TableCheckpointStats last_checkpoint(const std::string& table) const;
  const EmbeddingOptions& options() const { return options_; }

  // runtime::Encoder
  Status Attach(layout::ChunkHeap& chunks, const layout::Manifest& manifest,
                std::uint64_t last_committed_epoch,
                const std::vector<runtime::UnitRegistration>& units,
                const std::vector<std::uint32_t>& encoded_units, runtime::Device& device) override;
  Status OnCaptured(std::uint32_t unit, std::uint64_t epoch, std::uint64_t iteration) override;
  Status Encode(std::uint32_t unit, std::uint64_t epoch) override;
  Status OnCommitted(std::uint64_t epoch) override;
  void OnAbandoned(std::uint64_t epoch) override;
  Status Restore(std::uint32_t unit, std::uint64_t epoch) override;
  std::uint64_t bytes_written() const override;

  // Host bytes of encode buffers the tables keep between epochs, all tables
  // together (about 64 MiB at most): memory pmsnap holds beside the pool.
  std::uint64_t kept_buffer_bytes() const { return kept_buffer_bytes_.load(); }

  struct Table;  // per-table state (embedding_checkpointer.cc)

 private:
  EmbeddingOptions options_;
  // What options_.policy does at each Encode (diff/detail/encoding_policies.h).
  std::unique_ptr<detail::EncodingPolicy> encoding_;
  layout::ChunkHeap* chunks_ = nullptr;
  runtime::Device* device_ = nullptr;
  std::vector<std::unique_ptr<Table>> tables_;     // one per encoded unit
  std::vector<int> table_of_unit_;                 // unit -> index in tables_, -1
  std::atomic<std::uint64_t> committed_bytes_{0};  // chunk bytes of committed epochs
  // What the tables keep of their encode buffers between epochs, all
  // tables together (Table::gathered; at most kKeptBufferBytes).
  std::atomic<std::uint64_t> kept_buffer_bytes_{0};
};

// --- recovery without an engine (tools, benchmarks, tests) ---

struct CheckpointInfo {
  std::uint64_t epoch = 0;
  std::uint64_t iteration = 0;
  std::uint64_t chunks = 0;       // logical chunks read to rebuild it
  std::uint64_t chunk_bytes = 0;  // their bytes
  Policy policy = Policy::kFull;  // the policy of the index that lists it
};

// Where a recovery's time went: the baseline (a checkpoint's first chunk,
// the whole table) and the chunks applied over it (differential,
// increments, IncrCP's list). IncrCP reports recovery time without the
// baseline (its section 5.1.4); the sum is the whole rebuild.
struct RecoveryStats {
  std::uint64_t chunks_read = 0;
  std::uint64_t baseline_bytes = 0;
  std::uint64_t increment_bytes = 0;
  double baseline_seconds = 0;
  double increment_seconds = 0;
};

struct RecoveredTable {
  std::uint64_t epoch = 0;
  std::uint64_t iteration = 0;
  std::uint64_t rows = 0;
  std::vector<std::uint32_t> elems_per_row;  // per tensor
  std::vector<std::vector<float>> tensors;   // rows * elems_per_row each
  RecoveryStats stats;
};

// Retained checkpoints of `table` (an encoded unit's name), oldest first,
// from the newest index not newer than the pool's last committed epoch.
Result<std::vector<CheckpointInfo>> ListCheckpoints(const layout::Pool& pool,
                                                    const std::string& table);
// Rebuilds `table` as of checkpoint `epoch` (default: the newest). Damaged
// chunks give kCorruption naming the table and the checkpoint.
Result<RecoveredTable> RecoverTable(const layout::Pool& pool, const std::string& table,
                                    std::optional<std::uint64_t> epoch = std::nullopt);

}  // namespace pmsnap::diff
