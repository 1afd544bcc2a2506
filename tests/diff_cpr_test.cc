// CPR (partial recovery for recommendation models): PLS accounting (Eq. 3)
// against a hand computation over a scripted failure sequence, the interval
// choice (Eq. 4) and the full/partial decision (Eq. 1-2), the ledger's
// persistent image, and the CPR-MFU / CPR-SSU policies: MFU saves the most
// used rows, SSU's list never exceeds r*N, both through the engine's pipeline
// and the pool's chunk heap.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "pmsnap/diff/cpr.h"
#include "pmsnap/diff/embedding_checkpointer.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/temp_pool.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

// --- Eq. 3 ---

TEST(CprPlsTest, LedgerMatchesAHandComputationOfEquation3) {
  // S_total = 10,000 samples over N_emb = 4 shards.
  cpr::PlsLedger ledger(10000, 4);
  EXPECT_EQ(ledger.pls(), 0.0);
  // Failure 1 at S = 2,500: one shard, last saved at 2,000: 500 / 40,000.
  const std::uint64_t first[] = {2000};
  ASSERT_TRUE(ledger.RecordFailure(2500, first).ok());
  EXPECT_DOUBLE_EQ(ledger.pls(), 500.0 / 40000.0);
  // Failure 2 at S = 6,000: two shards, saved at 5,000 and 4,000:
  // (1,000 + 2,000) / 40,000.
  const std::uint64_t second[] = {5000, 4000};
  ASSERT_TRUE(ledger.RecordFailure(6000, second).ok());
  // Failure 3 at S = 9,000 of a shard saved right then: nothing lost.
  const std::uint64_t third[] = {9000};
  ASSERT_TRUE(ledger.RecordFailure(9000, third).ok());
  const double expected = 0.0125 + 0.075;
  EXPECT_DOUBLE_EQ(ledger.pls(), expected);
  EXPECT_EQ(ledger.lost_samples(), 3500u);
  EXPECT_EQ(ledger.failed_shards(), 4u);
  ASSERT_EQ(ledger.failures().size(), 3u);
  EXPECT_DOUBLE_EQ(ledger.failures()[0].pls_after, 0.0125);
  EXPECT_EQ(ledger.failures()[1].lost_samples, 3000u);
  EXPECT_EQ(ledger.failures()[1].failed_shards, 2u);
}

TEST(CprPlsTest, ImpossibleFailuresAreRejectedAndLeaveTheLedgerUnchanged) {
  cpr::PlsLedger ledger(1000, 2);
  const std::uint64_t later_save[] = {600};
  EXPECT_THAT(ledger.RecordFailure(500, later_save).message(), HasSubstr("after the failure"));
  const std::uint64_t three[] = {1, 2, 3};
  EXPECT_THAT(ledger.RecordFailure(500, three).message(), HasSubstr("there are 2"));
  EXPECT_EQ(ledger.pls(), 0.0);
  EXPECT_TRUE(ledger.failures().empty());
  cpr::PlsLedger unset;
  const std::uint64_t one[] = {0};
  EXPECT_EQ(unset.RecordFailure(10, one).code(), StatusCode::kInvalidArgument);
}

TEST(CprPlsTest, LedgerImageRoundTripsAndIsFoundInsideAnExtraStateBlob) {
  cpr::PlsLedger ledger(5000, 8);
  const std::uint64_t saves[] = {100, 200};
  ASSERT_TRUE(ledger.RecordFailure(1000, saves).ok());
  const std::vector<std::byte> image = ledger.Serialize();
  auto parsed = cpr::PlsLedger::Parse(image);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_DOUBLE_EQ(parsed->pls(), ledger.pls());
  EXPECT_EQ(parsed->total_samples(), 5000u);
  EXPECT_EQ(parsed->emb_shards(), 8u);
  ASSERT_EQ(parsed->failures().size(), 1u);
  EXPECT_EQ(parsed->failures()[0].lost_samples, 1700u);

  // Embedded in other bytes (a pickled dict around it).
  std::vector<std::byte> blob(37 + image.size() + 11, std::byte{0x5a});
  std::memcpy(blob.data() + 37, image.data(), image.size());
  auto found = cpr::FindPlsLedger(blob);
  ASSERT_TRUE(found.has_value());
  EXPECT_DOUBLE_EQ(found->pls(), ledger.pls());

  // One flipped byte: the checksum refuses it, and nothing is "found".
  std::vector<std::byte> damaged = image;
  damaged[40] ^= std::byte{0x10};
  EXPECT_EQ(cpr::PlsLedger::Parse(damaged).status().code(), StatusCode::kCorruption);
  EXPECT_THAT(cpr::PlsLedger::Parse(damaged).status().message(), HasSubstr("checksum"));
  EXPECT_FALSE(cpr::FindPlsLedger(damaged).has_value());
  EXPECT_FALSE(cpr::FindPlsLedger(std::span<const std::byte>(image).first(30)).has_value());
}

