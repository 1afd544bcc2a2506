// LowDiff (lowdiff.h): top-k gradient synchronization with error feedback,
// the differentials it leaves, and their replay.
#include "pmsnap/hooks/lowdiff.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "libtorch_error.h"
#include "pmsnap/hooks/c10d_coordinator.h"

namespace pmsnap::hooks {
namespace {

// Piece codes of a differential beside tensors (whose code is their
// c10::ScalarType): the learning rate of every param group the step ran
// with (float64), and the caller's extra state (bytes).
constexpr std::uint32_t kLearningRatesCode = 0x101;
constexpr std::uint32_t kExtraStateCode = 0x102;
// A parameter's record: int64 [parameter index, numel, world, k], then
// `world` value tensors and `world` index tensors.
constexpr std::int64_t kDescriptorLength = 4;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

diff::DifferentialPiece PieceOf(const torch::Tensor& t, std::uint32_t code) {
  diff::DifferentialPiece piece;
  piece.dtype = code;
  piece.shape.assign(t.sizes().begin(), t.sizes().end());
  piece.data = static_cast<const std::byte*>(t.data_ptr());
  piece.bytes = static_cast<std::uint64_t>(t.numel()) * t.element_size();
  return piece;
}

// A view of a stored piece of `dtype` (its code when it is a tensor).
torch::Tensor TensorOf(const diff::StoredPiece& piece, c10::ScalarType dtype) {
  auto* data = const_cast<std::byte*>(piece.bytes.data());
  return torch::from_blob(data, piece.shape, torch::TensorOptions().dtype(dtype));
}

torch::Tensor TensorOf(const diff::StoredPiece& piece) {
  return TensorOf(piece, static_cast<c10::ScalarType>(piece.dtype));
}

// The averaged dense gradient of every rank's (values, indices), summed in
// rank order: training and replay both compute it this way, so they agree
// bit for bit. Per rank the indices are distinct (topk), so one index_add_
// has no duplicate.
torch::Tensor Decompress(const std::vector<torch::Tensor>& values,
                         const std::vector<torch::Tensor>& indices, std::int64_t numel,
                         torch::ScalarType dtype) {
  torch::Tensor dense = torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
  for (std::size_t r = 0; r < values.size(); ++r) dense.index_add_(0, indices[r], values[r]);
  return dense.div_(static_cast<double>(values.size()));
}

}  // namespace

struct LowDiff::Gathered {
  std::size_t index = 0;
  torch::Tensor descriptor;  // int64 [index, numel, world, k]
  std::vector<torch::Tensor> values;
  std::vector<torch::Tensor> indices;
};

Result<std::unique_ptr<LowDiff>> LowDiff::Create(const torch::nn::Module& module,
                                                 torch::optim::Optimizer& optimizer,
                                                 runtime::EngineOptions options,
                                                 LowDiffOptions lowdiff) {
  if (!(lowdiff.topk_ratio > 0 && lowdiff.topk_ratio <= 1)) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiff for " + options.pool_path + ": topk_ratio must be in (0, 1], got " +
                      std::to_string(lowdiff.topk_ratio));
  }
  if (lowdiff.gradient_group && options.coordinator &&
      lowdiff.gradient_group->getSize() != options.coordinator->world_size()) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiff for " + options.pool_path + ": the gradient group has " +
                      std::to_string(lowdiff.gradient_group->getSize()) +
                      " ranks, the checkpoint coordinator " +
                      std::to_string(options.coordinator->world_size()));
  }
  if (options.pool_options.chunk_heap_bytes == 0) {
    options.pool_options.chunk_heap_bytes = lowdiff.chunk_heap_bytes;
  }
  // Every step until the first one: the differentials build on a full
  // checkpoint of the first step (or on the restored one).
  auto policy = std::make_shared<runtime::EveryKPolicy>(1);
  options.policy = policy;
  auto coordinator = options.coordinator;
  std::string pool_path = options.pool_path;
  diff::LowDiffControllerOptions plan = lowdiff;
  plan.world_size =
      lowdiff.gradient_group ? static_cast<std::uint32_t>(lowdiff.gradient_group->getSize()) : 1;
  // The ranks agree on tuned values over the gradient group: the engine's
  // coordinator keeps an all-reduce in flight across the step.
  std::shared_ptr<runtime::Coordinator> agreement;
  if (lowdiff.gradient_group && lowdiff.gradient_group->getSize() > 1) {
    agreement = std::make_shared<C10dCoordinator>(lowdiff.gradient_group);
  }
  auto controller = diff::LowDiffController::Create(
      plan, std::move(agreement), [policy](std::uint64_t every, std::uint64_t anchor) {
        policy->set_every(every, anchor);
        return Status::Ok();
      });
  if (!controller.ok()) {
    return Status(controller.status().code(),
                  controller.status().message() + " (pool " + options.pool_path + ")");
  }
  auto checkpointed = CheckpointedOptimizer::Create(module, optimizer, std::move(options));
  if (!checkpointed.ok()) return checkpointed.status();
  return std::unique_ptr<LowDiff>(new LowDiff(std::move(*checkpointed), std::move(policy),
                                              std::move(*controller), optimizer,
                                              std::move(coordinator), std::move(pool_path),
                                              std::move(lowdiff)));
}

