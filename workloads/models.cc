#include "pmsnap/workloads/models.h"

#include <string>

namespace pmsnap::workloads {

torch::nn::Sequential MlpStack(const std::vector<std::int64_t>& widths, bool relu_after_last) {
  torch::nn::Sequential mlp;
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    mlp->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
    if (i + 2 < widths.size() || relu_after_last) mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

namespace {

// first, hidden..., last
std::vector<std::int64_t> Widths(std::int64_t first, const std::vector<std::int64_t>& hidden,
                                 std::int64_t last) {
  std::vector<std::int64_t> widths = {first};
  widths.insert(widths.end(), hidden.begin(), hidden.end());
  widths.push_back(last);
  return widths;
}

}  // namespace

DlrmImpl::DlrmImpl(const DlrmOptions& o) {
  bottom = register_module("bottom", MlpStack(Widths(o.dense_features, o.bottom_hidden, o.dim),
                                              /*relu_after_last=*/true));
  for (std::int64_t t = 0; t < o.tables; ++t) {
    tables.push_back(register_module(
        "emb" + std::to_string(t),
        torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(o.rows, o.dim).mode(torch::kSum))));
  }
  const std::int64_t features = o.tables + 1;
  const std::int64_t pairs = features * (features - 1) / 2;
  top = register_module(
      "top", MlpStack(Widths(o.dim + pairs, o.top_hidden, 1), /*relu_after_last=*/false));
  auto index = torch::triu_indices(features, features, 1);
  pair_rows = index[0];
  pair_cols = index[1];
}

torch::Tensor DlrmImpl::forward(const torch::Tensor& dense, const std::vector<torch::Tensor>& ids,
                                const torch::Tensor& offsets) {
  torch::Tensor x = bottom->forward(dense);
  std::vector<torch::Tensor> features = {x};
  for (std::size_t t = 0; t < tables.size(); ++t) {
    features.push_back(tables[t]->forward(ids[t], offsets));
  }
  // DLRM's interaction: every pairwise dot product of the feature vectors.
  torch::Tensor stacked = torch::stack(features, 1);  // [B, F, D]
  torch::Tensor dots = torch::bmm(stacked, stacked.transpose(1, 2));
  torch::Tensor pairs = dots.index({torch::indexing::Slice(), pair_rows, pair_cols});
  return top->forward(torch::cat({x, pairs}, 1)).squeeze(1);
}

TransformerImpl::TransformerImpl(const TransformerOptions& o) {
  for (std::int64_t l = 0; l < o.layers; ++l) {
    layers.push_back(register_module(
        "block" + std::to_string(l),
        torch::nn::TransformerEncoderLayer(torch::nn::TransformerEncoderLayerOptions(o.dim, o.heads)
                                               .dim_feedforward(4 * o.dim)
                                               .dropout(0.0))));
  }
  head = register_module("head", torch::nn::Linear(o.dim, o.dim));
}

torch::Tensor TransformerImpl::forward(torch::Tensor x) {
  for (auto& layer : layers) x = layer->forward(x);
  return head->forward(x);
}

}  // namespace pmsnap::workloads
