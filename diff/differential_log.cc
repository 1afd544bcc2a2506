#include "pmsnap/diff/differential_log.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <type_traits>

#include "detail/byte_codec.h"
#include "pmsnap/pmem_layout/chunk_heap.h"

namespace pmsnap::diff {
namespace {

constexpr std::uint32_t kMagic = 0x444C4D50;  // "PMLD"
constexpr std::uint16_t kVersion = 1;
constexpr std::uint64_t kNoTruncation = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint32_t kMaxDims = 8;

// A differential chunk's first 64 bytes, stored as raw bytes (FORMAT.md,
// "Differential chunks (LowDiff)"): pinned like the pool's own structs.
struct ChunkHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t reserved0;
  std::uint64_t sequence;         // write order across runs of the log
  std::uint64_t first_iteration;  // iterations first .. first + count - 1
  std::uint32_t count;
  std::uint32_t reserved1;
  std::uint64_t truncate_after;   // drop older chunks' iterations after it
  std::uint64_t body_bytes;       // bytes after this header
  std::uint64_t reserved[2];
};
static_assert(std::is_standard_layout_v<ChunkHeader>);
static_assert(std::has_unique_object_representations_v<ChunkHeader>);
static_assert(sizeof(ChunkHeader) == 64);
static_assert(offsetof(ChunkHeader, sequence) == 8);
static_assert(offsetof(ChunkHeader, first_iteration) == 16);
static_assert(offsetof(ChunkHeader, count) == 24);
static_assert(offsetof(ChunkHeader, truncate_after) == 32);
static_assert(offsetof(ChunkHeader, body_bytes) == 40);

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// Serializes one differential (iteration, pieces) onto `out`: the copy out
// of the caller's buffers. Every field 8-byte aligned.
Status AppendDifferential(detail::ByteWriter& out, std::uint64_t iteration,
                          const std::vector<DifferentialPiece>& pieces) {
  out.Put(iteration);
  out.Put(static_cast<std::uint32_t>(pieces.size()));
  out.Put(std::uint32_t{0});
  for (const DifferentialPiece& p : pieces) {
    if (p.shape.size() > kMaxDims) {
      return Status(StatusCode::kInvalidArgument,
                    "differential of iteration " + std::to_string(iteration) + ": a piece has " +
                        std::to_string(p.shape.size()) + " dimensions, at most 8 are stored");
    }
    out.Put(p.dtype);
    out.Put(static_cast<std::uint32_t>(p.shape.size()));
    for (std::int64_t d : p.shape) out.Put(d);
    out.Put(p.bytes);
    if (p.bytes > 0) out.PutBytes(p.data, p.bytes);
    out.PadTo8();  // every field above is 8-byte aligned, so the next starts aligned
  }
  return Status::Ok();
}

struct ParsedChunk {
  layout::ChunkInfo info;
  ChunkHeader header{};
  std::vector<Differential> differentials;  // filled with `payloads`
};


Status Corrupt(const layout::Pool& pool, const layout::ChunkInfo& c, const std::string& what) {
  return Status(StatusCode::kCorruption, "pool " + pool.path() + ": differential chunk " +
                                             std::to_string(c.id) + " " + what);
}

// Every sealed differential chunk of `pool`, by sequence, with (when
// `payloads`) their differentials. Unsealed ones (a write a crash cut short)
// are left out; `unsealed` gets their ids.
Result<std::vector<ParsedChunk>> ParseChunks(const layout::Pool& pool, bool payloads,
                                             std::vector<std::uint64_t>* unsealed = nullptr) {
  std::vector<ParsedChunk> out;
  for (const layout::ChunkInfo& c : pool.chunk_heap().List()) {
    if (c.tag != kDifferentialChunkTag) continue;
    if (!c.sealed) {
      if (unsealed != nullptr) unsealed->push_back(c.id);
      continue;
    }
    PMSNAP_ASSIGN_OR_RETURN(std::span<const std::byte> bytes, pool.chunk_heap().Read(c.id));
    ParsedChunk parsed;
    parsed.info = c;
    if (bytes.size() < sizeof(ChunkHeader)) return Corrupt(pool, c, "is shorter than its header");
    std::memcpy(&parsed.header, bytes.data(), sizeof(ChunkHeader));
    const ChunkHeader& h = parsed.header;
    if (h.magic != kMagic || h.version != kVersion ||
        h.body_bytes != bytes.size() - sizeof(ChunkHeader)) {
      return Corrupt(pool, c, "has a bad header (magic, version or size)");
    }
    if (payloads) {
      detail::ByteReader r(bytes.subspan(sizeof(ChunkHeader)));
      for (std::uint32_t i = 0; i < h.count; ++i) {
        Differential d;
        std::uint32_t pieces = 0, pad = 0;
        if (!r.Get(&d.iteration) || !r.Get(&pieces) || !r.Get(&pad) ||
            d.iteration != h.first_iteration + i) {
          return Corrupt(pool, c, "differential " + std::to_string(i) + " does not parse");
        }
        d.pieces.resize(pieces);
        for (StoredPiece& p : d.pieces) {
          std::uint32_t ndim = 0;
          std::uint64_t n = 0;
          if (!r.Get(&p.dtype) || !r.Get(&ndim) || ndim > kMaxDims) {
            return Corrupt(pool, c, "piece of iteration " + std::to_string(d.iteration) +
                                        " does not parse");
          }
          p.shape.resize(ndim);
          for (std::int64_t& dim : p.shape) {
            if (!r.Get(&dim)) return Corrupt(pool, c, "shape does not parse");
          }
          if (!r.Get(&n) || !r.GetPadded(&p.bytes, n)) {
            return Corrupt(pool, c, "piece of iteration " + std::to_string(d.iteration) +
                                        " is cut short");
          }
        }
        parsed.differentials.push_back(std::move(d));
      }
    }
    out.push_back(std::move(parsed));
  }
  std::sort(out.begin(), out.end(), [](const ParsedChunk& a, const ParsedChunk& b) {
    return a.header.sequence < b.header.sequence;
  });
  return out;
}

}  // namespace

