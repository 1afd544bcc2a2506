// LowDiffController: LowDiff's orchestration (paper 002, section V) below
// both front ends, so that each rule exists once (docs/ARCHITECTURE.md,
// "LowDiff"). hooks::LowDiff (libtorch) and pmsnap.LowDiff (Python) supply
// the tensors, the compression and the replay; the controller decides:
//
//  - when full checkpoints come: at anchor + k * full_every, the anchor
//    moving to the latest full checkpoint whenever the interval changes, set
//    through the adapter's SetFullInterval (runtime::EveryKPolicy::set_every);
//  - what the differential log may free: once a full checkpoint committed,
//    every differential older than the second-newest one (a rank may have to
//    roll back to it: a damaged slot, another rank one checkpoint behind);
//  - Eq. 10's interval and batch within the chunk heap (diff::HeapBounds),
//    first kFirstTuneStep steps after the start or the restored iteration,
//    then at every full checkpoint's step; with several ranks the batch is
//    the smallest any rank proposes, then the interval the smallest any rank
//    proposes for that batch (MIN all-reduces over the agreement
//    coordinator: the steps are the same on every rank, so every rank's
//    engine asks for the same full checkpoints);
//  - how far a restore replays: the newest iteration every rank holds.
//
//   LowDiffController controller(options, agreement, set_full_interval);
//   // after the first step opened the pool (or after a restore replayed):
//   controller.Attach(log, resume_after, full_iteration);
//   for (...) {
//     controller.CountHanded(bytes);      // each differential's piece bytes
//     ... append, step ...
//     controller.Observe(iteration, step_seconds, progress);
//   }
//
// Thread-safety: one thread (the training thread) calls every method. The
// agreement coordinator must not be one with an all-reduce of its own in
// flight across steps (the engine's is: give the controller its own group).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "pmsnap/common/status.h"
#include "pmsnap/diff/differential_log.h"
#include "pmsnap/runtime/coordinator.h"

namespace pmsnap::diff {

struct LowDiffControllerOptions {
  // Full checkpoint every full_every steps; 0: tuned (initial_full_every
  // until the first tuning).
  std::uint64_t full_every = 0;
  std::uint64_t initial_full_every = 50;
  // Differentials per chunk (b); 0: tuned (initial_batch until then), at
  // most max_batch.
  std::uint32_t batch = 0;
  std::uint32_t initial_batch = 4;
  std::uint32_t max_batch = 64;
  double mtbf_seconds = 3600;  // M of Eq. 8-10
  std::uint32_t world_size = 1;  // N of Eq. 8-10
};

// What the engine reports of its full checkpoints (runtime::Stats fields).
struct FullCheckpointProgress {
  std::uint64_t last_committed_iteration = 0;
  std::uint64_t epochs_committed = 0;
  std::uint64_t bytes_written = 0;
  double last_epoch_seconds = 0;
};

struct LowDiffControllerStats {
  std::uint64_t full_every = 0;  // in force
  std::uint32_t batch = 0;       // b in force
  bool tuned = false;            // f_star, b_star and inputs are set
  // The longest full interval the chunk heap holds at the measured
  // differential size; tuned values stay within it. 0: not measured yet.
  std::uint64_t heap_max_full_every = 0;
  double f_star = 0;
  double b_star = 0;
  ConfigurationInputs inputs;      // what the last tuning measured
  std::uint64_t bytes_handed = 0;  // CountHanded's total
};

class LowDiffController {
 public:
  // Sets the engine's full-checkpoint steps: anchor + every, anchor + 2
  // every, ... Called on the training thread from Attach and Observe.
  using SetFullInterval = std::function<Status(std::uint64_t every, std::uint64_t anchor)>;

  // Eq. 10 is first applied this many steps after the start or the
  // restored iteration (the first full checkpoint has usually committed by
  // then: W and S are measured).
  static constexpr std::uint64_t kFirstTuneStep = 10;

