// Crash consistency: a child process commits epochs (and chunk-heap chunks)
// continuously and reports each commit on a pipe; the parent SIGKILLs it at
// random moments and checks the reopened pool against what was reported.
// Trials: 200, or $PMSNAP_CRASH_TRIALS.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <random>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/kill_delay.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap::layout {
namespace {

using pmsnap::testing::CheckSeededView;
using pmsnap::testing::FillSeeded;
using pmsnap::testing::KillDelay;
using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kChunkTag = 5;

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
[[noreturn]] void RunWriter(const std::string& path, int report_fd) {
  SetWarningSink(nullptr);
  auto pool = Pool::Open(path);
  if (!pool.ok()) _exit(3);
  for (;;) {
    const std::uint64_t epoch = (*pool)->last_committed_epoch().value_or(0) + 1;
    // Each epoch: one new chunk, and chunks older than two epochs freed.
    for (const ChunkInfo& chunk : (*pool)->ListChunks()) {
      if (chunk.epoch + 2 < epoch && !(*pool)->FreeChunk(chunk.id).ok()) _exit(4);
    }
    if (!(*pool)->BeginEpoch(epoch * 10).ok()) _exit(5);
    const std::vector<std::byte> content = ChunkContent(epoch);
    auto chunk = (*pool)->AllocChunk(content.size(), epoch, kChunkTag);
    if (!chunk.ok()) _exit(6);
    std::memcpy((*pool)->ChunkPayload(chunk->id)->data(), content.data(), content.size());
    if (!(*pool)->SealChunk(chunk->id).ok()) _exit(7);
    const Manifest& manifest = (*pool)->manifest();
    for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
      for (std::uint32_t t = 0; t < manifest.units[u].tensors.size(); ++t) {
        auto bytes = pmsnap::testing::SeededTensor(manifest, epoch, u, t);
        if (!(*pool)->WriteTensor(u, t, bytes.data()).ok()) _exit(8);
      }
    }
    const std::string extra = "epoch=" + std::to_string(epoch);
    if (!(*pool)->Commit({reinterpret_cast<const std::byte*>(extra.data()), extra.size()}).ok()) {
      _exit(9);
    }
    if (::write(report_fd, &epoch, sizeof(epoch)) != sizeof(epoch)) _exit(10);
  }
}

int TrialCount() {
  const char* env = std::getenv("PMSNAP_CRASH_TRIALS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 200;
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
  std::mt19937_64 rng(20261121);
  KillDelay delay(0, 15000);
  std::uint64_t last_reported = 0;
  int trials_with_progress = 0;
  const int trials = TrialCount();
  for (int trial = 0; trial < trials; ++trial) {
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(fds[0]);
      RunWriter(path.path(), fds[1]);
    }
    ::close(fds[1]);
    ::usleep(delay.Next(rng, static_cast<std::uint64_t>(trials_with_progress)));
    ::kill(child, SIGKILL);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus))
        << "writer exited by itself with code " << WEXITSTATUS(wstatus) << " in trial " << trial;
    std::uint64_t reported = 0;
    bool progressed = false;
    while (::read(fds[0], &reported, sizeof(reported)) == sizeof(reported)) {
      last_reported = reported;
      progressed = true;
    }
    ::close(fds[0]);
    trials_with_progress += progressed ? 1 : 0;

    auto pool = Pool::Open(path.path());
    ASSERT_TRUE(pool.ok()) << "trial " << trial << ": " << pool.status().ToString();
    ASSERT_TRUE((*pool)->warnings().empty()) << (*pool)->warnings()[0];
    if (last_reported == 0 && !(*pool)->last_committed_epoch()) continue;
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok()) << "trial " << trial << ": " << latest.status().ToString();
    ASSERT_GE(latest->epoch(), last_reported) << "trial " << trial;
    ASSERT_EQ(latest->iteration(), latest->epoch() * 10);
    ASSERT_EQ(CheckSeededView(manifest, *latest, latest->epoch()), "") << "trial " << trial;
    const std::string extra(reinterpret_cast<const char*>(latest->extra_state().data()),
                            latest->extra_state().size());
    ASSERT_EQ(extra, "epoch=" + std::to_string(latest->epoch()));
    // Every chunk of a committed epoch is sealed and intact.
    bool found_latest_chunk = false;
    for (const ChunkInfo& chunk : (*pool)->ListChunks()) {
      if (chunk.epoch > latest->epoch()) continue;  // orphan of the killed epoch
      auto payload = (*pool)->ReadChunk(chunk.id);
      ASSERT_TRUE(payload.ok()) << "trial " << trial << ": " << payload.status().ToString();
      const std::vector<std::byte> expected = ChunkContent(chunk.epoch);
      ASSERT_EQ(payload->size(), expected.size());
      ASSERT_EQ(std::memcmp(payload->data(), expected.data(), expected.size()), 0);
      found_latest_chunk |= chunk.epoch == latest->epoch();
    }
    ASSERT_TRUE(found_latest_chunk) << "trial " << trial;
    last_reported = latest->epoch();
  }
  EXPECT_GT(trials_with_progress, trials / 4) << "kills came too early to test anything";
  EXPECT_GT(last_reported, static_cast<std::uint64_t>(trials));

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
