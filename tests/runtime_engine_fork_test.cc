// Engines and fork(): a child forked from a process that opened an engine
// gets a clear error naming the pool and the parent from Engine::Open and
// from the parent's engine, instead of waiting forever for oneTBB worker
// threads that fork() did not copy (also once the engines closed: oneTBB
// keeps its workers); the parent goes on checkpointing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>

#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/engine.h"
#include "testutil/engine_options.h"
#include "testutil/temp_pool.h"
#include "testutil/toy_model.h"

namespace pmsnap::runtime {
namespace {

using pmsnap::testing::EveryStep;
using pmsnap::testing::TempPoolPath;
using pmsnap::testing::ToyModel;
using ::testing::HasSubstr;

// Runs `child` in a forked process and returns its exit status (0: its
// checks passed). A hang becomes SIGALRM after a minute: a failure, not a
// stuck suite.
int InForkedChild(const std::function<int()>& child) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(60);
    _exit(child());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return 1000 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

std::uint64_t CommittedIteration(const std::string& path) {
  auto pool = layout::Pool::Open(path);
  if (!pool.ok()) return 0;
  auto latest = (*pool)->Latest();
  return latest.ok() ? latest->iteration() : 0;
}

TEST(EngineForkTest, AChildForkedWhileAnEngineIsOpenRefusesEnginesInsteadOfHanging) {
  TempPoolPath parent_pool("fork_parent"), child_pool("fork_child");
  ToyModel model(3, 4096);
  auto engine = Engine::Open(EveryStep(parent_pool.path()), model.Registrations());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  for (std::uint64_t k = 1; k <= 2; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());

  const int child = InForkedChild([&] {
    ToyModel other(2, 1024);
    auto opened = Engine::Open(EveryStep(child_pool.path()), other.Registrations());
    if (opened.ok() || opened.status().code() != StatusCode::kFailedPrecondition) return 2;
    const std::string& message = opened.status().message();
    if (message.find(child_pool.path()) == std::string::npos) return 3;
    if (message.find("forked from process " + std::to_string(getppid())) == std::string::npos) {
      return 4;
    }
    if (message.find("spawn") == std::string::npos) return 5;
    // The parent's engine: its hooks and Close refuse, and its destructor
    // (at the child's exit) must not hang either.
    if ((*engine)->BeginStep(3).code() != StatusCode::kFailedPrecondition) return 6;
    if ((*engine)->Flush().code() != StatusCode::kFailedPrecondition) return 7;
    if ((*engine)->Close().code() != StatusCode::kFailedPrecondition) return 8;
    engine->reset();
    return 0;
  });
  EXPECT_EQ(child, 0) << "1000+: killed by that signal (14: the child hung)";

  // The parent's engine is untouched by all that.
  for (std::uint64_t k = 3; k <= 4; ++k) ASSERT_TRUE(model.Step(**engine, k).ok());
  ASSERT_TRUE((*engine)->Close().ok());
  EXPECT_EQ(CommittedIteration(parent_pool.path()), 4u);
  EXPECT_EQ(CommittedIteration(child_pool.path()), 0u);
}

// oneTBB keeps the workers after the engines close: a child forked then
// hung 1 run in 3 without the guard, so it is refused too.
TEST(EngineForkTest, AChildForkedAfterTheEnginesClosedIsRefusedToo) {
  TempPoolPath parent_pool("fork_closed_parent"), child_pool("fork_closed_child");
  {
    ToyModel model(2, 2048);
    auto engine = Engine::Open(EveryStep(parent_pool.path()), model.Registrations());
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE(model.Step(**engine, 1).ok());
    ASSERT_TRUE((*engine)->Close().ok());
  }
  const int child = InForkedChild([&] {
    ToyModel other(2, 1024);
    auto opened = Engine::Open(EveryStep(child_pool.path()), other.Registrations());
    if (opened.ok() || opened.status().code() != StatusCode::kFailedPrecondition) return 2;
    return opened.status().message().find("(0 still open)") != std::string::npos ? 0 : 3;
  });
  EXPECT_EQ(child, 0) << "1000+: killed by that signal (14: the child hung)";
  EXPECT_EQ(CommittedIteration(child_pool.path()), 0u);
}

}  // namespace
}  // namespace pmsnap::runtime