LowDiff::LowDiff(std::unique_ptr<CheckpointedOptimizer> checkpointed,
                 std::shared_ptr<runtime::EveryKPolicy> policy,
                 std::unique_ptr<diff::LowDiffController> controller,
                 torch::optim::Optimizer& optimizer,
                 std::shared_ptr<runtime::Coordinator> coordinator, std::string pool_path,
                 LowDiffOptions options)
    : checkpointed_(std::move(checkpointed)),
      policy_(std::move(policy)),
      controller_(std::move(controller)),
      optimizer_(optimizer),
      coordinator_(std::move(coordinator)),
      pool_path_(std::move(pool_path)),
      options_(std::move(options)) {
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) params_.push_back(p);
  }
  residuals_.resize(params_.size());
  world_ = options_.gradient_group ? options_.gradient_group->getSize() : 1;
}

LowDiff::~LowDiff() { (void)Close(); }

Status LowDiff::SynchronizeGradients() {
  if (closed_) {
    return Status(StatusCode::kFailedPrecondition, "LowDiff for " +
                                                       pool_path_ +
                                                       ": closed");
  }
  if (synchronized_) {
    return Status(StatusCode::kFailedPrecondition,
                  "LowDiff: SynchronizeGradients called twice before Step (the second would "
                  "compress already averaged gradients)");
  }
  gathered_.clear();
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor grad = params_[i].grad();
    if (!grad.defined()) continue;
    try {
      torch::Tensor flat = grad.reshape({-1});
      if (options_.error_feedback) {
        if (!residuals_[i].defined()) residuals_[i] = torch::zeros_like(flat);
        flat = flat + residuals_[i];
      }
      const std::int64_t numel = flat.numel();
      const auto k = std::max<std::int64_t>(
          1, static_cast<std::int64_t>(std::ceil(options_.topk_ratio * static_cast<double>(numel))));
      torch::Tensor indices = std::get<1>(torch::topk(flat.abs(), k, 0, true, false));
      torch::Tensor values = flat.index_select(0, indices);
      if (options_.error_feedback) {
        residuals_[i].copy_(flat);
        residuals_[i].index_fill_(0, indices, 0);
      }
      Gathered g;
      g.index = i;
      g.descriptor = torch::tensor({static_cast<std::int64_t>(i), numel,
                                    static_cast<std::int64_t>(world_), k},
                                   torch::kInt64);
      if (options_.gradient_group) {
        // One collective per parameter, in parameter order: the same
        // sequence on every rank.
        std::vector<std::vector<torch::Tensor>> out_v(1), out_i(1);
        for (int r = 0; r < world_; ++r) {
          out_v[0].push_back(torch::empty_like(values));
          out_i[0].push_back(torch::empty_like(indices));
        }
        std::vector<torch::Tensor> in_v{values}, in_i{indices};
        options_.gradient_group->allgather(out_v, in_v)->wait();
        options_.gradient_group->allgather(out_i, in_i)->wait();
        g.values = std::move(out_v[0]);
        g.indices = std::move(out_i[0]);
      } else {
        g.values = {values};
        g.indices = {indices};
      }
      grad.copy_(Decompress(g.values, g.indices, numel, flat.scalar_type()).view(grad.sizes()));
      gathered_.push_back(std::move(g));
    } catch (const c10::Error& e) {
      return LibtorchError("LowDiff: synchronizing the gradient of parameter " + std::to_string(i),
                           e, StatusCode::kInternal);
    }
  }
  synchronized_ = true;
  return Status::Ok();
}