// --- Eq. 4 and the decision ---

TEST(CprPlanTest, IntervalFollowsEquation4) {
  // T_save = 2 * PLS * N_emb * T_fail.
  EXPECT_DOUBLE_EQ(cpr::SaveIntervalForPls(0.1, 8, 28.0), 2 * 0.1 * 8 * 28.0);
  EXPECT_DOUBLE_EQ(cpr::SaveIntervalForPls(0.02, 18, 10.0), 7.2);
  // Its inverse gives the target back.
  EXPECT_DOUBLE_EQ(cpr::ExpectedPls(cpr::SaveIntervalForPls(0.1, 8, 28.0), 8, 28.0), 0.1);
}

TEST(CprPlanTest, PartialRecoveryIsChosenWhenItsOverheadIsLower) {
  // The paper's emulation, scaled to hours: 56 h job, 2 failures (T_fail
  // 28 h), 4 shards, O_save 0.25 h, O_load 0.1 h, O_res 0.2 h.
  cpr::CostModel cost{0.25, 0.1, 0.2, 28.0, 56.0};
  auto plan = cpr::PlanRecovery(cost, 0.1, 4);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const double t_part = 2 * 0.1 * 4 * 28.0;  // 22.4 h
  const double t_full = std::sqrt(2 * 0.25 * 28.0);
  EXPECT_DOUBLE_EQ(plan->partial_interval, t_part);
  EXPECT_DOUBLE_EQ(plan->full_interval, t_full);
  // Eq. 2 and Eq. 1 by hand.
  EXPECT_DOUBLE_EQ(plan->partial_overhead, 0.25 * 56 / t_part + (0.1 + 0.2) * 56 / 28.0);
  EXPECT_DOUBLE_EQ(plan->full_overhead,
                   0.25 * 56 / t_full + (0.1 + t_full / 2 + 0.2) * 56 / 28.0);
  EXPECT_TRUE(plan->partial);
  EXPECT_DOUBLE_EQ(plan->save_interval, t_part);
  EXPECT_DOUBLE_EQ(plan->expected_pls, 0.1);
  EXPECT_THAT(plan->reason, HasSubstr("partial recovery"));
}

TEST(CprPlanTest, FallsBackToFullRecoveryWhenPartialBringsNoBenefit) {
  // A tiny target PLS forces saves so frequent that their cost exceeds what
  // dropping the lost computation saves.
  cpr::CostModel cost{0.25, 0.1, 0.2, 28.0, 56.0};
  auto plan = cpr::PlanRecovery(cost, 0.001, 1);
  ASSERT_TRUE(plan.ok());
  const double t_part = 2 * 0.001 * 1 * 28.0;
  EXPECT_DOUBLE_EQ(plan->partial_interval, t_part);
  EXPECT_GT(plan->partial_overhead, plan->full_overhead);
  EXPECT_FALSE(plan->partial);
  EXPECT_DOUBLE_EQ(plan->save_interval, plan->full_interval);
  EXPECT_THAT(plan->reason, HasSubstr("full recovery (fallback)"));
  // Just below the required margin also falls back: partial must save 5%.
  cpr::CostModel close{1.0, 0.0, 0.0, 10.0, 100.0};
  const double full = cpr::FullRecoveryOverhead(close, cpr::OptimalFullRecoveryInterval(close));
  // Pick the PLS whose partial overhead is 97% of full's: O_save T / T_part.
  const double t_part_close = 100.0 / (0.97 * full);
  auto marginal = cpr::PlanRecovery(close, t_part_close / (2 * 10.0), 1);
  ASSERT_TRUE(marginal.ok());
  EXPECT_NEAR(marginal->partial_overhead / marginal->full_overhead, 0.97, 1e-9);
  EXPECT_FALSE(marginal->partial);
  EXPECT_TRUE(cpr::PlanRecovery(close, t_part_close / (2 * 10.0), 1, 0.0)->partial);
}

