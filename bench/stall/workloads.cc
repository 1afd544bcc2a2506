#include "stall/workloads.h"

#include <cstdio>
#include <random>

#include "pmsnap/hooks/optimizer_state.h"
#include "pmsnap/workloads/models.h"
#include "pmsnap/workloads/zipf_rows.h"

namespace pmsnap::bench::stall {

namespace {

std::int64_t CountParameters(const torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// Adam (lr 1e-4) over `net`, and a regression step on 4 precomputed random
// batches of `shape` (inputs and targets alike): the MLP and the
// transformer train the same way.
template <typename Net>
void TrainWithAdamOnRandomBatches(Workload& w, Net net, const std::vector<std::int64_t>& shape) {
  w.module = net.ptr();
  w.make_optimizer = [net]() -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-4));
  };
  w.optimizer = w.make_optimizer();
  std::vector<torch::Tensor> xs, ys;
  for (int b = 0; b < 4; ++b) {
    xs.push_back(torch::randn(shape));
    ys.push_back(torch::randn(shape));
  }
  auto* opt = w.optimizer.get();
  w.forward_backward = [net, xs, ys, opt](std::uint64_t step) mutable {
    opt->zero_grad();
    const auto b = static_cast<std::size_t>(step % xs.size());
    torch::mse_loss(net->forward(xs[b]), ys[b]).backward();
  };
  w.parameters = CountParameters(*w.module);
}

Workload MakeMlp(const Options& o) {
  Workload w;
  w.name = "mlp";
  std::vector<std::int64_t> widths = {o.mlp_in};
  for (std::int64_t i = 0; i < o.mlp_hidden; ++i) widths.push_back(o.mlp_width);
  widths.push_back(o.mlp_in);
  TrainWithAdamOnRandomBatches(w, workloads::MlpStack(widths, /*relu_after_last=*/false),
                               {o.mlp_batch, o.mlp_in});
  char d[160];
  std::snprintf(d, sizeof(d), "MLP %lld->%lldx%lld->%lld, batch %lld, Adam",
                static_cast<long long>(o.mlp_in), static_cast<long long>(o.mlp_width),
                static_cast<long long>(o.mlp_hidden), static_cast<long long>(o.mlp_in),
                static_cast<long long>(o.mlp_batch));
  w.description = d;
  return w;
}

Workload MakeTransformer(const Options& o) {
  Workload w;
  w.name = "transformer";
  TrainWithAdamOnRandomBatches(
      w, workloads::Transformer(workloads::TransformerOptions{o.tf_dim, o.tf_layers, o.tf_heads}),
      {o.tf_seq, o.tf_batch, o.tf_dim});
  char d[160];
  std::snprintf(d, sizeof(d),
                "transformer %lld blocks, d=%lld, %lld heads, seq %lld x batch %lld, Adam",
                static_cast<long long>(o.tf_layers), static_cast<long long>(o.tf_dim),
                static_cast<long long>(o.tf_heads), static_cast<long long>(o.tf_seq),
                static_cast<long long>(o.tf_batch));
  w.description = d;
  return w;
}

Workload MakeDlrm(const Options& o) {
  Workload w;
  w.name = "dlrm";
  workloads::DlrmOptions shape;
  shape.tables = o.dlrm_tables;
  shape.rows = o.dlrm_rows;
  shape.dim = o.dlrm_dim;
  workloads::Dlrm net(shape);
  w.module = net.ptr();
  w.make_optimizer = [net]() -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adagrad>(net->parameters(),
                                                   torch::optim::AdagradOptions(0.01));
  };
  w.optimizer = w.make_optimizer();
  // Zipf(1.05) ids, hot rows scattered over each table; 8 batches, cycled.
  const workloads::ZipfRows zipf(o.dlrm_rows, 1.05);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> uniform;
  struct Batch {
    torch::Tensor dense, labels;
    std::vector<torch::Tensor> ids;
  };
  std::vector<Batch> batches;
  for (int b = 0; b < 8; ++b) {
    Batch batch;
    batch.dense = torch::randn({o.dlrm_batch, 13});
    batch.labels = torch::randint(0, 2, {o.dlrm_batch}).to(torch::kFloat);
    for (std::int64_t t = 0; t < o.dlrm_tables; ++t) {
      torch::Tensor ids = torch::empty({o.dlrm_batch * o.dlrm_bag}, torch::kLong);
      auto* p = ids.data_ptr<std::int64_t>();
      for (std::int64_t i = 0; i < o.dlrm_batch * o.dlrm_bag; ++i) {
        p[i] = zipf.Row(zipf.Rank(uniform(rng)), t);
      }
      batch.ids.push_back(ids);
    }
    batches.push_back(batch);
  }
  torch::Tensor offsets = torch::arange(0, o.dlrm_batch * o.dlrm_bag, o.dlrm_bag, torch::kLong);
  auto* opt = w.optimizer.get();
  w.forward_backward = [net, batches, offsets, opt](std::uint64_t step) mutable {
    opt->zero_grad();
    const Batch& b = batches[static_cast<std::size_t>(step % batches.size())];
    torch::binary_cross_entropy_with_logits(net->forward(b.dense, b.ids, offsets), b.labels)
        .backward();
  };
  w.parameters = CountParameters(*w.module);
  char d[200];
  std::snprintf(d, sizeof(d),
                "DLRM-like: %lld tables x %lld rows x %lld (Zipf 1.05 ids, bag %lld), "
                "bottom/top MLPs, batch %lld, Adagrad",
                static_cast<long long>(o.dlrm_tables), static_cast<long long>(o.dlrm_rows),
                static_cast<long long>(o.dlrm_dim), static_cast<long long>(o.dlrm_bag),
                static_cast<long long>(o.dlrm_batch));
  w.description = d;
  return w;
}

// Every checkpointed tensor: each parameter, then its optimizer state.
std::vector<torch::Tensor> StateTensors(torch::nn::Module& module,
                                        torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> out;
  for (const auto& p : module.parameters()) {
    out.push_back(p);
    for (const auto& t : hooks::ViewOptimizerState(optimizer, p).tensors) out.push_back(t);
  }
  return out;
}

}  // namespace

std::optional<Workload> MakeWorkload(const std::string& name, const Options& o) {
  if (name == "mlp") return MakeMlp(o);
  if (name == "transformer") return MakeTransformer(o);
  if (name == "dlrm") return MakeDlrm(o);
  std::fprintf(stderr, "unknown workload '%s' (mlp | transformer | dlrm)\n", name.c_str());
  return std::nullopt;
}

std::vector<torch::Tensor> StateTensors(Workload& w) {
  return StateTensors(*w.module, *w.optimizer);
}

std::uint64_t Bytes(const std::vector<torch::Tensor>& ts) {
  std::uint64_t n = 0;
  for (const auto& t : ts) n += static_cast<std::uint64_t>(t.numel() * t.element_size());
  return n;
}

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(const Workload& w) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : w.module->named_parameters())
    named.emplace_back(item.key(), item.value());
  return named;
}

}  // namespace pmsnap::bench::stall
