// LowDiff's differential log (diff::DifferentialLog) from C++: an engine
// takes full checkpoints every K steps, the log takes every step's gradient
// as a differential in batches of b; after a simulated crash, recovery
// restores the full checkpoint and replays the differentials bit-exact. Also:
// the loss bound of batched writes, truncation of a crashed run's tail on
// resume, retention, Eq. 10 against a hand computation, parallel against
// sequential merge, and bad configurations.
#include "pmsnap/diff/differential_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "pmsnap/runtime/engine.h"
#include "pmsnap/runtime/interval_policy.h"
#include "testutil/temp_pool.h"

namespace pmsnap::diff {
namespace {

using pmsnap::testing::TempPoolPath;
using ::testing::HasSubstr;

constexpr std::int64_t kWeights = 4096;
constexpr float kLr = 0.05f;

// The "gradient" of step k: deterministic, different every step.
std::vector<float> Gradient(std::uint64_t k) {
  std::mt19937 rng(static_cast<std::uint32_t>(k));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> g(kWeights);
  for (float& v : g) v = dist(rng);
  return g;
}

// The optimizer step, used by training and by replay alike.
void ApplySgd(std::vector<float>& w, const float* g) {
  for (std::size_t i = 0; i < w.size(); ++i) w[i] -= kLr * g[i];
}

struct Trainer {
  std::vector<float> w = std::vector<float>(kWeights, 0.5f);

