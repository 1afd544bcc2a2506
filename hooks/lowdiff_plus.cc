// LowDiffPlus (lowdiff_plus.h): the snapshot and replica threads.
#include "pmsnap/hooks/lowdiff_plus.h"

#include <torch/optim.h>
#include <torch/serialize.h>

#include <chrono>
#include <deque>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "libtorch_error.h"
#include "pmsnap/common/mutex.h"

namespace pmsnap::hooks {
namespace {

namespace optim = torch::optim;

// An optimizer of `training`'s type on `replica` (split into the same
// groups), with every group's options and the defaults copied.
template <typename Optimizer, typename Options>
std::unique_ptr<optim::Optimizer> MakeLike(optim::Optimizer& training,
                                           const std::vector<torch::Tensor>& replica) {
  std::vector<optim::OptimizerParamGroup> groups;
  std::size_t next = 0;
  for (const auto& group : training.param_groups()) {
    std::vector<torch::Tensor> params(replica.begin() + static_cast<std::ptrdiff_t>(next),
                                      replica.begin() + static_cast<std::ptrdiff_t>(
                                                            next + group.params().size()));
    next += group.params().size();
    groups.emplace_back(std::move(params), group.options().clone());
  }
  return std::make_unique<Optimizer>(groups, static_cast<const Options&>(training.defaults()));
}

Result<std::unique_ptr<optim::Optimizer>> ReplicaOptimizer(
    optim::Optimizer& training, const std::vector<torch::Tensor>& replica) {
  if (dynamic_cast<optim::SGD*>(&training)) {
    return MakeLike<optim::SGD, optim::SGDOptions>(training, replica);
  }
  if (dynamic_cast<optim::Adam*>(&training)) {
    return MakeLike<optim::Adam, optim::AdamOptions>(training, replica);
  }
  if (dynamic_cast<optim::AdamW*>(&training)) {
    return MakeLike<optim::AdamW, optim::AdamWOptions>(training, replica);
  }
  if (dynamic_cast<optim::Adagrad*>(&training)) {
    return MakeLike<optim::Adagrad, optim::AdagradOptions>(training, replica);
  }
  if (dynamic_cast<optim::RMSprop*>(&training)) {
    return MakeLike<optim::RMSprop, optim::RMSpropOptions>(training, replica);
  }
  return Status(StatusCode::kInvalidArgument,
                "LowDiffPlus: the optimizer is not SGD, Adam, AdamW, Adagrad or RMSprop; the "
                "replica needs an optimizer of the same kind");
}

// Copies `from`'s per-parameter state (every tensor cloned) and param-group
// options onto `to`, whose parameters correspond by position: libtorch's own
// optimizer serialization maps state by parameter position.
void CopyOptimizerState(optim::Optimizer& from, optim::Optimizer& to) {
  std::stringstream bytes;
  {
    torch::serialize::OutputArchive archive;
    from.save(archive);
    archive.save_to(bytes);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(bytes);
  to.load(archive);
}

}  // namespace

struct LowDiffPlus::State {
  // What the replica thread needs of one iteration.
  struct Iteration {
    std::uint64_t iteration = 0;
    std::vector<bool> with_gradient;
    std::vector<std::unique_ptr<optim::OptimizerOptions>> group_options;
    std::vector<std::byte> extra_state;
  };
  struct Copy {
    std::uint64_t iteration = 0;
    std::size_t index = 0;
    torch::Tensor gradient;
  };

  optim::Optimizer* training = nullptr;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;   // the trained parameters, optimizer order
  std::vector<torch::Tensor> replica;  // host copies, same order
  std::unique_ptr<optim::Optimizer> replica_optimizer;
  std::unique_ptr<CheckpointedOptimizer> checkpointer;
  std::vector<torch::Tensor> buffers[2];  // gradients of iterations t % 2
  std::uint64_t gradient_bytes = 0;

