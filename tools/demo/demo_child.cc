// One pmsnap-demo training run in a child process (--role=baseline or
// train): the DLRM-like model, its data, and the training loop with or
// without a CheckpointedOptimizer (demo.h).
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/common/memory_usage.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/extra_state.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/workloads/models.h"
#include "pmsnap/workloads/state_dump.h"
#include "pmsnap/workloads/zipf_rows.h"

#include "demo.h"

namespace pmsnap::demo {
namespace {

// ---------------------------------------------------------------- model

// The DLRM-like model of workloads/ at the demo's size.
pmsnap::workloads::DlrmOptions ModelShape(const Options& o) {
  pmsnap::workloads::DlrmOptions shape;
  shape.tables = o.tables;
  shape.rows = o.rows;
  shape.dim = o.dim;
  shape.dense_features = o.dense;
  shape.bottom_hidden = {64};
  shape.top_hidden = {64, 32};
  return shape;
}

// Synthetic click data: batch `iteration` is a pure function of (seed,
// iteration), so a resumed process sees the same stream.
class ZipfData {
 public:
  explicit ZipfData(const Options& o) : o_(o), zipf_(o.rows, o.zipf) {}

  struct Batch {
    torch::Tensor dense, offsets, labels;
    std::vector<torch::Tensor> ids;
  };

  Batch Get(std::uint64_t iteration) const {
    std::mt19937_64 rng(o_.seed * 0x9E3779B97F4A7C15ull + iteration);
    std::normal_distribution<float> normal;
    std::uniform_real_distribution<double> uniform;
    Batch b;
    b.dense = torch::empty({o_.batch, o_.dense});
    float* d = b.dense.data_ptr<float>();
    for (std::int64_t i = 0; i < o_.batch * o_.dense; ++i) d[i] = normal(rng);
    b.offsets = torch::arange(0, o_.batch * o_.bag, o_.bag, torch::kLong);
    b.labels = torch::empty({o_.batch});
    std::vector<double> hotness(static_cast<std::size_t>(o_.batch), 0.0);
    for (int t = 0; t < o_.tables; ++t) {
      torch::Tensor ids = torch::empty({o_.batch * o_.bag}, torch::kLong);
      std::int64_t* p = ids.data_ptr<std::int64_t>();
      for (std::int64_t i = 0; i < o_.batch * o_.bag; ++i) {
        const std::int64_t rank = zipf_.Rank(uniform(rng));
        p[i] = zipf_.Row(rank, t);
        hotness[static_cast<std::size_t>(i / o_.bag)] += rank < 100 ? 1.0 : 0.0;
      }
      b.ids.push_back(ids);
    }
    float* y = b.labels.data_ptr<float>();
    for (std::int64_t i = 0; i < o_.batch; ++i) {
      const double score = d[i * o_.dense] + 0.5 * d[i * o_.dense + 1] +
                           0.3 * hotness[static_cast<std::size_t>(i)] / o_.tables - 0.5 +
                           0.3 * normal(rng);
      y[i] = score > 0 ? 1.0f : 0.0f;
    }
    return b;
  }

 private:
  const Options& o_;
  pmsnap::workloads::ZipfRows zipf_;
};

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const Options& o,
                                                       std::vector<torch::Tensor> params) {
  namespace optim = torch::optim;
  if (o.optimizer == "sgd") {
    return std::make_unique<optim::SGD>(params, optim::SGDOptions(o.lr).momentum(0.9));
  }
  if (o.optimizer == "adam") return std::make_unique<optim::Adam>(params, optim::AdamOptions(o.lr));
  if (o.optimizer == "adamw") {
    return std::make_unique<optim::AdamW>(params, optim::AdamWOptions(o.lr));
  }
  if (o.optimizer == "adagrad") {
    return std::make_unique<optim::Adagrad>(params, optim::AdagradOptions(o.lr));
  }
  if (o.optimizer == "rmsprop") {
    return std::make_unique<optim::RMSprop>(params, optim::RMSpropOptions(o.lr));
  }
  return nullptr;
}

// ---------------------------------------------------------------- children

int ChildFail(const std::string& message) {
  std::fprintf(stderr, "pmsnap-demo child: %s\n", message.c_str());
  return 2;
}

// The final parameters and optimizer state, for the parent's byte-for-byte
// comparison; the child's exit status.
int WriteState(const std::string& path, pmsnap::workloads::Dlrm& model,
               torch::optim::Optimizer& optimizer) {
  const pmsnap::Status written = pmsnap::workloads::WriteStateDump(path, *model, optimizer);
  return written.ok() ? 0 : ChildFail(written.ToString());
}

// Prints "step k" after each iteration for the parent's progress display.
void Report(std::uint64_t step) {
  std::printf("step %llu\n", static_cast<unsigned long long>(step));
  std::fflush(stdout);
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<std::size_t>(q * static_cast<double>(values.size() - 1))];
}

}  // namespace

