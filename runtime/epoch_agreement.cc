#include "pmsnap/runtime/epoch_agreement.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>

namespace pmsnap::runtime {
namespace {

// Payload slots. Committed iterations travel as iteration + 1 so that 0 means
// "none" and MIN still picks the rank that is furthest behind.
constexpr std::size_t kCommittedSlot = 0;
constexpr std::size_t kHealthSlot = 1;

std::int64_t Encode(const std::optional<std::uint64_t>& iteration) {
  return iteration ? static_cast<std::int64_t>(*iteration) + 1 : 0;
}

std::optional<std::uint64_t> Decode(std::int64_t encoded) {
  if (encoded <= 0) return std::nullopt;
  return static_cast<std::uint64_t>(encoded - 1);
}

}  // namespace

Result<std::unique_ptr<EpochAgreement>> EpochAgreement::Create(
    std::shared_ptr<Coordinator> coordinator) {
  if (coordinator == nullptr) {
    return Status(StatusCode::kInvalidArgument, "epoch agreement needs a coordinator");
  }
  if (coordinator->world_size() < 1 || coordinator->rank() < 0 ||
      coordinator->rank() >= coordinator->world_size()) {
    return Status(StatusCode::kInvalidArgument,
                  "coordinator reports rank " + std::to_string(coordinator->rank()) +
                      " of world size " + std::to_string(coordinator->world_size()) +
                      "; expected 0 <= rank < world size");
  }
  return std::unique_ptr<EpochAgreement>(new EpochAgreement(std::move(coordinator)));
}

EpochAgreement::EpochAgreement(std::shared_ptr<Coordinator> coordinator)
    : coordinator_(std::move(coordinator)),
      rank_(coordinator_->rank()),
      world_size_(coordinator_->world_size()) {}

std::vector<std::int64_t> EpochAgreement::Payload(const LocalEpochState& local) const {
  std::vector<std::int64_t> payload(2);
  payload[kCommittedSlot] = Encode(local.committed_iteration);
  // MIN over ranks: the world size when all are healthy, else the lowest
  // failed rank.
  payload[kHealthSlot] = local.healthy ? world_size_ : rank_;
  return payload;
}

Status EpochAgreement::Absorb(const std::vector<std::int64_t>& reduced) {
  if (reduced.size() != 2) {
    return Status(StatusCode::kInternal,
                  "rank " + std::to_string(rank_) + ": epoch agreement all-reduce returned " +
                      std::to_string(reduced.size()) + " values, expected 2");
  }
  if (reduced[kHealthSlot] < world_size_) {
    stopped_ = true;
    return Status(StatusCode::kAborted,
                  "rank " + std::to_string(reduced[kHealthSlot]) +
                      " failed its checkpoint; no rank opens further epochs (seen on rank " +
                      std::to_string(rank_) + ")");
  }
  global_committed_ = Decode(reduced[kCommittedSlot]);
  return Status::Ok();
}

bool EpochAgreement::EveryRankCommittedLastOpened() const {
  if (!last_opened_) return true;
  return global_committed_ && *global_committed_ >= *last_opened_;
}

Result<bool> EpochAgreement::AtBoundary(
    std::uint64_t step, const LocalEpochState& local, bool wants_epoch, bool wait_if_busy,
    const std::function<LocalEpochState()>& wait_for_local_epoch) {
  if (stopped_) {
    return Status(StatusCode::kAborted, "rank " + std::to_string(rank_) +
                                            ": epoch agreement stopped after a rank failed");
  }
  if (exchange_in_flight_) {
    exchange_in_flight_ = false;
    PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->FinishMinAllReduce());
    PMSNAP_RETURN_IF_ERROR(Absorb(reduced));
  }
  LocalEpochState now = local;
  bool may_open = wants_epoch && EveryRankCommittedLastOpened();
  if (wants_epoch && !may_open && wait_if_busy) {
    // Every rank takes this branch at this boundary: they all saw the same
    // view and the same policy answer.
    now = wait_for_local_epoch();
    PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->MinAllReduce(Payload(now)));
    PMSNAP_RETURN_IF_ERROR(Absorb(reduced));
    may_open = EveryRankCommittedLastOpened();
    if (!may_open) {
      stopped_ = true;
      return Status(StatusCode::kInternal,
                    "rank " + std::to_string(rank_) + ": at step " + std::to_string(step) +
                        " every rank finished its epoch, yet the newest globally committed "
                        "iteration is " +
                        (global_committed_ ? std::to_string(*global_committed_) : "none") +
                        ", expected " + std::to_string(*last_opened_));
    }
  }
  PMSNAP_RETURN_IF_ERROR(coordinator_->StartMinAllReduce(Payload(now)));
  exchange_in_flight_ = true;
  return may_open;
}