  mutable Mutex mu;
  CondVar cv;
  std::uint64_t iteration PMSNAP_GUARDED_BY(mu) = 0;     // Steps done (training thread's count)
  std::uint64_t replica_done PMSNAP_GUARDED_BY(mu) = 0;  // last iteration the replica applied
  std::vector<bool> handed PMSNAP_GUARDED_BY(mu);        // gradients handed over this iteration
  std::uint64_t copies_queued PMSNAP_GUARDED_BY(mu) = 0;
  std::uint64_t copies_done PMSNAP_GUARDED_BY(mu) = 0;
  std::deque<Copy> copies PMSNAP_GUARDED_BY(mu);
  std::deque<Iteration> iterations PMSNAP_GUARDED_BY(mu);
  Status error PMSNAP_GUARDED_BY(mu);  // the first error of a thread
  bool stopping PMSNAP_GUARDED_BY(mu) = false;
  bool closed PMSNAP_GUARDED_BY(mu) = false;
  bool stepped = false;  // training thread
  LowDiffPlusStats stats PMSNAP_GUARDED_BY(mu);
  std::thread snapshot_thread, replica_thread;

  void RecordError(Status status) {
    MutexLock lock(mu);
    if (error.ok()) error = std::move(status);
    cv.NotifyAll();
  }

  void SnapshotLoop() {
    for (;;) {
      Copy copy;
      {
        MutexLock lock(mu);
        while (!stopping && copies.empty()) cv.Wait(lock);
        // Closing: a copy not taken by a Step is dropped (its buffer may be
        // the one the replica reads).
        if (stopping) return;
        copy = std::move(copies.front());
        copies.pop_front();
        // Buffer iteration % 2 is free once the replica applied iteration - 2.
        while (!stopping && error.ok() && replica_done + 2 < copy.iteration) cv.Wait(lock);
        if (stopping) return;
      }
      torch::Tensor& target = buffers[copy.iteration % 2][copy.index];
      try {
        target.copy_(copy.gradient.view_as(target));
      } catch (const c10::Error& e) {
        RecordError(LibtorchError("LowDiffPlus: copying the gradient of '" + names[copy.index] + "'",
                               e));
      }
      MutexLock lock(mu);
      ++copies_done;
      stats.gradient_bytes_snapshotted += target.nbytes();
      cv.NotifyAll();
    }
  }

  void ReplicaLoop() {
    for (;;) {
      Iteration next;
      bool apply = false;
      {
        MutexLock lock(mu);
        while (!stopping && iterations.empty()) cv.Wait(lock);
        if (iterations.empty()) return;
        next = std::move(iterations.front());
        iterations.pop_front();
        apply = error.ok();
      }
      if (apply) {
        Status status = Apply(next);
        if (!status.ok()) RecordError(std::move(status));
      }
      MutexLock lock(mu);
      replica_done = next.iteration;
      stats.replica_iteration = next.iteration;
      cv.NotifyAll();
    }
  }

  // The replica's update of one iteration and its checkpoint.
  Status Apply(Iteration& next) {
    auto& groups = replica_optimizer->param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move(next.group_options[g]));
    }
    const auto& buffer = buffers[next.iteration % 2];
    for (std::size_t i = 0; i < replica.size(); ++i) {
      replica[i].mutable_grad() = next.with_gradient[i] ? buffer[i] : torch::Tensor();
    }
    Status status = checkpointer->Step(next.extra_state);
    for (auto& r : replica) r.mutable_grad() = torch::Tensor();
    return status;
  }

  Status WaitForReplica(std::uint64_t target) {
    MutexLock lock(mu);
    while (replica_done < target && error.ok()) cv.Wait(lock);
    return error;
  }

  void Stop() {
    {
      MutexLock lock(mu);
      stopping = true;
      cv.NotifyAll();
    }
    if (snapshot_thread.joinable()) snapshot_thread.join();
    if (replica_thread.joinable()) replica_thread.join();
  }
};

LowDiffPlus::LowDiffPlus(std::unique_ptr<State> state) : state_(std::move(state)) {}

LowDiffPlus::~LowDiffPlus() { (void)Close(); }

