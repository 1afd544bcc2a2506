// DifferentialLog: LowDiff's differential checkpoints (paper 002, section V).
//
// In data-parallel training with gradient compression, the synchronized
// compressed gradient of iteration t is exactly what turns the model of
// iteration t-1 into the model of iteration t (after decompression and the
// optimizer step). LowDiff persists it as a differential checkpoint; a full
// checkpoint (the engine's slots) is taken only every 1/f iterations, and
// recovery restores the newest full checkpoint, then replays the
// differentials after it in order.
//
// This class holds the part that is independent of torch: the chunk format,
// batched writes (b differentials buffered in host memory and written as one
// chunk of the pool's chunk heap), their retention, recovery reads, the
// (f*, b*) configuration of Eq. 10 and the wasted time of Eq. 8, and the
// additive merges used by parallel recovery. What a differential means
// (compressor, decompression, optimizer) belongs to the front end
// (python/pmsnap/lowdiff.py); here a differential is a list of typed byte
// pieces.
//
// Chunks: tag kDifferentialChunkTag, epoch 0. Differentials are not tied to
// an engine epoch: they extend the newest full checkpoint, whichever slot
// that turns out to be after a crash (or after a distributed restore rolls
// a rank one epoch back), so the log frees them itself (Retire) instead of
// the pool's rule for chunks of uncommitted epochs. Format: FORMAT.md,
// "Differential chunks (LowDiff)".
//
// Thread-safety: Append, WaitCopied, WaitWritten, Flush, Retire, Close and
// SetBatch belong to one training thread; stats() may be called from any
// thread. One worker thread of the log copies the appended pieces into the
// host batch buffer and writes full batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/mutex.h"
#include "pmsnap/common/status.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::diff {

// The chunk heap tag of every differential chunk. Its bits 8..39 name no
// embedding table, so diff::EmbeddingCheckpointer leaves these chunks alone.
inline constexpr std::uint64_t kDifferentialChunkTag = 0x4C4F5744FFFFFFD1ull;

// One piece of a differential, by reference: `data` stays owned by the
// caller and must stay unchanged until WaitCopied(iteration) returned.
// `dtype` is the caller's code (stored, not interpreted); `shape` at most 8
// dimensions.
struct DifferentialPiece {
  std::uint32_t dtype = 0;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

// A piece read back from the pool (recovery), owning its bytes.
struct StoredPiece {
  std::uint32_t dtype = 0;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

struct Differential {
  std::uint64_t iteration = 0;
  std::vector<StoredPiece> pieces;
};

struct DifferentialLogOptions {
  // b: differentials per chunk (>= 1). After WaitCopied(t) returned, a
  // crash loses at most the b-1 differentials buffered in host memory (the
  // differential completing a batch counts as copied once its chunk is
  // sealed).
  std::uint32_t batch = 1;
  // The resumed run continues after iteration `resume_after` (the iteration
  // recovery replayed to): differentials after it that a crashed run wrote
  // are dropped at Open (a truncation mark, then their chunks freed).
  // nullopt: a fresh log; chunks already in the pool are kept as they are.
  std::optional<std::uint64_t> resume_after;
};

struct DifferentialLogStats {
  std::uint64_t appended = 0;         // differentials handed to Append
  std::uint64_t durable = 0;          // of those, in sealed chunks
  std::uint64_t last_durable_iteration = 0;
  std::uint64_t buffered = 0;         // copied to host memory, not in a chunk yet
  std::uint64_t batches_written = 0;  // chunks sealed by this log
  std::uint64_t bytes_written = 0;    // their payload bytes
  std::uint64_t last_chunk_bytes = 0;          // payload of the newest chunk sealed
  std::uint32_t last_chunk_differentials = 0;  // and the differentials in it
  std::uint64_t chunks_freed = 0;     // by Retire and Open's truncation
  std::uint64_t live_chunks = 0;      // differential chunks in the pool now
  // The pool's chunk heap (all its chunks) as of the last write, Retire or
  // Open: bytes charged, and the budget (PoolOptions::chunk_heap_bytes).
  std::uint64_t heap_used_bytes = 0;
  std::uint64_t heap_capacity_bytes = 0;
  std::uint32_t batch = 1;            // b in force
  std::uint32_t max_loss = 0;         // b - 1: differentials a crash may lose beyond a write in flight
  double write_seconds = 0;           // worker time in Alloc + copy + Seal
  double copy_wait_seconds = 0;       // training thread waiting in WaitCopied (Append never waits)
  // Measured write bandwidth of the differential chunks (bytes / second of
  // Alloc + payload copy + Seal); 0 until a batch was written.
  double write_bandwidth() const { return write_seconds > 0 ? bytes_written / write_seconds : 0; }
};

class DifferentialLog {
 public:
  // Opens the log on `pool`'s chunk heap (which must have a budget:
  // PoolOptions::chunk_heap_bytes > 0, else kFailedPrecondition naming the
  // pool). Reads no payload; with options.resume_after, writes the
  // truncation mark and frees the chunks it masks. kInvalidArgument for a
  // batch of 0. `pool` must outlive the log.
  static Result<std::unique_ptr<DifferentialLog>> Open(layout::Pool& pool,
                                                       DifferentialLogOptions options);
  // Stops the worker. Differentials still buffered are not written (what a
  // crash does); call Close() first to keep them.
  ~DifferentialLog();
  DifferentialLog(const DifferentialLog&) = delete;
  DifferentialLog& operator=(const DifferentialLog&) = delete;

