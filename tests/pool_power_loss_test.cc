// Power loss, simulated at the persistence seam (testutil/power_loss.h): a
// workload runs once against a pool while the simulator captures, at every
// drain and at sampled seam calls between them, the file a power loss would
// leave (drained lines only, everything, and random subsets torn at 8-byte
// words). After the workload each image is opened and checked: it opens; no
// COMPLETE slot in it fails verification and no sealed chunk is damaged; it
// recovers to the newest epoch whose Commit returned, or to the one being
// committed, bit-exact (tensors, iteration, extra state, that epoch's chunk).
// A test-only switch that drops the drain before the commit word must be
// caught, and images are also taken the moment each Commit returns: a commit
// word flushed but not drained, or a part checksum never persisted, shows
// there (both mutations fail this test). Covered: pool create, epoch writes and commits, an abandoned
// epoch, slot fallback, extra state, chunk allocate, seal, free and the
// sweep of orphans at BeginEpoch; and the simulator itself keeps drains of
// several threads in order (the Engine persists from its workers).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <thread>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "detail/persistence.h"
#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/power_loss.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CaptureRequest;
using pmsnap::testing::CheckSeededView;
using pmsnap::testing::FillSeeded;
using pmsnap::testing::PowerLossImage;
using pmsnap::testing::PowerLossSimulator;
using pmsnap::testing::SeamEvent;
using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kChunkTag = 7;
constexpr std::uint64_t kEpochs = 4;

// Three units whose tensors span two parts each, plus 8-byte ones: 15 part
// checksums, so that the table has a cache line of its own between the
// record header's and the extra state's (with fewer, their flushes would
// also write back a checksum nobody persisted, and hide that bug).
Manifest SmallManifest() { return pmsnap::testing::MakeManifest(3, 1100); }

PoolOptions SmallOptions(std::uint64_t chunk_heap_bytes) {
  PoolOptions options;
  options.part_bytes = 4096;
  options.extra_state_capacity = 512;
  options.chunk_heap_bytes = chunk_heap_bytes;
  options.prefault_mapping = false;  // its page touches are no stores, but keep the mapping quiet
  return options;
}

std::string ExtraState(std::uint64_t epoch) {
  return "epoch=" + std::to_string(epoch) + std::string(epoch * 37 % 200, 'x');
}

std::vector<std::byte> ChunkContent(std::uint64_t epoch) {
  std::vector<std::byte> bytes(2000 + epoch * 300);
  FillSeeded(bytes, epoch, 99, kChunkTag);
  return bytes;
}

// What the workload has done when an image is taken, packed into its note:
// the newest epoch whose Commit returned, and whether the next one's Commit
// is running (its commit word may already be on the media).
struct Progress {
  std::uint64_t committed = 0;
  bool committing = false;
  std::uint64_t Pack() const { return committed * 2 + (committing ? 1 : 0); }
  static Progress Unpack(std::uint64_t note) { return {note / 2, (note & 1) != 0}; }
};

// Once `armed` is set: inside a Commit, at every seam call with four
// random images; elsewhere at every drain with one and at every fourth other
// seam call with none (only "drained only" and "everything").
PowerLossSimulator::Plan CapturePlan(const std::atomic<bool>* armed,
                                     const std::atomic<std::uint64_t>* progress) {
  return [armed, progress](const SeamEvent& event) -> std::optional<CaptureRequest> {
    if (!armed->load()) return std::nullopt;
    const std::uint64_t note = progress->load();
    if (Progress::Unpack(note).committing) return CaptureRequest{4, note};
    if (event.persist_point()) return CaptureRequest{1, note};
    if (event.index % 4 == 0) return CaptureRequest{0, note};
    return std::nullopt;
  };
}

