// Crash consistency of embedding checkpoints: a child process restores from
// the pool and trains on, checkpointing every step (extraction,
// concatenation, retention GC all run in its workers); the parent SIGKILLs
// it at random moments. After every kill each retained checkpoint must
// rebuild exactly the table at its iteration, and the dense slot and the
// embedding index must agree on the newest iteration, and no iteration the
// child reported committed may be missing. Kills are timed by the child's
// commits and its own step time (crash_trials.h).
// Trials: 24 per policy (168 in all), or $PMSNAP_CRASH_TRIALS per policy.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "pmsnap/diff/embedding_checkpointer.h"
#include "testutil/crash_trials.h"
#include "testutil/embedding_toy.h"
#include "testutil/temp_pool.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::CrashChild;
using pmsnap::testing::CrashTrials;
using pmsnap::testing::EmbeddingToy;
using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kRows = 2000;
constexpr std::uint32_t kDim = 8;

enum ChildPhase : int { kStarting, kCreating, kOpening, kRestoring, kTraining };
const std::vector<std::string> kPhaseNames = {"starting", "creating the pool", "opening the pool",
                                              "restoring", "training"};

EmbeddingOptions OptionsFor(Policy policy, double ratio = 1.0) {
  EmbeddingOptions options;
  options.policy = policy;
  options.retain = 3;
  options.incrcp.duplicate_ratio_threshold = 0.01;
  // CPR-MFU / CPR-SSU with r = 1 (and SSU sampling every lookup) save every
  // used row, so each checkpoint is exact and the same check applies; the
  // kills still land in their selection, chain and baseline code.
  options.priority.ratio = ratio;
  options.priority.ssu_period = 1;
  options.priority.baseline_every = 8;
  return options;
}

[[noreturn]] void Child(const std::string& path, Policy policy, CrashChild& crash,
                        double ratio = 1.0) {
  layout::SetWarningSink(nullptr);
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(OptionsFor(policy, ratio));
  EmbeddingToy toy(kRows, kDim);
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.encoder = checkpointer;
  options.workers = 1;
  crash.Phase(std::filesystem::exists(path) ? kOpening : kCreating);
  auto engine = runtime::Engine::Open(options, toy.Registrations());
  if (!engine.ok()) _exit(3);
  std::uint64_t k = 1;
  crash.Phase(kRestoring);
  auto restored = (*engine)->Restore();
  if (restored.ok()) {
    k = restored->iteration + 1;
  } else if (restored.status().code() != StatusCode::kNotFound) {
    _exit(4);
  }
  RowTracker* tracker = checkpointer->tracker("emb.users");
  crash.Phase(kTraining);
  const std::uint64_t first = k;
  for (;; ++k) {
    if (!toy.Step(**engine, *tracker, k).ok()) _exit(5);
    // Every-1 checkpoints: step k began only once epoch k-1 had committed.
    if (k == first) {
      crash.StartEpochs();
    } else {
      crash.Committed(k - 1);
    }
  }
}

int Trials() { return pmsnap::testing::CrashTrialCount(24); }

// Trials on a fresh pool each, killed around the pool's creation.
int CreationTrials() { return std::max(2, Trials() / 8); }

// The pool after a kill: its newest iteration is `at_least` or later (0: it
// may hold no commit, or not exist yet), the dense slot and the embedding
// index agree on it, and every retained checkpoint rebuilds the table at its
// iteration exactly. Sets *newest to the newest iteration (if any), adds the
// checkpoints it verified to *verified.
void VerifyAfterKill(const std::string& path, std::uint64_t at_least, const std::string& context,
                     std::uint64_t* newest, int* verified) {
  layout::SetWarningSink(nullptr);
  auto pool = layout::Pool::Open(path);
  // Create builds the file under another name: a kill inside leaves none.
  if (at_least == 0 && pool.status().code() == StatusCode::kNotFound) return;
  ASSERT_TRUE(pool.ok()) << context << ": " << pool.status().ToString();
  auto latest = (*pool)->Latest();
  if (at_least == 0 && latest.status().code() == StatusCode::kNotFound) return;
  ASSERT_TRUE(latest.ok()) << context << ": expected iteration " << at_least << " or later, got "
                           << latest.status().ToString();
  auto checkpoints = ListCheckpoints(**pool, "emb.users");
  ASSERT_TRUE(checkpoints.ok()) << context << ": " << checkpoints.status().ToString();
  ASSERT_FALSE(checkpoints->empty()) << context;
  ASSERT_EQ(checkpoints->back().epoch, latest->epoch()) << context;
  ASSERT_EQ(checkpoints->back().iteration, latest->iteration()) << context;
  ASSERT_GE(latest->iteration(), at_least)
      << context << ": expected the newest iteration reported or recovered so far";
  *newest = latest->iteration();
  for (const CheckpointInfo& c : *checkpoints) {
    auto table = RecoverTable(**pool, "emb.users", c.epoch);
    ASSERT_TRUE(table.ok()) << context << ": " << table.status().ToString();
    ASSERT_EQ(table->tensors[0], EmbeddingToy::ReferenceWeights(kRows, kDim, c.iteration))
        << context << ", checkpoint " << c.epoch << " iteration " << c.iteration;
    ASSERT_EQ(table->tensors[1], EmbeddingToy::ReferenceAccumulator(kRows, kDim, c.iteration))
        << context << ", checkpoint " << c.epoch << " iteration " << c.iteration;
    ++*verified;
  }
}