void EpochAgreement::OnEpochOpened(std::uint64_t step) { last_opened_ = step; }

Status EpochAgreement::RefuseRestoreAfterBoundary() const {
  if (exchange_in_flight_ || last_opened_) {
    return Status(StatusCode::kFailedPrecondition,
                  "rank " + std::to_string(rank_) +
                      ": restore must be agreed before the first step boundary");
  }
  return Status::Ok();
}

Result<std::vector<RankHoldings>> EpochAgreement::GatherHoldings(const RankHoldings& mine) {
  // An all-gather through the MIN all-reduce: each rank fills its own words
  // and leaves the others' at the maximum. Words: two intact iterations
  // (encoded, 0: none), then the flags.
  constexpr std::size_t kWordsPerRank = 5;
  Status fits = Status::Ok();
  if (mine.intact.size() > 2) {
    fits = Status(StatusCode::kInternal, "reports " + std::to_string(mine.intact.size()) +
                                             " intact iterations, a pool holds at most 2");
  }
  PMSNAP_RETURN_IF_ERROR(AgreeOnStatus(fits));
  std::vector<std::int64_t> words(kWordsPerRank * world_size_,
                                  std::numeric_limits<std::int64_t>::max());
  std::int64_t* own = words.data() + kWordsPerRank * rank_;
  for (std::size_t i = 0; i < 2; ++i) {
    own[i] = i < mine.intact.size() ? Encode(mine.intact[i]) : 0;
  }
  own[2] = mine.has_unreplicated_state ? 1 : 0;
  own[3] = mine.never_committed ? 1 : 0;
  own[4] = mine.committed_twice ? 1 : 0;
  PMSNAP_ASSIGN_OR_RETURN(const auto gathered, coordinator_->MinAllReduce(words));
  if (gathered.size() != words.size()) {
    return Status(StatusCode::kInternal,
                  "rank " + std::to_string(rank_) + ": holdings all-reduce returned " +
                      std::to_string(gathered.size()) + " values, expected " +
                      std::to_string(words.size()));
  }
  std::vector<RankHoldings> holdings(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    const std::int64_t* theirs = gathered.data() + kWordsPerRank * r;
    for (std::size_t i = 0; i < 2; ++i) {
      if (const auto iteration = Decode(theirs[i])) holdings[r].intact.push_back(*iteration);
    }
    holdings[r].has_unreplicated_state = theirs[2] != 0;
    holdings[r].never_committed = theirs[3] != 0;
    holdings[r].committed_twice = theirs[4] != 0;
  }
  return holdings;
}

Result<std::uint64_t> EpochAgreement::AgreeOnRestore(const RankHoldings& mine) {
  PMSNAP_RETURN_IF_ERROR(RefuseRestoreAfterBoundary());
  PMSNAP_ASSIGN_OR_RETURN(const std::vector<RankHoldings> holdings, GatherHoldings(mine));
  // Every rank computes the same answer from the same holdings.
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t agreed, ChooseRestore(holdings));
  global_committed_ = agreed;
  last_opened_ = agreed;
  return agreed;
}

Result<ShardedRestoreChoice> EpochAgreement::AgreeOnShardedRestore(
    const RankHoldings& mine, const ShardPlan& plan, std::span<const std::string> unit_names) {
  PMSNAP_RETURN_IF_ERROR(RefuseRestoreAfterBoundary());
  PMSNAP_ASSIGN_OR_RETURN(const std::vector<RankHoldings> holdings, GatherHoldings(mine));
  PMSNAP_ASSIGN_OR_RETURN(ShardedRestoreChoice choice,
                          ChooseShardedRestore(plan, holdings, unit_names));
  global_committed_ = choice.iteration;
  last_opened_ = choice.iteration;
  return choice;
}

Result<std::vector<std::byte>> EpochAgreement::BroadcastBytes(std::vector<std::byte> bytes,
                                                              int root) {
  std::int64_t size = static_cast<std::int64_t>(bytes.size());
  PMSNAP_RETURN_IF_ERROR(
      coordinator_->Broadcast(std::as_writable_bytes(std::span<std::int64_t>(&size, 1)), root));
  bytes.resize(static_cast<std::size_t>(size));
  if (size > 0) PMSNAP_RETURN_IF_ERROR(coordinator_->Broadcast(bytes, root));
  return bytes;
}