// Begins epoch `epoch` at iteration epoch * 10, allocates and seals its
// chunk (with_chunks) and writes every tensor: all but the commit.
void BeginAndWriteEpoch(Pool& pool, std::uint64_t epoch, bool with_chunks) {
  const Manifest& manifest = pool.manifest();
  auto begun = pool.BeginEpoch(epoch * 10);
  ASSERT_TRUE(begun.ok()) << begun.status().message();
  ASSERT_EQ(*begun, epoch);
  if (with_chunks) {
    const std::vector<std::byte> content = ChunkContent(epoch);
    auto chunk = pool.chunk_heap().Alloc(content.size(), epoch, kChunkTag);
    ASSERT_TRUE(chunk.ok()) << chunk.status().message();
    auto payload = pool.chunk_heap().Payload(chunk->id);
    ASSERT_TRUE(payload.ok());
    std::memcpy(payload->data(), content.data(), content.size());
    ASSERT_TRUE(pool.chunk_heap().Seal(chunk->id).ok());
  }
  for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
    for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
      auto bytes = pmsnap::testing::SeededTensor(manifest, epoch, u, t);
      ASSERT_TRUE(pool.WriteTensor(u, t, bytes.data()).ok());
    }
  }
}

void CommitEpoch(Pool& pool, std::uint64_t epoch) {
  const std::string extra = ExtraState(epoch);
  ASSERT_TRUE(pool.Commit({reinterpret_cast<const std::byte*>(extra.data()), extra.size()}).ok());
}

// Whether epoch `epoch`'s sealed chunk is in the pool with its content.
bool ChunkOfEpochIntact(const Pool& pool, std::uint64_t epoch) {
  const std::vector<std::byte> content = ChunkContent(epoch);
  for (const ChunkInfo& chunk : pool.chunk_heap().List()) {
    if (chunk.epoch != epoch || !chunk.sealed) continue;
    auto payload = pool.chunk_heap().Read(chunk.id);
    if (payload.ok() && payload->size() == content.size() &&
        std::memcmp(payload->data(), content.data(), content.size()) == 0) {
      return true;
    }
  }
  return false;
}

// Runs the epochs: each frees chunks more than two epochs old (with chunks),
// begins, allocates and seals one chunk, writes every tensor and commits;
// epoch 3 is first begun, half written and abandoned. Updates `progress`
// around each Commit.
void RunEpochs(Pool& pool, bool with_chunks, std::atomic<std::uint64_t>* progress,
               PowerLossSimulator& simulator) {
  const Manifest& manifest = pool.manifest();
  Progress state;
  for (std::uint64_t epoch = 1; epoch <= kEpochs; ++epoch) {
    if (epoch == 3) {
      ASSERT_TRUE(pool.BeginEpoch(epoch * 10 + 1).ok());
      auto bytes = pmsnap::testing::SeededTensor(manifest, 1000 + epoch, 0, 0);
      ASSERT_TRUE(pool.WriteTensor(0, 0, bytes.data()).ok());
      pool.Abandon();
    }
    if (with_chunks) {
      for (const ChunkInfo& chunk : pool.chunk_heap().List()) {
        if (chunk.epoch + 2 < epoch) {
          ASSERT_TRUE(pool.chunk_heap().Free(chunk.id).ok());
        }
      }
    }
    BeginAndWriteEpoch(pool, epoch, with_chunks);
    state.committing = true;
    progress->store(state.Pack());
    CommitEpoch(pool, epoch);
    state = {epoch, false};
    progress->store(state.Pack());
    // Commit returned: the epoch is durable now, not at the next drain (a
    // commit word flushed but not drained, or a part checksum never
    // persisted, shows here and maybe nowhere else).
    simulator.CaptureNow({2, state.Pack()});
  }
}

