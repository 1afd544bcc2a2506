// hooks_resume_trainer: the child process of hooks_resume_test. Trains the
// small MLP of hooks_test_util.h on deterministic data and writes the final
// parameters and optimizer state, raw, to --out.
//
//   --mode=reference   plain optimizer.step(), no pool: the uninterrupted run
//   --mode=train       CheckpointedOptimizer, a checkpoint every iteration
//                      (--policy=every1) or as often as possible
//                      (--policy=continuous); restores from --pool first if it
//                      holds a commit, including the data position and the
//                      RNG state (the model has dropout).
//
// Prints "restored K" once, then "step k STEP_NS NOW_NS" after every step
// (flushed): how long step k took and when it ended on the steady clock,
// which parent and child share, so the parent can time a kill by this
// machine's own step time. --linger: after the last step, print "done" and
// wait for the parent's kill instead of exiting, so that a kill drawn late
// still lands. Exit status 0 on success, 2 with a message on stderr otherwise.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "hooks_test_util.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/extra_state.h"
#include "pmsnap/workloads/state_dump.h"

namespace {

using pmsnap::Status;
using pmsnap::StatusCode;
using pmsnap::testing::Mlp;

struct Args {
  std::string mode;
  std::string optimizer;
  std::string pool;
  std::string out;
  std::string policy = "every1";
  std::uint64_t steps = 40;
  bool linger = false;
};

std::int64_t SteadyNanoseconds() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int Fail(const std::string& message) {
  std::cerr << "hooks_resume_trainer: " << message << std::endl;
  return 2;
}

// The final state for the parent's byte-for-byte comparison; 0 or Fail's 2.
int WriteState(const std::string& path, Mlp& model, torch::optim::Optimizer& optimizer) {
  const Status written = pmsnap::workloads::WriteStateDump(path, *model, optimizer);
  return written.ok() ? 0 : Fail(written.ToString());
}

int Run(const Args& args) {
  pmsnap::testing::UseOneTorchThread();
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  Mlp model = pmsnap::testing::MakeMlp(11, /*dropout=*/0.1);
  for (const auto& config : pmsnap::testing::AllOptimizerConfigs()) {
    if (config.name == args.optimizer) optimizer = config.make(model->parameters());
  }
  if (!optimizer) return Fail("unknown optimizer " + args.optimizer);

  if (args.mode == "reference") {
    for (std::uint64_t step = 1; step <= args.steps; ++step) {
      pmsnap::testing::ForwardBackward(model, *optimizer, step);
      optimizer->step();
    }
    return WriteState(args.out, model, *optimizer);
  }
  if (args.mode != "train") return Fail("unknown mode " + args.mode);

  pmsnap::runtime::EngineOptions options;
  options.pool_path = args.pool;
  if (args.policy == "every1") {
    options.policy = std::make_shared<pmsnap::runtime::EveryKPolicy>(1);
  } else if (args.policy != "continuous") {
    return Fail("unknown policy " + args.policy);
  }
  auto checkpointed = pmsnap::hooks::CheckpointedOptimizer::Create(*model, *optimizer, options);
  if (!checkpointed.ok()) return Fail(checkpointed.status().ToString());
  auto restored = (*checkpointed)->Restore();
  std::uint64_t done = 0;
  if (restored.ok()) {
    auto extra = pmsnap::hooks::UnpackExtraState(restored->extra_state);
    if (!extra.ok()) return Fail(extra.status().ToString());
    if (extra->data_position != restored->iteration) return Fail("data position mismatch");
    Status rng = pmsnap::hooks::RestoreCpuRngState(extra->rng_state);
    if (!rng.ok()) return Fail(rng.ToString());
    done = restored->iteration;
  } else if (restored.status().code() != StatusCode::kNotFound) {
    return Fail(restored.status().ToString());
  }
  std::printf("restored %llu\n", static_cast<unsigned long long>(done));
  std::fflush(stdout);

  for (std::uint64_t step = done + 1; step <= args.steps; ++step) {
    const std::int64_t step_start = SteadyNanoseconds();
    pmsnap::testing::ForwardBackward(model, *optimizer, step);
    pmsnap::hooks::ExtraState extra;
    extra.data_position = step;
    auto rng = pmsnap::hooks::CaptureCpuRngState();
    if (!rng.ok()) return Fail(rng.status().ToString());
    extra.rng_state = std::move(rng).value();
    Status status = (*checkpointed)->Step(pmsnap::hooks::PackExtraState(extra));
    if (!status.ok()) return Fail("step " + std::to_string(step) + ": " + status.ToString());
    const std::int64_t now = SteadyNanoseconds();
    std::printf("step %llu %lld %lld\n", static_cast<unsigned long long>(step),
                static_cast<long long>(now - step_start), static_cast<long long>(now));
    std::fflush(stdout);
  }
  Status closed = (*checkpointed)->Close();
  if (!closed.ok()) return Fail(closed.ToString());
  if (const int written = WriteState(args.out, model, *optimizer); written != 0) return written;
  if (args.linger) {
    std::printf("done\n");
    std::fflush(stdout);
    for (;;) ::pause();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const std::size_t n = std::strlen(flag);
      return arg.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--mode="))
      args.mode = v;
    else if (const char* v = value("--optimizer="))
      args.optimizer = v;
    else if (const char* v = value("--pool="))
      args.pool = v;
    else if (const char* v = value("--out="))
      args.out = v;
    else if (const char* v = value("--policy="))
      args.policy = v;
    else if (const char* v = value("--steps="))
      args.steps = std::stoull(v);
    else if (arg == "--linger")
      args.linger = true;
    else
      return Fail("unknown argument " + arg);
  }
  try {
    return Run(args);
  } catch (const std::exception& error) {
    return Fail(std::string("exception: ") + error.what());
  }
}
