// pmsnap-demo (training): checkpoint a DLRM-like model every iteration while
// it trains, crash it, recover it, and prove the result is bit-exact.
//
//   1. baseline  a child trains N iterations with the plain optimizer (no
//                checkpointing): the reference result and the iteration time
//                without checkpointing.
//   2. crash     a child trains with a CheckpointedOptimizer (a pmsnap epoch
//                every iteration) into a pool; the parent SIGKILLs it at a
//                random iteration, mid-step.
//   3. recover   a fresh child restores the newest committed epoch (weights,
//                optimizer state, data position, RNG) straight from the pool
//                and trains to N, still checkpointing every iteration.
//   4. verify    the recovered run's final parameters and optimizer state
//                are compared byte for byte with the baseline's; the stall
//                profile comes from Engine::stats() of the recovered run.
//   5. overhead  --rounds rounds (default 3), each a plain and a
//                checkpointed run of --round-iterations in fresh processes
//                and fresh pools, their order alternating; the overhead is
//                the median of the rounds' ratios, printed with its spread
//                and the time blocked in hooks. One cold run each would
//                compare a cold baseline with a warm machine (a fresh
//                machine printed -5.3% that way).
//
// It runs pmsnap's recommended configuration for this model and says why
// (--table-checkpoints, --strategy, --pin choose otherwise):
//   * the embedding tables through a differential policy (Check-N-Run's
//     intermittent differential): Adagrad changes only the rows a batch
//     looked up, so a checkpoint writes those rows, not the whole tables;
//   * the adaptive conflict strategy, which picks per unit from the last
//     epoch's profile;
//   * on a machine with two or more CPUs, the training thread pinned to one
//     CPU and the checkpoint workers to the others (the baseline's training
//     thread is pinned alike, so both runs compare on equal terms).
//
// Children are this executable re-executed (posix_spawn of /proc/self/exe
// with --role=...), so no libtorch thread pool is ever forked.
//
// Model: bottom MLP over dense features, embedding-bag tables looked up with
// Zipf-distributed ids (hot rows, as in recommendation traces), DLRM's
// pairwise dot-product interaction, top MLP, binary cross-entropy. Data is a
// pure function of (seed, iteration), so a resumed run sees the same batches.
#include <fcntl.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pmsnap/common/child_process.h"
#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/common/memory_usage.h"
#include "pmsnap/common/command_line.h"
#include "pmsnap/common/pool_directory.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/extra_state.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/workloads/models.h"
#include "pmsnap/workloads/state_dump.h"
#include "pmsnap/workloads/zipf_rows.h"

namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---------------------------------------------------------------- options

struct Options {
  std::string role = "main";  // main | baseline | train
  std::uint64_t iterations = 4000;
  int tables = 8;
  std::int64_t rows = 20000;
  std::int64_t dim = 16;
  std::int64_t batch = 128;
  std::int64_t bag = 8;     // ids per sample per table
  std::int64_t dense = 13;  // dense features (as in the Criteo data set)
  double zipf = 1.05;
  std::string optimizer = "adagrad";
  double lr = 0.02;
  std::string pool;  // default: $PMSNAP_POOL_DIR (or /dev/shm)/pmsnap-demo-<pid>.pool
  std::string device = "host";
  std::string policy = "every1";
  std::string tables_policy = "differential";  // differential | full
  std::string strategy = "adaptive";           // adaptive | 1..4
  std::string pin = "auto";                    // auto | off
  int workers = 0;                             // 0: from the CPUs (ResolveWorkers)
  int threads = 1;            // torch intra-op threads per child
  std::uint64_t kill_at = 0;  // 0: random in the middle half
  int rounds = 3;                    // overhead rounds; 0: compare the demo's own runs
  std::uint64_t round_iterations = 0;  // 0: a quarter of --iterations
  std::uint64_t seed = 0;     // 0: from the clock
  bool keep_pool = false;
  std::string out;    // child: where to write the final state
  std::string stats;  // child: where to write the stall profile
};