struct DifferentialLog::Pending {
  std::uint64_t iteration = 0;
  std::vector<DifferentialPiece> pieces;
};

DifferentialLog::DifferentialLog(layout::Pool& pool, DifferentialLogOptions options)
    : pool_(pool), pool_path_(pool.path()), options_(options) {
  stats_.batch = options.batch;
  stats_.max_loss = options.batch - 1;
}

DifferentialLog::~DifferentialLog() { Abandon(); }

void DifferentialLog::Abandon() {
  {
    MutexLock lock(mutex_);
    stopping_ = true;
    closed_ = true;
    queue_.clear();  // buffered and queued differentials are dropped, as in a crash
  }
  changed_.NotifyAll();
  if (worker_.joinable()) worker_.join();
}

Result<std::unique_ptr<DifferentialLog>> DifferentialLog::Open(layout::Pool& pool,
                                                               DifferentialLogOptions options) {
  if (options.batch == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "pool " + pool.path() + ": differential batch size must be >= 1");
  }
  if (pool.chunk_heap().capacity_bytes() == 0) {
    return Status(StatusCode::kFailedPrecondition,
                  "pool " + pool.path() +
                      " has no chunk heap for differential checkpoints (create it with "
                      "chunk_heap_bytes > 0)");
  }
  std::unique_ptr<DifferentialLog> log(new DifferentialLog(pool, options));
  // No other thread sees the log until its worker starts; the locks are for
  // the analysis, taken in Retire's order (live_mutex_, then mutex_).
  MutexLock live_lock(log->live_mutex_);
  MutexLock lock(log->mutex_);
  std::vector<std::uint64_t> unsealed;
  PMSNAP_ASSIGN_OR_RETURN(std::vector<ParsedChunk> chunks, ParseChunks(pool, false, &unsealed));
  // A chunk a crash left unsealed holds nothing readable; nobody else frees
  // it (epoch 0 is never "uncommitted").
  for (std::uint64_t id : unsealed) PMSNAP_RETURN_IF_ERROR(pool.chunk_heap().Free(id));
  std::vector<DifferentialLog::LiveChunk> live;
  for (const ParsedChunk& c : chunks) {
    live.push_back({c.info.id, c.header.sequence, c.header.first_iteration, c.header.count,
                    c.header.truncate_after});
    log->next_sequence_ = std::max(log->next_sequence_, c.header.sequence + 1);
  }
  if (options.resume_after.has_value()) {
    const std::uint64_t n = *options.resume_after;
    const bool masks = std::any_of(live.begin(), live.end(), [&](const DifferentialLog::LiveChunk& c) {
      return c.count > 0 && c.first + c.count - 1 > n;
    });
    if (masks) {
      // The mark first: if a crash interrupts the frees below, readers still
      // drop the crashed run's differentials after n.
      ChunkHeader h{};
      h.magic = kMagic;
      h.version = kVersion;
      h.sequence = log->next_sequence_++;
      h.truncate_after = n;
      PMSNAP_ASSIGN_OR_RETURN(layout::ChunkInfo mark,
                              pool.chunk_heap().Alloc(sizeof(ChunkHeader), 0, kDifferentialChunkTag));
      PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, pool.chunk_heap().Payload(mark.id));
      std::memcpy(payload.data(), &h, sizeof(h));
      PMSNAP_RETURN_IF_ERROR(pool.chunk_heap().Seal(mark.id));
      std::vector<DifferentialLog::LiveChunk> kept;
      for (const DifferentialLog::LiveChunk& c : live) {
        if (c.count > 0 && c.first > n) {
          PMSNAP_RETURN_IF_ERROR(pool.chunk_heap().Free(c.id));
          ++log->stats_.chunks_freed;
        } else {
          kept.push_back(c);
        }
      }
      kept.push_back({mark.id, h.sequence, 0, 0, n});
      live = std::move(kept);
    }
  }
  log->stats_.live_chunks = live.size();
  log->NoteHeapLocked();
  log->live_ = std::move(live);
  lock.Unlock();
  live_lock.Unlock();
  log->worker_ = std::thread([raw = log.get()] { raw->Run(); });
  return log;
}

