// LowDiffController (lowdiff_controller.h): LowDiff's full-checkpoint
// steps, retirement, Eq. 10 retuning and the ranks' agreement on them.
#include "pmsnap/diff/lowdiff_controller.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <utility>

namespace pmsnap::diff {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double MovingAverage(double old, double now) { return old == 0 ? now : 0.8 * old + 0.2 * now; }

// What a rank without a value proposes in a MIN all-reduce.
constexpr std::int64_t kNoProposal = std::numeric_limits<std::int64_t>::max();

Result<std::int64_t> MinOverRanks(runtime::Coordinator& coordinator, std::int64_t value,
                                  const char* what) {
  Status started = coordinator.StartMinAllReduce(std::span(&value, 1));
  Result<std::vector<std::int64_t>> agreed =
      started.ok() ? coordinator.FinishMinAllReduce() : Result<std::vector<std::int64_t>>(started);
  if (!agreed.ok() || agreed->size() != 1) {
    return Status(StatusCode::kInternal,
                  "LowDiff: rank " + std::to_string(coordinator.rank()) + ": agreeing on " + what +
                      " failed: " +
                      (agreed.ok() ? "the all-reduce returned " + std::to_string(agreed->size()) +
                                         " values for 1"
                                   : agreed.status().ToString()));
  }
  return agreed->front();
}

}  // namespace

Result<std::unique_ptr<LowDiffController>> LowDiffController::Create(
    const LowDiffControllerOptions& options, std::shared_ptr<runtime::Coordinator> agreement,
    SetFullInterval set_full_interval) {
  if (options.max_batch == 0 || options.initial_batch == 0 || options.initial_full_every == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiff: max_batch, initial_batch and initial_full_every must be >= 1");
  }
  if (!(options.mtbf_seconds > 0) || !std::isfinite(options.mtbf_seconds)) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiff: mtbf_seconds must be positive, got " +
                      std::to_string(options.mtbf_seconds));
  }
  if (!set_full_interval) {
    return Status(StatusCode::kInvalidArgument, "LowDiff: no way to set the full interval given");
  }
  return std::unique_ptr<LowDiffController>(
      new LowDiffController(options, std::move(agreement), std::move(set_full_interval)));
}

LowDiffController::LowDiffController(const LowDiffControllerOptions& options,
                                     std::shared_ptr<runtime::Coordinator> agreement,
                                     SetFullInterval set_full_interval)
    : options_(options),
      agreement_(std::move(agreement)),
      set_full_interval_(std::move(set_full_interval)),
      full_every_(options.full_every != 0 ? options.full_every : options.initial_full_every),
      batch_(options.batch != 0 ? options.batch : options.initial_batch) {}

Status LowDiffController::Attach(std::shared_ptr<DifferentialLog> log,
                                 std::optional<std::uint64_t> resume_after,
                                 std::optional<std::uint64_t> full_iteration) {
  log_ = std::move(log);
  // After a restore every rank counts from the same full checkpoint.
  if (full_iteration) anchor_ = last_full_ = *full_iteration;
  first_tune_step_ = resume_after.value_or(0) + kFirstTuneStep;
  return set_full_interval_(full_every_, anchor_);
}

Status LowDiffController::Observe(std::uint64_t iteration, double step_seconds,
                                  const FullCheckpointProgress& progress) {
  const double now = Now();
  merge_seconds_ = MovingAverage(merge_seconds_, step_seconds);
  if (last_observed_ > 0) iteration_seconds_ = MovingAverage(iteration_seconds_, now - last_observed_);
  last_observed_ = now;
  if (!log_) return Status::Ok();
  const bool full_step = iteration > anchor_ && (iteration - anchor_) % full_every_ == 0;
  if (full_step) {
    pending_full_ = iteration;  // its epoch commits in the background
    last_full_ = iteration;
  }
  RetireBehindCommittedFull(progress.last_committed_iteration);
  if (full_step || iteration == first_tune_step_) return Retune(progress);
  return Status::Ok();
}

void LowDiffController::RetireBehindCommittedFull(std::uint64_t committed) {
  if (!pending_full_ || committed < *pending_full_) return;
  pending_full_.reset();
  if (!full_iterations_.empty() && full_iterations_.back() == committed) return;
  full_iterations_.push_back(committed);
  // Keep what the second-newest full checkpoint needs (file comment). A
  // failed retirement keeps more than needed, which the next one frees.
  if (full_iterations_.size() >= 2) (void)log_->Retire(full_iterations_[full_iterations_.size() - 2]);
}