Result<std::unique_ptr<LowDiffPlus>> LowDiffPlus::Create(
    const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
    torch::optim::Optimizer& optimizer, runtime::EngineOptions options) {
  auto state = std::make_unique<State>();
  state->training = &optimizer;
  std::unordered_map<const void*, std::string> names;
  for (const auto& [name, p] : named_parameters) names.emplace(p.unsafeGetTensorImpl(), name);
  std::vector<std::pair<std::string, torch::Tensor>> replica_named;
  try {
    std::size_t g = 0;
    for (const auto& group : optimizer.param_groups()) {
      std::size_t i = 0;
      for (const auto& p : group.params()) {
        auto found = names.find(p.unsafeGetTensorImpl());
        if (found == names.end()) {
          return Status(StatusCode::kInvalidArgument,
                        "LowDiffPlus: the optimizer's parameter group" + std::to_string(g) +
                            ".param" + std::to_string(i) + " is not among the named parameters");
        }
        if (p.is_sparse()) {
          return Status(StatusCode::kInvalidArgument,
                        "LowDiffPlus: parameter '" + found->second + "' is not dense");
        }
        torch::Tensor copy = p.detach().to(torch::kCPU).clone().contiguous();
        copy.set_requires_grad(p.requires_grad());
        state->names.push_back(found->second);
        state->params.push_back(p);
        state->replica.push_back(copy);
        replica_named.emplace_back(found->second, copy);
        for (auto& buffer : state->buffers) buffer.push_back(torch::empty_like(copy));
        state->gradient_bytes += copy.nbytes();
        ++i;
      }
      ++g;
    }
  } catch (const c10::Error& e) {
    return LibtorchError("LowDiffPlus: copying the parameters", e);
  }
  PMSNAP_ASSIGN_OR_RETURN(state->replica_optimizer, ReplicaOptimizer(optimizer, state->replica));
  if (!optimizer.state().empty()) {
    try {
      // Created mid-training (or Adagrad's constructor made state): the
      // replica starts from the optimizer's state as it is.
      CopyOptimizerState(optimizer, *state->replica_optimizer);
    } catch (const c10::Error& e) {
      return LibtorchError("LowDiffPlus: copying the optimizer's state to the replica", e);
    }
  }
  PMSNAP_ASSIGN_OR_RETURN(state->checkpointer,
                          CheckpointedOptimizer::Create(replica_named, *state->replica_optimizer,
                                                        std::move(options)));
  {
    // Before the threads start; the lock is for the analysis.
    MutexLock lock(state->mu);
    state->iteration = state->replica_done = state->checkpointer->iteration();
    state->handed.assign(state->params.size(), false);
    state->stats.gradient_bytes_per_iteration = state->gradient_bytes;
  }
  State* s = state.get();
  s->snapshot_thread = std::thread([s] { s->SnapshotLoop(); });
  s->replica_thread = std::thread([s] { s->ReplicaLoop(); });
  return std::unique_ptr<LowDiffPlus>(new LowDiffPlus(std::move(state)));
}

Status LowDiffPlus::HandGradient(std::size_t index, const torch::Tensor& gradient) {
  State& s = *state_;
  if (index >= s.params.size()) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiffPlus: gradient index " + std::to_string(index) + " out of range (" +
                      std::to_string(s.params.size()) + " parameters)");
  }
  if (!gradient.defined() || gradient.sizes() != s.params[index].sizes() ||
      gradient.scalar_type() != s.params[index].scalar_type() || gradient.is_sparse()) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiffPlus: the gradient handed for '" + s.names[index] +
                      "' is not a dense tensor of the parameter's shape and dtype");
  }
  MutexLock lock(s.mu);
  if (s.closed) {
    return Status(StatusCode::kFailedPrecondition, "LowDiffPlus: closed");
  }
  if (s.handed[index]) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiffPlus: parameter '" + s.names[index] +
                      "' got a second gradient before Step; accumulating gradients over several "
                      "backward passes would be applied twice");
  }
  s.handed[index] = true;
  ++s.copies_queued;
  s.copies.push_back({s.iteration + 1, index, gradient});
  s.cv.NotifyAll();
  return Status::Ok();
}