TEST(CprPlanTest, InvalidInputsNameTheField) {
  cpr::CostModel cost{0.25, 0.1, 0.2, 28.0, 56.0};
  EXPECT_THAT(cpr::PlanRecovery(cost, 0, 4).status().message(), HasSubstr("target PLS"));
  EXPECT_THAT(cpr::PlanRecovery(cost, 0.1, 0).status().message(), HasSubstr("shard"));
  cost.mean_time_to_failure = 0;
  EXPECT_THAT(cpr::PlanRecovery(cost, 0.1, 4).status().message(), HasSubstr("time to failure"));
}

// --- access records ---

TEST(CprAccessRecordTest, MfuTakesTheMostUsedRowsAndClearsTheirCounters) {
  RowTracker tracker("emb.t", 100);
  ASSERT_TRUE(tracker.EnableAccessRecord(AccessRecord::kMostFrequentlyUsed, 3, 1, 0).ok());
  // Row 7 used 5 times, 3 four times, 50 three times, 9 and 60 twice, 1 once.
  const std::vector<std::int64_t> ids = {7, 3, 50, 7, 9, 3, 7, 50, 60, 3, 7, 1, 50, 9, 3, 7, 60};
  ASSERT_TRUE(tracker.Mark(ids).ok());
  EXPECT_EQ(tracker.access_count(7), 5u);
  PriorityTake take = tracker.TakePriorityRows();
  EXPECT_EQ(take.rows, (std::vector<std::uint64_t>{3, 7, 50}));
  EXPECT_EQ(tracker.access_count(7), 0u);
  // The rest keep their counts: 9 and 60 (tie: both fit), then 1.
  EXPECT_EQ(tracker.TakePriorityRows().rows, (std::vector<std::uint64_t>{1, 9, 60}));
  EXPECT_TRUE(tracker.TakePriorityRows().rows.empty());
  // A tie at the cut goes to the lower id.
  const std::vector<std::int64_t> tie = {40, 41, 42, 43};
  ASSERT_TRUE(tracker.Mark(tie).ok());
  EXPECT_EQ(tracker.TakePriorityRows().rows, (std::vector<std::uint64_t>{40, 41, 42}));
  EXPECT_EQ(tracker.access_record_bytes(), 100u * 4);
}

TEST(CprAccessRecordTest, SsuListNeverExceedsItsCapacity) {
  const std::uint64_t rows = 5000, capacity = 625;  // r = 0.125
  RowTracker tracker("emb.t", rows);
  ASSERT_TRUE(tracker.EnableAccessRecord(AccessRecord::kSubSampledUsed, capacity, 2, 42).ok());
  // 4 bytes per list entry and one membership bit per row.
  EXPECT_EQ(tracker.access_record_bytes(), capacity * 4 + (rows + 63) / 64 * 8);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0, 1);
  std::uint64_t most = 0;
  for (int batch = 0; batch < 200; ++batch) {
    std::vector<std::int64_t> ids;
    for (int i = 0; i < 128; ++i) {
      // Zipf-like: hot low ids, a long tail over the whole table.
      ids.push_back(static_cast<std::int64_t>(rows * std::pow(u(rng), 3)));
    }
    ASSERT_TRUE(tracker.Mark(ids).ok());
    ASSERT_LE(tracker.sampled_rows(), capacity) << "batch " << batch;
    most = std::max(most, tracker.sampled_rows());
    if (batch % 50 == 49) {
      PriorityTake take = tracker.TakePriorityRows();
      ASSERT_LE(take.rows.size(), capacity);
      // No duplicates, ascending.
      for (std::size_t i = 1; i < take.rows.size(); ++i) ASSERT_LT(take.rows[i - 1], take.rows[i]);
      EXPECT_EQ(tracker.sampled_rows(), 0u);
    }
  }
  EXPECT_EQ(most, capacity) << "the stream overflows the list: eviction must have run";
  // The high-pass effect: the hottest row stays in the list far more often
  // than a tail row would.
  int hot_kept = 0;
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<std::int64_t> ids;
    for (int i = 0; i < 4000; ++i) ids.push_back(static_cast<std::int64_t>(rows * std::pow(u(rng), 3)));
    ASSERT_TRUE(tracker.Mark(ids).ok());
    PriorityTake take = tracker.TakePriorityRows();
    hot_kept += std::binary_search(take.rows.begin(), take.rows.end(), 0) ? 1 : 0;
  }
  EXPECT_GE(hot_kept, 15);
}

