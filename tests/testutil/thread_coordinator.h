// Test helper: runtime::Coordinator for ranks that are threads of one
// process. Collectives match by call order, as on a real process group: the
// n-th collective of every rank forms one exchange.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <mutex>
#include <string>
#include <vector>

#include "pmsnap/runtime/coordinator.h"

namespace pmsnap::testutil {

class ThreadGroup : public std::enable_shared_from_this<ThreadGroup> {
 public:
  explicit ThreadGroup(int world_size) : world_size_(world_size) {}

  std::shared_ptr<runtime::Coordinator> Rank(int rank);
  int world_size() const { return world_size_; }
  // Total collectives every rank has issued so far (exchanges begun).
  std::uint64_t exchanges(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    return issued_[rank];
  }

 private:
  friend class ThreadCoordinator;
  struct Exchange {
    std::vector<std::vector<std::int64_t>> values;
    std::vector<std::byte> broadcast;
    int arrived = 0;
  };

  // Deposits this rank's contribution to its next exchange; returns its index.
  std::uint64_t Deposit(int rank, std::vector<std::int64_t> values) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::uint64_t index = issued_[rank]++;
    Exchange& x = exchanges_[index];
    if (x.values.empty()) x.values.resize(world_size_);
    x.values[rank] = std::move(values);
    x.arrived += 1;
    changed_.notify_all();
    return index;
  }

  std::vector<std::int64_t> AwaitMin(std::uint64_t index) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return exchanges_[index].arrived == world_size_; });
    const Exchange& x = exchanges_[index];
    std::vector<std::int64_t> result = x.values[0];
    for (const auto& v : x.values) {
      for (std::size_t i = 0; i < result.size() && i < v.size(); ++i) {
        result[i] = std::min(result[i], v[i]);
      }
    }
    return result;
  }

  void BroadcastBytes(int rank, std::span<std::byte> bytes, int root) {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t index = issued_[rank]++;
    Exchange& x = exchanges_[index];
    if (rank == root) x.broadcast.assign(bytes.begin(), bytes.end());
    x.arrived += 1;
    changed_.notify_all();
    changed_.wait(lock, [&] { return exchanges_[index].arrived == world_size_; });
    if (rank != root) {
      std::memcpy(bytes.data(), exchanges_[index].broadcast.data(),
                  std::min(bytes.size(), exchanges_[index].broadcast.size()));
    }
  }

  const int world_size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::uint64_t, Exchange> exchanges_;
  std::map<int, std::uint64_t> issued_;
};

class ThreadCoordinator final : public runtime::Coordinator {
 public:
  ThreadCoordinator(std::shared_ptr<ThreadGroup> group, int rank)
      : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return group_->world_size(); }

  Status StartMinAllReduce(std::span<const std::int64_t> values) override {
    if (pending_) {
      return Status(StatusCode::kFailedPrecondition,
                    "rank " + std::to_string(rank_) + ": an all-reduce is already in flight");
    }
    pending_ = group_->Deposit(rank_, {values.begin(), values.end()});
    return Status::Ok();
  }
  Result<std::vector<std::int64_t>> FinishMinAllReduce() override {
    if (!pending_) {
      return Status(StatusCode::kFailedPrecondition,
                    "rank " + std::to_string(rank_) + ": no all-reduce in flight");
    }
    const std::uint64_t index = *pending_;
    pending_.reset();
    return group_->AwaitMin(index);
  }
  Status Broadcast(std::span<std::byte> bytes, int root) override {
    group_->BroadcastBytes(rank_, bytes, root);
    return Status::Ok();
  }

 private:
  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  std::optional<std::uint64_t> pending_;
};

inline std::shared_ptr<runtime::Coordinator> ThreadGroup::Rank(int rank) {
  return std::make_shared<ThreadCoordinator>(shared_from_this(), rank);
}

}  // namespace pmsnap::testutil
