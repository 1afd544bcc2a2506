// Power-loss simulator: a layout::detail::Persistence (the persistence seam,
// pmem_layout/detail/persistence.h) that records, per 64-byte cache line of
// one pool file, what was written, flushed and drained, and builds the file
// a power loss would leave at any seam call: every drained line, plus a
// chosen subset of the lines flushed but not drained and of the words
// written but never flushed. Only aligned 8-byte words are atomic: a line
// can be torn between its words. Everything is forwarded to libpmemobj, so
// the pool under test behaves as in production.
//
// What counts as durable besides drained lines: what libpmemobj wrote and
// made durable itself, between Persistence::BeginLibraryWrites and
// EndLibraryWrites (a transaction) and while mapping the file (create,
// open). Lines pmsnap dirtied before such a stretch and did not touch in it
// stay undurable. No image is taken inside such a stretch: its stores are
// atomic with the transaction, whose undo log the simulator does not model.
//
// Tracks the first pool file mapped after construction, and again the next
// mapping after that one is closed (a pool reopened: same file). Images are
// kept as the lines that differ from the file as first mapped, so hundreds fit
// in memory; libpmemobj refuses a second open of the same pool in one
// process, so they are opened after the pool under test is closed.
//
// Thread-safety: the seam calls may come from any threads (the Engine's
// workers persist parts in parallel); one mutex guards the state, and every
// image is built inside a seam call under it, so it is one consistent cut:
// each thread's flushed lines are as they were at its flush, ordered by a
// global sequence number (a drain never makes a line older than another
// thread already made durable). Only what a thread stores *outside* the seam
// (a memcpy into a part, a chunk's payload) may be read while it is being
// written: those lines are undrained, so any mix of their words is a state a
// power loss may leave. Construct, Stop and read images on one thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "detail/persistence.h"
#include "testutil/test_seed.h"

namespace pmsnap::testing {

// One seam call on the tracked pool, after it took effect.
struct SeamEvent {
  enum class Kind { kFlush, kDrain, kCopyNonTemporal, kStreamAndHash };
  Kind kind;
  std::uint64_t index;  // seam calls on the tracked pool before this one
  // The file range a flush or copy wrote back (offset from the start of the
  // pool file); 0 bytes for a drain.
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  bool Touches(std::uint64_t begin, std::uint64_t length) const {
    return bytes != 0 && offset < begin + length && begin < offset + bytes;
  }
  // A drain: the point where earlier flushes became durable.
  bool persist_point() const { return kind == Kind::kDrain; }
};

// What a test wants captured at one event.
struct CaptureRequest {
  int random_images = 2;   // besides "drained only" and "everything"
  std::uint64_t note = 0;  // the test's own tag (its expectations), kept with the images
};

// The pool file a power loss at one event would leave.
struct PowerLossImage {
  std::uint64_t event = 0;
  std::string variant;  // "drained only", "everything", "random <k>"
  std::uint64_t note = 0;
  std::vector<std::uint64_t> line_offsets;  // lines that differ from the first mapping
  std::vector<std::byte> line_bytes;        // 64 bytes per offset
  std::string Describe() const;
};

class PowerLossSimulator final : public layout::detail::Persistence {
 public:
  // Called at every seam event on the tracked pool outside libpmemobj's own
  // writes, under the simulator's lock (it must not call into the pool);
  // returns what to capture there, if anything.
  using Plan = std::function<std::optional<CaptureRequest>(const SeamEvent&)>;

  // Installs itself as the seam's implementation; random images draw from
  // `seed`. Only one simulator at a time.
  explicit PowerLossSimulator(std::uint64_t seed);
  ~PowerLossSimulator() override;  // Stop()
  PowerLossSimulator(const PowerLossSimulator&) = delete;
  PowerLossSimulator& operator=(const PowerLossSimulator&) = delete;

  void SetPlan(Plan plan);
  // Captures images now, as at a seam event (numbered as the next one
  // would be): for points no seam call marks, such as the moment a call
  // returned to its caller (a Commit that returned must be durable).
  void CaptureNow(const CaptureRequest& request);
  // Gives the seam back to production. Images stay readable.
  void Stop();

