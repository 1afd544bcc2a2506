// LowDiff (lowdiff.h): top-k gradient synchronization with error feedback,
// the differentials it leaves, and their replay.
#include "pmsnap/hooks/lowdiff.h"

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <optional>

#include "libtorch_error.h"

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
  if (lowdiff.max_batch == 0 || lowdiff.initial_batch == 0 || lowdiff.initial_full_every == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiff for " + options.pool_path +
                      ": max_batch, initial_batch and initial_full_every must be >= 1");
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
  auto checkpointed = CheckpointedOptimizer::Create(module, optimizer, std::move(options));
  if (!checkpointed.ok()) return checkpointed.status();
  return std::unique_ptr<LowDiff>(new LowDiff(std::move(*checkpointed), std::move(policy),
                                              optimizer, std::move(coordinator),
                                              std::move(pool_path), std::move(lowdiff)));
}

LowDiff::LowDiff(std::unique_ptr<CheckpointedOptimizer> checkpointed,
                 std::shared_ptr<runtime::EveryKPolicy> policy, torch::optim::Optimizer& optimizer,
                 std::shared_ptr<runtime::Coordinator> coordinator, std::string pool_path,
                 LowDiffOptions options)
    : checkpointed_(std::move(checkpointed)),
      policy_(std::move(policy)),
      optimizer_(optimizer),
      coordinator_(std::move(coordinator)),
      pool_path_(std::move(pool_path)),
      options_(std::move(options)) {
  for (const auto& group : optimizer_.param_groups()) {
    for (const auto& p : group.params()) params_.push_back(p);
  }
  residuals_.resize(params_.size());
  world_ = options_.gradient_group ? options_.gradient_group->getSize() : 1;
  full_every_ = options_.full_every ? options_.full_every : options_.initial_full_every;
  batch_ = options_.batch ? options_.batch : options_.initial_batch;
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

Status LowDiff::OpenLog(std::optional<std::uint64_t> resume_after) {
  diff::DifferentialLogOptions options;
  options.batch = batch_;
  options.resume_after = resume_after;
  auto log = diff::DifferentialLog::Open(checkpointed_->engine().pool(), options);
  if (!log.ok()) return log.status();
  log_ = std::move(*log);
  policy_->set_every(full_every_, anchor_);
  first_tune_step_ = resume_after.value_or(0) + kFirstTuneStep;
  return Status::Ok();
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
  if (log_) {
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
    for (const auto& p : pieces) bytes_handed_ += p.bytes;
    status = log_->Append(step, std::move(pieces));
    appended = status.ok();
  }
  Status stepped = checkpointed_->Step(extra_state);
  if (status.ok()) status = stepped;
  if (!log_) {
    Status opened = OpenLog(std::nullopt);
    if (status.ok()) status = opened;
  } else if (appended) {
    // The pieces above must outlive the worker's copy of them.
    Status copied = log_->WaitCopied(step);
    if (status.ok()) status = copied;
  }
  gathered_.clear();
  synchronized_ = false;
  Status observed = Observe(Now() - began);
  return status.ok() ? observed : status;
}

Status LowDiff::Observe(double step_seconds) {
  auto ema = [](double old, double now) { return old == 0 ? now : 0.8 * old + 0.2 * now; };
  const double now = Now();
  merge_seconds_ = ema(merge_seconds_, step_seconds);
  if (last_step_end_ > 0) iteration_seconds_ = ema(iteration_seconds_, now - last_step_end_);
  last_step_end_ = now;
  if (!log_) return Status::Ok();
  const std::uint64_t step = checkpointed_->iteration();
  const bool full_step = step > anchor_ && (step - anchor_) % full_every_ == 0;
  if (full_step) {
    pending_full_ = step;  // commits in the background
    last_full_ = step;
  }
  RetireBehindCommittedFull();
  // The same steps on every rank (full_every_ is agreed), so the ranks can
  // agree on what they tune: every rank's engine must ask for the same
  // full checkpoints (runtime::EpochAgreement).
  if (full_step || step == first_tune_step_) return Retune();
  return Status::Ok();
}

void LowDiff::RetireBehindCommittedFull() {
  if (!pending_full_) return;
  const std::uint64_t committed = checkpointed_->stats().last_committed_iteration;
  if (committed < *pending_full_) return;
  pending_full_.reset();
  if (!full_iterations_.empty() && full_iterations_.back() == committed) return;
  full_iterations_.push_back(committed);
  if (full_iterations_.size() >= 2) {
    // Keep what the second-newest full checkpoint needs: a rank may have to
    // roll back to it (a damaged slot, another rank one checkpoint behind).
    (void)log_->Retire(full_iterations_[full_iterations_.size() - 2]);
  }
}

Result<std::optional<std::uint64_t>> LowDiff::SmallestOverRanks(
    std::optional<std::uint64_t> value) {
  if (!options_.gradient_group || world_ <= 1) return value;
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::vector<torch::Tensor> values{
      torch::tensor({value ? static_cast<std::int64_t>(*value) : kNone}, torch::kInt64)};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  try {
    options_.gradient_group->allreduce(values, min)->wait();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, "LowDiff for " + pool_path_ + ": rank " +
                                             std::to_string(options_.gradient_group->getRank()) +
                                             ": agreeing on the tuned full interval and batch "
                                             "failed: " + e.what());
  }
  const std::int64_t smallest = values[0][0].item<std::int64_t>();
  if (smallest == kNone) return std::optional<std::uint64_t>();
  return std::optional<std::uint64_t>(static_cast<std::uint64_t>(smallest));
}

