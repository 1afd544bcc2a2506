// Embedding checkpoints through the engine: every policy, every retained
// checkpoint recovers exactly the table at its iteration (within the
// quantizer's bound when quantized); dense and embedding state commit
// together; restore resumes training; damaged chunks are reported.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <set>
#include <thread>

#include "detail/policy_rules.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "testutil/embedding_toy.h"
#include "testutil/manifest_rewrite.h"
#include "testutil/temp_pool.h"
#include "testutil/thread_coordinator.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::EmbeddingToy;
using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

constexpr std::uint64_t kRows = 3000;
constexpr std::uint32_t kDim = 16;

runtime::EngineOptions Options(const std::string& path,
                               std::shared_ptr<EmbeddingCheckpointer> checkpointer) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.encoder = std::move(checkpointer);
  return options;
}

// Trains steps [first, last] with a flush after each, so each one commits.
void Train(runtime::Engine& engine, EmbeddingCheckpointer& checkpointer, EmbeddingToy& toy,
           std::uint64_t first, std::uint64_t last) {
  RowTracker* tracker = checkpointer.tracker("emb.users");
  ASSERT_NE(tracker, nullptr);
  for (std::uint64_t k = first; k <= last; ++k) {
    ASSERT_TRUE(toy.Step(engine, *tracker, k).ok());
    ASSERT_TRUE(engine.Flush().ok());
  }
}

void ExpectTableAt(const layout::Pool& pool, std::uint64_t epoch, double tolerance) {
  auto table = RecoverTable(pool, "emb.users", epoch);
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  const std::vector<float> weights = EmbeddingToy::ReferenceWeights(kRows, kDim, table->iteration);
  const std::vector<float> acc = EmbeddingToy::ReferenceAccumulator(kRows, kDim, table->iteration);
  ASSERT_EQ(table->tensors.size(), 2u);
  if (tolerance == 0) {
    ASSERT_EQ(std::memcmp(table->tensors[0].data(), weights.data(), weights.size() * 4), 0)
        << "epoch " << epoch << " iteration " << table->iteration;
  } else {
    double worst = 0;
    for (std::size_t i = 0; i < weights.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(table->tensors[0][i]) - weights[i]));
    }
    EXPECT_LE(worst, tolerance) << "epoch " << epoch;
  }
  // The per-row accumulator has one value per row: stored raw, always exact.
  ASSERT_EQ(std::memcmp(table->tensors[1].data(), acc.data(), acc.size() * 4), 0);
}

struct PolicyCase {
  Policy policy;
  bool quantize;
};

// The case's policy, 8-bit quantized where it says, keeping `retain`
// checkpoints; IncrCP extracts whenever rows repeat and never resets its
// baseline on its own (timing-driven: tested on its own below).
EmbeddingOptions OptionsFor(const PolicyCase& c, std::uint32_t retain) {
  EmbeddingOptions options;
  options.policy = c.policy;
  options.retain = retain;
  options.quantize.enabled = c.quantize;
  options.quantize.bits = 8;
  options.incrcp.duplicate_ratio_threshold = 0.0;
  options.incrcp.reset_baseline = false;
  return options;
}

class PolicyTest : public ::testing::TestWithParam<PolicyCase> {};