Status LowDiff::OpenLog(std::optional<std::uint64_t> resume_after,
                        std::optional<std::uint64_t> full_iteration) {
  diff::DifferentialLogOptions options;
  options.batch = controller_->batch();
  options.resume_after = resume_after;
  auto log = diff::DifferentialLog::Open(checkpointed_->engine().pool(), options);
  if (!log.ok()) return log.status();
  return controller_->Attach(std::move(*log), resume_after, full_iteration);
}

Status LowDiff::Step(std::span<const std::byte> extra_state) {
  if (!synchronized_) {
    return Status(StatusCode::kFailedPrecondition,
                  "LowDiff::Step: no synchronized gradient for this step; call "
                  "SynchronizeGradients after backward");
  }
  const double began = Now();
  const std::uint64_t step = checkpointed_->iteration() + 1;
  Status status = Status::Ok();
  bool appended = false;
  // Kept alive until the log's worker copied them (WaitCopied below).
  torch::Tensor learning_rates;
  std::vector<std::byte> extra;
  diff::DifferentialLog* log = controller_->log().get();
  if (log) {
    extra.assign(extra_state.begin(), extra_state.end());
    std::vector<double> lrs;
    for (const auto& group : optimizer_.param_groups()) lrs.push_back(group.options().get_lr());
    learning_rates = torch::tensor(lrs, torch::kFloat64);
    std::vector<diff::DifferentialPiece> pieces;
    for (const Gathered& g : gathered_) {
      pieces.push_back(PieceOf(g.descriptor, static_cast<std::uint32_t>(torch::kInt64)));
      for (const auto& v : g.values) {
        pieces.push_back(PieceOf(v, static_cast<std::uint32_t>(v.scalar_type())));
      }
      for (const auto& ix : g.indices) {
        pieces.push_back(PieceOf(ix, static_cast<std::uint32_t>(torch::kInt64)));
      }
    }
    pieces.push_back(PieceOf(learning_rates, kLearningRatesCode));
    diff::DifferentialPiece extra_piece;
    extra_piece.dtype = kExtraStateCode;
    extra_piece.shape = {static_cast<std::int64_t>(extra.size())};
    extra_piece.data = extra.data();
    extra_piece.bytes = extra.size();
    pieces.push_back(extra_piece);
    for (const auto& p : pieces) controller_->CountHanded(p.bytes);
    status = log->Append(step, std::move(pieces));
    appended = status.ok();
  }
  Status stepped = checkpointed_->Step(extra_state);
  if (status.ok()) status = stepped;
  if (!log) {
    Status opened = OpenLog(std::nullopt, std::nullopt);
    if (status.ok()) status = opened;
  } else if (appended) {
    // The pieces above must outlive the worker's copy of them.
    Status copied = log->WaitCopied(step);
    if (status.ok()) status = copied;
  }
  gathered_.clear();
  synchronized_ = false;
  Status observed = Observe(Now() - began);
  return status.ok() ? observed : status;
}

Status LowDiff::Observe(double step_seconds) {
  const runtime::Stats stats = checkpointed_->stats();
  diff::FullCheckpointProgress progress;
  progress.last_committed_iteration = stats.last_committed_iteration;
  progress.epochs_committed = stats.epochs_committed;
  progress.bytes_written = stats.bytes_written;
  progress.last_epoch_seconds = stats.last_epoch_seconds;
  return controller_->Observe(checkpointed_->iteration(), step_seconds, progress);
}

