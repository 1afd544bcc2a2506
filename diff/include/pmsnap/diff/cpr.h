// CPR (Maeng et al., MLSys 2021): partial recovery for recommendation models.
//
// Embedding tables are sharded over N_emb shards (ranks, or logical shards in
// a single-process emulation). When a shard fails only its tables go back to
// their last save; every other shard keeps its state. The samples whose effect
// on the failed tables is lost are counted as the portion of lost samples:
//
//   PLS_i = PLS_{i-1} + (S_i - S_last_save) / (S_total * N_emb)   on a failure at i  (Eq. 3)
//
// (one term per failed shard, each with its own last save). A target PLS and
// the expected time between failures T_fail give the save interval
//
//   T_save,part = 2 * PLS * N_emb * T_fail                                            (Eq. 4)
//
// and CPR keeps partial recovery only when its expected overhead (Eq. 2, no
// lost computation) at that interval beats full recovery's (Eq. 1) at full
// recovery's optimum T_save,full = sqrt(2 O_save T_fail).
//
// PlsLedger is the persistent record: a small binary image (magic, version,
// checksum) that front ends store in the pool's extra state, so it survives
// restarts, and that tools find inside any extra-state blob (FindPlsLedger).
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "pmsnap/common/status.h"

namespace pmsnap::diff::cpr {

// --- Eq. 1, 2, 4 ---

// Times in any one unit (seconds, iterations): the same for every field.
struct CostModel {
  double save_seconds = 0;        // O_save: one checkpoint save
  double load_seconds = 0;        // O_load: one checkpoint load
  double reschedule_seconds = 0;  // O_res: finding a replacement node
  double mean_time_to_failure = 0;  // T_fail
  double total_seconds = 0;       // T_total: the training job
};

// Eq. 4 solved for the interval: 2 * PLS * N_emb * T_fail.
double SaveIntervalForPls(double target_pls, std::uint32_t emb_shards, double mean_time_to_failure);
// Eq. 4: 0.5 * T_save / (T_fail * N_emb).
double ExpectedPls(double save_interval, std::uint32_t emb_shards, double mean_time_to_failure);
// sqrt(2 * O_save * T_fail): the interval minimising Eq. 1.
double OptimalFullRecoveryInterval(const CostModel& cost);
// Eq. 1: O_save T/T_save + (O_load + T_save/2 + O_res) T/T_fail.
double FullRecoveryOverhead(const CostModel& cost, double save_interval);
// Eq. 2: O_save T/T_save + (O_load + O_res) T/T_fail.
double PartialRecoveryOverhead(const CostModel& cost, double save_interval);

// CPR's decision (4.2, Figure 5) and the numbers behind it.
struct RecoveryPlan {
  bool partial = false;             // false: fall back to full recovery
  double target_pls = 0;
  std::uint32_t emb_shards = 0;
  double partial_interval = 0;      // Eq. 4
  double full_interval = 0;         // sqrt(2 O_save T_fail)
  double partial_overhead = 0;      // Eq. 2 at partial_interval (same unit as T_total)
  double full_overhead = 0;         // Eq. 1 at full_interval
  double expected_pls = 0;          // Eq. 4 at the interval chosen
  double save_interval = 0;         // the interval to use: partial or full
  std::string reason;               // one sentence with the numbers
};

// Plans a run: partial recovery at Eq. 4's interval when its expected
// overhead is below (1 - min_relative_benefit) of full recovery's at its
// optimum, else full recovery at its optimum. kInvalidArgument (naming the
// field) for a non-positive T_fail, T_total or O_save, negative O_load /
// O_res, a target PLS outside (0, 1], zero shards, or a benefit outside [0, 1).
Result<RecoveryPlan> PlanRecovery(const CostModel& cost, double target_pls,
                                  std::uint32_t emb_shards, double min_relative_benefit = 0.05);

// --- Eq. 3: the ledger ---

struct PlsFailure {
  std::uint64_t samples = 0;           // S_i: samples processed when it failed
  std::uint64_t lost_samples = 0;      // sum over its failed shards of S_i - S_last_save
  std::uint32_t failed_shards = 0;
  double pls_after = 0;
};

class PlsLedger {
 public:
  PlsLedger() = default;
  // `total_samples` = S_total of the job (> 0), `emb_shards` = N_emb (> 0).
  PlsLedger(std::uint64_t total_samples, std::uint32_t emb_shards)
      : total_samples_(total_samples), emb_shards_(emb_shards) {}

  // A failure at S_i = `samples` of the shards whose last saves were at
  // `samples_at_last_save` (one entry per failed shard). kInvalidArgument
  // when a save is later than S_i, when more shards fail than exist, or the
  // ledger was default-constructed; the ledger is unchanged then.
  Status RecordFailure(std::uint64_t samples, std::span<const std::uint64_t> samples_at_last_save);

  double pls() const { return pls_; }
  std::uint64_t total_samples() const { return total_samples_; }
  std::uint32_t emb_shards() const { return emb_shards_; }
  std::uint64_t lost_samples() const { return lost_samples_; }
  std::uint64_t failed_shards() const { return failed_shards_; }
  // Every failure, oldest first (the newest 64 are kept).
  const std::vector<PlsFailure>& failures() const { return failures_; }

  // The persistent image: "PMSNAPCPRPLS" magic, version, fields, the newest
  // failures, and a 64-bit checksum over everything before it.
  std::vector<std::byte> Serialize() const;
  // kCorruption (naming what is wrong) for a damaged or foreign image.
  static Result<PlsLedger> Parse(std::span<const std::byte> bytes);

  static constexpr std::size_t kMaxFailuresKept = 64;

 private:
  std::uint64_t total_samples_ = 0;
  std::uint32_t emb_shards_ = 0;
  double pls_ = 0;
  std::uint64_t lost_samples_ = 0;
  std::uint64_t failed_shards_ = 0;
  std::vector<PlsFailure> failures_;
};

// The first intact ledger image inside `blob` (e.g. a pool's extra state,
// which the Python front end pickles around it), or nullopt.
std::optional<PlsLedger> FindPlsLedger(std::span<const std::byte> blob);

}  // namespace pmsnap::diff::cpr