// "" if the pool opened from `image` is one a correct protocol may leave,
// else what is wrong with it.
std::string CheckImage(const PowerLossSimulator& simulator, const PowerLossImage& image,
                       const Manifest& manifest, bool with_chunks, const std::string& path) {
  const std::string where = image.Describe() + ": ";
  if (std::string failed = simulator.WriteImage(image, path); !failed.empty()) return failed;
  OpenOptions options;
  options.prefault_mapping = false;
  auto opened = Pool::Open(path, manifest, options);
  if (!opened.ok()) return where + "does not open: " + opened.status().message();
  Pool& pool = **opened;
  if (!pool.warnings().empty()) return where + "opens with a warning: " + pool.warnings().front();
  const VerifyReport report = pool.Verify(/*deep=*/true);
  if (!report.ok()) {
    for (const auto& slot : report.slots) {
      if (!slot.problems.empty()) return where + "a slot fails verification: " + slot.problems[0];
    }
    return where + "a chunk fails verification: " + report.chunk_problems.front();
  }
  const Progress progress = Progress::Unpack(image.note);
  auto latest = pool.Latest();
  const std::uint64_t recovered = latest.ok() ? latest->epoch() : 0;
  const bool allowed = recovered == progress.committed ||
                       (progress.committing && recovered == progress.committed + 1);
  if (!allowed) {
    return where + "recovers epoch " + std::to_string(recovered) + ", expected " +
           std::to_string(progress.committed) +
           (progress.committing ? " or " + std::to_string(progress.committed + 1) : "");
  }
  if (recovered == 0) return "";
  if (latest->iteration() != recovered * 10) {
    return where + "epoch " + std::to_string(recovered) + " has iteration " +
           std::to_string(latest->iteration());
  }
  if (std::string differs = CheckSeededView(manifest, *latest, recovered); !differs.empty()) {
    return where + "epoch " + std::to_string(recovered) + ": " + differs;
  }
  const std::string extra = ExtraState(recovered);
  const auto stored = latest->extra_state();
  if (stored.size() != extra.size() ||
      std::memcmp(stored.data(), extra.data(), extra.size()) != 0) {
    return where + "epoch " + std::to_string(recovered) + ": extra state differs";
  }
  if (with_chunks && !ChunkOfEpochIntact(pool, recovered)) {
    return where + "epoch " + std::to_string(recovered) + "'s chunk is lost";
  }
  return "";
}

struct Outcome {
  std::uint64_t persist_points = 0;
  std::vector<std::string> problems;
  std::size_t images = 0;
};

// Creates a pool, runs the epochs under the simulator and checks every image.
Outcome RunWorkload(bool with_chunks, std::uint64_t seed) {
  Outcome outcome;
  TempPoolPath path("power-loss");
  TempPoolPath image_path("power-loss-image");
  const Manifest manifest = SmallManifest();
  std::atomic<bool> armed{false};
  std::atomic<std::uint64_t> progress{0};
  PowerLossSimulator simulator(pmsnap::testing::TestSeed(seed));
  simulator.SetPlan(CapturePlan(&armed, &progress));
  {
    auto pool = Pool::Create(path.path(), manifest, SmallOptions(with_chunks ? 4 << 20 : 0));
    EXPECT_TRUE(pool.ok()) << pool.status().message();
    if (!pool.ok()) return outcome;
    armed = true;
    RunEpochs(**pool, with_chunks, &progress, simulator);
  }
  simulator.Stop();
  outcome.persist_points = simulator.persist_points();
  outcome.images = simulator.images().size();
  for (const PowerLossImage& image : simulator.images()) {
    std::string problem = CheckImage(simulator, image, manifest, with_chunks, image_path.path());
    if (!problem.empty()) outcome.problems.push_back(problem);
  }
  return outcome;
}