TEST_P(PolicyTest, EveryRetainedCheckpointRecoversItsIteration) {
  TempPoolPath path("diff");
  const EmbeddingOptions options = OptionsFor(GetParam(), 4);
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  EmbeddingToy toy(kRows, kDim);
  {
    auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    Train(**engine, *checkpointer, toy, 1, 14);
    auto checkpoints = ListCheckpoints((*engine)->pool(), "emb.users");
    ASSERT_TRUE(checkpoints.ok()) << checkpoints.status().ToString();
    ASSERT_EQ(checkpoints->size(), 4u);
    EXPECT_EQ(checkpoints->back().iteration, 14u);
    // 8-bit asymmetric: within half a step of a row's range / 255.
    const double tolerance = GetParam().quantize ? 0.002 : 0.0;
    for (const CheckpointInfo& c : *checkpoints)
      ExpectTableAt((*engine)->pool(), c.epoch, tolerance);
    EXPECT_EQ(RecoverTable((*engine)->pool(), "emb.users", 1).status().code(),
              StatusCode::kNotFound);
    if (GetParam().policy != Policy::kFull) {
      EXPECT_FALSE(checkpointer->last_checkpoint("emb.users").full);
      EXPECT_LT(checkpointer->last_checkpoint("emb.users").rows_written, kRows);
    }
    ASSERT_TRUE((*engine)->Close().ok());
  }
  // A later process sees the same checkpoints through the pool alone.
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  auto checkpoints = ListCheckpoints(**pool, "emb.users");
  ASSERT_TRUE(checkpoints.ok());
  ASSERT_EQ(checkpoints->size(), 4u);
  if (!GetParam().quantize) {
    for (const CheckpointInfo& c : *checkpoints) ExpectTableAt(**pool, c.epoch, 0);
  }
  // The recovery's breakdown accounts for every chunk the checkpoint lists.
  for (const CheckpointInfo& c : *checkpoints) {
    auto table = RecoverTable(**pool, "emb.users", c.epoch);
    ASSERT_TRUE(table.ok());
    const RecoveryStats& stats = table->stats;
    EXPECT_EQ(stats.chunks_read, c.chunks);
    EXPECT_EQ(stats.baseline_bytes + stats.increment_bytes, c.chunk_bytes);
    EXPECT_GT(stats.baseline_bytes, 0u);
    EXPECT_GT(stats.baseline_seconds, 0.0);
    EXPECT_EQ(stats.increment_bytes == 0, c.chunks == 1);
    EXPECT_EQ(stats.increment_seconds == 0.0, c.chunks == 1);
  }
}

// A test name for `c`: the policy's name with '_' for '-', and `quantized`
// appended where the case quantizes.
std::string CaseName(const PolicyCase& c, const std::string& quantized) {
  std::string name = PolicyName(c.policy);
  for (char& ch : name) {
    if (ch == '-') ch = '_';
  }
  return name + (c.quantize ? quantized : "");
}

INSTANTIATE_TEST_SUITE_P(AllPolicies, PolicyTest,
                         ::testing::Values(PolicyCase{Policy::kFull, false},
                                           PolicyCase{Policy::kOneShotDifferential, false},
                                           PolicyCase{Policy::kConsecutiveIncremental, false},
                                           PolicyCase{Policy::kIntermittentDifferential, false},
                                           PolicyCase{Policy::kIncrCP, false},
                                           PolicyCase{Policy::kOneShotDifferential, true},
                                           PolicyCase{Policy::kIncrCP, true}),
                         [](const auto& info) { return CaseName(info.param, "_quantized"); });

TEST(DiffEngineTest, RestoreResumesTrainingAndLaterCheckpointsStayExact) {
  TempPoolPath path("diff-restore");
  EmbeddingOptions options;
  options.policy = Policy::kIncrCP;
  options.retain = 3;
  options.incrcp.duplicate_ratio_threshold = 0.0;
  {
    auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
    EmbeddingToy toy(kRows, kDim);
    auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
    ASSERT_TRUE(engine.ok());
    Train(**engine, *checkpointer, toy, 1, 6);
  }
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  EmbeddingToy toy(kRows, kDim);
  toy.Zero();
  auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  auto restored = (*engine)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 6u);
  EXPECT_EQ(toy.weights(), EmbeddingToy::ReferenceWeights(kRows, kDim, 6));
  EXPECT_EQ(toy.accumulator(), EmbeddingToy::ReferenceAccumulator(kRows, kDim, 6));
  Train(**engine, *checkpointer, toy, 7, 11);
  auto checkpoints = ListCheckpoints((*engine)->pool(), "emb.users");
  ASSERT_TRUE(checkpoints.ok());
  for (const CheckpointInfo& c : *checkpoints) ExpectTableAt((*engine)->pool(), c.epoch, 0);
}