  // Hands over the differential of `iteration` by reference (no copy on the
  // calling thread): the worker copies the pieces into the host batch
  // buffer, and once b are buffered writes them as one chunk. Iterations
  // must increase by one from the first Append on (kInvalidArgument
  // otherwise, naming both). Never waits. Returns the worker's first error, if any, from then on.
  Status Append(std::uint64_t iteration, std::vector<DifferentialPiece> pieces);
  // Waits until the pieces of `iteration` (and every earlier one) were
  // copied: their buffers may be reused; and if `iteration` completed a
  // batch, until that chunk is sealed. The worker's error, if any.
  Status WaitCopied(std::uint64_t iteration);
  // Waits until every batch handed to the writer is sealed (the partial
  // batch stays buffered).
  Status WaitWritten();
  // Writes the partial batch too and waits: everything appended is durable.
  Status Flush();
  // Flush, then stops the worker. Later calls return kFailedPrecondition.
  Status Close();
  // Stops the worker without writing what is buffered or queued (what a
  // crash does; also for an engine closed with abandon). Later calls return
  // kFailedPrecondition.
  void Abandon();
  // Full checkpoints of iterations up to `full_iteration` are committed and
  // no recovery will start before it: frees the chunks whose differentials
  // are all at or before it (and spent truncation marks).
  Status Retire(std::uint64_t full_iteration);
  // Changes b from the next batch on (>= 1). kInvalidArgument for 0.
  Status SetBatch(std::uint32_t batch);

  DifferentialLogStats stats() const;
  const std::string& pool_path() const { return pool_path_; }

 private:
  struct Pending;
  // A differential chunk in the pool (what Retire needs of it).
  struct LiveChunk {
    std::uint64_t id = 0;
    std::uint64_t sequence = 0;
    std::uint64_t first = 0;  // iterations first .. first + count - 1
    std::uint32_t count = 0;  // 0: a truncation mark
    std::uint64_t truncate_after = 0;
  };
  DifferentialLog(layout::Pool& pool, DifferentialLogOptions options);
  void Run() PMSNAP_EXCLUDES(mutex_, live_mutex_);
  Status Fail(Status status) PMSNAP_EXCLUDES(mutex_);
  // Copies the chunk heap's figures into stats_ (mutex_ held), while the
  // pool is surely open: stats() stays valid after the pool closed.
  void NoteHeapLocked() PMSNAP_REQUIRES(mutex_);