Status DifferentialLog::Fail(Status status) {
  MutexLock lock(mutex_);
  if (error_.ok()) error_ = status;
  changed_.NotifyAll();
  return status;
}

Status DifferentialLog::Append(std::uint64_t iteration, std::vector<DifferentialPiece> pieces) {
  MutexLock lock(mutex_);
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  if (!error_.ok()) return error_;
  if (last_appended_.has_value() && iteration != *last_appended_ + 1) {
    return Status(StatusCode::kInvalidArgument,
                  "differential log of " + pool_path_ + ": iteration " + std::to_string(iteration) +
                      " appended after " + std::to_string(*last_appended_) +
                      " (differentials must be consecutive)");
  }
  for (const DifferentialPiece& p : pieces) {
    if (p.bytes > 0 && p.data == nullptr) {
      return Status(StatusCode::kInvalidArgument,
                    "differential log of " + pool_path_ + ": iteration " +
                        std::to_string(iteration) + " has a piece without data");
    }
  }
  auto pending = std::make_unique<Pending>();
  pending->iteration = iteration;
  pending->pieces = std::move(pieces);
  queue_.push_back(std::move(pending));
  last_appended_ = iteration;
  ++stats_.appended;
  lock.Unlock();
  changed_.NotifyAll();
  return Status::Ok();
}

Status DifferentialLog::WaitCopied(std::uint64_t iteration) {
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  const auto start = std::chrono::steady_clock::now();
  MutexLock lock(mutex_);
  while (error_.ok() && copied_through_ < iteration && !stopping_) changed_.Wait(lock);
  stats_.copy_wait_seconds += Seconds(start);
  return error_;
}