Status EpochAgreement::AgreeOnStatus(const Status& local) {
  const std::vector<std::int64_t> mine{local.ok() ? world_size_ : rank_, 0};
  PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->MinAllReduce(mine));
  if (reduced.empty()) return Absorb(reduced);
  const std::int64_t failed = reduced[0];
  if (failed >= world_size_) return Status::Ok();
  // The failing rank's code and message, so that every rank reports the
  // same error, naming the failing rank's own file.
  std::vector<std::byte> message(1024);
  if (failed == rank_) {
    const std::string text = "rank " + std::to_string(rank_) + ": " + local.message();
    message[0] = static_cast<std::byte>(local.code());
    std::memcpy(message.data() + 1, text.data(), std::min(text.size(), message.size() - 2));
  }
  PMSNAP_RETURN_IF_ERROR(coordinator_->Broadcast(message, static_cast<int>(failed)));
  const auto* text = reinterpret_cast<const char*>(message.data() + 1);
  return Status(static_cast<StatusCode>(message[0]), std::string(text, strnlen(text, message.size() - 1)));
}

Result<layout::RankGroup> EpochAgreement::AgreeOnGroup(
    const std::optional<layout::RankGroup>& existing, bool holds_checkpoint,
    std::uint64_t model_fingerprint, const std::string& pool_path) {
  // The identity comes from the lowest rank with an existing pool; the
  // second word is 0 when some rank's pool holds a committed epoch.
  const bool has_group = existing && existing->in_group();
  const std::vector<std::int64_t> mine{has_group ? rank_ : world_size_,
                                       existing && holds_checkpoint ? 0 : 1};
  PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->MinAllReduce(mine));
  if (reduced.size() != 2) return Absorb(reduced);
  const int source = reduced[0] < world_size_ ? static_cast<int>(reduced[0]) : 0;
  std::uint64_t identity[2] = {0, model_fingerprint};
  if (rank_ == source) {
    if (has_group) {
      identity[0] = existing->run_id;
      identity[1] = existing->model_fingerprint;
    } else {
      std::random_device entropy;
      while (identity[0] == 0) {
        identity[0] = (std::uint64_t{entropy()} << 32) ^ entropy();
      }
    }
  }
  PMSNAP_RETURN_IF_ERROR(coordinator_->Broadcast(
      std::as_writable_bytes(std::span<std::uint64_t>(identity)), source));
  const layout::RankGroup group{.run_id = identity[0],
                                .rank = static_cast<std::uint32_t>(rank_),
                                .world_size = static_cast<std::uint32_t>(world_size_),
                                .model_fingerprint = identity[1],
                                .created_beside_checkpoints = !existing && reduced[1] == 0};
  auto hex = [](std::uint64_t v) {
    char text[19];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
    return std::string(text);
  };
  Status local = Status::Ok();
  const std::string pool = "pool '" + pool_path + "'";
  if (existing && !existing->in_group()) {
    local = Status(StatusCode::kFailedPrecondition,
                   pool + " was made by a single process, not by rank " + std::to_string(rank_) +
                       " of " + std::to_string(world_size_) + " ranks");
  } else if (existing && existing->run_id != group.run_id) {
    local = Status(StatusCode::kFailedPrecondition,
                   pool + " belongs to run " + hex(existing->run_id) + ", not to this job's run " +
                       hex(group.run_id) + " (rank " + std::to_string(source) + "'s pool)");
  } else if (existing && existing->world_size != group.world_size) {
    local = Status(StatusCode::kFailedPrecondition,
                   pool + " was written by " + std::to_string(existing->world_size) +
                       " ranks, this job has " + std::to_string(world_size_) +
                       "; restoring with another world size is not supported");
  } else if (existing && existing->rank != group.rank) {
    local = Status(StatusCode::kFailedPrecondition,
                   pool + " belongs to rank " + std::to_string(existing->rank) + ", not rank " +
                       std::to_string(rank_) + " (check the {rank} in the pool path)");
  } else if (model_fingerprint != group.model_fingerprint) {
    local = Status(StatusCode::kModelMismatch,
                   pool + ": this rank's model (fingerprint " + hex(model_fingerprint) +
                       ") differs from the run's (" + hex(group.model_fingerprint) + ")");
  }
  PMSNAP_RETURN_IF_ERROR(AgreeOnStatus(local));
  return group;
}

Status EpochAgreement::Finish() {
  if (!exchange_in_flight_) return Status::Ok();
  exchange_in_flight_ = false;
  PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->FinishMinAllReduce());
  if (stopped_) return Status::Ok();
  return Absorb(reduced);
}

}  // namespace pmsnap::runtime