  std::uint64_t events() const;
  // The tracked pool and where its file is mapped (null before the first
  // mapping): tests that call the Persistence methods themselves need them.
  PMEMobjpool* tracked_pool() const;
  const std::byte* tracked_base() const;
  std::uint64_t persist_points() const;
  const std::vector<PowerLossImage>& images() const { return images_; }

  // Writes `image` as a pool file at `path` (replacing it). Returns "" or
  // what failed, naming the path.
  std::string WriteImage(const PowerLossImage& image, const std::string& path) const;

  // Persistence:
  void Mapped(PMEMobjpool* pop, std::byte* base, std::uint64_t bytes) override;
  void Unmapping(PMEMobjpool* pop) override;
  void Flush(PMEMobjpool* pop, const void* addr, std::size_t bytes) override;
  void Drain(PMEMobjpool* pop) override;
  void CopyNonTemporal(PMEMobjpool* pop, void* dst, const void* src, std::size_t bytes) override;
  std::size_t StreamAndHash(void* dst, const void* src, std::size_t bytes,
                            std::uint64_t* hash) override;
  void BeginLibraryWrites(PMEMobjpool* pop) override;
  void EndLibraryWrites(PMEMobjpool* pop) override;

 private:
  static constexpr std::size_t kLine = 64;
  using LineBytes = std::array<std::byte, kLine>;
  enum class Choice { kNone, kAll, kRandom };

  bool Tracks(PMEMobjpool* pop) const { return mapped_ && pop == pop_; }
  // Marks the lines overlapping [addr, addr + bytes) as flushed by this
  // thread with their current contents.
  void RecordFlushLocked(const void* addr, std::size_t bytes);
  // The newest line any thread flushed and did not drain that is newer than
  // the durable one, or null.
  const LineBytes* NewestPendingLocked(std::uint64_t offset) const;
  // The file range of [addr, addr + bytes) clipped to the mapping.
  std::pair<std::uint64_t, std::uint64_t> RangeOf(const void* addr, std::size_t bytes) const;
  // Lines whose mapped bytes differ from the durable image, with their bytes.
  std::map<std::uint64_t, LineBytes> DirtyLinesLocked() const;
  // Makes durable every line changed since `before` was taken (libpmemobj's
  // own writes), keeping lines that were already dirty then and unchanged.
  void AbsorbLibraryWritesLocked(const std::map<std::uint64_t, LineBytes>& before);
  void AfterEventLocked(SeamEvent::Kind kind, std::uint64_t offset = 0, std::uint64_t bytes = 0);
  void CaptureLocked(std::uint64_t event_index, const CaptureRequest& request);
  // Lines an image may hold other than as first mapped: durable ones that
  // changed, and ones stored or flushed since their last drain. Computed
  // once per event, shared by its images.
  std::vector<std::uint64_t> UnsettledLinesLocked() const;
  PowerLossImage BuildImageLocked(Choice choice, const std::string& variant,
                                  const std::vector<std::uint64_t>& lines);

  mutable std::mutex mutex_;
  std::mt19937_64 random_;
  bool installed_ = false;
  Plan plan_;
  PMEMobjpool* pop_ = nullptr;
  std::byte* base_ = nullptr;
  bool mapped_ = false;
  std::vector<std::byte> first_mapping_;  // the file when tracking began
  std::vector<std::byte> durable_;        // what survives a power loss for sure
  // Per thread: lines flushed (or streamed) and not yet drained, with their
  // bytes at that moment and the flush's sequence number. A drain makes only
  // its own thread's lines durable, and only where they are newer than what
  // is durable already (another thread may have flushed and drained the
  // same line since).
  struct PendingLine {
    std::uint64_t sequence = 0;
    LineBytes bytes;
  };
  std::unordered_map<std::thread::id, std::map<std::uint64_t, PendingLine>> pending_;
  std::vector<std::uint64_t> durable_sequence_;  // per line: of the bytes in durable_
  std::uint64_t sequence_ = 0;
  int library_depth_ = 0;
  std::map<std::uint64_t, LineBytes> dirty_before_library_;
  std::uint64_t events_ = 0;
  std::uint64_t persist_points_ = 0;
  std::vector<PowerLossImage> images_;
};

}  // namespace pmsnap::testing