Status DifferentialLog::WaitWritten() {
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  MutexLock lock(mutex_);
  const std::uint64_t through = last_appended_.value_or(0);
  while (error_.ok() && copied_through_ < through && !stopping_) changed_.Wait(lock);
  return error_;
}

Status DifferentialLog::Flush() {
  MutexLock lock(mutex_);
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  if (stopping_) return error_;
  const std::uint64_t ticket = ++flushes_requested_;
  changed_.NotifyAll();
  while (error_.ok() && flushes_done_ < ticket && !stopping_) changed_.Wait(lock);
  return error_;
}

Status DifferentialLog::Close() {
  if (closed_) {  // the training thread's own flag: Close and Abandon run there
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  Status status = Flush();
  {
    MutexLock lock(mutex_);
    closed_ = true;
    stopping_ = true;
  }
  changed_.NotifyAll();
  if (worker_.joinable()) worker_.join();
  return status;
}

Status DifferentialLog::SetBatch(std::uint32_t batch) {
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  if (batch == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "differential log of " + pool_path_ + ": batch size must be >= 1");
  }
  MutexLock lock(mutex_);
  options_.batch = batch;
  stats_.batch = batch;
  stats_.max_loss = batch - 1;
  return Status::Ok();
}

Status DifferentialLog::Retire(std::uint64_t full_iteration) {
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "differential log of " + pool_path_ + " is closed");
  }
  MutexLock live_lock(live_mutex_);
  std::vector<LiveChunk>& live = live_;
  std::vector<LiveChunk> kept;
  std::uint64_t freed = 0;
  for (const LiveChunk& c : live) {
    if (c.count > 0 && c.first + c.count - 1 <= full_iteration) {
      Status s = pool_.chunk_heap().Free(c.id);
      if (!s.ok()) return Fail(s);
      ++freed;
    } else {
      kept.push_back(c);
    }
  }
  // A truncation mark is spent once no older chunk holds an iteration it masks.
  std::vector<LiveChunk> after_marks;
  for (const LiveChunk& c : kept) {
    if (c.count == 0) {
      const bool needed = std::any_of(kept.begin(), kept.end(), [&](const LiveChunk& o) {
        return o.count > 0 && o.sequence < c.sequence && o.first + o.count - 1 > c.truncate_after;
      });
      if (!needed) {
        Status s = pool_.chunk_heap().Free(c.id);
        if (!s.ok()) return Fail(s);
        ++freed;
        continue;
      }
    }
    after_marks.push_back(c);
  }
  live = std::move(after_marks);
  MutexLock lock(mutex_);
  stats_.chunks_freed += freed;
  stats_.live_chunks = live.size();
  NoteHeapLocked();
  return Status::Ok();
}

DifferentialLogStats DifferentialLog::stats() const {
  MutexLock lock(mutex_);
  return stats_;
}

void DifferentialLog::NoteHeapLocked() {
  stats_.heap_used_bytes = pool_.chunk_heap().used_bytes();
  stats_.heap_capacity_bytes = pool_.chunk_heap().capacity_bytes();
}