const char* kUsage =
    "usage: pmsnap-demo [flags]\n"
    "  --iterations=N      training iterations (default 4000)\n"
    "  --size=small|medium|large   preset table sizes (default small: 8 x 20000 x 16)\n"
    "  --tables=T --rows=R --dim=D --batch=B --bag=L   model and batch shape\n"
    "  --optimizer=sgd|adam|adamw|adagrad|rmsprop      (default adagrad)\n"
    "  --pool=PATH         pool file (default $PMSNAP_POOL_DIR or /dev/shm)\n"
    "  --device=host|simulated[:GBPS[:MEM_MIB]]        where tensors live (default host)\n"
    "  --policy=every1|continuous   checkpoint every iteration, or as often as possible\n"
    "  --table-checkpoints=differential|full   embedding tables: only the rows a step\n"
    "                      changed (Check-N-Run intermittent differential; default), or in full\n"
    "  --strategy=adaptive|1|2|3|4  conflict strategy (default adaptive)\n"
    "  --pin=auto|off      pin the training thread and the checkpoint workers to CPUs of\n"
    "                      their own where the machine has 2+ CPUs (default auto)\n"
    "  --workers=N         checkpoint worker threads (default: the CPUs left to them, 1-2)\n"
    "  --threads=N         torch threads per training process (default 1)\n"
    "  --kill-at=K         iteration at which the training child is killed (default random)\n"
    "  --rounds=N          overhead: N interleaved rounds of a plain and a checkpointed run\n"
    "                      (default 3; 0: compare the demo's own two runs, one cold each)\n"
    "  --round-iterations=M  iterations of each overhead run (default: --iterations / 4)\n"
    "  --seed=S            data and kill-point seed (default: clock)\n"
    "  --keep-pool         leave the pool file behind (inspect it with `pmsnap info`)\n";

bool ParseFlag(const std::string& key, const std::string& value, Options* o) {
  auto num = [&] { return std::stoull(value); };
  if (key == "--role")
    o->role = value;
  else if (key == "--iterations")
    o->iterations = num();
  else if (key == "--table-checkpoints" && (value == "differential" || value == "full"))
    o->tables_policy = value;
  else if (key == "--tables")
    o->tables = static_cast<int>(num());
  else if (key == "--strategy")
    o->strategy = value;
  else if (key == "--pin" && (value == "auto" || value == "off"))
    o->pin = value;
  else if (key == "--rows")
    o->rows = static_cast<std::int64_t>(num());
  else if (key == "--dim")
    o->dim = static_cast<std::int64_t>(num());
  else if (key == "--batch")
    o->batch = static_cast<std::int64_t>(num());
  else if (key == "--bag")
    o->bag = static_cast<std::int64_t>(num());
  else if (key == "--optimizer")
    o->optimizer = value;
  else if (key == "--lr")
    o->lr = std::stod(value);
  else if (key == "--pool")
    o->pool = value;
  else if (key == "--device")
    o->device = value;
  else if (key == "--policy")
    o->policy = value;
  else if (key == "--workers")
    o->workers = static_cast<int>(num());
  else if (key == "--threads")
    o->threads = static_cast<int>(num());
  else if (key == "--kill-at")
    o->kill_at = num();
  else if (key == "--rounds")
    o->rounds = static_cast<int>(num());
  else if (key == "--round-iterations")
    o->round_iterations = num();
  else if (key == "--seed")
    o->seed = num();
  else if (key == "--keep-pool")
    o->keep_pool = true;
  else if (key == "--out")
    o->out = value;
  else if (key == "--stats")
    o->stats = value;
  else if (key == "--size") {
    if (value == "small")
      o->tables = 8, o->rows = 20000, o->dim = 16;
    else if (value == "medium")
      o->tables = 16, o->rows = 100000, o->dim = 32;
    else if (value == "large")
      o->tables = 26, o->rows = 400000, o->dim = 64;
    else
      return false;
  } else {
    return false;
  }
  return true;
}

// Flags a child needs to rebuild the same model, data and checkpointing.
std::vector<std::string> ChildFlags(const Options& o) {
  auto s = [](auto v) { return std::to_string(v); };
  std::ostringstream lr;
  lr.precision(17);
  lr << o.lr;
  return {"--iterations=" + s(o.iterations),
          "--tables=" + s(o.tables),
          "--rows=" + s(o.rows),
          "--dim=" + s(o.dim),
          "--batch=" + s(o.batch),
          "--bag=" + s(o.bag),
          "--optimizer=" + o.optimizer,
          "--lr=" + lr.str(),
          "--pool=" + o.pool,
          "--device=" + o.device,
          "--policy=" + o.policy,
          "--table-checkpoints=" + o.tables_policy,
          "--strategy=" + o.strategy,
          "--pin=" + o.pin,
          "--workers=" + s(o.workers),
          "--threads=" + s(o.threads),
          "--seed=" + s(o.seed)};
}

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