Status LowDiff::ReplayOne(const diff::Differential& differential,
                          std::vector<std::byte>* extra_state) {
  const auto& pieces = differential.pieces;
  const std::string where = "LowDiff replay of iteration " +
                            std::to_string(differential.iteration) + " from " +
                            pool_path_;
  std::vector<torch::Tensor> grads(params_.size());
  try {
    for (std::size_t at = 0; at < pieces.size();) {
      const diff::StoredPiece& piece = pieces[at];
      if (piece.dtype == kExtraStateCode) {
        *extra_state = piece.bytes;
        ++at;
        continue;
      }
      if (piece.dtype == kLearningRatesCode) {
        torch::Tensor lrs = TensorOf(piece, torch::kFloat64);
        auto& groups = optimizer_.param_groups();
        if (lrs.numel() != static_cast<std::int64_t>(groups.size())) {
          return Status(StatusCode::kModelMismatch,
                        where + ": " + std::to_string(lrs.numel()) +
                            " learning rates for " + std::to_string(groups.size()) +
                            " param groups");
        }
        for (std::size_t g = 0; g < groups.size(); ++g) {
          groups[g].options().set_lr(lrs[static_cast<std::int64_t>(g)].item<double>());
        }
        ++at;
        continue;
      }
      // The code first: any other one is no dtype to view the bytes as.
      if (piece.dtype != static_cast<std::uint32_t>(torch::kInt64) ||
          piece.bytes.size() != kDescriptorLength * sizeof(std::int64_t)) {
        return Status(StatusCode::kCorruption, where + ": piece " + std::to_string(at) +
                                                   " is not a parameter record");
      }
      torch::Tensor desc = TensorOf(piece);
      const auto index = desc[0].item<std::int64_t>();
      const auto numel = desc[1].item<std::int64_t>();
      const auto world = desc[2].item<std::int64_t>();
      if (index < 0 || index >= static_cast<std::int64_t>(params_.size()) ||
          numel != params_[static_cast<std::size_t>(index)].numel() || world < 1 ||
          at + 1 + 2 * static_cast<std::size_t>(world) > pieces.size()) {
        return Status(StatusCode::kModelMismatch,
                      where + ": a record for parameter " + std::to_string(index) + " of " +
                          std::to_string(numel) + " elements does not fit this model");
      }
      std::vector<torch::Tensor> values, indices;
      for (std::int64_t r = 0; r < world; ++r) {
        values.push_back(TensorOf(pieces[at + 1 + static_cast<std::size_t>(r)]));
        indices.push_back(TensorOf(pieces[at + 1 + static_cast<std::size_t>(world + r)]));
      }
      const torch::Tensor& param = params_[static_cast<std::size_t>(index)];
      grads[static_cast<std::size_t>(index)] =
          Decompress(values, indices, numel, values[0].scalar_type()).view(param.sizes());
      at += 1 + 2 * static_cast<std::size_t>(world);
    }
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = grads[i];
  } catch (const c10::Error& e) {
    return LibtorchError(where, e, StatusCode::kInternal);
  }
  return checkpointed_->Step(*extra_state);
}

Result<LowDiffRestoreInfo> LowDiff::Restore() {
  if (controller_->log() || checkpointed_->iteration() != 0) {
    return Status(StatusCode::kFailedPrecondition,
                  "LowDiff::Restore of " + pool_path_ +
                      ": only before the first Step");
  }
  auto full = checkpointed_->Restore();
  if (!full.ok()) return full.status();
  LowDiffRestoreInfo info;
  info.full_iteration = full->iteration;
  info.extra_state = std::move(full->extra_state);
  const double began = Now();
  auto diffs = diff::ReadDifferentials(checkpointed_->engine().pool(), full->iteration);
  if (!diffs.ok()) return diffs.status();
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t reach,
                          diff::LowDiffController::AgreeOnReplayReach(
                              coordinator_.get(), full->iteration, diffs->size()));
  diffs->resize(reach - full->iteration);
  // The replayed steps go through the same Step as training, with no full
  // checkpoint among them.
  policy_->set_every(std::numeric_limits<std::uint64_t>::max());
  std::vector<torch::Tensor> saved;
  for (const auto& p : params_) saved.push_back(p.grad());
  for (const diff::Differential& d : *diffs) {
    Status replayed = ReplayOne(d, &info.extra_state);
    if (!replayed.ok()) return replayed;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].mutable_grad() = saved[i];
  info.iteration = reach;
  info.replayed = diffs->size();
  info.replay_seconds = Now() - began;
  PMSNAP_RETURN_IF_ERROR(OpenLog(reach, full->iteration));
  return info;
}

Status LowDiff::Flush() {
  if (const auto& log = controller_->log()) PMSNAP_RETURN_IF_ERROR(log->Flush());
  return checkpointed_->Flush();
}

Status LowDiff::Close(runtime::CloseMode mode) {
  if (closed_) return Status::Ok();
  closed_ = true;
  Status status = Status::Ok();
  if (const auto& log = controller_->log()) {
    if (mode == runtime::CloseMode::kFinish) {
      status = log->Close();
    } else {
      log->Abandon();
    }
    // The log writes into the engine's pool: it goes first.
    controller_->Detach();
  }
  Status closed = checkpointed_->Close(mode);
  return status.ok() ? closed : status;
}

LowDiffStats LowDiff::stats() const {
  LowDiffStats s;
  static_cast<diff::LowDiffControllerStats&>(s) = controller_->stats();
  s.max_loss = s.batch - 1;
  s.world_size = static_cast<std::uint32_t>(world_);
  if (const auto& log = controller_->log()) s.log = log->stats();
  return s;
}

}  // namespace pmsnap::hooks