TEST(PoolPowerLossTest, CreatedPoolOpensFromEveryImageAfterItsHeaderIsDrained) {
  TempPoolPath path("power-loss-create");
  TempPoolPath image_path("power-loss-create-image");
  const Manifest manifest = SmallManifest();
  PowerLossSimulator simulator(pmsnap::testing::TestSeed(1));
  std::uint64_t last_drain = 0;
  simulator.SetPlan([&](const SeamEvent& event) -> std::optional<CaptureRequest> {
    if (event.persist_point()) last_drain = event.index;
    return CaptureRequest{3, 0};
  });
  auto pool = Pool::Create(path.path(), manifest, SmallOptions(1 << 20));
  ASSERT_TRUE(pool.ok()) << pool.status().message();
  simulator.SetPlan(nullptr);
  pool->reset();
  simulator.Stop();
  ASSERT_FALSE(simulator.images().empty());
  // Before the header's drain the file is still under its temporary name; an
  // image of it may be refused, but cleanly. From that drain on (the file
  // about to be renamed) every image is an empty pool of this model.
  int complete = 0;
  for (const PowerLossImage& image : simulator.images()) {
    ASSERT_EQ(simulator.WriteImage(image, image_path.path()), "");
    OpenOptions options;
    options.prefault_mapping = false;
    auto opened = Pool::Open(image_path.path(), manifest, options);
    if (image.event < last_drain) {
      if (!opened.ok()) {
        EXPECT_TRUE(opened.status().code() == StatusCode::kNotAPool ||
                    opened.status().code() == StatusCode::kCorruption)
            << image.Describe() << ": " << opened.status().message();
      }
      continue;
    }
    ++complete;
    ASSERT_TRUE(opened.ok()) << image.Describe() << ": " << opened.status().message();
    EXPECT_FALSE((*opened)->Latest().ok()) << image.Describe();
    EXPECT_TRUE((*opened)->Verify(true).ok()) << image.Describe();
  }
  EXPECT_GE(complete, 5);  // none, all and three random at the header's drain
}

TEST(PoolPowerLossTest, EpochsRecoverToTheLastDrainedCommitFromEveryImage) {
  const Outcome outcome = RunWorkload(/*with_chunks=*/false, 11);
  std::cout << "persist points " << outcome.persist_points << ", images checked " << outcome.images
            << ", bad " << outcome.problems.size() << "\n";
  EXPECT_GT(outcome.persist_points, 50u);
  EXPECT_GT(outcome.images, 200u);
  for (std::size_t i = 0; i < outcome.problems.size() && i < 5; ++i) {
    ADD_FAILURE() << outcome.problems[i];
  }
}

TEST(PoolPowerLossTest, ChunkAllocSealFreeAndSweepSurviveEveryImage) {
  const Outcome outcome = RunWorkload(/*with_chunks=*/true, 12);
  std::cout << "persist points " << outcome.persist_points << ", images checked " << outcome.images
            << ", bad " << outcome.problems.size() << "\n";
  EXPECT_GT(outcome.images, 200u);
  for (std::size_t i = 0; i < outcome.problems.size() && i < 5; ++i) {
    ADD_FAILURE() << outcome.problems[i];
  }
}

// The Engine's workers persist from several threads: thread A flushes a
// line, thread B stores newer bytes into it, flushes and drains, then A
// drains. The line A flushed is older than the durable one; A's drain must
// not make it durable again (it did before the flushes were ordered).
// The ranks agreed on an older epoch (Pool::RollBackLatest): the next
// BeginEpoch reuses the dropped epoch's slot and frees its chunks. A power
// cut in between must not leave that epoch complete without its chunks: a
// reader of this pool alone (export, recover_table) would pick it and miss
// its tables. The slot is marked first, then the chunks go.
TEST(PoolPowerLossTest, ARolledBackEpochNeverOutlivesItsChunksInAnyImage) {
  TempPoolPath path("power-loss-rollback");
  TempPoolPath image_path("power-loss-rollback-image");
  const Manifest manifest = SmallManifest();
  {
    auto pool = Pool::Create(path.path(), manifest, SmallOptions(4 << 20));
    ASSERT_TRUE(pool.ok()) << pool.status().message();
    for (std::uint64_t epoch = 1; epoch <= 2; ++epoch) {
      BeginAndWriteEpoch(**pool, epoch, /*with_chunks=*/true);
      CommitEpoch(**pool, epoch);
    }
  }
  PowerLossSimulator simulator(pmsnap::testing::TestSeed(13));
  {
    OpenOptions options;
    options.prefault_mapping = false;
    auto pool = Pool::Open(path.path(), manifest, options);
    ASSERT_TRUE(pool.ok()) << pool.status().message();
    ASSERT_TRUE((*pool)->RollBackLatest("the ranks agreed on iteration 10").ok());
    simulator.SetPlan([](const SeamEvent&) -> std::optional<CaptureRequest> {
      return CaptureRequest{2, 0};
    });
    ASSERT_TRUE((*pool)->BeginEpoch(20).ok());
    simulator.SetPlan(nullptr);
    (*pool)->Abandon();
  }
  simulator.Stop();
  ASSERT_FALSE(simulator.images().empty());
  int dropped_seen = 0;
  for (const PowerLossImage& image : simulator.images()) {
    ASSERT_EQ(simulator.WriteImage(image, image_path.path()), "");
    OpenOptions options;
    options.prefault_mapping = false;
    auto opened = Pool::Open(image_path.path(), manifest, options);
    ASSERT_TRUE(opened.ok()) << image.Describe() << ": " << opened.status().message();
    auto latest = (*opened)->Latest();
    ASSERT_TRUE(latest.ok()) << image.Describe();
    if (latest->epoch() == 2) {
      ++dropped_seen;
      EXPECT_TRUE(ChunkOfEpochIntact(**opened, 2))
          << image.Describe() << ": epoch 2 is complete but its chunk is gone";
    } else {
      EXPECT_EQ(latest->epoch(), 1u) << image.Describe();
    }
  }
  EXPECT_GT(dropped_seen, 0);  // images from before the slot was marked
}