// --- a multi-rank restore that rolls this rank's newest epoch back ---

// Runs body(rank, coordinator) on one thread per rank of a fresh group.
void OnRanks(int world,
             const std::function<void(int, std::shared_ptr<runtime::Coordinator>)>& body) {
  auto group = std::make_shared<testutil::ThreadGroup>(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { body(r, group->Rank(r)); });
  for (auto& t : threads) t.join();
}

class RolledBackEpochTest : public ::testing::TestWithParam<PolicyCase> {
 protected:
  EmbeddingOptions Embedding() const {
    return OptionsFor(GetParam(), 3);
  }
  // Quantized, the errors add up: training resumes from quantized rows at
  // each of the test's two restores, and the checkpoints after them
  // quantize again. Three 8-bit quantizations, half a step each at the most.
  double Tolerance() const { return GetParam().quantize ? 3 * 0.002 : 0.0; }

  // Opens rank r's engine on `toy` with a fresh encoder (the rank's own
  // process), restores if asked (checking the restored table), trains
  // [first, last] and closes.
  void RunRank(int r, std::shared_ptr<runtime::Coordinator> coordinator, EmbeddingToy& toy,
               std::optional<std::uint64_t> restore_expect, std::uint64_t first,
               std::uint64_t last) {
    const std::string rank = "rank " + std::to_string(r);
    auto checkpointer = std::make_shared<EmbeddingCheckpointer>(Embedding());
    runtime::EngineOptions options = Options(paths_[r]->path(), checkpointer);
    options.coordinator = std::move(coordinator);
    options.workers = 1;
    options.print_summary = false;
    auto engine = runtime::Engine::Open(options, toy.Registrations());
    ASSERT_TRUE(engine.ok()) << rank << ": " << engine.status().ToString();
    if (restore_expect) {
      auto restored = (*engine)->Restore();
      ASSERT_TRUE(restored.ok()) << rank << ": " << restored.status().ToString();
      EXPECT_EQ(restored->iteration, *restore_expect) << rank;
      const std::string what = rank + " restored iteration " + std::to_string(*restore_expect);
      ExpectNear(toy.weights(), EmbeddingToy::ReferenceWeights(kRows, kDim, *restore_expect),
                 what);
      EXPECT_EQ(toy.accumulator(),
                EmbeddingToy::ReferenceAccumulator(kRows, kDim, *restore_expect))
          << what;
    }
    RowTracker* tracker = checkpointer->tracker("emb.users");
    ASSERT_NE(tracker, nullptr);
    for (std::uint64_t k = first; k <= last; ++k) {
      Status stepped = toy.Step(**engine, *tracker, k);
      ASSERT_TRUE(stepped.ok()) << rank << " step " << k << ": " << stepped.ToString();
    }
    Status closed = (*engine)->Close();
    ASSERT_TRUE(closed.ok()) << rank << ": " << closed.ToString();
  }

  // Every rank's pool retains `iterations`, each once, and each recovers
  // its iteration's table.
  void ExpectRetained(int world, const std::vector<std::uint64_t>& iterations) const {
    for (int r = 0; r < world; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      auto pool = layout::Pool::Open(paths_[r]->path());
      ASSERT_TRUE(pool.ok()) << rank << ": " << pool.status().ToString();
      auto checkpoints = ListCheckpoints(**pool, "emb.users");
      ASSERT_TRUE(checkpoints.ok()) << rank << ": " << checkpoints.status().ToString();
      std::vector<std::uint64_t> listed;
      std::set<std::uint64_t> epochs;
      for (const CheckpointInfo& c : *checkpoints) {
        listed.push_back(c.iteration);
        epochs.insert(c.epoch);
      }
      EXPECT_EQ(listed, iterations) << rank;
      EXPECT_EQ(epochs.size(), checkpoints->size()) << rank << ": an epoch is listed twice";
      for (const CheckpointInfo& c : *checkpoints) {
        const std::string what = rank + " iteration " + std::to_string(c.iteration);
        auto table = RecoverTable(**pool, "emb.users", c.epoch);
        ASSERT_TRUE(table.ok()) << what << ": " << table.status().ToString();
        ExpectNear(table->tensors[0], EmbeddingToy::ReferenceWeights(kRows, kDim, c.iteration),
                   what);
        EXPECT_EQ(table->tensors[1], EmbeddingToy::ReferenceAccumulator(kRows, kDim, c.iteration))
            << what;
      }
    }
  }