void DifferentialLog::Run() {
  detail::ByteWriter body;  // the batch buffer in host memory (body.out)
  std::uint64_t first = 0;
  std::uint32_t count = 0;
  auto write = [&]() -> Status {
    const auto start = std::chrono::steady_clock::now();
    ChunkHeader h{};
    h.magic = kMagic;
    h.version = kVersion;
    {
      MutexLock lock(mutex_);
      h.sequence = next_sequence_++;
    }
    h.first_iteration = first;
    h.count = count;
    h.truncate_after = kNoTruncation;
    h.body_bytes = body.out.size();
    layout::ChunkHeap& heap = pool_.chunk_heap();
    PMSNAP_ASSIGN_OR_RETURN(layout::ChunkInfo chunk,
                            heap.Alloc(sizeof(h) + body.out.size(), 0, kDifferentialChunkTag));
    PMSNAP_ASSIGN_OR_RETURN(std::span<std::byte> payload, heap.Payload(chunk.id));
    std::memcpy(payload.data(), &h, sizeof(h));
    if (!body.out.empty()) {
      std::memcpy(payload.data() + sizeof(h), body.out.data(), body.out.size());
    }
    PMSNAP_RETURN_IF_ERROR(heap.Seal(chunk.id));
    {
      MutexLock live_lock(live_mutex_);
      live_.push_back({chunk.id, h.sequence, first, count, kNoTruncation});
    }
    MutexLock lock(mutex_);
    stats_.write_seconds += Seconds(start);
    stats_.bytes_written += sizeof(h) + body.out.size();
    stats_.last_chunk_bytes = sizeof(h) + body.out.size();
    stats_.last_chunk_differentials = count;
    ++stats_.batches_written;
    NoteHeapLocked();
    stats_.durable += count;
    stats_.last_durable_iteration = first + count - 1;
    stats_.buffered -= count;
    ++stats_.live_chunks;
    body.out.clear();
    count = 0;
    return Status::Ok();
  };
  MutexLock lock(mutex_);
  for (;;) {
    while (!stopping_ && queue_.empty() && flushes_done_ >= flushes_requested_) {
      changed_.Wait(lock);
    }
    if (!queue_.empty() && !stopping_) {
      std::unique_ptr<Pending> p = std::move(queue_.front());
      queue_.pop_front();
      const std::uint32_t batch = options_.batch;
      const bool failed = !error_.ok();
      lock.Unlock();
      Status status = Status::Ok();
      if (!failed) {
        if (count == 0) first = p->iteration;
        status = AppendDifferential(body, p->iteration, p->pieces);
        if (status.ok()) {
          ++count;
          {
            MutexLock inner(mutex_);
            ++stats_.buffered;
          }
          // The differential completing a batch counts as copied only once
          // its chunk is sealed: after WaitCopied(t) returned, a crash
          // loses at most the b - 1 differentials buffered.
          if (count >= batch) status = write();
        }
      }
      if (!status.ok()) static_cast<void>(Fail(status));
      lock.Lock();
      copied_through_ = p->iteration;
      changed_.NotifyAll();
      continue;
    }
    if (flushes_done_ < flushes_requested_ && !stopping_) {
      const std::uint64_t ticket = flushes_requested_;
      const bool failed = !error_.ok();
      lock.Unlock();
      if (!failed && count > 0) {
        Status status = write();
        if (!status.ok()) static_cast<void>(Fail(status));
      }
      lock.Lock();
      flushes_done_ = ticket;
      changed_.NotifyAll();
      continue;
    }
    if (stopping_) break;
  }
}

// --- recovery ---------------------------------------------------------------

namespace {
// Iteration -> differential after applying sequences and truncation marks.
Result<std::map<std::uint64_t, Differential>> Resolve(const layout::Pool& pool, bool payloads) {
  PMSNAP_ASSIGN_OR_RETURN(std::vector<ParsedChunk> chunks, ParseChunks(pool, payloads));
  std::map<std::uint64_t, Differential> by_iteration;
  for (ParsedChunk& c : chunks) {
    if (c.header.truncate_after != kNoTruncation) {
      by_iteration.erase(by_iteration.upper_bound(c.header.truncate_after), by_iteration.end());
    }
    for (std::uint32_t i = 0; i < c.header.count; ++i) {
      Differential d;
      if (payloads) {
        d = std::move(c.differentials[i]);
      } else {
        d.iteration = c.header.first_iteration + i;
      }
      by_iteration[d.iteration] = std::move(d);
    }
  }
  return by_iteration;
}
}  // namespace

