#include "pmsnap/runtime/epoch_agreement.h"

#include <algorithm>
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

Result<std::uint64_t> EpochAgreement::AgreeOnRestore(const std::vector<std::uint64_t>& intact) {
  if (exchange_in_flight_ || last_opened_) {
    return Status(StatusCode::kFailedPrecondition,
                  "rank " + std::to_string(rank_) +
                      ": restore must be agreed before the first step boundary");
  }
  std::optional<std::uint64_t> newest;
  if (!intact.empty()) newest = *std::max_element(intact.begin(), intact.end());
  const LocalEpochState local{newest, newest.has_value()};
  PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->MinAllReduce(Payload(local)));
  if (reduced.size() != 2) return Absorb(reduced);
  if (reduced[kHealthSlot] < world_size_) {
    return Status(StatusCode::kNotFound,
                  "rank " + std::to_string(reduced[kHealthSlot]) +
                      "'s pool holds no intact checkpoint, so no iteration is held by every "
                      "rank (seen on rank " +
                      std::to_string(rank_) + ")");
  }
  const std::uint64_t agreed = *Decode(reduced[kCommittedSlot]);
  const bool holds = std::find(intact.begin(), intact.end(), agreed) != intact.end();
  const LocalEpochState holding{agreed, holds};
  PMSNAP_ASSIGN_OR_RETURN(const auto confirmed, coordinator_->MinAllReduce(Payload(holding)));
  if (confirmed.size() != 2) return Absorb(confirmed);
  if (confirmed[kHealthSlot] < world_size_) {
    return Status(StatusCode::kCorruption,
                  "rank " + std::to_string(confirmed[kHealthSlot]) +
                      " does not hold iteration " + std::to_string(agreed) +
                      " intact, the newest iteration every other rank can restore (seen on rank " +
                      std::to_string(rank_) + ")");
  }
  global_committed_ = agreed;
  last_opened_ = agreed;
  return agreed;
}

Status EpochAgreement::Finish() {
  if (!exchange_in_flight_) return Status::Ok();
  exchange_in_flight_ = false;
  PMSNAP_ASSIGN_OR_RETURN(const auto reduced, coordinator_->FinishMinAllReduce());
  if (stopped_) return Status::Ok();
  return Absorb(reduced);
}

}  // namespace pmsnap::runtime