Status LowDiff::Retune() {
  std::optional<diff::Configuration> config;
  std::optional<diff::HeapBounds> bounds;
  const diff::DifferentialLogStats log = log_->stats();
  if (auto b = diff::BoundsOfHeap(diff::MeasuredDifferentialBytes(log, bytes_handed_),
                                  log.heap_capacity_bytes, options_.max_batch);
      b.ok()) {
    bounds = *b;
  }
  const runtime::Stats stats = checkpointed_->stats();
  if (stats.epochs_committed > 0 && stats.last_epoch_seconds > 0 && iteration_seconds_ > 0) {
    diff::ConfigurationInputs in;
    in.full_bytes = static_cast<double>(stats.bytes_written) / stats.epochs_committed;
    in.write_bandwidth = in.full_bytes / stats.last_epoch_seconds;
    in.merge_seconds = merge_seconds_;
    in.mtbf_seconds = options_.mtbf_seconds;
    in.iteration_seconds = iteration_seconds_;
    in.world_size = static_cast<std::uint32_t>(world_);
    if (auto c = diff::OptimalConfiguration(in, bounds ? bounds->max_batch : options_.max_batch);
        c.ok()) {
      config = *c;
      tuned_ = true;
      config_ = *c;
      inputs_ = in;
    }
  }
  if (options_.full_every != 0 && options_.batch != 0) return Status::Ok();
  // The batch first (the heap's interval bound depends on it), then the
  // interval each rank's heap holds at that batch.
  // Without a measured full checkpoint (a resumed run): the values in
  // force, still kept within the heap.
  std::uint32_t batch = batch_;
  if (options_.batch == 0) {
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
  if (config || bounds) interval = config ? config->full_interval : full_every_;
  if (bounds) {
    heap_max_full_every_ = bounds->MaxInterval(batch);
    interval = std::min(*interval, heap_max_full_every_);
  }
  if (options_.full_every == 0) {
    PMSNAP_ASSIGN_OR_RETURN(interval, SmallestOverRanks(interval));
    if (interval && *interval != full_every_) {
      full_every_ = *interval;
      anchor_ = last_full_;  // the new interval counts from the latest full checkpoint
      policy_->set_every(full_every_, anchor_);
    }
  }
  if (batch != batch_) {
    batch_ = batch;
    PMSNAP_RETURN_IF_ERROR(log_->SetBatch(batch_));
  }
  return Status::Ok();
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
  if (log_ || checkpointed_->iteration() != 0) {
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
  std::uint64_t reach = full->iteration + diffs->size();
  if (coordinator_ && coordinator_->world_size() > 1) {
    const std::int64_t mine = static_cast<std::int64_t>(reach);
    PMSNAP_RETURN_IF_ERROR(coordinator_->StartMinAllReduce(std::span(&mine, 1)));
    auto agreed = coordinator_->FinishMinAllReduce();
    if (!agreed.ok()) return agreed.status();
    reach = static_cast<std::uint64_t>(agreed->at(0));
  }
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
  anchor_ = last_full_ = full->iteration;  // the same on every rank
  PMSNAP_RETURN_IF_ERROR(OpenLog(reach));
  return info;
}

Status LowDiff::Flush() {
  if (log_) PMSNAP_RETURN_IF_ERROR(log_->Flush());
  return checkpointed_->Flush();
}

Status LowDiff::Close(runtime::CloseMode mode) {
  if (closed_) return Status::Ok();
  closed_ = true;
  Status status = Status::Ok();
  if (log_) {
    if (mode == runtime::CloseMode::kFinish) {
      status = log_->Close();
    } else {
      log_->Abandon();
    }
    // The log writes into the engine's pool: it goes first.
    log_.reset();
  }
  Status closed = checkpointed_->Close(mode);
  return status.ok() ? closed : status;
}

LowDiffStats LowDiff::stats() const {
  LowDiffStats s;
  s.full_every = full_every_;
  s.batch = batch_;
  s.max_loss = batch_ - 1;
  s.world_size = static_cast<std::uint32_t>(world_);
  s.tuned = tuned_;
  s.heap_max_full_every = heap_max_full_every_;
  s.f_star = config_.f_star;
  s.b_star = config_.b_star;
  s.inputs = inputs_;
  s.bytes_handed = bytes_handed_;
  if (log_) s.log = log_->stats();
  return s;
}

}  // namespace pmsnap::hooks