class DiffCrashTest : public ::testing::TestWithParam<Policy> {
 protected:
  // The host device measures memcpy bandwidth once per process (100 MiB of
  // copies, a tenth of a second on a slow machine): measured here, before
  // the forks, the children spend their time opening, restoring and
  // checkpointing instead, and that is where the kills land.
  void SetUp() override { runtime::HostDevice().EstimateInDeviceCopySeconds(1); }
};

TEST_P(DiffCrashTest, EveryRetainedCheckpointSurvivesRandomKills) {
  TempPoolPath path("diff-crash");
  CrashTrials kills(pmsnap::testing::TestSeed(static_cast<unsigned>(GetParam()) * 7919u),
                    kPhaseNames);
  std::uint64_t newest = 0;
  int verified = 0;
  for (int trial = 0; trial < Trials(); ++trial) {
    const auto kill = kills.Run([&](CrashChild& crash) { Child(path.path(), GetParam(), crash); });
    const std::string context =
        "trial " + std::to_string(trial) + " (" + kill.Describe(kPhaseNames) + ")";
    ASSERT_TRUE(kill.killed) << context;
    // Every iteration the child reported committed is durable. The first
    // trial waits for a commit (crash_trials.h): from then on there is one.
    newest = std::max<std::uint64_t>({newest, kill.last_reported, 1});
    VerifyAfterKill(path.path(), newest, context, &newest, &verified);
    if (HasFatalFailure()) return;
  }
  std::printf("diff crash (%s): %s; newest iteration %llu, %d checkpoints verified\n",
              PolicyName(GetParam()), kills.Summary().c_str(),
              static_cast<unsigned long long>(newest), verified);
  // Each child but the planned early kills reported commits before it was
  // killed, on top of the iteration the previous one left behind.
  EXPECT_GE(newest, kills.commits_waited_for()) << "iterations were lost: " << kills.Summary();
  // Once something committed, every trial verifies at least one checkpoint.
  EXPECT_GE(verified, Trials()) << kills.Summary();
  // Retention keeps the heap bounded however long the run and many the
  // kills; consecutive incremental keeps its whole chain by design (Check-N-
  // Run 6.3.1: its capacity grows with every interval).
  if (GetParam() != Policy::kConsecutiveIncremental) {
    auto pool = layout::Pool::Open(path.path());
    ASSERT_TRUE(pool.ok());
    EXPECT_LT((*pool)->chunk_heap().used_bytes(), 12 * kRows * (kDim + 1) * 4 + (4u << 20));
  }
}