Status LowDiffPlus::Step(std::span<const std::byte> extra_state) {
  State& s = *state_;
  State::Iteration next;
  {
    MutexLock lock(s.mu);
    if (s.closed) return Status(StatusCode::kFailedPrecondition, "LowDiffPlus: closed");
    if (!s.error.ok()) return s.error;
    for (std::size_t i = 0; i < s.params.size(); ++i) {
      bool has = s.params[i].grad().defined();
      if (has && !s.handed[i]) {
        return Status(StatusCode::kInvalidArgument,
                      "LowDiffPlus: parameter '" + s.names[i] +
                          "' has a gradient that was not handed over this iteration; the "
                          "replica would miss it");
      }
      next.with_gradient.push_back(has);
    }
  }
  try {
    s.training->step();
    for (const auto& group : s.training->param_groups()) {
      next.group_options.push_back(group.options().clone());
    }
  } catch (const c10::Error& e) {
    return LibtorchError("LowDiffPlus: the training optimizer's step", e);
  }
  next.extra_state.assign(extra_state.begin(), extra_state.end());
  auto began = std::chrono::steady_clock::now();
  MutexLock lock(s.mu);
  while (s.copies_done < s.copies_queued && s.error.ok()) s.cv.Wait(lock);
  s.stats.training_wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  s.copies_done = s.copies_queued = 0;
  s.handed.assign(s.params.size(), false);
  if (!s.error.ok()) return s.error;
  next.iteration = ++s.iteration;
  s.stepped = true;
  ++s.stats.iterations;
  s.iterations.push_back(std::move(next));
  s.cv.NotifyAll();
  return Status::Ok();
}

Result<RestoreInfo> LowDiffPlus::Restore() {
  State& s = *state_;
  bool closed = false;
  {
    MutexLock lock(s.mu);
    closed = s.closed;
  }
  if (s.stepped || closed) {
    return Status(StatusCode::kFailedPrecondition,
                  "LowDiffPlus: Restore must come before the first Step and before Close");
  }
  PMSNAP_ASSIGN_OR_RETURN(RestoreInfo info, s.checkpointer->Restore());
  try {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < s.params.size(); ++i) s.params[i].copy_(s.replica[i]);
    CopyOptimizerState(*s.replica_optimizer, *s.training);
  } catch (const c10::Error& e) {
    return LibtorchError("LowDiffPlus: copying the restored replica into the model", e);
  }
  MutexLock lock(s.mu);
  s.iteration = s.replica_done = info.iteration;
  return info;
}

Status LowDiffPlus::Flush() {
  PMSNAP_RETURN_IF_ERROR(state_->WaitForReplica(iteration()));
  return state_->checkpointer->Flush();
}

Status LowDiffPlus::Close(runtime::CloseMode mode) {
  State& s = *state_;
  {
    MutexLock lock(s.mu);
    if (s.closed) return Status::Ok();
  }
  Status waited;
  if (mode == runtime::CloseMode::kFinish) waited = s.WaitForReplica(iteration());
  {
    MutexLock lock(s.mu);
    s.closed = true;
    if (mode != runtime::CloseMode::kFinish) s.iterations.clear();
  }
  s.Stop();
  Status closed = s.checkpointer->Close(waited.ok() ? mode : runtime::CloseMode::kAbandon);
  return waited.ok() ? closed : waited;
}

std::uint64_t LowDiffPlus::iteration() const {
  MutexLock lock(state_->mu);
  return state_->iteration;
}

const std::vector<torch::Tensor>& LowDiffPlus::replica_parameters() const {
  return state_->replica;
}

torch::optim::Optimizer& LowDiffPlus::replica_optimizer() { return *state_->replica_optimizer; }

LowDiffPlusStats LowDiffPlus::stats() const {
  MutexLock lock(state_->mu);
  return state_->stats;
}

runtime::Stats LowDiffPlus::checkpoint_stats() const { return state_->checkpointer->stats(); }

}  // namespace pmsnap::hooks