// ---------------------------------------------------------------- CPUs

// Where the training thread and the checkpoint workers run. With --pin=auto
// and 2+ CPUs: training on the first allowed CPU, workers on the others
// (bench/RESULTS.md, "Pinning the checkpoint threads": otherwise the
// scheduler tends to run a worker on the training thread's core right after
// the training thread woke it).
struct CpuPlan {
  std::vector<int> training;  // empty: not pinned
  std::vector<int> workers;
  int worker_count = 2;
  std::string why;
};

CpuPlan PlanCpus(const Options& o) {
  CpuPlan plan;
  const std::vector<int> allowed = pmsnap::AllowedCpus();
  if (o.pin == "auto" && allowed.size() >= 2) {
    plan.training = {allowed.front()};
    plan.workers.assign(allowed.begin() + 1, allowed.end());
    plan.worker_count = o.workers > 0 ? o.workers : std::min<int>(2, plan.workers.size());
    plan.why = "training thread on CPU " + pmsnap::CpuList(plan.training) + ", " +
               std::to_string(plan.worker_count) + " checkpoint worker(s) on CPU(s) " +
               pmsnap::CpuList(plan.workers) +
               ": the copies never take the training thread's core";
  } else {
    plan.worker_count = o.workers > 0 ? o.workers : 2;
    plan.why = o.pin == "off" ? "not pinned (--pin=off)"
                              : "not pinned: this process may use only " +
                                    std::to_string(allowed.size()) +
                                    " CPU, so training and copies share it";
  }
  return plan;
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

// ---------------------------------------------------------------- parent

// This program again in a child role, its stdout on a pipe.
pmsnap::ChildProcess SpawnChild(const std::string& role, const Options& o, const std::string& out,
                                const std::string& stats) {
  std::vector<std::string> args = {"/proc/self/exe", "--role=" + role, "--out=" + out,
                                   "--stats=" + stats};
  for (auto& flag : ChildFlags(o)) args.push_back(flag);
  return pmsnap::ChildProcess(std::move(args));
}

// One progress line, redrawn in place on a terminal, every 10% otherwise.
class Progress {
 public:
  Progress(std::string label, std::uint64_t total, std::uint64_t first)
      : label_(std::move(label)), total_(total), first_(first), tty_(isatty(STDOUT_FILENO)) {}
  void Update(std::uint64_t step) {
    const int percent = static_cast<int>(100 * step / std::max<std::uint64_t>(total_, 1));
    const double elapsed = SecondsSince(start_);
    const double rate = step > first_ ? static_cast<double>(step - first_) / elapsed : 0;
    if (tty_) {
      if (SecondsSince(last_draw_) < 0.1 && step != total_) return;
      last_draw_ = Clock::now();
      const int filled = percent / 4;
      std::printf("\r  %-9s [%s%s] %3d%%  iteration %llu/%llu  %.0f it/s ", label_.c_str(),
                  std::string(static_cast<std::size_t>(filled), '#').c_str(),
                  std::string(static_cast<std::size_t>(25 - filled), '.').c_str(), percent,
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(total_),
                  rate);
      std::fflush(stdout);
    } else if (percent / 10 != last_decile_) {
      last_decile_ = percent / 10;
      std::printf("  %-9s %3d%%  iteration %llu/%llu  %.0f it/s\n", label_.c_str(), percent,
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(total_),
                  rate);
      std::fflush(stdout);
    }
  }
  void Done() {
    if (tty_) std::printf("\n");
  }

 private:
  std::string label_;
  std::uint64_t total_, first_;
  bool tty_;
  int last_decile_ = -1;
  Clock::time_point start_ = Clock::now();
  Clock::time_point last_draw_{};
};

std::map<std::string, std::string> ReadStats(const std::string& path) {
  std::map<std::string, std::string> values;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto space = line.find(' ');
    if (space != std::string::npos) values[line.substr(0, space)] = line.substr(space + 1);
  }
  return values;
}