  layout::Pool& pool_;
  std::string pool_path_;
  DifferentialLogOptions options_;
  mutable Mutex mutex_;
  CondVar changed_;
  std::deque<std::unique_ptr<Pending>> queue_ PMSNAP_GUARDED_BY(mutex_);  // appended, not copied yet
  bool stopping_ PMSNAP_GUARDED_BY(mutex_) = false;
  // The training thread's own flag (Close and Abandon run there, and only
  // that thread reads it); written under mutex_ beside stopping_.
  bool closed_ = false;
  Status error_ PMSNAP_GUARDED_BY(mutex_) = Status::Ok();
  std::optional<std::uint64_t> last_appended_ PMSNAP_GUARDED_BY(mutex_);
  std::uint64_t copied_through_ PMSNAP_GUARDED_BY(mutex_) = 0;  // iteration (0: none)
  std::uint64_t next_sequence_ PMSNAP_GUARDED_BY(mutex_) = 1;
  std::uint64_t flushes_requested_ PMSNAP_GUARDED_BY(mutex_) = 0;
  std::uint64_t flushes_done_ PMSNAP_GUARDED_BY(mutex_) = 0;
  DifferentialLogStats stats_ PMSNAP_GUARDED_BY(mutex_);
  Mutex live_mutex_;  // the worker adds, Retire frees
  std::vector<LiveChunk> live_ PMSNAP_GUARDED_BY(live_mutex_);
  std::thread worker_;
};

// --- recovery ---------------------------------------------------------------

// The differentials after iteration `after` that the pool holds, oldest
// first, up to the first gap (a recovery can replay only a contiguous run).
// Truncation marks of resumed runs are applied. kCorruption naming the pool
// and the chunk if a sealed differential chunk fails its checksum or does
// not parse; unsealed chunks (a write a crash interrupted) are skipped.
Result<std::vector<Differential>> ReadDifferentials(const layout::Pool& pool,
                                                    std::uint64_t after);

// The newest iteration ReadDifferentials(pool, after) would reach (`after`
// when there is none), from the chunk headers only (no payload read).
Result<std::uint64_t> NewestReplayableIteration(const layout::Pool& pool, std::uint64_t after);

// --- Eq. 8-10: (f*, b*) and the wasted time ---------------------------------

// The constants of section V-C. Times in seconds, W in bytes/second, S in
// bytes. The model counts time in iterations (b/2 iterations of lost work
// per failure), so the inputs are converted with `iteration_seconds`.
struct ConfigurationInputs {
  double write_bandwidth = 0;    // W: pool write bandwidth (measured)
  double full_bytes = 0;         // S: bytes of one full checkpoint (measured)
  double merge_seconds = 0;      // R_D: merging one differential (measured)
  double load_full_seconds = 0;  // R_F: loading a full checkpoint (Eq. 8 only)
  double mtbf_seconds = 3600;    // M (configured)
  double iteration_seconds = 0;  // time of one training iteration (measured)
  std::uint32_t world_size = 1;  // N (configured; cancels out of Eq. 10)
};

struct Configuration {
  double f_star = 0;               // full checkpoints per iteration (Eq. 10)
  double b_star = 0;               // differentials per batch (Eq. 10)
  std::uint64_t full_interval = 1; // round(1 / f*), clamped to [1, max_interval]
  std::uint32_t batch = 1;         // round(b*), clamped to [1, max_batch]
};

// Eq. 10: f* = cbrt(R_D W^2 / (4 S^2 M^2)), b* = cbrt(2 S R_D M / W), with
// every time in iterations (W in bytes per iteration). kInvalidArgument
// naming the first input that is not positive.
Result<Configuration> OptimalConfiguration(const ConfigurationInputs& in,
                                           std::uint32_t max_batch = 64,
                                           std::uint64_t max_interval = 1u << 20);

// What a chunk heap can hold of a differential log. A log keeps every
// differential since the second-newest full checkpoint, and the oldest are
// freed only once the newest full checkpoint has committed: up to
// 3 * interval + b of them, in chunks of b that the heap charges with its
// rounding (layout::ChunkHeap::ChargedBytesFor).
struct HeapBounds {
  // Largest b whose chunk takes at most 1/16 of the heap (so that about ten
  // chunks fit), at most the max_batch asked for; 1 if none does.
  std::uint32_t max_batch = 1;
  // Longest full interval whose retained differentials, with the chunk
  // being filled and a truncation mark, take at most 3/4 of the heap when
  // chunks hold `batch` differentials; in [1, 2^20].
  std::uint64_t MaxInterval(std::uint32_t batch) const;

  double differential_bytes = 0;  // measured mean, headers included
  std::uint64_t heap_bytes = 0;
};
// kInvalidArgument unless differential_bytes is positive and finite and
// heap_bytes > 0.
Result<HeapBounds> BoundsOfHeap(double differential_bytes, std::uint64_t heap_bytes,
                                std::uint32_t max_batch = 64);
// A log's bytes per differential now: the newest sealed chunk's payload per
// differential in it (headers included; the first differentials can be far
// larger, e.g. PowerSGD's uncompressed warm-up), or before any chunk
// `bytes_handed` (the pieces' bytes) per appended one; 0 before any.
double MeasuredDifferentialBytes(const DifferentialLogStats& stats, std::uint64_t bytes_handed);

// Eq. 8: wasted time, in seconds, of a job of `training_seconds` with full
// checkpoints every 1/f iterations and batches of b, across all N workers.
double WastedSeconds(const ConfigurationInputs& in, double f, double b,
                     double training_seconds);

// --- merges for additive updates (plain SGD: w <- w - lr * g) -------------

// Sequential merge, what training did: w = (((w + d1) + d2) + ... + dn),
// element by element in float32.
void MergeSequential(std::span<float> weights, const std::vector<std::span<const float>>& deltas);
// The paper's parallel merge (Figure 11): the deltas are summed pairwise in
// a tree of log2(n) levels, the pairs of one level concurrently on
// `threads` threads (0: hardware concurrency), and the sum is added to the
// weights once. Float addition is not associative, so the result equals
// MergeSequential only where every partial sum is exact (e.g. deltas that
// are multiples of a power of two within float32's range); otherwise it
// differs by rounding. Returns the number of merge levels.
std::uint32_t MergeParallel(std::span<float> weights,
                            const std::vector<std::span<const float>>& deltas,
                            unsigned threads = 0);

}  // namespace pmsnap::diff