  void ExpectNear(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) const {
    ASSERT_EQ(got.size(), want.size()) << what;
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
    }
    EXPECT_LE(worst, Tolerance()) << what;
  }

  std::vector<std::unique_ptr<TempPoolPath>> paths_;
};

// Rank 0 commits iteration 5 alone before the job dies; the ranks then
// restore iteration 4, rolling rank 0's epoch of iteration 5 back. Its
// table's next checkpoints must build on iteration 4's chunks, not on the
// discarded epoch's (whose chunks the pool frees and whose number the next
// epoch takes again).
TEST_P(RolledBackEpochTest, LaterCheckpointsBuildOnTheRestoredEpoch) {
  constexpr int kWorld = 2;
  for (int r = 0; r < kWorld; ++r) {
    paths_.push_back(std::make_unique<TempPoolPath>("diff-rollback-rank" + std::to_string(r)));
  }
  std::vector<std::unique_ptr<EmbeddingToy>> toys;
  for (int r = 0; r < kWorld; ++r) toys.push_back(std::make_unique<EmbeddingToy>(kRows, kDim));
  OnRanks(kWorld, [&](int r, std::shared_ptr<runtime::Coordinator> c) {
    RunRank(r, std::move(c), *toys[r], std::nullopt, 1, 4);
  });
  ASSERT_FALSE(HasFailure());
  RunRank(0, nullptr, *toys[0], std::nullopt, 5, 5);
  ASSERT_FALSE(HasFailure());
  {
    auto pool = layout::Pool::Open(paths_[0]->path());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    ASSERT_EQ((*pool)->Latest()->iteration(), 5u);
  }

  // The restarts: every value comes from the pools. The first rolls rank 0
  // back and commits one checkpoint over the dropped epoch's number.
  for (auto& toy : toys) toy->Zero();
  OnRanks(kWorld, [&](int r, std::shared_ptr<runtime::Coordinator> c) {
    RunRank(r, std::move(c), *toys[r], 4, 5, 5);
  });
  ASSERT_FALSE(HasFailure());
  ExpectRetained(kWorld, {3, 4, 5});
  for (auto& toy : toys) toy->Zero();
  OnRanks(kWorld, [&](int r, std::shared_ptr<runtime::Coordinator> c) {
    RunRank(r, std::move(c), *toys[r], 5, 6, 9);
  });
  ASSERT_FALSE(HasFailure());
  ExpectRetained(kWorld, {7, 8, 9});
  for (auto& toy : toys) toy->Zero();
  OnRanks(kWorld, [&](int r, std::shared_ptr<runtime::Coordinator> c) {
    RunRank(r, std::move(c), *toys[r], 9, 10, 9);
  });
}

INSTANTIATE_TEST_SUITE_P(EncodedPolicies, RolledBackEpochTest,
                         ::testing::Values(PolicyCase{Policy::kIncrCP, false},
                                           PolicyCase{Policy::kIntermittentDifferential, false},
                                           PolicyCase{Policy::kIntermittentDifferential, true},
                                           PolicyCase{Policy::kIncrCP, true}),
                         [](const auto& info) { return CaseName(info.param, "_quantized8"); });