Result<std::optional<std::uint64_t>> LowDiffController::SmallestOverRanks(
    std::optional<std::uint64_t> value) {
  if (!agreement_ || agreement_->world_size() <= 1) return value;
  PMSNAP_ASSIGN_OR_RETURN(
      const std::int64_t smallest,
      MinOverRanks(*agreement_, value ? static_cast<std::int64_t>(*value) : kNoProposal,
                   "the tuned full interval and batch"));
  if (smallest == kNoProposal) return std::optional<std::uint64_t>();
  return std::optional<std::uint64_t>(static_cast<std::uint64_t>(smallest));
}

Status LowDiffController::Retune(const FullCheckpointProgress& progress) {
  std::optional<Configuration> config;
  std::optional<HeapBounds> bounds;
  // This rank's failure is returned after the agreement, which every rank
  // must join.
  Status failure = Status::Ok();
  const DifferentialLogStats log = log_->stats();
  const double differential_bytes = MeasuredDifferentialBytes(log, bytes_handed_);
  if (differential_bytes > 0 && log.heap_capacity_bytes > 0) {
    auto b = BoundsOfHeap(differential_bytes, log.heap_capacity_bytes, options_.max_batch);
    if (b.ok()) {
      bounds = *b;
    } else {
      failure = b.status();
    }
  }
  if (failure.ok() && progress.epochs_committed > 0 && progress.last_epoch_seconds > 0 &&
      iteration_seconds_ > 0) {
    ConfigurationInputs in;
    in.full_bytes = static_cast<double>(progress.bytes_written) / progress.epochs_committed;
    in.write_bandwidth = in.full_bytes / progress.last_epoch_seconds;
    in.merge_seconds = merge_seconds_;
    in.mtbf_seconds = options_.mtbf_seconds;
    in.iteration_seconds = iteration_seconds_;
    in.world_size = options_.world_size;
    auto c = OptimalConfiguration(in, bounds ? bounds->max_batch : options_.max_batch);
    if (c.ok()) {
      config = *c;
      tuned_ = true;
      config_ = *c;
      inputs_ = in;
    } else {
      failure = c.status();
      bounds.reset();
    }
  }
  if (!tunes_full_every() && !tunes_batch()) return failure;
  // The batch first (the heap's interval bound depends on it), then the
  // interval each rank's heap holds at that batch. Without a measured full
  // checkpoint (a resumed run): the values in force, still kept within the
  // heap.
  std::uint32_t batch = batch_;
  if (tunes_batch()) {
    std::optional<std::uint64_t> proposal;
    if (config) {
      proposal = config->batch;
    } else if (bounds) {
      proposal = std::min(batch_, bounds->max_batch);
    }
    PMSNAP_ASSIGN_OR_RETURN(const std::optional<std::uint64_t> agreed,
                            SmallestOverRanks(proposal));
    if (agreed) batch = static_cast<std::uint32_t>(*agreed);
  }
  std::optional<std::uint64_t> interval;
  if (config) interval = config->full_interval;
  if (bounds) {
    heap_max_full_every_ = bounds->MaxInterval(batch);
    interval = std::min(interval.value_or(full_every_), heap_max_full_every_);
  }
  if (tunes_full_every()) {
    PMSNAP_ASSIGN_OR_RETURN(interval, SmallestOverRanks(interval));
    if (interval && *interval != full_every_) {
      full_every_ = *interval;
      anchor_ = last_full_;  // the new interval counts from the latest full checkpoint
      PMSNAP_RETURN_IF_ERROR(set_full_interval_(full_every_, anchor_));
    }
  }
  if (batch != batch_) {
    batch_ = batch;
    PMSNAP_RETURN_IF_ERROR(log_->SetBatch(batch_));
  }
  return failure;
}

Result<std::uint64_t> LowDiffController::AgreeOnReplayReach(runtime::Coordinator* coordinator,
                                                            std::uint64_t full_iteration,
                                                            std::uint64_t available) {
  const std::uint64_t reach = full_iteration + available;
  if (coordinator == nullptr || coordinator->world_size() <= 1) return reach;
  PMSNAP_ASSIGN_OR_RETURN(const std::int64_t agreed,
                          MinOverRanks(*coordinator, static_cast<std::int64_t>(reach),
                                       "the iteration to replay to"));
  return static_cast<std::uint64_t>(agreed);
}

LowDiffControllerStats LowDiffController::stats() const {
  LowDiffControllerStats s;
  s.full_every = full_every_;
  s.batch = batch_;
  s.tuned = tuned_;
  s.heap_max_full_every = heap_max_full_every_;
  s.f_star = config_.f_star;
  s.b_star = config_.b_star;
  s.inputs = inputs_;
  s.bytes_handed = bytes_handed_;
  return s;
}

}  // namespace pmsnap::diff