Result<std::vector<Differential>> ReadDifferentials(const layout::Pool& pool,
                                                    std::uint64_t after) {
  PMSNAP_ASSIGN_OR_RETURN(auto by_iteration, Resolve(pool, true));
  std::vector<Differential> out;
  for (std::uint64_t it = after + 1;; ++it) {
    auto found = by_iteration.find(it);
    if (found == by_iteration.end()) break;
    out.push_back(std::move(found->second));
  }
  return out;
}

Result<std::uint64_t> NewestReplayableIteration(const layout::Pool& pool, std::uint64_t after) {
  PMSNAP_ASSIGN_OR_RETURN(auto by_iteration, Resolve(pool, false));
  std::uint64_t it = after;
  while (by_iteration.count(it + 1) != 0) ++it;
  return it;
}

// --- Eq. 8-10 -----------------------------------------------------------------

Result<Configuration> OptimalConfiguration(const ConfigurationInputs& in, std::uint32_t max_batch,
                                           std::uint64_t max_interval) {
  const std::pair<const char*, double> checks[] = {
      {"write bandwidth W", in.write_bandwidth}, {"full checkpoint bytes S", in.full_bytes},
      {"merge time R_D", in.merge_seconds},      {"MTBF M", in.mtbf_seconds},
      {"iteration time", in.iteration_seconds}};
  for (const auto& [name, value] : checks) {
    if (!(value > 0) || !std::isfinite(value)) {
      return Status(StatusCode::kInvalidArgument,
                    std::string("Eq. 10 needs a positive ") + name + ", got " + std::to_string(value));
    }
  }
  // Time in iterations: W per iteration, R_D and M in iterations.
  const double w = in.write_bandwidth * in.iteration_seconds;
  const double s = in.full_bytes;
  const double rd = in.merge_seconds / in.iteration_seconds;
  const double m = in.mtbf_seconds / in.iteration_seconds;
  Configuration c;
  c.f_star = std::cbrt(rd * w * w / (4 * s * s * m * m));
  c.b_star = std::cbrt(2 * s * rd * m / w);
  const double interval = std::round(1 / c.f_star);
  c.full_interval = static_cast<std::uint64_t>(
      std::clamp(interval, 1.0, static_cast<double>(max_interval)));
  c.batch = static_cast<std::uint32_t>(
      std::clamp(std::round(c.b_star), 1.0, static_cast<double>(std::max<std::uint32_t>(1, max_batch))));
  return c;
}

namespace {
// What the heap charges for a chunk of `batch` differentials; the maximum
// for a chunk larger than the heap itself (no overflow for absurd sizes).
std::uint64_t ChargedChunk(const HeapBounds& bounds, std::uint32_t batch) {
  const double payload = std::ceil(static_cast<double>(batch) * bounds.differential_bytes);
  if (payload >= static_cast<double>(bounds.heap_bytes)) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return layout::ChunkHeap::ChargedBytesFor(static_cast<std::uint64_t>(payload));
}
}  // namespace

std::uint64_t HeapBounds::MaxInterval(std::uint32_t batch) const {
  constexpr double kLongest = 1u << 20;  // OptimalConfiguration's own bound
  batch = std::max<std::uint32_t>(1, batch);
  // Beside the retained chunks: the one being filled and a truncation mark.
  const double chunks = std::floor(0.75 * static_cast<double>(heap_bytes) /
                                   static_cast<double>(ChargedChunk(*this, batch))) - 2;
  const double interval = std::floor((chunks * batch - batch) / 3);
  return static_cast<std::uint64_t>(std::clamp(interval, 1.0, kLongest));
}