TEST(DiffEngineTest, RetentionFreesChunksNoCheckpointNeeds) {
  TempPoolPath path("diff-retention");
  EmbeddingOptions options;
  options.policy = Policy::kFull;
  options.retain = 2;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  EmbeddingToy toy(kRows, kDim);
  auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok());
  Train(**engine, *checkpointer, toy, 1, 3);
  const std::uint64_t used_after_3 = (*engine)->pool().chunk_heap().used_bytes();
  Train(**engine, *checkpointer, toy, 4, 12);
  // Two retained full checkpoints plus one kept for the previous index:
  // the heap does not grow with the number of checkpoints.
  EXPECT_LE((*engine)->pool().chunk_heap().used_bytes(), used_after_3 + 4096);
  EXPECT_GT((*engine)->stats().encoded_bytes_written, 12u * kRows * kDim * 4);
}

// A table keeps its gather and image buffers between epochs (no memory
// faulted in again each epoch), counted once however many epochs reuse them.
TEST(DiffEngineTest, EncodeBuffersAreKeptBetweenEpochsAndCountedOnce) {
  TempPoolPath path("diff-kept-buffers");
  EmbeddingOptions options;
  options.policy = Policy::kFull;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  EmbeddingToy toy(kRows, kDim);
  auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ(checkpointer->kept_buffer_bytes(), 0u);
  Train(**engine, *checkpointer, toy, 1, 3);
  const std::uint64_t kept = checkpointer->kept_buffer_bytes();
  // The weights and the accumulator gathered, and the image built of them.
  EXPECT_GE(kept, 2 * kRows * (kDim + 1) * sizeof(float));
  EXPECT_LE(kept, std::uint64_t{64} << 20);
  Train(**engine, *checkpointer, toy, 4, 12);
  EXPECT_EQ(checkpointer->kept_buffer_bytes(), kept);
  for (std::uint64_t epoch = 11; epoch <= 12; ++epoch) ExpectTableAt((*engine)->pool(), epoch, 0);
}

TEST(DiffEngineTest, EncodedUnitWithoutEncoderIsRejected) {
  TempPoolPath path("diff-no-encoder");
  EmbeddingToy toy(kRows, kDim);
  runtime::EngineOptions options;
  options.pool_path = path.path();
  auto engine = runtime::Engine::Open(options, toy.Registrations());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(engine.status().message(), HasSubstr("emb.users"));
}

TEST(DiffEngineTest, OutOfRangeRowIdNamesTheTable) {
  RowTracker tracker("emb.items", 10);
  const std::int64_t ids[] = {3, 10};
  Status status = tracker.Mark(ids);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("emb.items"));
  EXPECT_EQ(tracker.marked().Count(), 0u);
}

TEST(DiffEngineTest, DamagedChunkIsCorruptionNamingTableAndCheckpoint) {
  TempPoolPath path("diff-corrupt");
  EmbeddingOptions options;
  options.policy = Policy::kOneShotDifferential;
  options.retain = 2;
  std::uint64_t victim = 0;
  std::uint64_t epoch = 0;
  {
    auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
    EmbeddingToy toy(kRows, kDim);
    auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
    ASSERT_TRUE(engine.ok());
    Train(**engine, *checkpointer, toy, 1, 4);
    auto checkpoints = ListCheckpoints((*engine)->pool(), "emb.users");
    ASSERT_TRUE(checkpoints.ok());
    epoch = checkpoints->back().epoch;
    for (const layout::ChunkInfo& chunk : (*engine)->pool().chunk_heap().List()) {
      if (chunk.epoch == epoch && (chunk.tag & 0xff) == 1) victim = chunk.id;  // its data chunk
    }
    ASSERT_NE(victim, 0u);
  }
  pmsnap::testing::FlipBit(path.path(), victim + 128 + 80, 4);
  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok());
  auto table = RecoverTable(**pool, "emb.users", epoch);
  EXPECT_EQ(table.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(table.status().message(),
              HasSubstr("table 'emb.users' checkpoint " + std::to_string(epoch)));
}