int RunChild(const Options& o) {
  const CpuPlan cpus = PlanCpus(o);
  if (!cpus.training.empty()) {
    // Before libtorch starts any thread: they inherit the training CPU.
    const pmsnap::Status pinned = pmsnap::PinCurrentThread(cpus.training, "training thread");
    if (!pinned.ok()) return ChildFail(pinned.ToString());
  }
  torch::set_num_threads(o.threads);
  torch::manual_seed(o.seed);
  pmsnap::workloads::Dlrm model(ModelShape(o));
  auto optimizer = MakeOptimizer(o, model->parameters());
  if (!optimizer) return ChildFail("unknown optimizer " + o.optimizer);
  ZipfData data(o);
  // Marks the rows each table's lookups read (what Adagrad then changes);
  // set by the checkpointed run.
  std::function<pmsnap::Status(const ZipfData::Batch&)> mark_rows;
  auto train_one = [&](std::uint64_t step) {
    optimizer->zero_grad();
    ZipfData::Batch b = data.Get(step);
    torch::Tensor loss = torch::binary_cross_entropy_with_logits(
        model->forward(b.dense, b.ids, b.offsets), b.labels);
    loss.backward();
    if (mark_rows) {
      const pmsnap::Status marked = mark_rows(b);
      if (!marked.ok()) throw std::runtime_error(marked.ToString());
    }
    return loss.item<double>();
  };
  std::ofstream stats(o.stats, std::ios::trunc);

  if (o.role == "baseline") {
    const auto start = Clock::now();
    for (std::uint64_t step = 1; step <= o.iterations; ++step) {
      train_one(step);
      optimizer->step();
      Report(step);
    }
    stats << "iteration_seconds " << SecondsSince(start) / static_cast<double>(o.iterations)
          << "\n"
          << "peak_rss_bytes " << pmsnap::PeakRssBytes() << "\n";
    return WriteState(o.out, model, *optimizer);
  }

  // role == "train": checkpoint every iteration, resume from the pool if it has a commit.
  std::string device_note;
  auto device = pmsnap::runtime::MakeDevice(o.device, &device_note);
  if (!device.ok()) return ChildFail(device.status().ToString());
  pmsnap::runtime::EngineOptions engine;
  engine.pool_path = o.pool;
  engine.workers = cpus.worker_count;
  engine.worker_cpus = cpus.workers;
  engine.device = device->get();
  engine.print_summary = false;  // the demo prints its own stall profile
  engine.strategy = pmsnap::conflict::MakeStrategy(o.strategy);
  if (!engine.strategy) return ChildFail("unknown strategy " + o.strategy);
  // Embedding tables: differential checkpoints of the rows a step changed.
  // The demo's tables are plain EmbeddingBags, so it marks each batch's ids
  // itself (RowSource::kLookups through the checkpointer's trackers).
  pmsnap::hooks::EmbeddingTables tables;
  if (o.tables_policy == "differential") {
    for (int t = 0; t < o.tables; ++t) tables.names.push_back("emb" + std::to_string(t) + ".weight");
    tables.options.policy = pmsnap::diff::Policy::kIntermittentDifferential;
    tables.rows = pmsnap::hooks::RowSource::kLookups;
  }
  if (o.policy == "every1") {
    engine.policy = std::make_shared<pmsnap::runtime::EveryKPolicy>(1);
  } else if (o.policy != "continuous") {
    return ChildFail("unknown policy " + o.policy);
  }
  const auto open_start = Clock::now();
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : model->named_parameters()) named.emplace_back(item.key(), item.value());
  auto checkpointed =
      pmsnap::hooks::CheckpointedOptimizer::Create(named, *optimizer, engine, tables);
  if (!checkpointed.ok()) return ChildFail(checkpointed.status().ToString());
  std::vector<pmsnap::diff::RowTracker*> trackers;
  for (const std::string& name : tables.names) {
    trackers.push_back((*checkpointed)->embedding_checkpointer()->tracker(name));
    if (trackers.back() == nullptr) return ChildFail("no row tracker for table " + name);
  }
  const double open_seconds = SecondsSince(open_start);
  const auto restore_start = Clock::now();
  auto restored = (*checkpointed)->Restore();
  std::uint64_t done = 0;
  if (restored.ok()) {
    auto extra = pmsnap::hooks::UnpackExtraState(restored->extra_state);
    if (!extra.ok()) return ChildFail(extra.status().ToString());
    pmsnap::Status rng = pmsnap::hooks::RestoreCpuRngState(extra->rng_state);
    if (!rng.ok()) return ChildFail(rng.ToString());
    done = extra->data_position;
  } else if (restored.status().code() != pmsnap::StatusCode::kNotFound) {
    return ChildFail(restored.status().ToString());
  }
  const double restore_seconds = SecondsSince(restore_start);
  std::printf("restored %llu %.6f %.6f\n", static_cast<unsigned long long>(done), open_seconds,
              restore_seconds);
  std::fflush(stdout);

  mark_rows = [&trackers](const ZipfData::Batch& b) {
    for (std::size_t t = 0; t < trackers.size(); ++t) {
      const torch::Tensor& ids = b.ids[t];
      PMSNAP_RETURN_IF_ERROR(trackers[t]->Mark(
          {ids.data_ptr<std::int64_t>(), static_cast<std::size_t>(ids.numel())}));
    }
    return pmsnap::Status::Ok();
  };
  const auto start = Clock::now();
  double loss = 0;
  for (std::uint64_t step = done + 1; step <= o.iterations; ++step) {
    loss = train_one(step);
    pmsnap::hooks::ExtraState extra;
    extra.data_position = step;
    auto rng = pmsnap::hooks::CaptureCpuRngState();
    if (!rng.ok()) return ChildFail(rng.status().ToString());
    extra.rng_state = std::move(rng).value();
    pmsnap::Status status = (*checkpointed)->Step(pmsnap::hooks::PackExtraState(extra));
    if (!status.ok())
      return ChildFail("iteration " + std::to_string(step) + ": " + status.ToString());
    Report(step);
  }
  const double train_seconds = SecondsSince(start);
  pmsnap::Status flushed = (*checkpointed)->Close();
  if (!flushed.ok()) return ChildFail(flushed.ToString());
  const pmsnap::runtime::Stats s = (*checkpointed)->stats();
  const double iterations = static_cast<double>(o.iterations - done);
  stats.precision(9);
  stats << "restored " << done << "\n"
        << "open_seconds " << open_seconds << "\n"
        << "restore_seconds " << restore_seconds << "\n"
        << "iterations " << (o.iterations - done) << "\n"
        << "iteration_seconds " << (iterations > 0 ? train_seconds / iterations : 0) << "\n"
        << "blocked_seconds " << s.blocked_seconds << "\n"
        << "conflict_wait_seconds " << s.conflict_wait_seconds << "\n"
        << "boundary_wait_seconds " << s.boundary_wait_seconds << "\n"
        << "blocked_p50 " << Percentile(s.blocked_per_step, 0.5) << "\n"
        << "blocked_p99 " << Percentile(s.blocked_per_step, 0.99) << "\n"
        << "blocked_max " << Percentile(s.blocked_per_step, 1.0) << "\n"
        << "conflicts " << s.conflicts << "\n"
        << "epochs_committed " << s.epochs_committed << "\n"
        << "checkpoints_per_minute "
        << (train_seconds > 0 ? s.epochs_committed * 60.0 / train_seconds : 0) << "\n"
        << "bytes_written " << s.bytes_written << "\n"
        << "encoded_bytes_written " << s.encoded_bytes_written << "\n"
        << "last_epoch_seconds " << s.last_epoch_seconds << "\n"
        << "pool_mapped_bytes " << s.memory.pool_mapped_bytes << "\n"
        << "pool_resident_bytes " << s.memory.pool_resident_bytes << "\n"
        << "staging_bytes " << s.memory.staging_bytes << "\n"
        << "registered_bytes " << s.memory.registered_bytes << "\n"
        << "peak_rss_bytes " << pmsnap::PeakRssBytes() << "\n"
        << "final_loss " << loss << "\n"
        << "device " << s.device << (device_note.empty() ? "" : " [" + device_note + "]") << "\n"
        << "policy " << s.policy << "\n"
        << "strategy " << s.strategy << "\n"
        << "summary " << s.Summary() << "\n";
  return WriteState(o.out, model, *optimizer);
}


}  // namespace pmsnap::demo