Result<HeapBounds> BoundsOfHeap(double differential_bytes, std::uint64_t heap_bytes,
                                std::uint32_t max_batch) {
  if (!(differential_bytes > 0) || !std::isfinite(differential_bytes) || heap_bytes == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "heap bounds need a positive differential size and heap, got " +
                      std::to_string(differential_bytes) + " bytes per differential and a heap of " +
                      std::to_string(heap_bytes) + " bytes");
  }
  HeapBounds bounds;
  bounds.differential_bytes = differential_bytes;
  bounds.heap_bytes = heap_bytes;
  // The charge grows with b: the largest b within 1/16, by bisection.
  const auto fits = [&](std::uint32_t b) {
    return static_cast<double>(ChargedChunk(bounds, b)) <= static_cast<double>(heap_bytes) / 16;
  };
  std::uint32_t lo = 1, hi = std::max<std::uint32_t>(1, max_batch);
  if (!fits(lo)) return bounds;
  while (lo < hi) {
    const std::uint32_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  bounds.max_batch = lo;
  return bounds;
}

double MeasuredDifferentialBytes(const DifferentialLogStats& stats, std::uint64_t bytes_handed) {
  if (stats.last_chunk_differentials > 0) {
    return static_cast<double>(stats.last_chunk_bytes) /
           static_cast<double>(stats.last_chunk_differentials);
  }
  if (stats.appended > 0) {
    return static_cast<double>(bytes_handed) / static_cast<double>(stats.appended);
  }
  return 0;
}

double WastedSeconds(const ConfigurationInputs& in, double f, double b, double training_seconds) {
  const double t = training_seconds / in.iteration_seconds;  // T in iterations
  const double m = in.mtbf_seconds / in.iteration_seconds;
  const double rf = in.load_full_seconds / in.iteration_seconds;
  const double rd = in.merge_seconds / in.iteration_seconds;
  const double w = in.write_bandwidth * in.iteration_seconds;
  const double n = in.world_size;
  const double merges = std::max(0.0, 1 / (f * b) - 1);
  const double wasted = n * t / m * (b / 2 + (rf + rd / 2 * merges)) + n * t * in.full_bytes * f / w;
  return wasted * in.iteration_seconds;
}

// --- merges ---------------------------------------------------------------------

void MergeSequential(std::span<float> weights, const std::vector<std::span<const float>>& deltas) {
  for (const std::span<const float>& d : deltas) {
    const std::size_t n = std::min(weights.size(), d.size());
    for (std::size_t i = 0; i < n; ++i) weights[i] += d[i];
  }
}

std::uint32_t MergeParallel(std::span<float> weights,
                            const std::vector<std::span<const float>>& deltas, unsigned threads) {
  if (deltas.empty()) return 0;
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t n = weights.size();
  // Level 0 holds the deltas; each level sums adjacent pairs concurrently.
  std::vector<std::vector<float>> level;
  level.reserve(deltas.size());
  for (const auto& d : deltas) level.emplace_back(d.begin(), d.begin() + std::min(n, d.size()));
  for (auto& v : level) v.resize(n, 0.0f);
  std::uint32_t levels = 0;
  while (level.size() > 1) {
    const std::size_t pairs = level.size() / 2;
    std::vector<std::vector<float>> next((level.size() + 1) / 2);
    auto work = [&](std::size_t from, std::size_t to) {
      for (std::size_t p = from; p < to; ++p) {
        std::vector<float>& out = level[2 * p];
        const std::vector<float>& other = level[2 * p + 1];
        for (std::size_t i = 0; i < n; ++i) out[i] += other[i];
        next[p] = std::move(out);
      }
    };
    const std::size_t workers = std::min<std::size_t>(threads, pairs);
    std::vector<std::thread> pool;
    const std::size_t per = (pairs + workers - 1) / workers;
    for (std::size_t w = 1; w < workers; ++w) {
      const std::size_t from = w * per, to = std::min(pairs, from + per);
      if (from < to) pool.emplace_back(work, from, to);
    }
    work(0, std::min(pairs, per));
    for (std::thread& t : pool) t.join();
    if (level.size() % 2 == 1) next.back() = std::move(level.back());
    level = std::move(next);
    ++levels;
  }
  for (std::size_t i = 0; i < n; ++i) weights[i] += level[0][i];
  return levels + 1;
}

}  // namespace pmsnap::diff