// Found by tests/fuzz/pool_open_fuzz.cc (an allocation of terabytes): a
// manifest rewritten under valid checksums to give the encoded table 2^40
// rows. Encoded units take no slot bytes, so the pool still opens; recovery
// allocated the whole table before reading a chunk. It must refuse a table
// that even 2-bit codes could not fit in the pool's chunk heap.
TEST(DiffEngineTest, TableTooLargeForTheChunkHeapIsCorruption) {
  TempPoolPath path("diff-huge-table");
  std::uint64_t header_offset = 0;
  layout::Manifest manifest;
  {
    auto checkpointer = std::make_shared<EmbeddingCheckpointer>(EmbeddingOptions{});
    EmbeddingToy toy(kRows, kDim);
    auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    Train(**engine, *checkpointer, toy, 1, 2);
    header_offset = (*engine)->pool().regions().header.offset;
    manifest = (*engine)->pool().manifest();
  }
  const std::optional<std::uint32_t> table = [&]() -> std::optional<std::uint32_t> {
    for (std::uint32_t u = 0; u < manifest.units.size(); ++u) {
      if (manifest.units[u].name == "emb.users") return u;
    }
    return std::nullopt;
  }();
  ASSERT_TRUE(table.has_value());
  for (layout::TensorSpec& tensor : manifest.units[*table].tensors) {
    tensor.shape[0] = std::int64_t{1} << 40;
  }
  pmsnap::testing::RewriteManifest(path.path(), header_offset, manifest);

  auto pool = layout::Pool::Open(path.path());
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  auto recovered = RecoverTable(**pool, "emb.users");
  EXPECT_EQ(recovered.status().code(), StatusCode::kCorruption);
  EXPECT_THAT(recovered.status().message(), HasSubstr("cannot fit the pool's chunk heap"));
  EXPECT_THAT(recovered.status().message(), HasSubstr("table 'emb.users'"));
}

TEST(DiffEngineTest, IntermittentPolicyTakesANewBaselineWhenDifferentialsGrow) {
  TempPoolPath path("diff-intermittent");
  EmbeddingOptions options;
  options.policy = Policy::kIntermittentDifferential;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  EmbeddingToy toy(kRows, kDim);
  auto engine = runtime::Engine::Open(Options(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok());
  RowTracker* tracker = checkpointer->tracker("emb.users");
  int fulls = 0;
  for (std::uint64_t k = 1; k <= 40; ++k) {
    ASSERT_TRUE(toy.Step(**engine, *tracker, k).ok());
    ASSERT_TRUE((*engine)->Flush().ok());
    fulls += checkpointer->last_checkpoint("emb.users").full ? 1 : 0;
  }
  // The first checkpoint, then at least one reset as F_c <= I_c kicks in.
  EXPECT_GE(fulls, 2);
  EXPECT_LT(fulls, 20);
}

TEST(PolicyRuleTest, IntermittentFollowsCheckNRunsPredictor) {
  const double small[] = {0.05, 0.08, 0.1};
  EXPECT_FALSE(detail::IntermittentTakesFull(small));  // F_c 1.23 > I_c 0.4
  const double grown[] = {0.4, 0.6, 0.7};
  EXPECT_TRUE(detail::IntermittentTakesFull(grown));  // F_c 2.7 <= I_c 2.8
  EXPECT_FALSE(detail::IntermittentTakesFull({}));
}

TEST(PolicyRuleTest, IncrCPResetsWhenIncrementsCostMoreThanABaseline) {
  // C_base 10 ms vs C_incre 2 ms + 1 MB / 1 GB/s = 3 ms: keep incrementing.
  EXPECT_FALSE(detail::IncrCPResetsBaseline(0.010, 0.002, 1'000'000, 1e9));
  // 20 MB of increments to replay: 22 ms > 10 ms, reset.
  EXPECT_TRUE(detail::IncrCPResetsBaseline(0.010, 0.002, 20'000'000, 1e9));
  EXPECT_FALSE(detail::IncrCPResetsBaseline(0.010, 0.002, 20'000'000, 0));
}

}  // namespace
}  // namespace pmsnap::diff