TEST(PoolPowerLossTest, ADrainNeverMakesALineOlderThanAnotherThreadMadeDurable) {
  TempPoolPath path("power-loss-threads");
  PowerLossSimulator simulator(pmsnap::testing::TestSeed(5));
  auto pool = Pool::Create(path.path(), SmallManifest(), SmallOptions(0));
  ASSERT_TRUE(pool.ok()) << pool.status().message();
  PMEMobjpool* pop = simulator.tracked_pool();
  ASSERT_NE(pop, nullptr);
  std::byte* line = (*pool)->slot_extents(0)[0].data();
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(line) % 64, 0u);
  const std::uint64_t offset = static_cast<std::uint64_t>(line - simulator.tracked_base());
  bool captured = false;
  simulator.SetPlan([&](const SeamEvent& event) -> std::optional<CaptureRequest> {
    if (!captured || !event.persist_point()) return std::nullopt;
    return CaptureRequest{0, 0};
  });
  std::promise<void> a_flushed, b_drained;
  std::thread a([&] {
    std::memset(line, 0xAA, 64);
    simulator.Flush(pop, line, 64);
    a_flushed.set_value();
    b_drained.get_future().wait();
    captured = true;  // ordered by the future: only A's drain below captures
    simulator.Drain(pop);
  });
  a_flushed.get_future().wait();
  std::thread b([&] {
    std::memset(line, 0xBB, 64);
    simulator.Flush(pop, line, 64);
    simulator.Drain(pop);
  });
  b.join();
  b_drained.set_value();
  a.join();
  simulator.SetPlan(nullptr);
  pool->reset();
  simulator.Stop();
  ASSERT_EQ(simulator.images().size(), 2u);  // drained only, everything
  for (const PowerLossImage& image : simulator.images()) {
    auto at = std::find(image.line_offsets.begin(), image.line_offsets.end(), offset);
    ASSERT_NE(at, image.line_offsets.end()) << image.Describe();
    const std::byte* bytes = image.line_bytes.data() + (at - image.line_offsets.begin()) * 64;
    for (int i = 0; i < 64; ++i) {
      ASSERT_EQ(bytes[i], std::byte{0xBB}) << image.Describe() << ": byte " << i;
    }
  }
}

TEST(PoolPowerLossTest, DroppingTheDrainBeforeTheCommitWordIsCaught) {
  layout::detail::DropCommitRecordDrainForTesting(true);
  const Outcome outcome = RunWorkload(/*with_chunks=*/false, 13);
  layout::detail::DropCommitRecordDrainForTesting(false);
  std::cout << "planted bug: " << outcome.problems.size() << " of " << outcome.images
            << " images bad" << (outcome.problems.empty() ? "" : ", first: ")
            << (outcome.problems.empty() ? "" : outcome.problems.front()) << "\n";
  EXPECT_FALSE(outcome.problems.empty());
}

}  // namespace
}  // namespace pmsnap::layout