// --- through the engine and the chunk heap ---

// A 100-row, 4-wide table plus a dense unit; step k adds 1 to every row it
// looks up (once per distinct row).
struct PriorityToy {
  static constexpr std::uint64_t kRows = 100;
  static constexpr std::uint32_t kDim = 4;
  std::vector<float> table = std::vector<float>(kRows * kDim, 0.0f);
  std::vector<float> dense = std::vector<float>(8, 0.0f);

  std::vector<runtime::UnitRegistration> Registrations() {
    return {{"dense", {{"param", dense.data(), layout::DType::kFloat32, {8}}}, false},
            {"emb.t",
             {{"weight", table.data(), layout::DType::kFloat32,
               {static_cast<std::int64_t>(kRows), kDim}}},
             true}};
  }
  Status Step(runtime::Engine& engine, RowTracker& tracker, std::uint64_t k,
              const std::vector<std::int64_t>& ids) {
    PMSNAP_RETURN_IF_ERROR(tracker.Mark(ids));
    PMSNAP_RETURN_IF_ERROR(engine.BeginStep(k));
    PMSNAP_RETURN_IF_ERROR(engine.BeforeUpdate(1));
    std::vector<bool> seen(kRows, false);
    for (std::int64_t id : ids) {
      if (seen[id]) continue;
      seen[id] = true;
      for (std::uint32_t d = 0; d < kDim; ++d) table[id * kDim + d] += 1.0f;
    }
    PMSNAP_RETURN_IF_ERROR(engine.AfterUpdate(1));
    PMSNAP_RETURN_IF_ERROR(engine.BeforeUpdate(0));
    dense[0] += 1.0f;
    PMSNAP_RETURN_IF_ERROR(engine.AfterUpdate(0));
    PMSNAP_RETURN_IF_ERROR(engine.EndStep({}));
    return engine.Flush();
  }
};

runtime::EngineOptions PriorityOptionsFor(const std::string& path,
                                          std::shared_ptr<EmbeddingCheckpointer> checkpointer) {
  runtime::EngineOptions options;
  options.pool_path = path;
  options.policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.encoder = std::move(checkpointer);
  return options;
}

