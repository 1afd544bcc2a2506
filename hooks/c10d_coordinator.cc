#include "pmsnap/hooks/c10d_coordinator.h"

#include <torch/torch.h>

#include <string>

namespace pmsnap::hooks {
namespace {

// c10d reports failures (a peer gone, a timeout) as exceptions; pmsnap's API
// carries them as Status values naming the rank.
Status TransportError(int rank, const char* what, const std::exception& e) {
  return Status(StatusCode::kIOError,
                "rank " + std::to_string(rank) + ": c10d " + what + " failed: " + e.what());
}

}  // namespace

C10dCoordinator::C10dCoordinator(c10::intrusive_ptr<c10d::Backend> backend)
    : backend_(std::move(backend)) {}

int C10dCoordinator::rank() const { return backend_->getRank(); }
int C10dCoordinator::world_size() const { return backend_->getSize(); }

Status C10dCoordinator::StartMinAllReduce(std::span<const std::int64_t> values) {
  if (pending_work_) {
    return Status(StatusCode::kFailedPrecondition,
                  "rank " + std::to_string(rank()) + ": an all-reduce is already in flight");
  }
  try {
    pending_values_ = torch::empty({static_cast<std::int64_t>(values.size())}, torch::kInt64);
    std::copy(values.begin(), values.end(), pending_values_.data_ptr<std::int64_t>());
    std::vector<at::Tensor> tensors{pending_values_};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MIN;
    pending_work_ = backend_->allreduce(tensors, options);
  } catch (const std::exception& e) {
    pending_work_.reset();
    return TransportError(rank(), "all-reduce", e);
  }
  return Status::Ok();
}

Result<std::vector<std::int64_t>> C10dCoordinator::FinishMinAllReduce() {
  if (!pending_work_) {
    return Status(StatusCode::kFailedPrecondition,
                  "rank " + std::to_string(rank()) + ": no all-reduce in flight");
  }
  auto work = std::move(pending_work_);
  pending_work_.reset();
  try {
    work->wait();
  } catch (const std::exception& e) {
    return TransportError(rank(), "all-reduce", e);
  }
  const std::int64_t* data = pending_values_.data_ptr<std::int64_t>();
  return std::vector<std::int64_t>(data, data + pending_values_.numel());
}

Status C10dCoordinator::Broadcast(std::span<std::byte> bytes, int root) {
  try {
    std::vector<at::Tensor> tensors{
        torch::from_blob(bytes.data(), {static_cast<std::int64_t>(bytes.size())}, torch::kUInt8)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    backend_->broadcast(tensors, options)->wait();
  } catch (const std::exception& e) {
    return TransportError(rank(), "broadcast", e);
  }
  return Status::Ok();
}

}  // namespace pmsnap::hooks
