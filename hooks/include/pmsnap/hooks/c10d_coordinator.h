// C10dCoordinator: runtime::Coordinator on a c10d backend (libtorch's
// process groups: gloo on CPU, NCCL on GPUs), for C++ trainers that run
// torch.distributed without Python. Python front ends use torch.distributed
// directly (python/pmsnap), so the extension keeps no libtorch link.
//
// Pass a backend that works on CPU tensors (gloo): pmsnap's exchanges are a
// few integers and host bytes. With NCCL for training, make a gloo group for
// pmsnap beside it (torch.distributed.new_group(backend="gloo") in Python;
// a ProcessGroupGloo on the same store in C++), which also keeps pmsnap's
// all-reduces off the gradients' stream.
//
// Thread-safety: the runtime::Coordinator contract (one thread at a time).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <memory>

#include "pmsnap/runtime/coordinator.h"

namespace pmsnap::hooks {

class C10dCoordinator final : public runtime::Coordinator {
 public:
  // Shares ownership of `backend`; it must be a CPU-capable backend whose
  // members all create a C10dCoordinator (or otherwise issue the same
  // collectives in the same order).
  explicit C10dCoordinator(c10::intrusive_ptr<c10d::Backend> backend);

  int rank() const override;
  int world_size() const override;
  Status StartMinAllReduce(std::span<const std::int64_t> values) override;
  Result<std::vector<std::int64_t>> FinishMinAllReduce() override;
  Status Broadcast(std::span<std::byte> bytes, int root) override;

 private:
  c10::intrusive_ptr<c10d::Backend> backend_;
  // The all-reduce in flight: its work handle and the tensor it reduces.
  c10::intrusive_ptr<c10d::Work> pending_work_;
  at::Tensor pending_values_;
};

}  // namespace pmsnap::hooks
