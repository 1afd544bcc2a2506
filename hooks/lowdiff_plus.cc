// LowDiffPlus (lowdiff_plus.h): the snapshot and replica threads.
#include "pmsnap/hooks/lowdiff_plus.h"

#include <torch/optim.h>
#include <torch/serialize.h>

#include <map>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "libtorch_error.h"
#include "pmsnap/common/mutex.h"
#include "pmsnap/frontend/replica_pipeline.h"

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
    std::vector<bool> with_gradient;
    std::vector<std::unique_ptr<optim::OptimizerOptions>> group_options;
    std::vector<std::byte> extra_state;
  };

  optim::Optimizer* training = nullptr;
  std::vector<std::string> names;
  std::vector<torch::Tensor> params;   // the trained parameters, optimizer order
  std::vector<torch::Tensor> replica;  // host copies, same order
  std::unique_ptr<optim::Optimizer> replica_optimizer;
  std::unique_ptr<CheckpointedOptimizer> checkpointer;
  std::vector<torch::Tensor> buffers[2];  // gradients of iterations t % 2
  std::uint64_t gradient_bytes = 0;
  // The schedule: hand-over, two buffers, the replica's lag, errors.
  std::unique_ptr<frontend::ReplicaPipeline> pipeline;
  // The gradient each parameter handed over this iteration: written by the
  // thread that claimed it, read by the snapshot thread (the pipeline
  // orders both).
  std::vector<torch::Tensor> handed;
  Mutex released_mu;
  std::map<std::uint64_t, Iteration> released PMSNAP_GUARDED_BY(released_mu);
  bool stepped = false;  // training thread
  std::thread snapshot_thread, replica_thread;

  void SnapshotLoop() {
    while (auto copies = pipeline->NextCopies()) {
      std::uint64_t bytes = 0;
      for (const frontend::ReplicaPipeline::Copy& copy : *copies) {
        torch::Tensor& target = buffers[copy.iteration % 2][copy.index];
        try {
          target.copy_(handed[copy.index].view_as(target));
          bytes += target.nbytes();
          handed[copy.index] = torch::Tensor();  // the caller's tensor is free again
        } catch (const c10::Error& e) {
          pipeline->RecordError(
              LibtorchError("LowDiffPlus: copying the gradient of '" + names[copy.index] + "'", e));
        }
      }
      pipeline->CopiesDone(copies->size(), bytes);
    }
  }

  void ReplicaLoop() {
    while (auto next = pipeline->NextIteration()) {
      Iteration iteration;
      {
        MutexLock lock(released_mu);
        auto found = released.find(next->iteration);
        iteration = std::move(found->second);
        released.erase(found);
      }
      if (next->apply) {
        Status status = Apply(next->iteration, iteration);
        if (!status.ok()) pipeline->RecordError(std::move(status));
      }
      pipeline->Applied(next->iteration);
    }
  }

  // The replica's update of one iteration and its checkpoint.
  Status Apply(std::uint64_t number, Iteration& next) {
    auto& groups = replica_optimizer->param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move(next.group_options[g]));
    }
    const auto& buffer = buffers[number % 2];
    for (std::size_t i = 0; i < replica.size(); ++i) {
      replica[i].mutable_grad() = next.with_gradient[i] ? buffer[i] : torch::Tensor();
    }
    Status status = checkpointer->Step(next.extra_state);
    for (auto& r : replica) r.mutable_grad() = torch::Tensor();
    return status;
  }

  void Join() {
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
  std::string pool_path = options.pool_path;
  PMSNAP_ASSIGN_OR_RETURN(state->checkpointer,
                          CheckpointedOptimizer::Create(replica_named, *state->replica_optimizer,
                                                        std::move(options)));
  state->pipeline = std::make_unique<frontend::ReplicaPipeline>(
      state->names, std::move(pool_path), state->checkpointer->iteration());
  state->handed.resize(state->params.size());
  State* s = state.get();
  s->snapshot_thread = std::thread([s] { s->SnapshotLoop(); });
  s->replica_thread = std::thread([s] { s->ReplicaLoop(); });
  return std::unique_ptr<LowDiffPlus>(new LowDiffPlus(std::move(state)));
}

Status LowDiffPlus::HandGradient(std::size_t index, const torch::Tensor& gradient) {
  State& s = *state_;
  if (index < s.params.size() &&
      (!gradient.defined() || gradient.sizes() != s.params[index].sizes() ||
       gradient.scalar_type() != s.params[index].scalar_type() || gradient.is_sparse())) {
    return Status(StatusCode::kInvalidArgument,
                  "LowDiffPlus: the gradient handed for '" + s.names[index] +
                      "' is not a dense tensor of the parameter's shape and dtype");
  }
  const std::size_t indices[] = {index};
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t iteration, s.pipeline->Claim(indices));
  s.handed[index] = gradient;
  s.pipeline->Queue(indices, iteration);
  return Status::Ok();
}

Status LowDiffPlus::Step(std::span<const std::byte> extra_state) {
  State& s = *state_;
  State::Iteration next;
  for (const auto& p : s.params) next.with_gradient.push_back(p.grad().defined());
  PMSNAP_RETURN_IF_ERROR(s.pipeline->CheckHandedOver(next.with_gradient));
  try {
    s.training->step();
    for (const auto& group : s.training->param_groups()) {
      next.group_options.push_back(group.options().clone());
    }
  } catch (const c10::Error& e) {
    return LibtorchError("LowDiffPlus: the training optimizer's step", e);
  }
  next.extra_state.assign(extra_state.begin(), extra_state.end());
  PMSNAP_ASSIGN_OR_RETURN(const std::uint64_t iteration, s.pipeline->FinishStep());
  s.stepped = true;
  {
    MutexLock lock(s.released_mu);
    s.released.emplace(iteration, std::move(next));
  }
  s.pipeline->Release(iteration);
  return Status::Ok();
}

Result<RestoreInfo> LowDiffPlus::Restore() {
  State& s = *state_;
  if (s.stepped || s.pipeline->closed()) {
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
  s.pipeline->Restored(info.iteration);
  return info;
}

Status LowDiffPlus::Flush() {
  PMSNAP_RETURN_IF_ERROR(state_->pipeline->WaitForReplica(iteration()));
  return state_->checkpointer->Flush();
}

Status LowDiffPlus::Close(runtime::CloseMode mode) {
  State& s = *state_;
  Status waited;
  if (!s.pipeline->Close(mode == runtime::CloseMode::kFinish, &waited)) return Status::Ok();
  s.Join();
  Status closed = s.checkpointer->Close(waited.ok() ? mode : runtime::CloseMode::kAbandon);
  return waited.ok() ? closed : waited;
}

std::uint64_t LowDiffPlus::iteration() const { return state_->pipeline->iteration(); }

const std::vector<torch::Tensor>& LowDiffPlus::replica_parameters() const {
  return state_->replica;
}

torch::optim::Optimizer& LowDiffPlus::replica_optimizer() { return *state_->replica_optimizer; }

LowDiffPlusStats LowDiffPlus::stats() const {
  LowDiffPlusStats out;
  static_cast<frontend::ReplicaPipelineStats&>(out) = state_->pipeline->stats();
  out.gradient_bytes_per_iteration = state_->gradient_bytes;
  return out;
}

runtime::Stats LowDiffPlus::checkpoint_stats() const { return state_->checkpointer->stats(); }

}  // namespace pmsnap::hooks
