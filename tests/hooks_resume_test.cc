// End-to-end crash and resume through the libtorch hooks: a child process
// (hooks_resume_trainer) trains a small MLP, checkpointing every iteration;
// the parent SIGKILLs it at a random step; a fresh process restores from the
// pool and trains to step N. Its final parameters and optimizer state must
// be bitwise equal to an uninterrupted run with the plain optimizer.
//
// The children are separate executables (fork + exec via posix_spawn), so
// no libtorch thread pool is ever forked. The kill points come from
// PMSNAP_TEST_SEED (testutil/test_seed.h), printed with a failure.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/child_process.h"
#include "testutil/crash_trials.h"
#include "testutil/temp_pool.h"

namespace {

using pmsnap::testing::TempPoolPath;

constexpr std::uint64_t kSteps = 40;
constexpr int kKillPoints = 24;

// A running trainer with its stdout on a pipe.
pmsnap::ChildProcess Trainer(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {PMSNAP_HOOKS_TRAINER};
  argv.insert(argv.end(), args.begin(), args.end());
  return pmsnap::ChildProcess(std::move(argv));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs a trainer to completion; returns its exit status and its last
// "restored K" value in *restored.
int RunToEnd(const std::vector<std::string>& args, std::uint64_t* restored = nullptr) {
  pmsnap::ChildProcess trainer = Trainer(args);
  if (!trainer.started()) return -1000;
  std::string line;
  while (trainer.ReadLine(&line)) {
    if (restored && line.rfind("restored ", 0) == 0) *restored = std::stoull(line.substr(9));
  }
  return trainer.Wait();
}

class ResumeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    out_dir_ = pmsnap::PoolDirectory() + "/pmsnap-hooks-resume-" + std::to_string(getpid());
    std::filesystem::create_directories(out_dir_);
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(out_dir_); }

  // The uninterrupted plain-optimizer run's final state, once per optimizer.
  std::string Reference(const std::string& optimizer) {
    auto it = references_.find(optimizer);
    if (it != references_.end()) return it->second;
    const std::string out = out_dir_ + "/reference-" + optimizer;
    EXPECT_EQ(RunToEnd({"--mode=reference", "--optimizer=" + optimizer,
                        "--steps=" + std::to_string(kSteps), "--out=" + out}),
              0);
    std::string bytes = ReadFile(out);
    EXPECT_FALSE(bytes.empty());
    return references_[optimizer] = bytes;
  }

  static std::string out_dir_;
  static std::map<std::string, std::string> references_;
};
std::string ResumeTest::out_dir_;
std::map<std::string, std::string> ResumeTest::references_;

TEST_F(ResumeTest, KilledAtRandomStepsResumesBitwiseEqualToUninterruptedRun) {
  std::mt19937_64 rng(pmsnap::testing::TestSeed(/*salt=*/91));
  const std::vector<std::string> optimizers = {
      "SgdMomentum",           "Adam", "AdamW", "Adagrad", "RmspropCenteredMomentum",
      "SgdNesterovWeightDecay"};
  const int kill_points = pmsnap::testing::CrashTrialCount(kKillPoints);
  for (int point = 0; point < kill_points; ++point) {
    const std::string optimizer = optimizers[point % optimizers.size()];
    const std::string policy = point % 2 == 0 ? "every1" : "continuous";
    const std::uint64_t kill_step = 1 + rng() % (kSteps - 2);
    // Kills land 0..2 of this machine's own step times after step kill_step
    // ended: inside the next step's update, its checkpoint, or between steps,
    // on a fast machine and a slow one alike.
    const double steps_later = std::uniform_real_distribution<double>(0.0, 2.0)(rng);
    SCOPED_TRACE(optimizer + " " + policy + " kill " + std::to_string(steps_later) +
                 " steps after step " + std::to_string(kill_step));
    const std::string reference = Reference(optimizer);
    TempPoolPath pool("hooks-resume");
    const std::string out = out_dir_ + "/resumed-" + std::to_string(point);
    const std::vector<std::string> args = {
        "--mode=train",       "--optimizer=" + optimizer,
        "--policy=" + policy, "--pool=" + pool.path(),
        "--out=" + out,       "--steps=" + std::to_string(kSteps)};
    std::uint64_t last_reported = 0;
    {
      std::vector<std::string> victim_args = args;
      victim_args.push_back("--linger");  // a late kill still finds it
      pmsnap::ChildProcess victim = Trainer(victim_args);
      ASSERT_TRUE(victim.started());
      std::string line;
      while (victim.ReadLine(&line)) {
        if (line == "done") {
          victim.Kill();
          break;
        }
        unsigned long long step = 0;
        long long step_ns = 0;
        long long ended_ns = 0;
        if (std::sscanf(line.c_str(), "step %llu %lld %lld", &step, &step_ns, &ended_ns) != 3) {
          continue;
        }
        last_reported = step;
        if (last_reported >= kill_step) {
          const auto kill_at = std::chrono::steady_clock::time_point(
              std::chrono::nanoseconds(ended_ns + static_cast<long long>(steps_later * step_ns)));
          std::this_thread::sleep_until(kill_at);
          victim.Kill();
          break;
        }
      }
      EXPECT_EQ(victim.Wait(), -SIGKILL) << "the trainer ended on its own";
    }
    std::uint64_t restored = 0;
    ASSERT_EQ(RunToEnd(args, &restored), 0);
    EXPECT_LE(restored, kSteps);
    if (policy == "every1") {
      // Step k begins only after epoch k-1 committed.
      EXPECT_GE(restored + 1, last_reported);
    }
    EXPECT_TRUE(ReadFile(out) == reference) << "final state differs after restoring " << restored;
  }
}

TEST_F(ResumeTest, UninterruptedCheckpointedRunEqualsPlainOptimizer) {
  TempPoolPath pool("hooks-resume-clean");
  const std::string out = out_dir_ + "/clean";
  ASSERT_EQ(RunToEnd({"--mode=train", "--optimizer=Adam", "--pool=" + pool.path(), "--out=" + out,
                      "--steps=" + std::to_string(kSteps)}),
            0);
  EXPECT_TRUE(ReadFile(out) == Reference("Adam"));
  // A second process finds the finished run and has nothing left to do.
  std::uint64_t restored = 0;
  ASSERT_EQ(RunToEnd({"--mode=train", "--optimizer=Adam", "--pool=" + pool.path(), "--out=" + out,
                      "--steps=" + std::to_string(kSteps)},
                     &restored),
            0);
  EXPECT_EQ(restored, kSteps);
  EXPECT_TRUE(ReadFile(out) == Reference("Adam"));
}

}  // namespace