  std::vector<runtime::UnitRegistration> Units() {
    return {{"w", {{"param", w.data(), layout::DType::kFloat32, {kWeights}}}}};
  }
  static runtime::EngineOptions Options(const std::string& path, std::uint64_t every) {
    runtime::EngineOptions options;
    options.pool_path = path;
    options.pool_options.chunk_heap_bytes = 64ull << 20;
    options.policy = std::make_shared<runtime::EveryKPolicy>(every);
    return options;
  }
  // Step k: the gradient goes to the log (by reference, waited for before
  // the buffer is dropped), then the update runs between the engine hooks.
  void Step(runtime::Engine& engine, DifferentialLog& log, std::uint64_t k) {
    std::vector<float> g = Gradient(k);
    ASSERT_TRUE(log.Append(k, {{1, {kWeights}, reinterpret_cast<const std::byte*>(g.data()),
                                g.size() * sizeof(float)}})
                    .ok());
    ASSERT_TRUE(engine.BeginStep(k).ok());
    ASSERT_TRUE(engine.BeforeUpdate(0).ok());
    ApplySgd(w, g.data());
    ASSERT_TRUE(engine.AfterUpdate(0).ok());
    ASSERT_TRUE(engine.EndStep({}).ok());
    ASSERT_TRUE(log.WaitCopied(k).ok());  // `g` dies here
  }
};

DifferentialLogOptions Batch(std::uint32_t batch,
                             std::optional<std::uint64_t> resume_after = std::nullopt) {
  DifferentialLogOptions options;
  options.batch = batch;
  options.resume_after = resume_after;
  return options;
}

std::vector<float> ReferenceAfter(std::uint64_t steps) {
  Trainer t;
  for (std::uint64_t k = 1; k <= steps; ++k) ApplySgd(t.w, Gradient(k).data());
  return t.w;
}

// Restores the newest full checkpoint into a fresh trainer and replays the
// log; returns the iteration reached.
std::uint64_t Recover(const std::string& path, Trainer& fresh) {
  auto engine = runtime::Engine::Open(Trainer::Options(path, 1), fresh.Units());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  auto restored = (*engine)->Restore();
  EXPECT_TRUE(restored.ok()) << restored.status().ToString();
  auto diffs = ReadDifferentials((*engine)->pool(), restored->iteration);
  EXPECT_TRUE(diffs.ok()) << diffs.status().ToString();
  std::uint64_t reached = restored->iteration;
  for (const Differential& d : *diffs) {
    EXPECT_EQ(d.iteration, reached + 1);
    EXPECT_EQ(d.pieces.size(), 1u);
    EXPECT_EQ(d.pieces[0].shape, std::vector<std::int64_t>{kWeights});
    ApplySgd(fresh.w, reinterpret_cast<const float*>(d.pieces[0].bytes.data()));
    reached = d.iteration;
  }
  EXPECT_TRUE((*engine)->Close(runtime::CloseMode::kAbandon).ok());
  return reached;
}

TEST(DifferentialLogTest, FullCheckpointPlusReplayedDifferentialsEqualsTrainingBitExact) {
  TempPoolPath path("lowdiff-replay");
  constexpr std::uint64_t kSteps = 23;
  {
    Trainer t;
    auto engine = runtime::Engine::Open(Trainer::Options(path.path(), 5), t.Units());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto log = DifferentialLog::Open((*engine)->pool(), Batch(3));
    ASSERT_TRUE(log.ok()) << log.status().ToString();
    for (std::uint64_t k = 1; k <= kSteps; ++k) t.Step(**engine, **log, k);
    ASSERT_TRUE((*log)->Close().ok());
    ASSERT_TRUE((*engine)->Close().ok());
    EXPECT_EQ((*log)->stats().durable, kSteps);
  }
  Trainer fresh;
  EXPECT_EQ(Recover(path.path(), fresh), kSteps);
  const std::vector<float> want = ReferenceAfter(kSteps);
  EXPECT_EQ(std::memcmp(fresh.w.data(), want.data(), want.size() * sizeof(float)), 0);
}

TEST(DifferentialLogTest, CrashLosesAtMostTheBatchSizeMinusOneBufferedDifferentials) {
  for (std::uint32_t batch : {1u, 4u, 7u}) {
    TempPoolPath path("lowdiff-loss");
    const std::uint64_t steps = 3 * batch + batch / 2 + 1;
    {
      Trainer t;
      auto engine = runtime::Engine::Open(Trainer::Options(path.path(), 1000), t.Units());
      ASSERT_TRUE(engine.ok());
      auto log = DifferentialLog::Open((*engine)->pool(), Batch(batch));
      ASSERT_TRUE(log.ok());
      for (std::uint64_t k = 1; k <= steps; ++k) {
        t.Step(**engine, **log, k);
        // After every step the bound holds: what is not durable is buffered.
        const DifferentialLogStats s = (*log)->stats();
        ASSERT_LE(k - s.durable, batch - 1) << "b=" << batch << " step " << k;
        ASSERT_EQ(s.max_loss, batch - 1);
      }
      // The crash: the log dies without Close, the engine abandons.
      log->reset();
      ASSERT_TRUE((*engine)->Close(runtime::CloseMode::kAbandon).ok());
    }
    auto pool = layout::Pool::Open(path.path());
    ASSERT_TRUE(pool.ok());
    auto diffs = ReadDifferentials(**pool, 0);
    ASSERT_TRUE(diffs.ok()) << diffs.status().ToString();
    const std::uint64_t lost = steps - diffs->size();
    EXPECT_LE(lost, batch - 1) << "b=" << batch;
    EXPECT_EQ(diffs->size() % batch, 0u) << "only whole batches are written";
  }
}

TEST(DifferentialLogTest, ResumeDropsTheCrashedRunsDifferentialsAfterTheReplayPoint) {
  TempPoolPath path("lowdiff-resume");
  Trainer t;
  auto engine = runtime::Engine::Open(Trainer::Options(path.path(), 1000), t.Units());
  ASSERT_TRUE(engine.ok());
  {
    auto log = DifferentialLog::Open((*engine)->pool(), Batch(4));
    ASSERT_TRUE(log.ok());
    for (std::uint64_t k = 1; k <= 12; ++k) t.Step(**engine, **log, k);
    ASSERT_TRUE((*log)->Close().ok());
  }
  // Another rank held only 6: this rank resumes after 6 with other gradients.
  auto log = DifferentialLog::Open((*engine)->pool(), Batch(4, 6));
  ASSERT_TRUE(log.ok());
  auto reached = NewestReplayableIteration((*engine)->pool(), 0);
  ASSERT_TRUE(reached.ok());
  EXPECT_EQ(*reached, 6u);
  std::vector<float> other(kWeights, 7.0f);
  ASSERT_TRUE((*log)->Append(7, {{1, {kWeights}, reinterpret_cast<const std::byte*>(other.data()),
                                  other.size() * sizeof(float)}})
                  .ok());
  ASSERT_TRUE((*log)->Close().ok());
  auto diffs = ReadDifferentials((*engine)->pool(), 0);
  ASSERT_TRUE(diffs.ok());
  ASSERT_EQ(diffs->size(), 7u);
  EXPECT_EQ(std::memcmp((*diffs)[6].pieces[0].bytes.data(), other.data(), kWeights * 4), 0);
  const std::vector<float> g6 = Gradient(6);
  EXPECT_EQ(std::memcmp((*diffs)[5].pieces[0].bytes.data(), g6.data(), kWeights * 4), 0);
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(DifferentialLogTest, RetireFreesChunksAFullCheckpointMadeUseless) {
  TempPoolPath path("lowdiff-retire");
  Trainer t;
  auto engine = runtime::Engine::Open(Trainer::Options(path.path(), 1000), t.Units());
  ASSERT_TRUE(engine.ok());
  auto log = DifferentialLog::Open((*engine)->pool(), Batch(2));
  ASSERT_TRUE(log.ok());
  for (std::uint64_t k = 1; k <= 10; ++k) t.Step(**engine, **log, k);
  EXPECT_EQ((*log)->stats().live_chunks, 5u);
  ASSERT_TRUE((*log)->Retire(7).ok());  // chunks [1,2] [3,4] [5,6] go; [7,8] keeps 8
  EXPECT_EQ((*log)->stats().live_chunks, 2u);
  EXPECT_EQ((*log)->stats().chunks_freed, 3u);
  auto diffs = ReadDifferentials((*engine)->pool(), 7);
  ASSERT_TRUE(diffs.ok());
  ASSERT_EQ(diffs->size(), 3u);
  EXPECT_EQ((*diffs)[0].iteration, 8u);
  ASSERT_TRUE((*log)->Close().ok());
  ASSERT_TRUE((*engine)->Close().ok());
}

TEST(DifferentialLogTest, OptimalConfigurationMatchesEquationTenByHand) {
  ConfigurationInputs in;
  in.write_bandwidth = 2e9;  // 2 GB/s
  in.full_bytes = 1.2e9;     // 1.2 GB
  in.merge_seconds = 0.05;
  in.mtbf_seconds = 3600;
  in.iteration_seconds = 0.5;
  in.world_size = 8;
  // By hand, in iterations: W = 1e9 B/it, R_D = 0.1 it, M = 7200 it.
  // f* = cbrt(0.1 * 1e18 / (4 * 1.44e18 * 5.184e7)) = cbrt(3.3490e-10) = 6.944444e-4
  // b* = cbrt(2 * 1.2e9 * 0.1 * 7200 / 1e9) = cbrt(1728) = 12
  auto c = OptimalConfiguration(in);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_NEAR(c->f_star, 6.944444e-4, 1e-9);
  EXPECT_NEAR(c->b_star, 12.0, 1e-9);
  EXPECT_EQ(c->batch, 12u);
  EXPECT_EQ(c->full_interval, 1440u);  // round(1 / 6.9442e-4)
  // (f*, b*) is the minimum of Eq. 8: any step away wastes more.
  const double best = WastedSeconds(in, c->f_star, c->b_star, 86400);
  for (double df : {0.8, 1.25}) {
    for (double db : {0.8, 1.25}) {
      EXPECT_GT(WastedSeconds(in, c->f_star * df, c->b_star * db, 86400), best);
    }
  }
  // Eq. 8 by hand at f = 1/100, b = 4, T = 1 day (172800 it), N = 8:
  // 8 * 172800 / 7200 * (2 + 0 + 0.05 * 24) + 8 * 172800 * 1.2e9 * 0.01 / 1e9 = 614.4 + 16588.8
  EXPECT_NEAR(WastedSeconds(in, 0.01, 4, 86400), (614.4 + 16588.8) * 0.5, 1e-6);
  in.merge_seconds = 0;
  auto bad = OptimalConfiguration(in);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("merge time R_D"));
}

TEST(DifferentialLogTest, HeapBoundsKeepTheRetainedDifferentialsWithinTheChunkHeap) {
  // 7000-byte differentials in a 1 MiB heap. A chunk of b is charged
  // 7000 b + 144 (chunk and allocation headers), in 4 KiB units up to 64 KiB
  // and in 256 KiB chunks above.
  auto bounds = BoundsOfHeap(7000, 1 << 20);
  ASSERT_TRUE(bounds.ok()) << bounds.status().ToString();
  // b = 9: 63144 -> 64 KiB = heap / 16; b = 10: 70144 -> 256 KiB.
  EXPECT_EQ(bounds->max_batch, 9u);
  // Retained: up to 3 I + b differentials (two full intervals, and a third
  // while the newest full checkpoint commits). b = 9: 768 KiB / 64 KiB = 12
  // chunks, 10 beside the filling one and a truncation mark:
  // 3 I + 9 <= 90 -> I = 27.
  EXPECT_EQ(bounds->MaxInterval(9), 27u);
  // b = 4: 28144 -> 28 KiB; 27 chunks, 25 retained: 3 I + 4 <= 100 -> I = 32.
  EXPECT_EQ(bounds->MaxInterval(4), 32u);
  // b = 20 (fixed above the bound): one 256 KiB chunk retained at most.
  EXPECT_EQ(bounds->MaxInterval(20), 1u);
  // A smaller max_batch asked for is kept.
  EXPECT_EQ(BoundsOfHeap(7000, 1 << 20, 4)->max_batch, 4u);
  // Absurd sizes: no overflow, the smallest bounds; a huge max_batch is
  // searched, not walked.
  auto huge = BoundsOfHeap(1e30, 1 << 20, 4'000'000'000u);
  ASSERT_TRUE(huge.ok());
  EXPECT_EQ(huge->max_batch, 1u);
  EXPECT_EQ(huge->MaxInterval(1), 1u);
  EXPECT_EQ(BoundsOfHeap(1, 1ull << 40, 4'000'000'000u)->MaxInterval(1), 1u << 20);

  DifferentialLogStats log;
  EXPECT_EQ(MeasuredDifferentialBytes(log, 0), 0);
  log.appended = 4;
  EXPECT_EQ(MeasuredDifferentialBytes(log, 24000), 6000);  // pieces' bytes before any chunk
  log.durable = 6;
  log.bytes_written = 90000;  // a large first chunk (a warm-up of dense gradients)
  log.last_chunk_bytes = 21300;
  log.last_chunk_differentials = 3;
  EXPECT_EQ(MeasuredDifferentialBytes(log, 24000), 7100);  // then the newest chunk's payload
  auto bad = BoundsOfHeap(0, 1 << 20);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("positive differential size"));
}

TEST(DifferentialLogTest, ParallelMergeEqualsSequentialWhereSumsAreExact) {
  for (std::size_t n : {1u, 2u, 5u, 8u, 13u}) {
    std::mt19937 rng(static_cast<std::uint32_t>(n));
    std::uniform_int_distribution<int> ints(-1000, 1000);
    // Multiples of 2^-10 with small magnitude: every partial sum is exact.
    std::vector<std::vector<float>> deltas(n, std::vector<float>(1000));
    for (auto& d : deltas) {
      for (float& v : d) v = std::ldexp(static_cast<float>(ints(rng)), -10);
    }
    std::vector<std::span<const float>> spans(deltas.begin(), deltas.end());
    std::vector<float> seq(1000, 3.0f), par(1000, 3.0f);
    MergeSequential(seq, spans);
    const std::uint32_t levels = MergeParallel(par, spans, 4);
    EXPECT_EQ(std::memcmp(seq.data(), par.data(), seq.size() * 4), 0) << "n=" << n;
    EXPECT_EQ(levels, static_cast<std::uint32_t>(std::ceil(std::log2(n))) + 1) << "n=" << n;
  }
}

TEST(DifferentialLogTest, BadConfigurationsAreRejectedWithThePoolNamed) {
  TempPoolPath path("lowdiff-bad");
  Trainer t;
  runtime::EngineOptions options = Trainer::Options(path.path(), 1);
  options.pool_options.chunk_heap_bytes = 0;
  auto engine = runtime::Engine::Open(std::move(options), t.Units());
  ASSERT_TRUE(engine.ok());
  auto no_heap = DifferentialLog::Open((*engine)->pool(), {});
  ASSERT_FALSE(no_heap.ok());
  EXPECT_EQ(no_heap.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_heap.status().message(), HasSubstr(path.path()));
  ASSERT_TRUE((*engine)->Close().ok());

  TempPoolPath path2("lowdiff-bad2");
  auto engine2 = runtime::Engine::Open(Trainer::Options(path2.path(), 1), t.Units());
  ASSERT_TRUE(engine2.ok());
  EXPECT_EQ(DifferentialLog::Open((*engine2)->pool(), Batch(0)).status().code(),
            StatusCode::kInvalidArgument);
  auto log = DifferentialLog::Open((*engine2)->pool(), {});
  ASSERT_TRUE(log.ok());
  ASSERT_TRUE((*log)->Append(5, {}).ok());
  Status gap = (*log)->Append(7, {});
  EXPECT_EQ(gap.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(gap.message(), HasSubstr("iteration 7 appended after 5"));
  ASSERT_TRUE((*log)->Close().ok());
  // After Close every call says so ([architecture2]: SetBatch, WaitCopied and
  // WaitWritten returned OK).
  for (const Status& late : {(*log)->Append(6, {}), (*log)->WaitCopied(5), (*log)->WaitWritten(),
                             (*log)->Flush(), (*log)->SetBatch(2), (*log)->Close()}) {
    EXPECT_EQ(late.code(), StatusCode::kFailedPrecondition) << late.ToString();
    EXPECT_THAT(late.message(), HasSubstr("is closed"));
  }
  ASSERT_TRUE((*engine2)->Close().ok());
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the engine's workers are threads
  EXPECT_DEATH(
      {
        // The death test's child runs this test again up to here and never
        // runs its destructors: it removes its own pools before it dies.
        std::filesystem::remove(path.path());
        std::filesystem::remove(path2.path());
        (void)(*engine2)->pool();
      },
      "Engine::pool\\(\\) called after Close");
}

}  // namespace
}  // namespace pmsnap::diff
