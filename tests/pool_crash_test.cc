// Crash consistency: a child process commits epochs (and chunk-heap chunks)
// continuously and reports each commit on a pipe; the parent SIGKILLs it at
// random moments measured in the child's own epoch time (crash_trials.h) and
// checks the reopened pool against what was reported.
// Trials: 200, or $PMSNAP_CRASH_TRIALS.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/crash_trials.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CheckSeededView;
using pmsnap::testing::CrashChild;
using pmsnap::testing::CrashTrials;
using pmsnap::testing::FillSeeded;
using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kChunkTag = 5;

// What the writer is doing, for the tally of where kills landed.
enum WriterPhase : int { kOpening, kFreeing, kWriting, kCommitting, kReporting };
const std::vector<std::string> kPhaseNames = {"opening", "freeing chunks", "writing", "committing",
                                              "reporting"};

Manifest CrashManifest() {
  // Units of several sizes so kills land inside large multi-part copies too.
  Manifest manifest = pmsnap::testing::MakeManifest(3, 40000);
  Manifest small = pmsnap::testing::MakeManifest(5, 37);
  for (auto& unit : small.units) {
    unit.name = "small." + unit.name;
    manifest.units.push_back(unit);
  }
  return manifest;
}

std::vector<std::byte> ChunkContent(std::uint64_t epoch) {
  std::vector<std::byte> bytes(3000 + epoch % 1000);
  FillSeeded(bytes, epoch, 999, kChunkTag);
  return bytes;
}

// Child: continue from the last committed epoch forever, report each commit.
[[noreturn]] void RunWriter(const std::string& path, CrashChild& crash) {
  SetWarningSink(nullptr);
  auto pool = Pool::Open(path);
  if (!pool.ok()) _exit(3);
  crash.StartEpochs();
  for (;;) {
    const std::uint64_t epoch = (*pool)->last_committed_epoch().value_or(0) + 1;
    crash.Phase(kFreeing);
    // Each epoch: one new chunk, and chunks older than two epochs freed.
    for (const ChunkInfo& chunk : (*pool)->chunk_heap().List()) {
      if (chunk.epoch + 2 < epoch && !(*pool)->chunk_heap().Free(chunk.id).ok()) _exit(4);
    }
    if (!(*pool)->BeginEpoch(epoch * 10).ok()) _exit(5);
    crash.Phase(kWriting);
    const std::vector<std::byte> content = ChunkContent(epoch);
    auto chunk = (*pool)->chunk_heap().Alloc(content.size(), epoch, kChunkTag);
    if (!chunk.ok()) _exit(6);
    std::memcpy((*pool)->chunk_heap().Payload(chunk->id)->data(), content.data(), content.size());
    if (!(*pool)->chunk_heap().Seal(chunk->id).ok()) _exit(7);
    const Manifest& manifest = (*pool)->manifest();
    for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
      for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
        auto bytes = pmsnap::testing::SeededTensor(manifest, epoch, u, t);
        if (!(*pool)->WriteTensor(u, t, bytes.data()).ok()) _exit(8);
      }
    }
    const std::string extra = "epoch=" + std::to_string(epoch);
    crash.Phase(kCommitting);
    if (!(*pool)->Commit({reinterpret_cast<const std::byte*>(extra.data()), extra.size()}).ok()) {
      _exit(9);
    }
    crash.Phase(kReporting);
    crash.Committed(epoch);
  }
}

TEST(PoolCrashTest, RandomSigkillAlwaysRecoversALaterOrEqualCommittedEpochBitExact) {
  TempPoolPath path("crash");
  const Manifest manifest = CrashManifest();
  {
    PoolOptions options;
    options.part_bytes = 16 << 10;
    options.chunk_heap_bytes = 1 << 20;
    ASSERT_TRUE(Pool::Create(path.path(), manifest, options).ok());
  }
  CrashTrials kills(pmsnap::testing::TestSeed(20261121), kPhaseNames);
  std::uint64_t newest = 0;  // epoch: reported by a child or recovered
  const int trials = pmsnap::testing::CrashTrialCount(200);
  for (int trial = 0; trial < trials; ++trial) {
    const auto kill = kills.Run([&](CrashChild& crash) { RunWriter(path.path(), crash); });
    ASSERT_TRUE(kill.killed) << "trial " << trial << ": " << kill.Describe(kPhaseNames);
    // Every commit the child reported is durable, the newest included. The
    // first trial waits for a commit (crash_trials.h): from then on there is one.
    newest = std::max(newest, kill.last_reported);

    auto pool = Pool::Open(path.path());
    ASSERT_TRUE(pool.ok()) << "trial " << trial << ": " << pool.status().ToString();
    ASSERT_TRUE((*pool)->warnings().empty()) << (*pool)->warnings()[0];
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok()) << "trial " << trial << ": " << latest.status().ToString();
    ASSERT_GE(latest->epoch(), newest)
        << "trial " << trial << ": expected the newest commit reported or recovered so far; "
        << kill.Describe(kPhaseNames);
    ASSERT_EQ(latest->iteration(), latest->epoch() * 10);
    ASSERT_EQ(CheckSeededView(manifest, *latest, latest->epoch()), "") << "trial " << trial;
    const std::string extra(reinterpret_cast<const char*>(latest->extra_state().data()),
                            latest->extra_state().size());
    ASSERT_EQ(extra, "epoch=" + std::to_string(latest->epoch()));
    // Every chunk of a committed epoch is sealed and intact.
    bool found_latest_chunk = false;
    for (const ChunkInfo& chunk : (*pool)->chunk_heap().List()) {
      if (chunk.epoch > latest->epoch()) continue;  // orphan of the killed epoch
      auto payload = (*pool)->chunk_heap().Read(chunk.id);
      ASSERT_TRUE(payload.ok()) << "trial " << trial << ": " << payload.status().ToString();
      const std::vector<std::byte> expected = ChunkContent(chunk.epoch);
      ASSERT_EQ(payload->size(), expected.size());
      ASSERT_EQ(std::memcmp(payload->data(), expected.data(), expected.size()), 0);
      found_latest_chunk |= chunk.epoch == latest->epoch();
    }
    ASSERT_TRUE(found_latest_chunk) << "trial " << trial;
    newest = latest->epoch();
  }
  std::printf("pool crash: %s; newest epoch %llu\n", kills.Summary().c_str(),
              static_cast<unsigned long long>(newest));
  // Each child but the planned early kills committed at least once before it
  // was killed, from the epoch the previous one left behind.
  EXPECT_GE(newest, kills.commits_waited_for()) << "the pool lost commits: " << kills.Summary();

  // PMDK's own checker agrees the pool is consistent.
  const std::string command = "pmempool check -v '" + path.path() + "' 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buffer[256];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int rc = ::pclose(pipe);
  ASSERT_EQ(WEXITSTATUS(rc), 0) << "pmempool check failed (is pmdk-tools installed?): " << output;
  EXPECT_THAT(output, ::testing::HasSubstr("consistent"));
}

}  // namespace
}  // namespace pmsnap::layout