TEST(CprPolicyTest, MfuCheckpointHoldsTheMostUsedRowsThroughThePipeline) {
  TempPoolPath path("cpr-mfu");
  EmbeddingOptions options;
  options.policy = Policy::kMostFrequentlyUsed;
  options.priority.ratio = 0.05;  // 5 rows per checkpoint
  options.retain = 3;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  PriorityToy toy;
  auto engine =
      runtime::Engine::Open(PriorityOptionsFor(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RowTracker* tracker = checkpointer->tracker("emb.t");
  ASSERT_NE(tracker, nullptr);
  ASSERT_EQ(tracker->access_record(), AccessRecord::kMostFrequentlyUsed);
  // Step 1: the baseline (every row).
  ASSERT_TRUE(toy.Step(**engine, *tracker, 1, {0, 1}).ok());
  EXPECT_TRUE(checkpointer->last_checkpoint("emb.t").full);
  // Step 2: 7 rows used 5, 4, 3, 2, 1, 1, 1 times: the checkpoint saves the
  // 5 most used (the tie at the cut to the lower id) and not rows 15, 16.
  ASSERT_TRUE(toy.Step(**engine, *tracker, 2,
                       {10, 10, 10, 10, 10, 11, 11, 11, 11, 12, 12, 12, 13, 13, 14, 15, 16})
                  .ok());
  TableCheckpointStats stats = checkpointer->last_checkpoint("emb.t");
  EXPECT_FALSE(stats.full);
  EXPECT_EQ(stats.rows_written, 5u);
  EXPECT_EQ(stats.access_record_bytes, PriorityToy::kRows * 4);
  auto at2 = RecoverTable((*engine)->pool(), "emb.t");
  ASSERT_TRUE(at2.ok()) << at2.status().ToString();
  EXPECT_EQ(at2->iteration, 2u);
  for (std::uint64_t row : {10, 11, 12, 13, 14}) {
    EXPECT_EQ(at2->tensors[0][row * 4], 1.0f) << "row " << row << " is among the 5 most used";
  }
  for (std::uint64_t row : {15, 16}) {
    EXPECT_EQ(at2->tensors[0][row * 4], 0.0f) << "row " << row << " keeps its saved value";
  }
  EXPECT_EQ(at2->tensors[0][0], 1.0f);  // from the baseline
  // Step 3 uses row 20 once; 15 and 16 still hold their counts: all three saved.
  ASSERT_TRUE(toy.Step(**engine, *tracker, 3, {20}).ok());
  EXPECT_EQ(checkpointer->last_checkpoint("emb.t").rows_written, 3u);
  auto at3 = RecoverTable((*engine)->pool(), "emb.t");
  ASSERT_TRUE(at3.ok());
  EXPECT_EQ(at3->tensors[0], toy.table) << "every changed row has been saved by now";
  ASSERT_TRUE((*engine)->Close().ok());
  // A restarted process's engine restore applies the chain.
  std::fill(toy.table.begin(), toy.table.end(), -7.0f);
  auto reopened = runtime::Engine::Open(
      PriorityOptionsFor(path.path(), std::make_shared<EmbeddingCheckpointer>(options)),
      toy.Registrations());
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  auto restored = (*reopened)->Restore();
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(restored->iteration, 3u);
  EXPECT_EQ(toy.table, at3->tensors[0]);
  ASSERT_TRUE((*reopened)->Close().ok());
}

TEST(CprPolicyTest, SsuCheckpointsNeverWriteMoreThanRTimesNRows) {
  TempPoolPath path("cpr-ssu");
  EmbeddingOptions options;
  options.policy = Policy::kSubSampledUsed;
  options.priority.ratio = 0.1;  // 10 rows
  options.priority.baseline_every = 1000;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  PriorityToy toy;
  auto engine =
      runtime::Engine::Open(PriorityOptionsFor(path.path(), checkpointer), toy.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RowTracker* tracker = checkpointer->tracker("emb.t");
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<std::int64_t> any(0, PriorityToy::kRows - 1);
  std::uint64_t most = 0;
  for (std::uint64_t k = 1; k <= 12; ++k) {
    std::vector<std::int64_t> ids;
    for (int i = 0; i < 80; ++i) ids.push_back(any(rng));
    ASSERT_TRUE(toy.Step(**engine, *tracker, k, ids).ok());
    const TableCheckpointStats stats = checkpointer->last_checkpoint("emb.t");
    if (k > 1) {
      EXPECT_FALSE(stats.full);
      ASSERT_LE(stats.rows_written, 10u) << "step " << k;
      most = std::max(most, stats.rows_written);
      EXPECT_GT(stats.access_record_bytes, 0u);
    }
  }
  EXPECT_EQ(most, 10u) << "40 sampled lookups per step overflow a 10-row list";
  // Every saved row holds the value it had when it was saved: rebuilt
  // values are whole numbers no larger than the live ones.
  auto table = RecoverTable((*engine)->pool(), "emb.t");
  ASSERT_TRUE(table.ok()) << table.status().ToString();
  for (std::size_t i = 0; i < toy.table.size(); ++i) {
    ASSERT_LE(table->tensors[0][i], toy.table[i]);
  }
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(CprPolicyTest, ARatioOutsideZeroToOneIsRejectedNamingTheTable) {
  TempPoolPath path("cpr-bad");
  EmbeddingOptions options;
  options.policy = Policy::kMostFrequentlyUsed;
  options.priority.ratio = 1.5;
  auto checkpointer = std::make_shared<EmbeddingCheckpointer>(options);
  PriorityToy toy;
  auto engine =
      runtime::Engine::Open(PriorityOptionsFor(path.path(), checkpointer), toy.Registrations());
  ASSERT_FALSE(engine.ok());
  EXPECT_THAT(engine.status().message(), HasSubstr("emb.t"));
  EXPECT_THAT(engine.status().message(), HasSubstr("cpr-mfu"));
}

}  // namespace
}  // namespace pmsnap::diff
