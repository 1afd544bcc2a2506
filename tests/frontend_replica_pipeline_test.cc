// LowDiff+'s schedule (frontend::ReplicaPipeline), the one place both front
// ends take it from, driven by plain threads without torch: a gradient is
// claimed once per iteration, the step names what was not handed over,
// iteration t's copy waits until the replica applied t - 2 (two buffers),
// the first error ends every wait, and closing finishes or drops what the
// replica has not applied.
#include "pmsnap/frontend/replica_pipeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace pmsnap::frontend {
namespace {

using ::testing::HasSubstr;

ReplicaPipeline ThreeParameters(std::uint64_t iteration = 0) {
  return ReplicaPipeline({"fc.weight", "fc.bias", "head.weight"}, "/dev/shm/run.pool", iteration);
}

// Claims and queues `indices` as one hand-over, as an adapter does.
std::uint64_t HandOver(ReplicaPipeline& pipeline, std::vector<std::size_t> indices) {
  auto iteration = pipeline.Claim(indices);
  EXPECT_TRUE(iteration.ok()) << iteration.status().ToString();
  pipeline.Queue(indices, *iteration);
  return *iteration;
}

TEST(ReplicaPipelineTest, AGradientIsClaimedOncePerIterationAndAMissingOneIsNamed) {
  ReplicaPipeline pipeline = ThreeParameters(4);
  EXPECT_EQ(HandOver(pipeline, {0}), 5u);
  auto second = pipeline.Claim(std::vector<std::size_t>{1, 0});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(second.status().message(), HasSubstr("'fc.weight' got a second gradient"));
  // Nothing of a refused claim was taken: fc.bias can still be handed over.
  auto twice_in_one = pipeline.Claim(std::vector<std::size_t>{1, 1});
  ASSERT_FALSE(twice_in_one.ok());
  EXPECT_THAT(twice_in_one.status().message(), HasSubstr("'fc.bias' got a second gradient"));
  auto out_of_range = pipeline.Claim(std::vector<std::size_t>{3});
  ASSERT_FALSE(out_of_range.ok());
  EXPECT_THAT(out_of_range.status().message(), HasSubstr("out of range (3 parameters)"));

  Status missing = pipeline.CheckHandedOver({true, true, true});
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(missing.message(), HasSubstr("'fc.bias', 'head.weight'"));
  EXPECT_THAT(missing.message(), HasSubstr("/dev/shm/run.pool"));
  EXPECT_TRUE(pipeline.CheckHandedOver({true, false, false}).ok());
}

TEST(ReplicaPipelineTest, TheCopyOfIterationTWaitsUntilTheReplicaAppliedTMinusTwo) {
  ReplicaPipeline pipeline = ThreeParameters();
  std::atomic<std::uint64_t> copied_iteration{0};
  std::thread snapshot([&] {
    while (auto copies = pipeline.NextCopies()) {
      copied_iteration = copies->front().iteration;
      pipeline.CopiesDone(copies->size(), 8 * copies->size());
    }
  });
  // Iterations 1 and 2 need no replica progress (buffers 1 and 0 are free).
  for (std::uint64_t t = 1; t <= 2; ++t) {
    EXPECT_EQ(HandOver(pipeline, {0, 1}), t);
    auto finished = pipeline.FinishStep();
    ASSERT_TRUE(finished.ok());
    EXPECT_EQ(*finished, t);
    pipeline.Release(t);
  }
  // Iteration 3 reuses iteration 1's buffer: its copy waits for the replica.
  EXPECT_EQ(HandOver(pipeline, {0}), 3u);
  std::atomic<bool> stepped{false};
  std::thread training([&] {
    auto finished = pipeline.FinishStep();
    EXPECT_TRUE(finished.ok());
    stepped = true;
  });
  // The replica takes iterations in order; until it applied 1, iteration 3
  // is neither copied nor stepped (however long this thread waits).
  auto first = pipeline.NextIteration();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->iteration, 1u);
  EXPECT_TRUE(first->apply);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(copied_iteration.load(), 2u);
  EXPECT_FALSE(stepped.load());
  pipeline.Applied(1);
  training.join();
  EXPECT_TRUE(stepped.load());
  EXPECT_EQ(copied_iteration.load(), 3u);
  pipeline.Release(3);

  const ReplicaPipelineStats stats = pipeline.stats();
  EXPECT_EQ(stats.iterations, 3u);
  EXPECT_EQ(stats.replica_iteration, 1u);
  EXPECT_EQ(stats.gradient_bytes_snapshotted, 8u * 5);
  // Finishing waits for the replica to apply 2 and 3.
  std::thread replica([&] {
    while (auto next = pipeline.NextIteration()) pipeline.Applied(next->iteration);
  });
  Status waited;
  EXPECT_TRUE(pipeline.Close(/*finish=*/true, &waited));
  EXPECT_TRUE(waited.ok());
  EXPECT_EQ(pipeline.stats().replica_iteration, 3u);
  EXPECT_FALSE(pipeline.Close(true, &waited)) << "a second close does nothing";
  snapshot.join();
  replica.join();
  EXPECT_EQ(pipeline.Claim(std::vector<std::size_t>{0}).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST(ReplicaPipelineTest, TheFirstErrorEndsEveryWaitAndTheReplicaSkipsTheRest) {
  ReplicaPipeline pipeline = ThreeParameters();
  HandOver(pipeline, {2});
  // No snapshot thread: the step would wait forever for its copy, until a
  // thread fails.
  std::thread failing([&] {
    pipeline.RecordError(Status(StatusCode::kNoSpace, "replica pool full"));
    pipeline.RecordError(Status(StatusCode::kInternal, "a later error"));
  });
  auto finished = pipeline.FinishStep();
  failing.join();
  ASSERT_FALSE(finished.ok());
  EXPECT_EQ(finished.status().code(), StatusCode::kNoSpace);
  EXPECT_EQ(pipeline.WaitForReplica(100).code(), StatusCode::kNoSpace);
  EXPECT_EQ(pipeline.CheckHandedOver({false, false, false}).code(), StatusCode::kNoSpace);
  pipeline.Release(7);
  auto next = pipeline.NextIteration();
  ASSERT_TRUE(next.has_value());
  EXPECT_FALSE(next->apply);
  Status waited;
  EXPECT_TRUE(pipeline.Close(true, &waited));
  EXPECT_EQ(waited.code(), StatusCode::kNoSpace);
  EXPECT_FALSE(pipeline.NextCopies().has_value());
}

TEST(ReplicaPipelineTest, AbandoningDropsWhatTheReplicaHasNotTaken) {
  ReplicaPipeline pipeline = ThreeParameters(10);
  pipeline.Release(11);
  pipeline.Release(12);
  EXPECT_TRUE(pipeline.Close(/*finish=*/false, nullptr));
  EXPECT_FALSE(pipeline.NextIteration().has_value());
  EXPECT_EQ(pipeline.stats().replica_iteration, 10u);
}

TEST(ReplicaPipelineTest, ARestoreMovesTrainingAndReplicaTogether) {
  ReplicaPipeline pipeline = ThreeParameters();
  pipeline.Restored(42);
  EXPECT_EQ(pipeline.iteration(), 42u);
  EXPECT_TRUE(pipeline.WaitForReplica(42).ok());
  EXPECT_EQ(HandOver(pipeline, {1}), 43u);
}

}  // namespace
}  // namespace pmsnap::frontend