// Kills while the child creates the pool, opens it and makes its first
// checkpoint: the first trial times how long a child takes to its first
// commit, the others kill at a random fraction of that.
TEST_P(DiffCrashTest, KillsAroundPoolCreationLeaveNoPoolOrAVerifiedOne) {
  CrashTrials kills(pmsnap::testing::TestSeed(static_cast<unsigned>(GetParam()) * 104729u),
                    kPhaseNames);
  int verified = 0;
  for (int trial = 0; trial < CreationTrials(); ++trial) {
    TempPoolPath path("diff-create");
    const auto kill = kills.Run([&](CrashChild& crash) { Child(path.path(), GetParam(), crash); },
                                CrashTrials::Kill::kBeforeFirstCommit);
    const std::string context =
        "trial " + std::to_string(trial) + " (" + kill.Describe(kPhaseNames) + ")";
    ASSERT_TRUE(kill.killed) << context;
    std::uint64_t newest = 0;
    VerifyAfterKill(path.path(), kill.last_reported, context, &newest, &verified);
    if (HasFatalFailure()) return;
  }
  std::printf("diff crash at creation (%s): %s; %d checkpoints verified\n", PolicyName(GetParam()),
              kills.Summary().c_str(), verified);
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, DiffCrashTest,
                         ::testing::Values(Policy::kFull, Policy::kOneShotDifferential,
                                           Policy::kConsecutiveIncremental,
                                           Policy::kIntermittentDifferential, Policy::kIncrCP,
                                           Policy::kMostFrequentlyUsed, Policy::kSubSampledUsed),
                         [](const auto& info) {
                           std::string name = PolicyName(info.param);
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

// CPR-MFU / CPR-SSU at r = 0.25: checkpoints hold only the rows chosen, so
// they are not the table at their iteration; after every kill the pool must
// still open to a newest iteration at least the one reported, the dense slot
// and the index must agree, every retained checkpoint must rebuild, and each
// of its rows must hold a value that row really had at some iteration up to
// the checkpoint's (a torn or mixed-up chunk would show as a value no
// iteration produced).
class PrioritisedCrashTest : public ::testing::TestWithParam<Policy> {
 protected:
  void SetUp() override { runtime::HostDevice().EstimateInDeviceCopySeconds(1); }
};

TEST_P(PrioritisedCrashTest, ApproximateCheckpointsStayConsistentUnderRandomKills) {
  TempPoolPath path("diff-crash-cpr");
  CrashTrials kills(pmsnap::testing::TestSeed(static_cast<unsigned>(GetParam()) * 31337u),
                    kPhaseNames);
  const int trials = std::max(4, Trials() / 3);
  std::uint64_t newest = 0;
  int verified = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const auto kill =
        kills.Run([&](CrashChild& crash) { Child(path.path(), GetParam(), crash, 0.25); });
    const std::string context =
        "trial " + std::to_string(trial) + " (" + kill.Describe(kPhaseNames) + ")";
    ASSERT_TRUE(kill.killed) << context;
    newest = std::max<std::uint64_t>({newest, kill.last_reported, 1});
    layout::SetWarningSink(nullptr);
    auto pool = layout::Pool::Open(path.path());
    ASSERT_TRUE(pool.ok()) << context << ": " << pool.status().ToString();
    auto latest = (*pool)->Latest();
    ASSERT_TRUE(latest.ok()) << context << ": " << latest.status().ToString();
    ASSERT_GE(latest->iteration(), newest) << context;
    newest = latest->iteration();
    auto checkpoints = ListCheckpoints(**pool, "emb.users");
    ASSERT_TRUE(checkpoints.ok()) << context << ": " << checkpoints.status().ToString();
    ASSERT_EQ(checkpoints->back().iteration, latest->iteration()) << context;
    const CheckpointInfo& c = checkpoints->back();
    auto table = RecoverTable(**pool, "emb.users", c.epoch);
    ASSERT_TRUE(table.ok()) << context << ": " << table.status().ToString();
    // Row r matches iteration j when all its values equal the toy's after j.
    std::vector<bool> matched(kRows, false);
    EmbeddingToy toy(kRows, kDim);
    std::vector<float> weights = EmbeddingToy::ReferenceWeights(kRows, kDim, 0);
    for (std::uint64_t j = 0;; ++j) {
      for (std::uint64_t r = 0; r < kRows; ++r) {
        if (!matched[r] && std::equal(weights.begin() + r * kDim, weights.begin() + (r + 1) * kDim,
                                      table->tensors[0].begin() + r * kDim)) {
          matched[r] = true;
        }
      }
      if (j == c.iteration) break;
      // The rows step j + 1 changes, applied to the running copy.
      for (std::int64_t r : toy.RowsOf(j + 1)) {
        for (std::uint32_t d = 0; d < kDim; ++d) {
          weights[r * kDim + d] += 0.001f * static_cast<float>((j + 1 + d) % 17) - 0.008f;
        }
      }
    }
    for (std::uint64_t r = 0; r < kRows; ++r) {
      ASSERT_TRUE(matched[r]) << context << ": row " << r << " of checkpoint " << c.epoch
                              << " holds a value it never had up to iteration " << c.iteration;
    }
    ++verified;
  }
  std::printf("diff crash r=0.25 (%s): %s; newest iteration %llu, %d checkpoints verified\n",
              PolicyName(GetParam()), kills.Summary().c_str(),
              static_cast<unsigned long long>(newest), verified);
  EXPECT_EQ(verified, trials);
}

INSTANTIATE_TEST_SUITE_P(CprPolicies, PrioritisedCrashTest,
                         ::testing::Values(Policy::kMostFrequentlyUsed, Policy::kSubSampledUsed),
                         [](const auto& info) {
                           std::string name = PolicyName(info.param);
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace pmsnap::diff