double Num(const std::map<std::string, std::string>& stats, const std::string& key) {
  auto it = stats.find(key);
  return it == stats.end() ? 0.0 : std::atof(it->second.c_str());
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `role` to completion with progress (none when `label` is empty);
// returns its exit status.
int RunWithProgress(const std::string& role, const std::string& label, const Options& o,
                    const std::string& out, const std::string& stats, std::uint64_t kill_at = 0,
                    std::uint64_t* last_step = nullptr, std::uint64_t* restored = nullptr,
                    std::mt19937_64* rng = nullptr) {
  pmsnap::ChildProcess child = SpawnChild(role, o, out, stats);
  if (!child.started()) return -1000;
  std::unique_ptr<Progress> progress;
  std::string line;
  while (child.ReadLine(&line)) {
    if (line.rfind("restored ", 0) == 0) {
      const std::uint64_t from = std::stoull(line.substr(9));
      if (restored) *restored = from;
      if (!label.empty()) progress = std::make_unique<Progress>(label, o.iterations, from);
      continue;
    }
    if (line.rfind("step ", 0) != 0) continue;
    const std::uint64_t step = std::stoull(line.substr(5));
    if (!progress && !label.empty()) progress = std::make_unique<Progress>(label, o.iterations, 0);
    if (progress) progress->Update(step);
    if (last_step) *last_step = step;
    if (kill_at != 0 && step >= kill_at) {
      // Land mid-iteration: up to ~one iteration after the report.
      std::this_thread::sleep_for(std::chrono::microseconds((*rng)() % 3000));
      child.Kill();
      break;
    }
  }
  if (progress) progress->Done();
  return child.Wait();
}

std::string Bytes(double bytes) {
  char buffer[64];
  if (bytes >= 1e9)
    std::snprintf(buffer, sizeof(buffer), "%.2f GB", bytes / 1e9);
  else
    std::snprintf(buffer, sizeof(buffer), "%.1f MB", bytes / 1e6);
  return buffer;
}

double Median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

// "median [min .. max]" of `values` scaled by `scale`, in `format` (a printf
// conversion for one double).
std::string MedianAndSpread(const std::vector<double>& values, double scale, const char* format) {
  auto text = [&](double v) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), format, v * scale);
    return std::string(buffer);
  };
  if (values.empty()) return "-";
  const auto [low, high] = std::minmax_element(values.begin(), values.end());
  return text(Median(values)) + "  [" + text(*low) + " .. " + text(*high) + "]";
}

// Per-round figures of the overhead measurement (seconds per iteration).
struct OverheadRounds {
  std::vector<double> plain, checkpointed, blocked, overhead;
  std::vector<double> plain_peak_rss, checkpointed_peak_rss;  // bytes
};

// Runs o.rounds rounds of a plain and a checkpointed child, fresh processes
// and a fresh pool each, the order alternating between rounds so that
// neither side always runs first (cold). Returns the rounds, or an error
// message naming the run that failed.
pmsnap::Result<OverheadRounds> MeasureOverhead(const Options& o, const std::string& work) {
  Options run = o;
  run.iterations = o.round_iterations;
  OverheadRounds rounds;
  for (int round = 1; round <= o.rounds; ++round) {
    double plain = 0, checkpointed = 0, blocked = 0;
    for (int turn = 0; turn < 2; ++turn) {
      const bool plain_turn = (turn == 0) == (round % 2 == 1);
      const std::string tag = "round" + std::to_string(round) + (plain_turn ? "-plain" : "-ckpt");
      run.pool = work + "/" + tag + ".pool";
      const std::string stats_path = work + "/" + tag + ".stats";
      const int rc = RunWithProgress(plain_turn ? "baseline" : "train", "", run,
                                     work + "/" + tag + ".state", stats_path);
      if (rc != 0) {
        return pmsnap::Status(pmsnap::StatusCode::kInternal,
                              "overhead run " + tag + " failed (exit " + std::to_string(rc) + ")");
      }
      const auto stats = ReadStats(stats_path);
      if (plain_turn) {
        plain = Num(stats, "iteration_seconds");
        rounds.plain_peak_rss.push_back(Num(stats, "peak_rss_bytes"));
      } else {
        rounds.checkpointed_peak_rss.push_back(Num(stats, "peak_rss_bytes"));
        checkpointed = Num(stats, "iteration_seconds");
        blocked = Num(stats, "blocked_seconds") / std::max(1.0, Num(stats, "iterations"));
      }
      std::filesystem::remove(run.pool);
      std::filesystem::remove(work + "/" + tag + ".state");
    }
    rounds.plain.push_back(plain);
    rounds.checkpointed.push_back(checkpointed);
    rounds.blocked.push_back(blocked);
    rounds.overhead.push_back(plain > 0 ? checkpointed / plain - 1 : 0);
    std::printf("  round %d/%d  plain %.3f ms/it, checkpointed %.3f ms/it (%+.1f%%), "
                "blocked %.3f ms/it\n",
                round, o.rounds, plain * 1e3, checkpointed * 1e3, rounds.overhead.back() * 1e2,
                blocked * 1e3);
    std::fflush(stdout);
  }
  return rounds;
}

