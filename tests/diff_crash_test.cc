// Crash consistency of embedding checkpoints: a child process restores from
// the pool and trains on, checkpointing every step (extraction,
// concatenation, retention GC all run in its workers); the parent SIGKILLs
// it at random moments. After every kill each retained checkpoint must
// rebuild exactly the table at its iteration, and the dense slot and the
// embedding index must agree on the newest iteration.
// Trials: 24 per policy (120 in all), or $PMSNAP_CRASH_TRIALS per policy.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <random>

#include "pmsnap/diff/embedding_checkpointer.h"
#include "testutil/embedding_toy.h"
#include "testutil/kill_delay.h"
#include "testutil/temp_pool.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::EmbeddingToy;
using pmsnap::testing::KillDelay;
using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kRows = 2000;
constexpr std::uint32_t kDim = 8;

EmbeddingOptions OptionsFor(Policy policy) {
  EmbeddingOptions options;
  options.policy = policy;
  options.retain = 3;
  options.incrcp.duplicate_ratio_threshold = 0.01;
  return options;
}

[[noreturn]] void Child(const std::string& path, Policy policy) {
  layout::SetWarningSink(nullptr);
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(OptionsFor(policy));
  EmbeddingToy toy(kRows, kDim);
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.encoder = checkpointer;
  options.workers = 1;
  auto engine = runtime::Engine::Open(options, toy.Registrations());
  if (!engine.ok()) _exit(3);
  std::uint64_t k = 1;
  auto restored = (*engine)->Restore();
  if (restored.ok()) {
    k = restored->iteration + 1;
  } else if (restored.status().code() != StatusCode::kNotFound) {
    _exit(4);
  }
  RowTracker* tracker = checkpointer->tracker("emb.users");
  for (;; ++k) {
    if (!toy.Step(**engine, *tracker, k).ok()) _exit(5);
  }
}

int Trials() {
  const char* env = std::getenv("PMSNAP_CRASH_TRIALS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 24;
}

class DiffCrashTest : public ::testing::TestWithParam<Policy> {};

TEST_P(DiffCrashTest, EveryRetainedCheckpointSurvivesRandomKills) {
  TempPoolPath path("diff-crash");
  std::mt19937 rng(static_cast<unsigned>(GetParam()) * 7919u);
  KillDelay delay(2000, 40000);
  std::uint64_t newest = 0;
  int verified = 0;
  for (int trial = 0; trial < Trials(); ++trial) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) Child(path.path(), GetParam());
    ::usleep(delay.Next(rng, newest));
    ::kill(child, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status))
        << "child exited by itself with " << WEXITSTATUS(status) << " in trial " << trial;
    layout::SetWarningSink(nullptr);
    auto pool = layout::Pool::Open(path.path());
    if (!pool.ok() && (pool.status().code() == StatusCode::kNotFound ||
                       pool.status().code() == StatusCode::kNotAPool)) {
      continue;  // killed while the pool was being created
    }
    ASSERT_TRUE(pool.ok()) << "trial " << trial << ": " << pool.status().ToString();
    auto latest = (*pool)->Latest();
    if (!latest.ok()) continue;  // killed before the first commit
    auto checkpoints = ListCheckpoints(**pool, "emb.users");
    ASSERT_TRUE(checkpoints.ok()) << "trial " << trial << ": " << checkpoints.status().ToString();
    ASSERT_FALSE(checkpoints->empty());
    ASSERT_EQ(checkpoints->back().epoch, latest->epoch()) << "trial " << trial;
    ASSERT_EQ(checkpoints->back().iteration, latest->iteration());
    ASSERT_GE(latest->iteration(), newest) << "a committed iteration went missing";
    newest = latest->iteration();
    for (const CheckpointInfo& c : *checkpoints) {
      auto table = RecoverTable(**pool, "emb.users", c.epoch);
      ASSERT_TRUE(table.ok()) << "trial " << trial << ": " << table.status().ToString();
      ASSERT_EQ(table->tensors[0], EmbeddingToy::ReferenceWeights(kRows, kDim, c.iteration))
          << "trial " << trial << " checkpoint " << c.epoch << " iteration " << c.iteration;
      ASSERT_EQ(table->tensors[1], EmbeddingToy::ReferenceAccumulator(kRows, kDim, c.iteration));
      ++verified;
    }
  }
  EXPECT_GT(newest, static_cast<std::uint64_t>(Trials())) << "children made too little progress";
  EXPECT_GT(verified, Trials());
  // Retention keeps the heap bounded however long the run and many the
  // kills; consecutive incremental keeps its whole chain by design (Check-N-
  // Run 6.3.1: its capacity grows with every interval).
  if (GetParam() != Policy::kConsecutiveIncremental) {
    auto pool = layout::Pool::Open(path.path());
    ASSERT_TRUE(pool.ok());
    EXPECT_LT((*pool)->chunk_heap_used(), 12 * kRows * (kDim + 1) * 4 + (4u << 20));
  }
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, DiffCrashTest,
                         ::testing::Values(Policy::kFull, Policy::kOneShotDifferential,
                                           Policy::kConsecutiveIncremental,
                                           Policy::kIntermittentDifferential, Policy::kIncrCP),
                         [](const auto& info) {
                           std::string name = PolicyName(info.param);
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace pmsnap::diff
