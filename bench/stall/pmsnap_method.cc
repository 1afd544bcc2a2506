// pmsnap's row of the table: hooks::CheckpointedOptimizer (methods.h).
#include <algorithm>
#include <cstdio>
#include <utility>

#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "stall/methods.h"
#include "stall/workloads.h"

namespace pmsnap::bench::stall {

namespace {

// Method 5: pmsnap's CheckpointedOptimizer.
class Pmsnap final : public Method {
 public:
  static Result<std::unique_ptr<Pmsnap>> Create(Workload& w, runtime::EngineOptions options,
                                                std::size_t block_bytes, hooks::UpdateMode mode) {
    auto opt =
        hooks::CheckpointedOptimizer::Create(*w.module, *w.optimizer, std::move(options), {}, mode);
    if (!opt.ok()) return opt.status();
    (*opt)->set_optimizer_block_bytes(block_bytes);
    return std::unique_ptr<Pmsnap>(new Pmsnap(std::move(opt).value()));
  }
  Status Step(std::uint64_t) override {
    const std::uint64_t before = opt_->stats().bytes_written;
    Status s = opt_->Step();
    last_step_end_bytes_ = opt_->stats().bytes_written;
    bytes_written_in_step_ += last_step_end_bytes_ - before;
    return s;
  }
  void AfterBackward() override {
    if (last_step_end_bytes_ == kUnset) return;  // the first measured iteration
    bytes_written_in_backward_ += opt_->stats().bytes_written - last_step_end_bytes_;
  }
  void Mark() override {
    base_ = opt_->stats();
    bytes_written_in_backward_ = bytes_written_in_step_ = 0;
    last_step_end_bytes_ = kUnset;
  }
  Counters Read() override {
    const runtime::Stats s = opt_->stats();
    Counters c;
    c.stall.conflict = s.conflict_wait_seconds - base_.conflict_wait_seconds;
    c.stall.boundary = s.boundary_wait_seconds - base_.boundary_wait_seconds;
    c.stall.copy = s.in_device_copy_seconds - base_.in_device_copy_seconds;
    c.stall.hook = std::max(0.0, (s.blocked_seconds - base_.blocked_seconds) - c.stall.conflict -
                                     c.stall.boundary - c.stall.copy);
    c.commits = s.epochs_committed - base_.epochs_committed;
    c.bytes = s.bytes_written - base_.bytes_written;
    c.conflicts = s.conflicts - base_.conflicts;
    last_ = s;
    return c;
  }
  Status Finish() override {
    Status closed = opt_->Close();
    // Close drains the epochs still in flight: only now are the bytes held
    // for the last steps also counted as written.
    last_ = opt_->stats();
    return closed;
  }
  std::string Note() const override {
    std::uint64_t counts[5] = {0, 0, 0, 0, 0};
    for (const auto& u : last_.units)
      for (int i = 1; i <= 4; ++i) counts[i] += u.strategy_counts[i];
    // The workers' copy rate into the pool over the measured iterations:
    // slower copies mean longer overlap with training.
    double copy_seconds = 0;
    for (std::size_t u = 0; u < last_.units.size(); ++u)
      copy_seconds += last_.units[u].total_copy_seconds -
                      (u < base_.units.size() ? base_.units[u].total_copy_seconds : 0.0);
    const double copied = static_cast<double>(last_.bytes_written - base_.bytes_written);
    const double held = static_cast<double>(last_.held_bytes - base_.held_bytes);
    char b[300];
    std::snprintf(
        b, sizeof(b),
        "choices s1/s2/s3/s4 %llu/%llu/%llu/%llu, fallbacks %llu, copies %.1f GB/s, %.0f%% after "
        "the step, %.0f%% written during forward+backward, %.0f%% during the step",
        static_cast<unsigned long long>(counts[1]), static_cast<unsigned long long>(counts[2]),
        static_cast<unsigned long long>(counts[3]), static_cast<unsigned long long>(counts[4]),
        static_cast<unsigned long long>(last_.in_device_fallbacks),
        copy_seconds > 0 ? copied / copy_seconds / 1e9 : 0.0,
        copied > 0 ? 100 * held / copied : 0.0,
        copied > 0 ? 100 * static_cast<double>(bytes_written_in_backward_) / copied : 0.0,
        copied > 0 ? 100 * static_cast<double>(bytes_written_in_step_) / copied : 0.0);
    return b;
  }

 private:
  explicit Pmsnap(std::unique_ptr<hooks::CheckpointedOptimizer> opt) : opt_(std::move(opt)) {}
  static constexpr std::uint64_t kUnset = ~std::uint64_t{0};
  std::unique_ptr<hooks::CheckpointedOptimizer> opt_;
  runtime::Stats base_, last_;
  // Pool bytes written between one step's end and the next backward's end
  // (forward + backward: with UpdateMode::kInBackward, copies of this
  // iteration's updates too), and within Step.
  std::uint64_t bytes_written_in_backward_ = 0, bytes_written_in_step_ = 0;
  std::uint64_t last_step_end_bytes_ = kUnset;
};

}  // namespace

Result<std::unique_ptr<Method>> MakePmsnap(Workload& w, runtime::EngineOptions options,
                                           std::size_t block_bytes, bool update_in_backward) {
  PMSNAP_ASSIGN_OR_RETURN(auto method,
                          Pmsnap::Create(w, std::move(options), block_bytes,
                                         update_in_backward ? hooks::UpdateMode::kInBackward
                                                            : hooks::UpdateMode::kInStep));
  return std::unique_ptr<Method>(std::move(method));
}

}  // namespace pmsnap::bench::stall