  // kInvalidArgument for a max_batch, initial_batch or initial_full_every of
  // 0, or a non-positive MTBF. `agreement` may be null (one rank, or values
  // fixed by the options); it is shared, and must outlive no one.
  static Result<std::unique_ptr<LowDiffController>> Create(
      const LowDiffControllerOptions& options, std::shared_ptr<runtime::Coordinator> agreement,
      SetFullInterval set_full_interval);

  // The log differentials go to from now on (shared with the adapter, which
  // appends to it), after the first step's full checkpoint or after a
  // restore that reached `resume_after` from the full checkpoint of
  // `full_iteration`. Sets the engine's interval; SetFullInterval's error.
  Status Attach(std::shared_ptr<DifferentialLog> log, std::optional<std::uint64_t> resume_after,
                std::optional<std::uint64_t> full_iteration);
  // The log, or null before Attach / after Detach.
  const std::shared_ptr<DifferentialLog>& log() const { return log_; }
  // Drops the controller's reference to the log (the adapter closes it).
  void Detach() { log_.reset(); }

  // Bytes of the pieces of a differential handed to the log (measures the
  // differential size before its first chunk is sealed).
  void CountHanded(std::uint64_t bytes) { bytes_handed_ += bytes; }

  // After the step of `iteration` (the engine's count) that took
  // `step_seconds` of optimizer and checkpoint work: moves the measured
  // averages, notes a full checkpoint step, retires what a committed full
  // checkpoint no longer needs and retunes at the tuning steps. Every rank
  // calls it at every step (the retuning all-reduces). Returns this rank's
  // first error after the agreement (a tuning formula's, the log's, an
  // all-reduce's naming the rank).
  Status Observe(std::uint64_t iteration, double step_seconds,
                 const FullCheckpointProgress& progress);

  // The iteration a restore replays to: the smallest `full_iteration +
  // available` over the ranks of `coordinator` (null: one rank). A
  // collective; the coordinator's error naming the rank.
  static Result<std::uint64_t> AgreeOnReplayReach(runtime::Coordinator* coordinator,
                                                  std::uint64_t full_iteration,
                                                  std::uint64_t available);

  std::uint64_t full_every() const { return full_every_; }
  std::uint32_t batch() const { return batch_; }
  bool tunes_full_every() const { return options_.full_every == 0; }
  bool tunes_batch() const { return options_.batch == 0; }
  LowDiffControllerStats stats() const;

 private:
  LowDiffController(const LowDiffControllerOptions& options,
                    std::shared_ptr<runtime::Coordinator> agreement,
                    SetFullInterval set_full_interval);
  void RetireBehindCommittedFull(std::uint64_t committed);
  Status Retune(const FullCheckpointProgress& progress);
  // MIN over the agreement's ranks (nullopt: none proposed); alone: value.
  Result<std::optional<std::uint64_t>> SmallestOverRanks(std::optional<std::uint64_t> value);

  LowDiffControllerOptions options_;
  std::shared_ptr<runtime::Coordinator> agreement_;
  SetFullInterval set_full_interval_;
  std::shared_ptr<DifferentialLog> log_;
  std::uint64_t full_every_;
  std::uint32_t batch_;
  std::uint64_t first_tune_step_ = kFirstTuneStep;
  // Full checkpoints come at anchor_ + k * full_every_; a new interval
  // counts from the latest full checkpoint (last_full_; step 1's at first).
  std::uint64_t anchor_ = 0;
  std::uint64_t last_full_ = 1;
  std::optional<std::uint64_t> pending_full_ = 1;  // the first step's full checkpoint
  std::vector<std::uint64_t> full_iterations_;     // committed full checkpoints seen
  double merge_seconds_ = 0;                       // EMA of a step's optimizer time
  double iteration_seconds_ = 0;                   // EMA of Observe to Observe
  double last_observed_ = 0;
  bool tuned_ = false;
  std::uint64_t heap_max_full_every_ = 0;
  Configuration config_;
  ConfigurationInputs inputs_;
  std::uint64_t bytes_handed_ = 0;
};

}  // namespace pmsnap::diff