int RunParent(Options o) {
  if (o.seed == 0) {
    o.seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) % 1000000007 + 1;
  }
  std::mt19937_64 rng(o.seed);
  if (o.kill_at == 0)
    o.kill_at = o.iterations / 4 + rng() % std::max<std::uint64_t>(o.iterations / 2, 1);
  if (o.kill_at >= o.iterations) o.kill_at = o.iterations - 1;
  if (o.round_iterations == 0) o.round_iterations = std::max<std::uint64_t>(o.iterations / 4, 4);
  const std::string dir = pmsnap::PoolDirectory();
  if (o.pool.empty()) o.pool = dir + "/pmsnap-demo-" + std::to_string(getpid()) + ".pool";
  if (std::filesystem::exists(o.pool)) {
    std::fprintf(stderr, "pmsnap-demo: %s exists; pass another --pool or remove it\n",
                 o.pool.c_str());
    return 1;
  }
  const std::string work = dir + "/pmsnap-demo-" + std::to_string(getpid());
  std::filesystem::create_directories(work);
  const bool simulated = o.device.rfind("simulated", 0) == 0;

  // Sizes, for the banner (computed, not built: the parent never touches torch).
  const double embedding_params = static_cast<double>(o.tables) * o.rows * o.dim;
  const double state_factor = o.optimizer == "adam" || o.optimizer == "adamw" ? 3 : 2;
  std::printf(
      "pmsnap-demo: DLRM-like model, %d embedding tables x %lld rows x %lld dims "
      "(Zipf %.2f ids), bottom/top MLPs\n",
      o.tables, static_cast<long long>(o.rows), static_cast<long long>(o.dim), o.zipf);
  std::printf("  optimizer %s, %llu iterations of batch %lld, checkpoint %s, device %s%s\n",
              o.optimizer.c_str(), static_cast<unsigned long long>(o.iterations),
              static_cast<long long>(o.batch),
              o.policy == "every1" ? "every iteration" : "continuously", o.device.c_str(),
              simulated ? " (SIMULATED device: modelled bandwidth and memory)" : "");
  std::printf("  ~%s of parameters + optimizer state in the model; pool %s; seed %llu\n",
              Bytes(embedding_params * 4 * state_factor).c_str(), o.pool.c_str(),
              static_cast<unsigned long long>(o.seed));
  // What the demo chose, and why (the recommended configuration unless a
  // flag said otherwise).
  const CpuPlan cpus = PlanCpus(o);
  std::printf("configuration:\n");
  if (o.tables_policy == "differential") {
    std::printf(
        "  embedding tables  differential (Check-N-Run intermittent differential): %s changes\n"
        "                    only the rows a batch looked up, so each checkpoint writes those\n"
        "                    rows and a full table only when the changed rows add up to one\n",
        o.optimizer.c_str());
    if (o.optimizer != "adagrad" && o.optimizer != "sgd") {
      std::printf(
          "                    (note: %s moves every row each step, so every row is written)\n",
          o.optimizer.c_str());
    }
  } else {
    std::printf("  embedding tables  written in full every checkpoint (--table-checkpoints=full)\n");
  }
  std::printf("  conflict strategy %s%s\n", o.strategy.c_str(),
              o.strategy == "adaptive"
                  ? ": picks per unit from the last epoch's profile (wait, copy in the "
                    "device, or split)"
                  : " (--strategy)");
  std::printf("  CPUs              %s\n", cpus.why.c_str());
  std::printf("  checkpoint        %s\n\n",
              o.policy == "every1" ? "every iteration (the strictest: a crash loses at most one)"
                                   : "continuously (as often as the copies allow)");

  const std::string reference = work + "/baseline.state";
  const std::string baseline_stats = work + "/baseline.stats";
  const int phases = o.rounds > 0 ? 4 : 3;
  std::printf("[1/%d] uninterrupted run, plain optimizer, no checkpointing\n", phases);
  if (int rc = RunWithProgress("baseline", "baseline", o, reference, baseline_stats); rc != 0) {
    std::fprintf(stderr, "pmsnap-demo: baseline run failed (%d)\n", rc);
    return 1;
  }

  std::printf("[2/%d] checkpointed run, killed with SIGKILL at iteration %llu\n", phases,
              static_cast<unsigned long long>(o.kill_at));
  std::uint64_t last_step = 0;
  const std::string crash_stats = work + "/crash.stats";
  const int crash_rc = RunWithProgress("train", "training", o, work + "/crash.state", crash_stats,
                                       o.kill_at, &last_step, nullptr, &rng);
  if (crash_rc != -SIGKILL) {
    std::fprintf(stderr, "pmsnap-demo: the training child ended with %d before the kill\n",
                 crash_rc);
    return 1;
  }
  std::printf("  killed (SIGKILL) after it reported iteration %llu\n",
              static_cast<unsigned long long>(last_step));

  std::printf("[3/%d] new process: restore from the pool, train to the end\n", phases);
  const std::string resumed = work + "/resumed.state";
  const std::string stats_path = work + "/resumed.stats";
  std::uint64_t restored = 0;
  if (int rc = RunWithProgress("train", "recovered", o, resumed, stats_path, 0, nullptr, &restored);
      rc != 0) {
    std::fprintf(stderr, "pmsnap-demo: recovery run failed (%d)\n", rc);
    return 1;
  }
  const auto stats = ReadStats(stats_path);
  const auto base = ReadStats(baseline_stats);
  std::printf(
      "  restored iteration %llu (the kill lost %lld iteration(s)); open %.1f ms, "
      "restore %.1f ms\n\n",
      static_cast<unsigned long long>(restored),
      static_cast<long long>(last_step) - static_cast<long long>(restored),
      Num(stats, "open_seconds") * 1e3, Num(stats, "restore_seconds") * 1e3);

  const std::string a = ReadAll(reference);
  const std::string b = ReadAll(resumed);
  const bool exact = !a.empty() && a == b;
  std::printf(
      "bit-exact: %s  (%s of final parameters + optimizer state compared with the "
      "uninterrupted run)\n\n",
      exact ? "YES" : "NO", Bytes(static_cast<double>(a.size())).c_str());

  std::optional<OverheadRounds> rounds;
  if (o.rounds > 0) {
    std::printf(
        "[4/4] overhead: %d rounds of %llu iterations, each a plain and a checkpointed run "
        "(fresh processes and pools, the order alternating)\n",
        o.rounds, static_cast<unsigned long long>(o.round_iterations));
    auto measured = MeasureOverhead(o, work);
    if (!measured.ok()) {
      std::fprintf(stderr, "pmsnap-demo: %s\n", measured.status().message().c_str());
      return 1;
    }
    rounds = std::move(measured).value();
    std::printf("\n");
  }

  const double iterations = std::max(1.0, Num(stats, "iterations"));
  if (rounds) {
    std::printf("overhead (median of %d interleaved rounds of %llu iterations  [min .. max])\n",
                o.rounds, static_cast<unsigned long long>(o.round_iterations));
    std::printf("  iteration time, plain optimizer       %s ms\n",
                MedianAndSpread(rounds->plain, 1e3, "%.3f").c_str());
    std::printf("  iteration time, checkpoint %-10s %s ms\n",
                o.policy == "every1" ? "every it." : "continuous",
                MedianAndSpread(rounds->checkpointed, 1e3, "%.3f").c_str());
    std::printf("  overhead (checkpointed / plain - 1)   %s %%\n",
                MedianAndSpread(rounds->overhead, 1e2, "%+.1f").c_str());
    std::printf("  blocked in hooks per iteration        %s ms\n",
                MedianAndSpread(rounds->blocked, 1e3, "%.3f").c_str());
    std::printf("  peak resident set, plain optimizer    %s MB\n",
                MedianAndSpread(rounds->plain_peak_rss, 1e-6, "%.1f").c_str());
    std::printf("  peak resident set, checkpointed       %s MB\n\n",
                MedianAndSpread(rounds->checkpointed_peak_rss, 1e-6, "%.1f").c_str());
  }
  std::printf("stall profile (recovered run, %s, %s, device %s)\n",
              stats.count("policy") ? stats.at("policy").c_str() : "?",
              stats.count("strategy") ? stats.at("strategy").c_str() : "?",
              stats.count("device") ? stats.at("device").c_str() : "?");
  if (!rounds) {
    // One run each, the baseline first and cold: indicative only.
    const double plain = Num(base, "iteration_seconds");
    const double with = Num(stats, "iteration_seconds");
    std::printf("  iteration time without checkpointing  %8.3f ms  (one cold run: --rounds=0)\n",
                plain * 1e3);
    std::printf("  iteration time with checkpointing     %8.3f ms  (%+.1f%%, recovered run)\n",
                with * 1e3, plain > 0 ? (with / plain - 1) * 100 : 0.0);
  }
  std::printf(
      "  blocked in hooks per iteration        %8.3f ms mean, p50 %.3f, p99 %.3f, "
      "max %.3f ms\n",
      Num(stats, "blocked_seconds") / iterations * 1e3, Num(stats, "blocked_p50") * 1e3,
      Num(stats, "blocked_p99") * 1e3, Num(stats, "blocked_max") * 1e3);
  std::printf("    of which waiting for a unit's snapshot (conflicts: %.0f)  %.3f ms/it\n",
              Num(stats, "conflicts"), Num(stats, "conflict_wait_seconds") / iterations * 1e3);
  std::printf("    of which waiting for the previous epoch at the step boundary  %.3f ms/it\n",
              Num(stats, "boundary_wait_seconds") / iterations * 1e3);
  std::printf(
      "  pmsnap's memory                       pool %s mapped (%s resident; on tmpfs that is "
      "DRAM), staging %s, pinned %s\n",
      Bytes(Num(stats, "pool_mapped_bytes")).c_str(), Bytes(Num(stats, "pool_resident_bytes")).c_str(),
      Bytes(Num(stats, "staging_bytes")).c_str(), Bytes(Num(stats, "registered_bytes")).c_str());
  std::printf("  checkpoints committed                 %8.0f  (%.0f per minute)\n",
              Num(stats, "epochs_committed"), Num(stats, "checkpoints_per_minute"));
  std::printf("  written to the pool                   %s, last epoch %.2f ms capture->commit\n",
              Bytes(Num(stats, "bytes_written")).c_str(), Num(stats, "last_epoch_seconds") * 1e3);
  if (Num(stats, "encoded_bytes_written") > 0) {
    std::printf("    + embedding-table chunks            %s (%.1f KB per checkpoint)\n",
                Bytes(Num(stats, "encoded_bytes_written")).c_str(),
                Num(stats, "encoded_bytes_written") /
                    std::max(1.0, Num(stats, "epochs_committed")) / 1e3);
  }
  if (stats.count("summary")) std::printf("  %s\n", stats.at("summary").c_str());

  std::filesystem::remove_all(work);
  if (!o.keep_pool)
    std::filesystem::remove(o.pool);
  else
    std::printf("\npool kept at %s\n", o.pool.c_str());
  return exact ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (auto exit_code =
          pmsnap::ParseCommandLine(argc, argv, "pmsnap-demo", kUsage,
                                   [&options](const std::string& key, const std::string& value) {
                                     return ParseFlag(key, value, &options);
                                   })) {
    return *exit_code;
  }
  if (options.iterations < 4 || options.tables < 1 || options.rows < 1 || options.dim < 1 ||
      options.batch < 1 || options.bag < 1) {
    std::fprintf(stderr, "pmsnap-demo: sizes must be positive and --iterations at least 4\n");
    return 1;
  }
  try {
    if (options.role == "main") return RunParent(options);
    if (options.role == "baseline" || options.role == "train") return RunChild(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pmsnap-demo: %s\n", error.what());
    return 2;
  }
  std::fprintf(stderr, "pmsnap-demo: unknown role %s\n", options.role.c_str());
  return 1;
}
