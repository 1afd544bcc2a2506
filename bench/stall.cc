// bench/stall: what checkpointing costs a real libtorch training loop, side by
// side with what a user would pick instead (issue 7, [bench]).
//
// Workloads (libtorch on CPU, sizes by flag): an MLP of ~92M parameters with
// Adam, a transformer-encoder stack with Adam, and a DLRM-like model (bottom
// MLP, embedding-bag tables looked up with Zipf ids, top MLP) with Adagrad.
// Methods, interleaved round-robin in one process on the same model, all
// with the same optimizer step (pmsnap's ParameterStepper, whose Adam and
// Adagrad update parameters of 32 MiB or more in cache-sized blocks, bitwise
// libtorch's arithmetic; --block-kib), so that the overhead column is what
// checkpointing costs and nothing else:
//   none               the step, no checkpoint (the reference)
//   none-libtorch      libtorch's own optimizer.step(), no checkpoint: what a
//                      libtorch user runs today (not with --block-kib=0)
//   torch-save-kK      synchronous torch::save of module + optimizer every K
//   checkfreq-alg1     CheckFreq style: stop, copy the whole state into DRAM,
//                      resume, torch::save the copy on a background thread;
//                      interval from Algorithm 1 (CheckFreqPolicy::ComputeInterval)
//   checkfreq-k1       the same every iteration (pmsnap's frequency)
//   weight-files-k1    weight-grained serialization (slides, "One Possible
//                      Solution"): right after a weight's update a worker
//                      copies it out and torch::saves it to its own file; the
//                      next update of a weight waits for its own snapshot
//   pmsnap-S-cont      CheckpointedOptimizer, strategy S in {1,2,3,4,adaptive},
//   pmsnap-S-kK        continuous mode or every-K
//   pmsnap-hooks-only  control: steps through the hooks, never checkpoints; its
//                      distance from `none` is hook cost plus the VM's noise
// The overhead target's cell (mlp/host) runs none, none-libtorch,
// pmsnap-adaptive-k1 and the control for --target-rounds rounds (16), the rest
// for --repeats (2).
// Devices: "host" (CPU tensors) and "simulated" (SimulatedDevice: the state
// sits behind a modelled 12 GB/s link with limited device memory; every
// method's device -> host copies go through it). Always labelled.
//
// Measures per method: iteration time (median, p99, mean), overhead over
// `none` (paired per round, median and range of rounds), training-thread
// stall split into conflict waits / boundary waits / copies / synchronous
// saves / hook overhead, checkpoints committed per minute, bytes written, the
// longest interval K for which overhead stays under 3.5%, the training
// thread's CPU cycles and instructions per iteration (perf_event_open, when
// the kernel allows it: an overhead with the same instructions in more cycles
// is interference, e.g. a worker's memory traffic), and restore time of
// the newest checkpoint (pmsnap straight from the pool vs torch::load), each
// restore in a fresh process that builds the model as a restarted trainer
// would, taking turns within each round; speedups paired by round.
// Training runs on --threads cores (torch and OpenBLAS alike), leaving the
// rest to the checkpoint workers; unless --no-pin, the training thread is
// pinned to the first CPUs and every method's checkpoint threads (pmsnap's
// workers through EngineOptions::worker_cpus, CheckFreq's persister, the
// weight-files workers) to the last --workers CPUs. Restores run unpinned.
//
//   pmsnap_bench_stall [--quick] [--help for flags]
// CSV + PNG under bench/results/ (stall.csv, stall_trials.csv,
// stall_restore.csv, stall.png).
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "pmsnap/common/child_process.h"
#include "pmsnap/common/command_line.h"
#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/conflict/strategies.h"
#include "pmsnap/hooks/checkpointed_optimizer.h"
#include "pmsnap/hooks/optimizer_state.h"
#include "pmsnap/hooks/parameter_stepper.h"
#include "pmsnap/runtime/cuda_device.h"
#include "pmsnap/runtime/interval_policy.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace pmsnap;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

constexpr double kOverheadBudget = 0.035;  // the 3.5%

// ---------------------------------------------------------------- options

struct Options {
  std::vector<std::string> workloads = {"mlp", "transformer", "dlrm"};
  std::vector<std::string> devices = {"host", "simulated"};
  std::vector<std::string> methods;  // empty: all
  // MLP: in -> width x hidden -> in, Adam.
  std::int64_t mlp_in = 1024, mlp_width = 4096, mlp_hidden = 6, mlp_batch = 16;
  // Transformer encoder stack, Adam.
  std::int64_t tf_dim = 512, tf_layers = 4, tf_heads = 8, tf_seq = 64, tf_batch = 8;
  // DLRM-like, Adagrad.
  std::int64_t dlrm_tables = 8, dlrm_rows = 100000, dlrm_dim = 32, dlrm_batch = 256, dlrm_bag = 8;
  int iters = 4;    // measured iterations per trial (at least)
  int warmup = 1;   // unmeasured iterations per trial (first touch of pools/buffers)
  int repeats = 2;  // rounds; methods interleaved within a round
  // Iteration-count budget per trial for small models: iterations are scaled
  // up so a trial lasts about this long.
  double trial_seconds = 1.5;
  int restore_rounds = 5;  // restores timed per method (median)
  // Rounds of the target cell's methods (InTargetCellMethods). Trials on this
  // VM land on levels up to +-10% apart (cycles per iteration move with them:
  // memory placement and neighbours), so the median needs many rounds.
  int target_rounds = 16;
  std::uint64_t k = 4;                     // interval of torch-save-kK
  std::vector<std::uint64_t> sweep = {2};  // extra pmsnap-adaptive-kK trials
  int threads = 1;                         // torch intra-op threads (training)
  int workers = 1;                         // checkpoint worker threads (all methods)
  std::uint64_t part_mib = 4;              // pmsnap part size
  runtime::CopyStart copy_start = runtime::CopyStart::kAuto;  // pmsnap methods
  // Block size of the stepper's cache-blocked update, every method but
  // none-libtorch; 0: libtorch's own step everywhere (and no none-libtorch).
  std::uint64_t block_kib = hooks::ParameterStepper::kDefaultBlockBytes >> 10;
  // Training thread on the first CPUs, every method's checkpoint threads on
  // the last --workers (at least one CPU left for training).
  bool pin = true;
  double sim_gbps = 12.0;
  double sim_memory_fraction = 0.25;  // simulated device memory / checkpoint bytes
  std::string out = PMSNAP_BENCH_RESULTS_DIR;
  std::string tag = "stall";  // output file prefix
  std::string dir;            // pools and files; default $PMSNAP_POOL_DIR or /dev/shm
  bool plot = true;
  // Internal: a child process that times one restore (see RunRestoreChild).
  std::string restore_child;              // kRestore* method name
  std::string restore_path;               // pool or torch-save file
  std::string restore_device;             // runtime::MakeDevice spec
  std::vector<std::string> command_line;  // this process's argv, for the children
};

const char* kUsage =
    "usage: pmsnap_bench_stall [flags]\n"
    "  --quick                  ~1 minute smoke run (smaller models, 1 round)\n"
    "  --workloads=mlp,transformer,dlrm   --devices=host,simulated\n"
    "  --methods=a,b,...        subset (names as in the table; 'none' is always run)\n"
    "  --iters=N --warmup=N --repeats=N   measured / warm-up iterations per trial, rounds (4 1 2)\n"
    "  --trial-seconds=S        small models run more iterations, ~S s per trial (1.5)\n"
    "  --k=K                    interval of torch-save-kK (4)\n"
    "  --restore-rounds=N       restores per method, each in a fresh process; median (5)\n"
    "  --target-rounds=N        rounds of none, none-libtorch, pmsnap-adaptive-k1 and\n"
    "                           pmsnap-hooks-only on mlp/host, the overhead target's cell\n"
    "                           (16; at least --repeats)\n"
    "  --sweep=2                extra pmsnap-adaptive-kK trials\n"
    "  --threads=N              torch intra-op threads for training (1)\n"
    "  --workers=N              checkpoint worker threads, every method (1)\n"
    "  --part-mib=N             pmsnap part size (4)\n"
    "  --copy-start=WHEN        when pmsnap's copies start: auto (after the step on the host,\n"
    "                           after each update on a device), after-update, after-step\n"
    "  --block-kib=N            block of the stepper's cache-blocked update, every method but\n"
    "                           none-libtorch (256; 0: libtorch's own step everywhere)\n"
    "  --no-pin                 leave threads where the OS puts them (default: training on\n"
    "                           the first CPUs, every method's checkpoint threads on the last\n"
    "                           --workers CPUs)\n"
    "  --mlp-in=N --mlp-width=N --mlp-hidden=N --mlp-batch=N   (1024, 4096, 6, 16)\n"
    "  --tf-dim=N --tf-layers=N --tf-heads=N --tf-seq=N --tf-batch=N (512, 4, 8, 64, 8)\n"
    "  --dlrm-tables=N --dlrm-rows=N --dlrm-dim=N --dlrm-batch=N   (8, 100000, 32, 256)\n"
    "  --sim-gbps=G --sim-memory-fraction=F   simulated link and memory (12, 0.25)\n"
    "  --out=DIR --tag=NAME --dir=DIR --no-plot\n";

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) parts.push_back(item);
  return parts;
}

bool ParseFlag(const std::string& key, const std::string& v, Options* o) {
  auto i64 = [&] { return static_cast<std::int64_t>(std::stoll(v)); };
  auto i32 = [&] { return static_cast<int>(std::stoi(v)); };
  if (key == "--quick") {
    o->mlp_width = 1024, o->mlp_hidden = 3, o->mlp_in = 512;
    o->tf_dim = 256, o->tf_layers = 2;
    o->dlrm_rows = 20000;
    o->iters = 4, o->warmup = 1, o->repeats = 1, o->trial_seconds = 0.3, o->target_rounds = 1;
    o->sweep = {2};
  } else if (key == "--workloads") {
    o->workloads = Split(v);
  } else if (key == "--devices") {
    o->devices = Split(v);
  } else if (key == "--methods") {
    o->methods = Split(v);
  } else if (key == "--iters") {
    o->iters = i32();
  } else if (key == "--warmup") {
    o->warmup = i32();
  } else if (key == "--repeats") {
    o->repeats = i32();
  } else if (key == "--trial-seconds") {
    o->trial_seconds = std::stod(v);
  } else if (key == "--restore-rounds") {
    o->restore_rounds = i32();
  } else if (key == "--target-rounds") {
    o->target_rounds = i32();
  } else if (key == "--k") {
    o->k = static_cast<std::uint64_t>(std::stoull(v));
  } else if (key == "--sweep") {
    o->sweep.clear();
    for (const auto& s : Split(v)) o->sweep.push_back(std::stoull(s));
  } else if (key == "--threads") {
    o->threads = i32();
  } else if (key == "--workers") {
    o->workers = i32();
  } else if (key == "--copy-start") {
    auto copy_start = runtime::ParseCopyStart(v);
    if (!copy_start.ok()) return false;
    o->copy_start = *copy_start;
  } else if (key == "--part-mib") {
    o->part_mib = static_cast<std::uint64_t>(std::stoull(v));
  } else if (key == "--no-pin") {
    o->pin = false;
  } else if (key == "--block-kib") {
    o->block_kib = static_cast<std::uint64_t>(std::stoull(v));
  } else if (key == "--mlp-in") {
    o->mlp_in = i64();
  } else if (key == "--mlp-width") {
    o->mlp_width = i64();
  } else if (key == "--mlp-hidden") {
    o->mlp_hidden = i64();
  } else if (key == "--mlp-batch") {
    o->mlp_batch = i64();
  } else if (key == "--tf-dim") {
    o->tf_dim = i64();
  } else if (key == "--tf-layers") {
    o->tf_layers = i64();
  } else if (key == "--tf-heads") {
    o->tf_heads = i64();
  } else if (key == "--tf-seq") {
    o->tf_seq = i64();
  } else if (key == "--tf-batch") {
    o->tf_batch = i64();
  } else if (key == "--dlrm-tables") {
    o->dlrm_tables = i64();
  } else if (key == "--dlrm-rows") {
    o->dlrm_rows = i64();
  } else if (key == "--dlrm-dim") {
    o->dlrm_dim = i64();
  } else if (key == "--dlrm-batch") {
    o->dlrm_batch = i64();
  } else if (key == "--sim-gbps") {
    o->sim_gbps = std::stod(v);
  } else if (key == "--sim-memory-fraction") {
    o->sim_memory_fraction = std::stod(v);
  } else if (key == "--out") {
    o->out = v;
  } else if (key == "--tag") {
    o->tag = v;
  } else if (key == "--dir") {
    o->dir = v;
  } else if (key == "--no-plot") {
    o->plot = false;
  } else if (key == "--restore-child") {
    o->restore_child = v;
  } else if (key == "--restore-path") {
    o->restore_path = v;
  } else if (key == "--restore-device") {
    o->restore_device = v;
  } else {
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- workloads

torch::nn::Sequential Mlp(const std::vector<std::int64_t>& widths, bool last_relu) {
  torch::nn::Sequential mlp;
  for (std::size_t i = 0; i + 1 < widths.size(); ++i) {
    mlp->push_back(torch::nn::Linear(widths[i], widths[i + 1]));
    if (i + 2 < widths.size() || last_relu) mlp->push_back(torch::nn::ReLU());
  }
  return mlp;
}

struct DlrmImpl : torch::nn::Module {
  DlrmImpl(const Options& o) {
    bottom = register_module("bottom", Mlp({13, 256, 64, o.dlrm_dim}, true));
    for (std::int64_t t = 0; t < o.dlrm_tables; ++t) {
      tables.push_back(register_module(
          "emb" + std::to_string(t),
          torch::nn::EmbeddingBag(
              torch::nn::EmbeddingBagOptions(o.dlrm_rows, o.dlrm_dim).mode(torch::kSum))));
    }
    const std::int64_t features = o.dlrm_tables + 1;
    top = register_module("top",
                          Mlp({o.dlrm_dim + features * (features - 1) / 2, 256, 64, 1}, false));
    auto index = torch::triu_indices(features, features, 1);
    pair_rows = index[0];
    pair_cols = index[1];
  }
  torch::Tensor forward(const torch::Tensor& dense, const std::vector<torch::Tensor>& ids,
                        const torch::Tensor& offsets) {
    torch::Tensor x = bottom->forward(dense);
    std::vector<torch::Tensor> features = {x};
    for (std::size_t t = 0; t < tables.size(); ++t)
      features.push_back(tables[t]->forward(ids[t], offsets));
    torch::Tensor stacked = torch::stack(features, 1);
    torch::Tensor dots = torch::bmm(stacked, stacked.transpose(1, 2));
    torch::Tensor pairs = dots.index({torch::indexing::Slice(), pair_rows, pair_cols});
    return top->forward(torch::cat({x, pairs}, 1)).squeeze(1);
  }
  torch::nn::Sequential bottom{nullptr}, top{nullptr};
  std::vector<torch::nn::EmbeddingBag> tables;
  torch::Tensor pair_rows, pair_cols;
};
TORCH_MODULE(Dlrm);

struct Workload {
  std::string name;
  std::string description;
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  // A fresh optimizer (no state) over the same parameters, as after a restart.
  std::function<std::unique_ptr<torch::optim::Optimizer>()> make_optimizer;
  // zero_grad + forward + backward of iteration `step` (data precomputed).
  std::function<void(std::uint64_t)> forward_backward;
  std::int64_t parameters = 0;
};

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
  TrainWithAdamOnRandomBatches(w, Mlp(widths, false), {o.mlp_batch, o.mlp_in});
  char d[160];
  std::snprintf(d, sizeof(d), "MLP %lld->%lldx%lld->%lld, batch %lld, Adam",
                static_cast<long long>(o.mlp_in), static_cast<long long>(o.mlp_width),
                static_cast<long long>(o.mlp_hidden), static_cast<long long>(o.mlp_in),
                static_cast<long long>(o.mlp_batch));
  w.description = d;
  return w;
}

struct TransformerImpl : torch::nn::Module {
  TransformerImpl(const Options& o) {
    for (std::int64_t l = 0; l < o.tf_layers; ++l) {
      layers.push_back(
          register_module("block" + std::to_string(l),
                          torch::nn::TransformerEncoderLayer(
                              torch::nn::TransformerEncoderLayerOptions(o.tf_dim, o.tf_heads)
                                  .dim_feedforward(4 * o.tf_dim)
                                  .dropout(0.0))));
    }
    head = register_module("head", torch::nn::Linear(o.tf_dim, o.tf_dim));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = layer->forward(x);
    return head->forward(x);
  }
  std::vector<torch::nn::TransformerEncoderLayer> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

Workload MakeTransformer(const Options& o) {
  Workload w;
  w.name = "transformer";
  TrainWithAdamOnRandomBatches(w, Transformer(o), {o.tf_seq, o.tf_batch, o.tf_dim});
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
  Dlrm net(o);
  w.module = net.ptr();
  w.make_optimizer = [net]() -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adagrad>(net->parameters(),
                                                   torch::optim::AdagradOptions(0.01));
  };
  w.optimizer = w.make_optimizer();
  // Zipf(1.05) ids, hot rows scattered over each table; 8 batches, cycled.
  std::vector<double> cdf(static_cast<std::size_t>(o.dlrm_rows));
  double sum = 0;
  for (std::int64_t r = 0; r < o.dlrm_rows; ++r) {
    sum += 1.0 / std::pow(static_cast<double>(r + 1), 1.05);
    cdf[static_cast<std::size_t>(r)] = sum;
  }
  for (double& c : cdf) c /= sum;
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
        const auto rank = static_cast<std::uint64_t>(
            std::lower_bound(cdf.begin(), cdf.end(), uniform(rng)) - cdf.begin());
        p[i] =
            static_cast<std::int64_t>((rank * 2654435761ull + static_cast<std::uint64_t>(t) * 97) %
                                      static_cast<std::uint64_t>(o.dlrm_rows));
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

std::optional<Workload> MakeWorkload(const std::string& name, const Options& o) {
  if (name == "mlp") return MakeMlp(o);
  if (name == "transformer") return MakeTransformer(o);
  if (name == "dlrm") return MakeDlrm(o);
  std::fprintf(stderr, "unknown workload '%s' (mlp | transformer | dlrm)\n", name.c_str());
  return std::nullopt;
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
std::vector<torch::Tensor> StateTensors(Workload& w) {
  return StateTensors(*w.module, *w.optimizer);
}

std::uint64_t Bytes(const std::vector<torch::Tensor>& ts) {
  std::uint64_t n = 0;
  for (const auto& t : ts) n += static_cast<std::uint64_t>(t.numel() * t.element_size());
  return n;
}

void Fsync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::uint64_t FileBytes(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<std::uint64_t>(n);
}

void SaveFull(Workload& w, const std::string& path) {
  torch::serialize::OutputArchive archive;
  w.module->save(archive);
  torch::serialize::OutputArchive optimizer;
  w.optimizer->save(optimizer);
  archive.write("optimizer", optimizer);
  archive.save_to(path);
}

void LoadFull(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
              const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  module.load(archive);
  torch::serialize::InputArchive state;
  archive.read("optimizer", state);
  optimizer.load(state);
}

// Host copies of every state tensor, for snapshots through the device.
std::vector<torch::Tensor> Staging(const std::vector<torch::Tensor>& live) {
  std::vector<torch::Tensor> out;
  for (const auto& t : live) out.push_back(torch::empty_like(t).zero_());
  return out;
}

Status CopyOut(runtime::Device& device, const std::vector<torch::Tensor>& dst,
               const std::vector<torch::Tensor>& src) {
  for (std::size_t i = 0; i < src.size(); ++i) {
    Status s = device.CopyToHost(dst[i].data_ptr(), src[i].data_ptr(),
                                 static_cast<std::size_t>(src[i].numel() * src[i].element_size()));
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- methods

// Training-thread stall, seconds, by cause.
struct Stall {
  double conflict = 0;  // waiting for a unit's/weight's snapshot before its update
  double boundary = 0;  // waiting for the previous checkpoint at a step boundary
  double copy = 0;      // copies on the training thread (snapshot, in-device)
  double save = 0;      // synchronous serialization + write
  double hook = 0;      // the rest of the time inside pmsnap's hooks
  double total() const { return conflict + boundary + copy + save + hook; }
};

struct Counters {
  Stall stall;
  std::uint64_t commits = 0;
  std::uint64_t bytes = 0;
  std::uint64_t conflicts = 0;
};

// Hardware counters of the calling (training) thread, kernel time included
// (page faults zero pages there): they tell whether an overhead is more work
// on the training thread (instructions) or the same work done slower (cycles
// per instruction, cache and TLB misses), e.g. memory traffic of a worker on
// another core. Counters the kernel or the VM does not offer read as absent.
class ThreadCounters {
 public:
  // cycles, instructions, LLC misses, dTLB load misses, page faults
  static constexpr int kCount = 5;
  ThreadCounters() {
    const std::pair<std::uint32_t, std::uint64_t> events[kCount] = {
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_CPU_CYCLES},
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_INSTRUCTIONS},
        {PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_MISSES},
        {PERF_TYPE_HW_CACHE, PERF_COUNT_HW_CACHE_DTLB | (PERF_COUNT_HW_CACHE_OP_READ << 8) |
                                 (PERF_COUNT_HW_CACHE_RESULT_MISS << 16)},
        {PERF_TYPE_SOFTWARE, PERF_COUNT_SW_PAGE_FAULTS}};
    for (int i = 0; i < kCount; ++i) {
      perf_event_attr attr{};
      attr.size = sizeof(attr);
      attr.type = events[i].first;
      attr.config = events[i].second;
      attr.exclude_hv = 1;
      fds_[i] = static_cast<int>(::syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
      if (fds_[i] < 0) {  // e.g. perf_event_paranoid >= 2 without privileges
        attr.exclude_kernel = 1;
        fds_[i] = static_cast<int>(::syscall(SYS_perf_event_open, &attr, 0, -1, -1, 0));
      }
    }
  }
  ~ThreadCounters() {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  ThreadCounters(const ThreadCounters&) = delete;
  ThreadCounters& operator=(const ThreadCounters&) = delete;

  // Current values; -1 for a counter that is not available.
  std::array<double, kCount> Read() const {
    std::array<double, kCount> values;
    for (int i = 0; i < kCount; ++i) {
      std::uint64_t v = 0;
      values[i] = fds_[i] >= 0 && ::read(fds_[i], &v, sizeof(v)) == sizeof(v)
                      ? static_cast<double>(v)
                      : -1.0;
    }
    return values;
  }

 private:
  int fds_[kCount] = {-1, -1, -1, -1, -1};
};

// CPUs of every method's checkpoint threads (empty: not pinned; see
// Options::pin). Set once in main.
std::vector<int> g_worker_cpus;

// Called first on each checkpoint thread a method starts.
void PinCheckpointThread() {
  if (!g_worker_cpus.empty()) (void)PinCurrentThread(g_worker_cpus, "checkpoint threads");
}

class Method {
 public:
  virtual ~Method() = default;
  // The optimizer step of iteration `step` (1-based) plus checkpointing.
  virtual Status Step(std::uint64_t step) = 0;
  // Backward of the iteration has returned (Step follows): for methods that
  // work inside backward, to see how much they got done there.
  virtual void AfterBackward() {}
  // Counters since the last Mark().
  virtual void Mark() = 0;
  virtual Counters Read() = 0;
  // Waits for background work and releases files/pools.
  virtual Status Finish() = 0;
  virtual std::string Note() const { return ""; }
};

std::vector<std::pair<std::string, torch::Tensor>> NamedParameters(const Workload& w) {
  std::vector<std::pair<std::string, torch::Tensor>> named;
  for (const auto& item : w.module->named_parameters())
    named.emplace_back(item.key(), item.value());
  return named;
}

// The optimizer step every method runs, so that the overhead column measures
// checkpointing alone: pmsnap's stepper (large Adam, AdamW and Adagrad
// parameters cache-blocked, bitwise libtorch's arithmetic) with
// `block_bytes`, or libtorch's own step() when 0 (the `none-libtorch`
// reference: what a libtorch user runs today).
class OptimizerStep {
 public:
  OptimizerStep(Workload& w, std::size_t block_bytes) : w_(w) {
    if (block_bytes == 0) return;
    auto stepper = hooks::ParameterStepper::Create(*w.optimizer, NamedParameters(w));
    if (!stepper.ok()) {
      init_ = stepper.status();
      return;
    }
    stepper_ = std::move(stepper).value();
    stepper_->set_block_bytes(block_bytes);
  }
  Status Run() {
    if (!init_.ok()) return init_;
    if (stepper_ == nullptr) {
      w_.optimizer->step();
      return Status::Ok();
    }
    return stepper_->Step(nullptr);
  }

 private:
  Workload& w_;
  std::unique_ptr<hooks::ParameterStepper> stepper_;
  Status init_;
};

class NoCheckpoint final : public Method {
 public:
  NoCheckpoint(Workload& w, std::size_t block_bytes) : step_(w, block_bytes) {}
  Status Step(std::uint64_t) override { return step_.Run(); }
  void Mark() override {}
  Counters Read() override { return {}; }
  Status Finish() override { return Status::Ok(); }

 private:
  OptimizerStep step_;
};

// Method 2: synchronous torch::save every k (through the device on the
// simulated one: the state is copied to host first).
class TorchSave final : public Method {
 public:
  TorchSave(Workload& w, runtime::Device& device, std::string path, std::uint64_t k,
            std::size_t block_bytes)
      : w_(w), step_(w, block_bytes), device_(device), path_(std::move(path)), k_(k) {}
  Status Step(std::uint64_t step) override {
    PMSNAP_RETURN_IF_ERROR(step_.Run());
    if (step % k_ != 0) return Status::Ok();
    if (!device_.cpu_addressable()) {
      const auto t = Clock::now();
      auto live = StateTensors(w_);
      if (staging_.empty()) staging_ = Staging(live);
      Status s = CopyOut(device_, staging_, live);
      if (!s.ok()) return s;
      c_.stall.copy += Since(t);
    }
    const auto t = Clock::now();
    SaveFull(w_, path_ + ".tmp");
    Fsync(path_ + ".tmp");
    std::filesystem::rename(path_ + ".tmp", path_);
    c_.stall.save += Since(t);
    c_.bytes += FileBytes(path_);
    ++c_.commits;
    return Status::Ok();
  }
  void Mark() override { c_ = {}; }
  Counters Read() override { return c_; }
  Status Finish() override { return Status::Ok(); }

 private:
  Workload& w_;
  OptimizerStep step_;
  runtime::Device& device_;
  std::string path_;
  std::uint64_t k_;
  std::vector<torch::Tensor> staging_;
  Counters c_;
};

// Method 3: CheckFreq. At a checkpoint boundary: wait for the previous
// persist, copy the whole state to DRAM (training stopped), resume; a
// background thread torch::saves the copy. Interval: fixed, or Algorithm 1.
class CheckFreq final : public Method {
 public:
  CheckFreq(Workload& w, runtime::Device& device, std::string path, std::uint64_t fixed_k,
            std::size_t block_bytes)
      : w_(w), step_(w, block_bytes), device_(device), path_(std::move(path)), fixed_k_(fixed_k) {
    thread_ = std::thread([this] {
      PinCheckpointThread();
      Persister();
    });
  }
  ~CheckFreq() override { (void)Finish(); }

  Status Step(std::uint64_t step) override {
    // T_i: boundary to boundary, minus this method's own stall in between.
    const auto now = Clock::now();
    if (step > 1) {
      const double ti =
          std::chrono::duration<double>(now - last_boundary_).count() - last_step_stall_;
      iteration_seconds_ = iteration_seconds_ == 0 ? ti : 0.7 * iteration_seconds_ + 0.3 * ti;
    }
    last_boundary_ = now;
    last_step_stall_ = 0;
    PMSNAP_RETURN_IF_ERROR(step_.Run());
    bool due = false;
    if (fixed_k_ > 0) {
      due = step % fixed_k_ == 0;
    } else if (last_checkpoint_ == 0) {
      due = true;  // the profiling checkpoint
    } else {
      bool profiled = false;
      {
        std::lock_guard lock(mutex_);
        profiled = have_profile_;
        persist_seen_ = persist_seconds_;
      }
      if (profiled) Recompute();
      due = profiled && step - last_checkpoint_ >= k_;
    }
    if (!due) return Status::Ok();
    {
      const auto t = Clock::now();
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return !busy_; });
      const double waited = Since(t);
      c_.stall.boundary += waited;
      last_step_stall_ += waited;
    }
    const auto t = Clock::now();
    auto live = StateTensors(w_);
    if (staging_.empty()) staging_ = Staging(live);
    Status s = CopyOut(device_, staging_, live);
    if (!s.ok()) return s;
    snapshot_seconds_ = Since(t);
    last_step_stall_ += snapshot_seconds_;
    model_bytes_ = Bytes(live);
    last_checkpoint_ = step;
    {
      std::lock_guard lock(mutex_);
      c_.stall.copy += snapshot_seconds_;
      busy_ = true;
    }
    work_.notify_one();
    return Status::Ok();
  }
  void Mark() override {
    std::lock_guard lock(mutex_);
    c_ = {};
  }
  Counters Read() override {
    std::lock_guard lock(mutex_);
    return c_;
  }
  Status Finish() override {
    if (!thread_.joinable()) return Status::Ok();
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_.notify_one();
    thread_.join();
    return Status::Ok();
  }
  std::string Note() const override {
    if (fixed_k_ > 0) return "";
    char b[160];
    std::snprintf(b, sizeof(b), "Algorithm 1: k=%llu (T_i %.0f ms, T_c %.0f ms, T_s %.0f ms)",
                  static_cast<unsigned long long>(k_), iteration_seconds_ * 1e3,
                  snapshot_seconds_ * 1e3, persist_seen_ * 1e3);
    return b;
  }
  std::uint64_t interval() const { return fixed_k_ > 0 ? fixed_k_ : k_; }

 private:
  // Algorithm 1 from this run's measurements. The snapshot stops training
  // (no overlap with forward/backward), so T_w = T_i makes T_oc = T_c; the
  // device-memory (GPU) mode is not offered (free bytes 0).
  void Recompute() {
    runtime::PolicyInputs in;
    in.iteration_seconds = std::max(iteration_seconds_, 1e-6);
    in.update_seconds = in.iteration_seconds;
    in.snapshot_seconds = snapshot_seconds_;
    in.in_device_seconds = device_.EstimateInDeviceCopySeconds(model_bytes_);
    in.persist_seconds = persist_seen_;
    in.model_bytes = model_bytes_;
    in.device_free_bytes = 0;
    in.have_profile = true;
    bool gpu = false;
    k_ = std::max<std::uint64_t>(
        1, runtime::CheckFreqPolicy::ComputeInterval(in, kOverheadBudget, &gpu));
  }
  void Persister() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || busy_; });
      if (!busy_ && stop_) return;
      lock.unlock();
      const auto t = Clock::now();
      torch::save(staging_, path_ + ".tmp");
      Fsync(path_ + ".tmp");
      std::filesystem::rename(path_ + ".tmp", path_);
      const std::uint64_t bytes = FileBytes(path_);
      lock.lock();
      persist_seconds_ = Since(t);
      have_profile_ = true;
      c_.bytes += bytes;
      ++c_.commits;
      busy_ = false;
      done_.notify_all();
    }
  }

  Workload& w_;
  OptimizerStep step_;
  runtime::Device& device_;
  std::string path_;
  std::uint64_t fixed_k_;
  std::uint64_t k_ = 1;
  std::uint64_t last_checkpoint_ = 0;
  double last_step_stall_ = 0;
  double persist_seen_ = 0;  // persist_seconds_ as last read under mutex_
  Clock::time_point last_boundary_{};
  double iteration_seconds_ = 0, snapshot_seconds_ = 0;
  std::uint64_t model_bytes_ = 0;
  std::vector<torch::Tensor> staging_;
  std::mutex mutex_;  // guards busy_, stop_, c_, persist_seconds_, have_profile_
  std::condition_variable work_, done_;
  bool busy_ = false, stop_ = false, have_profile_ = false;
  double persist_seconds_ = 0;
  Counters c_;
  std::thread thread_;
};

// Method 4: weight-grained serialization. Per-parameter stepping; right after
// a weight's update in a checkpointed step, a worker copies the weight and its
// optimizer state out (the weight's snapshot) and torch::saves the copy into
// the weight's own file. Each weight is its own pipeline: before a weight's
// next update the training thread waits for that weight's snapshot (not its
// file), and a weight's next snapshot waits until its previous file is
// written (one staging copy per weight). Epoch e writes directory e<e>, then
// a COMMIT file; the previous committed directory is removed after that.
class WeightFiles final : public Method, public hooks::StepObserver {
 public:
  static Result<std::unique_ptr<WeightFiles>> Create(Workload& w, runtime::Device& device,
                                                     std::string dir, std::uint64_t k, int workers,
                                                     std::size_t block_bytes) {
    auto stepper = hooks::ParameterStepper::Create(*w.optimizer, NamedParameters(w));
    if (!stepper.ok()) return stepper.status();
    (*stepper)->set_block_bytes(block_bytes);
    return std::unique_ptr<WeightFiles>(
        new WeightFiles(std::move(stepper).value(), device, std::move(dir), k, workers));
  }
  ~WeightFiles() override { (void)Finish(); }

  Status Step(std::uint64_t step) override {
    if (step % k_ == 0) {
      std::lock_guard lock(mutex_);
      ++epoch_;
      pending_[epoch_] = units_.size();
      capturing_ = true;
      std::filesystem::create_directories(EpochDir(epoch_));
    }
    Status s = stepper_->Step(this);
    if (capturing_) {
      std::lock_guard lock(mutex_);
      for (std::size_t i = 0; i < units_.size(); ++i)
        if (units_[i].captured < epoch_) Enqueue(i);  // not updated this step
      capturing_ = false;
    }
    changed_.notify_all();
    return s;
  }
  Status BeforeUpdate(std::size_t i) override {
    std::unique_lock lock(mutex_);
    Unit& u = units_[i];
    if (u.snapshotted >= u.captured) return Status::Ok();
    const auto t = Clock::now();
    ++c_.conflicts;
    changed_.wait(lock, [&] { return u.snapshotted >= u.captured; });
    c_.stall.conflict += Since(t);
    return Status::Ok();
  }
  Status AfterUpdate(std::size_t i) override {
    if (!capturing_) return Status::Ok();
    {
      std::lock_guard lock(mutex_);
      Enqueue(i);
    }
    changed_.notify_all();
    return Status::Ok();
  }
  void Mark() override {
    std::lock_guard lock(mutex_);
    c_ = {};
  }
  Counters Read() override {
    std::lock_guard lock(mutex_);
    return c_;
  }
  Status Finish() override {
    {
      std::lock_guard lock(mutex_);
      if (stop_) return Status::Ok();
      stop_ = true;
    }
    changed_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    return Status::Ok();
  }

 private:
  struct Unit {
    std::vector<torch::Tensor> live, staging;
    std::uint64_t captured = 0;     // last epoch that enqueued this weight
    std::uint64_t snapshotted = 0;  // last epoch whose snapshot of it is done
    bool writing = false;           // staging copy in use by a worker
  };
  WeightFiles(std::unique_ptr<hooks::ParameterStepper> stepper, runtime::Device& device,
              std::string dir, std::uint64_t k, int workers)
      : stepper_(std::move(stepper)), device_(device), dir_(std::move(dir)), k_(k) {
    for (const auto& slot : stepper_->slots()) {
      Unit u;
      u.live.push_back(slot.param);
      for (const auto& [role, t] : slot.state) u.live.push_back(t);
      u.staging = Staging(u.live);
      units_.push_back(std::move(u));
    }
    for (int i = 0; i < std::max(1, workers); ++i) {
      threads_.emplace_back([this] {
        PinCheckpointThread();
        Worker();
      });
    }
  }
  std::string EpochDir(std::uint64_t e) const { return dir_ + "/e" + std::to_string(e); }
  void Enqueue(std::size_t i) {  // mutex_ held
    units_[i].captured = epoch_;
    queue_.emplace_back(i, epoch_);
  }
  void Worker() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      const auto [i, epoch] = queue_.front();
      queue_.pop_front();
      Unit& u = units_[i];
      changed_.wait(lock, [&] { return !u.writing; });
      u.writing = true;
      lock.unlock();
      (void)CopyOut(device_, u.staging, u.live);
      lock.lock();
      u.snapshotted = epoch;
      changed_.notify_all();
      lock.unlock();
      const std::string path = EpochDir(epoch) + "/w" + std::to_string(i) + ".pt";
      torch::save(u.staging, path);
      Fsync(path);
      const std::uint64_t bytes = FileBytes(path);
      lock.lock();
      u.writing = false;
      c_.bytes += bytes;
      if (--pending_[epoch] == 0) {
        pending_.erase(epoch);
        lock.unlock();
        const std::string commit = EpochDir(epoch) + "/COMMIT";
        std::ofstream(commit) << epoch << "\n";
        Fsync(commit);
        lock.lock();
        ++c_.commits;
        if (epoch > committed_) {
          if (committed_ > 0) {
            const std::string old = EpochDir(committed_);
            lock.unlock();
            std::filesystem::remove_all(old);
            lock.lock();
          }
          committed_ = epoch;
        }
      }
      changed_.notify_all();
    }
  }

  std::unique_ptr<hooks::ParameterStepper> stepper_;
  runtime::Device& device_;
  std::string dir_;
  std::uint64_t k_;
  std::mutex mutex_;  // guards everything below (tensor data: the `writing` protocol)
  std::condition_variable changed_;
  std::vector<Unit> units_;
  std::deque<std::pair<std::size_t, std::uint64_t>> queue_;  // (weight, epoch)
  std::map<std::uint64_t, std::size_t> pending_;             // epoch -> files left
  std::uint64_t epoch_ = 0, committed_ = 0;
  bool capturing_ = false, stop_ = false;
  Counters c_;
  std::vector<std::thread> threads_;
};

// Method 5: pmsnap's CheckpointedOptimizer.
class Pmsnap final : public Method {
 public:
  static Result<std::unique_ptr<Pmsnap>> Create(Workload& w, runtime::EngineOptions options,
                                                std::size_t block_bytes, hooks::UpdateMode mode) {
    auto opt =
        hooks::CheckpointedOptimizer::Create(*w.module, *w.optimizer, std::move(options), {}, mode);
    if (!opt.ok()) return opt.status();
    (*opt)->set_optimizer_block_bytes(block_bytes);
    return std::unique_ptr<Pmsnap>(new Pmsnap(std::move(opt).value()));
  }
  Status Step(std::uint64_t) override {
    const std::uint64_t before = opt_->stats().bytes_written;
    Status s = opt_->Step();
    last_step_end_bytes_ = opt_->stats().bytes_written;
    bytes_written_in_step_ += last_step_end_bytes_ - before;
    return s;
  }
  void AfterBackward() override {
    if (last_step_end_bytes_ == kUnset) return;  // the first measured iteration
    bytes_written_in_backward_ += opt_->stats().bytes_written - last_step_end_bytes_;
  }
  void Mark() override {
    base_ = opt_->stats();
    bytes_written_in_backward_ = bytes_written_in_step_ = 0;
    last_step_end_bytes_ = kUnset;
  }
  Counters Read() override {
    const runtime::Stats s = opt_->stats();
    Counters c;
    c.stall.conflict = s.conflict_wait_seconds - base_.conflict_wait_seconds;
    c.stall.boundary = s.boundary_wait_seconds - base_.boundary_wait_seconds;
    c.stall.copy = s.in_device_copy_seconds - base_.in_device_copy_seconds;
    c.stall.hook = std::max(0.0, (s.blocked_seconds - base_.blocked_seconds) - c.stall.conflict -
                                     c.stall.boundary - c.stall.copy);
    c.commits = s.epochs_committed - base_.epochs_committed;
    c.bytes = s.bytes_written - base_.bytes_written;
    c.conflicts = s.conflicts - base_.conflicts;
    last_ = s;
    return c;
  }
  Status Finish() override {
    Status closed = opt_->Close();
    // Close drains the epochs still in flight: only now are the bytes held
    // for the last steps also counted as written.
    last_ = opt_->stats();
    return closed;
  }
  std::string Note() const override {
    std::uint64_t counts[5] = {0, 0, 0, 0, 0};
    for (const auto& u : last_.units)
      for (int i = 1; i <= 4; ++i) counts[i] += u.strategy_counts[i];
    // The workers' copy rate into the pool over the measured iterations:
    // slower copies mean longer overlap with training.
    double copy_seconds = 0;
    for (std::size_t u = 0; u < last_.units.size(); ++u)
      copy_seconds += last_.units[u].total_copy_seconds -
                      (u < base_.units.size() ? base_.units[u].total_copy_seconds : 0.0);
    const double copied = static_cast<double>(last_.bytes_written - base_.bytes_written);
    const double held = static_cast<double>(last_.held_bytes - base_.held_bytes);
    char b[300];
    std::snprintf(
        b, sizeof(b),
        "choices s1/s2/s3/s4 %llu/%llu/%llu/%llu, fallbacks %llu, copies %.1f GB/s, %.0f%% after "
        "the step, %.0f%% written during forward+backward, %.0f%% during the step",
        static_cast<unsigned long long>(counts[1]), static_cast<unsigned long long>(counts[2]),
        static_cast<unsigned long long>(counts[3]), static_cast<unsigned long long>(counts[4]),
        static_cast<unsigned long long>(last_.in_device_fallbacks),
        copy_seconds > 0 ? copied / copy_seconds / 1e9 : 0.0,
        copied > 0 ? 100 * held / copied : 0.0,
        copied > 0 ? 100 * static_cast<double>(bytes_written_in_backward_) / copied : 0.0,
        copied > 0 ? 100 * static_cast<double>(bytes_written_in_step_) / copied : 0.0);
    return b;
  }

 private:
  explicit Pmsnap(std::unique_ptr<hooks::CheckpointedOptimizer> opt) : opt_(std::move(opt)) {}
  static constexpr std::uint64_t kUnset = ~std::uint64_t{0};
  std::unique_ptr<hooks::CheckpointedOptimizer> opt_;
  runtime::Stats base_, last_;
  // Pool bytes written between one step's end and the next backward's end
  // (forward + backward: with UpdateMode::kInBackward, copies of this
  // iteration's updates too), and within Step.
  std::uint64_t bytes_written_in_backward_ = 0, bytes_written_in_step_ = 0;
  std::uint64_t last_step_end_bytes_ = kUnset;
};

// ---------------------------------------------------------------- trials

struct MethodSpec {
  std::string name;
  int family = 1;                  // the method number
  std::string strategy;            // pmsnap
  bool continuous = false;         // pmsnap
  std::uint64_t k = 1;             // 0: CheckFreq Algorithm 1
  bool never_checkpoints = false;  // pmsnap control: the hooks run, no epoch ever opens
  bool libtorch_step = false;      // none-libtorch: libtorch's own optimizer.step()
  bool in_backward = false;        // pmsnap: each parameter updated inside backward
};

// The control for pmsnap's overhead: the same stepping through the hooks,
// without a checkpoint, so its distance from `none` is hook cost plus noise.
class NeverPolicy final : public runtime::IntervalPolicy {
 public:
  std::string name() const override { return "never"; }
  bool ShouldCheckpoint(std::uint64_t, const runtime::PolicyInputs&) override { return false; }
  bool wait_if_busy() const override { return false; }
};

// The overhead target is a few percent, inside a round's noise on a
// small VM: its cell gets extra rounds of these methods.
constexpr const char* kTargetWorkload = "mlp";
constexpr const char* kTargetDevice = "host";
bool InTargetCellMethods(const std::string& method) {
  return method == "none" || method == "none-libtorch" || method == "pmsnap-adaptive-k1" ||
         method == "pmsnap-hooks-only";
}

std::vector<MethodSpec> AllMethods(const Options& o) {
  std::vector<MethodSpec> m;
  m.push_back({"none", 1, "", false, 0});
  if (o.block_kib > 0) m.push_back({"none-libtorch", 1, "", false, 0, false, true});
  m.push_back({"torch-save-k" + std::to_string(o.k), 2, "", false, o.k});
  m.push_back({"checkfreq-alg1", 3, "", false, 0});
  m.push_back({"checkfreq-k1", 3, "", false, 1});
  m.push_back({"weight-files-k1", 4, "", false, 1});
  for (const std::string s : {"1", "2", "3", "4", "adaptive"}) {
    m.push_back({"pmsnap-" + s + "-cont", 5, s, true, 1});
    m.push_back({"pmsnap-" + s + "-k1", 5, s, false, 1});
  }
  for (std::uint64_t k : o.sweep)
    if (k > 1) m.push_back({"pmsnap-adaptive-k" + std::to_string(k), 5, "adaptive", false, k});
  m.push_back({"pmsnap-hooks-only", 5, "adaptive", false, 1, true});
  m.push_back({"pmsnap-adaptive-k1-backward", 5, "adaptive", false, 1, false, false, true});
  if (o.methods.empty()) return m;
  std::vector<MethodSpec> picked;
  for (const auto& spec : m)
    if (spec.name == "none" ||
        std::find(o.methods.begin(), o.methods.end(), spec.name) != o.methods.end())
      picked.push_back(spec);
  return picked;
}

// "  per it: 1.096 Gcycles IPC 1.94 ..." for a trial's progress line: the
// training thread's counters this machine offers.
std::string CountersText(const std::array<double, ThreadCounters::kCount>& per_iteration) {
  std::string text;
  char item[64];
  auto add = [&](const char* format, double value) {
    std::snprintf(item, sizeof(item), format, value);
    text += item;
  };
  const double cycles = per_iteration[0], instructions = per_iteration[1];
  if (cycles > 0) add(" %.3f Gcycles", cycles / 1e9);
  if (cycles > 0 && instructions >= 0) add(" IPC %.2f", instructions / cycles);
  if (per_iteration[2] >= 0) add(" LLC-miss %.1fM", per_iteration[2] / 1e6);
  if (per_iteration[3] >= 0) add(" dTLB-miss %.2fM", per_iteration[3] / 1e6);
  if (per_iteration[4] >= 0) add(" faults %.0fK", per_iteration[4] / 1e3);
  return text.empty() ? text : "  per it:" + text;
}

// Page faults of the whole process so far (every thread: training, checkpoint
// workers, the pool's prefault): where a method pays for first touches of
// its pool, files or buffers.
double ProcessPageFaults() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return -1;
  return static_cast<double>(usage.ru_minflt + usage.ru_majflt);
}

struct Trial {
  std::vector<double> iteration_seconds;
  // The warm-up iterations right after the method was set up (a fresh pool,
  // file or buffer): its cold start, reported apart from the steady state.
  std::vector<double> cold_iteration_seconds;
  // Process page faults per iteration, all threads: cold start, steady state.
  double cold_process_faults = -1, process_faults = -1;
  // Of each iteration, the optimizer step with its checkpoint hooks (the
  // rest is zero_grad + forward + backward): where an overhead lands.
  std::vector<double> step_seconds;
  // Training-thread hardware counters per measured iteration (-1: absent).
  std::array<double, ThreadCounters::kCount> per_iteration{};
  double wall = 0;
  Counters counters;
  std::string note;
  bool ok = true;
  std::string error;
};

struct Context {
  const Options& o;
  Workload& w;
  runtime::Device& device;
  std::string device_label;
  std::string dir;  // per workload/device scratch directory
  int iterations;   // measured iterations per trial
};

std::string PoolPath(const Context& c, const std::string& method) {
  return c.dir + "/" + method + ".pool";
}

runtime::EngineOptions PmsnapOptions(const Context& c, const MethodSpec& m) {
  runtime::EngineOptions e;
  e.pool_path = PoolPath(c, m.name);
  e.pool_options.part_bytes = c.o.part_mib << 20;
  e.workers = c.o.workers;
  e.worker_cpus = g_worker_cpus;
  e.copy_start = c.o.copy_start;
  e.device = &c.device;
  if (m.never_checkpoints)
    e.policy = std::make_shared<NeverPolicy>();
  else if (m.continuous)
    e.policy = std::make_shared<runtime::ContinuousPolicy>();
  else
    e.policy = std::make_shared<runtime::EveryKPolicy>(m.k);
  e.strategy = conflict::MakeStrategy(m.strategy);
  e.print_summary = false;  // the table reports it
  return e;
}

Trial RunTrial(Context& c, const MethodSpec& m, bool keep_files) {
  Trial trial;
  std::unique_ptr<Method> method;
  auto fail = [&](const std::string& what) {
    trial.ok = false;
    trial.error = what;
    return trial;
  };
  const std::size_t block_bytes = m.libtorch_step ? 0 : c.o.block_kib << 10;
  if (m.family == 1) {
    method = std::make_unique<NoCheckpoint>(c.w, block_bytes);
  } else if (m.family == 2) {
    method = std::make_unique<TorchSave>(c.w, c.device, c.dir + "/torch-save.pt", m.k, block_bytes);
  } else if (m.family == 3) {
    method =
        std::make_unique<CheckFreq>(c.w, c.device, c.dir + "/" + m.name + ".pt", m.k, block_bytes);
  } else if (m.family == 4) {
    auto wf =
        WeightFiles::Create(c.w, c.device, c.dir + "/" + m.name, m.k, c.o.workers, block_bytes);
    if (!wf.ok()) return fail(wf.status().ToString());
    method = std::move(wf).value();
  } else {
    std::filesystem::remove(PoolPath(c, m.name));
    auto p = Pmsnap::Create(c.w, PmsnapOptions(c, m), block_bytes,
                            m.in_backward ? hooks::UpdateMode::kInBackward
                                          : hooks::UpdateMode::kInStep);
    if (!p.ok()) return fail(p.status().ToString());
    method = std::move(p).value();
  }
  const int total = c.o.warmup + c.iterations;
  Clock::time_point start{};
  ThreadCounters counters;
  std::array<double, ThreadCounters::kCount> at_start{};
  const double faults_at_setup = ProcessPageFaults();
  double faults_at_start = faults_at_setup;
  for (int step = 1; step <= total; ++step) {
    if (step == c.o.warmup + 1) {
      method->Mark();
      at_start = counters.Read();
      faults_at_start = ProcessPageFaults();
      start = Clock::now();
    }
    const auto t = Clock::now();
    c.w.forward_backward(static_cast<std::uint64_t>(step));
    method->AfterBackward();
    const auto stepping = Clock::now();
    Status s = method->Step(static_cast<std::uint64_t>(step));
    if (!s.ok()) {
      (void)method->Finish();
      return fail("step " + std::to_string(step) + ": " + s.ToString());
    }
    if (step > c.o.warmup) {
      trial.iteration_seconds.push_back(Since(t));
      trial.step_seconds.push_back(Since(stepping));
    } else {
      trial.cold_iteration_seconds.push_back(Since(t));
    }
  }
  trial.wall = Since(start);
  const double faults_at_end = ProcessPageFaults();
  if (faults_at_setup >= 0 && faults_at_end >= 0) {
    if (c.o.warmup > 0)
      trial.cold_process_faults = (faults_at_start - faults_at_setup) / c.o.warmup;
    trial.process_faults = (faults_at_end - faults_at_start) / c.iterations;
  }
  const auto at_end = counters.Read();
  for (int i = 0; i < ThreadCounters::kCount; ++i)
    trial.per_iteration[i] =
        at_end[i] < 0 || at_start[i] < 0 ? -1.0 : (at_end[i] - at_start[i]) / c.iterations;
  trial.counters = method->Read();
  Status s = method->Finish();
  trial.note = method->Note();
  method.reset();
  if (!s.ok()) return fail(s.ToString());
  if (!keep_files) {
    std::filesystem::remove(PoolPath(c, m.name));
    std::filesystem::remove_all(c.dir + "/" + m.name);
    std::filesystem::remove(c.dir + "/" + m.name + ".pt");
  }
  return trial;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(pos);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}
double Median(const std::vector<double>& v) { return Quantile(v, 0.5); }

// 95% percentile-bootstrap interval of the median of `v` (fixed seed, so a
// run's table and CSV agree); a single value is its own interval.
std::pair<double, double> MedianInterval95(const std::vector<double>& v) {
  if (v.size() < 2) return {Median(v), Median(v)};
  std::mt19937_64 random(0x5eed);
  std::uniform_int_distribution<std::size_t> pick(0, v.size() - 1);
  std::vector<double> medians, sample(v.size());
  for (int i = 0; i < 4000; ++i) {
    for (double& x : sample) x = v[pick(random)];
    medians.push_back(Median(sample));
  }
  return {Quantile(medians, 0.025), Quantile(medians, 0.975)};
}
double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

struct Row {
  std::string workload, device, method;
  int family = 0;
  std::uint64_t k = 0;  // checkpoint interval (measured: iterations per commit)
  double median_ms = 0, p99_ms = 0, mean_ms = 0, overhead_pct = 0;
  double overhead_min_pct = 0, overhead_max_pct = 0;  // spread over rounds
  // 95% bootstrap interval of the median overhead (resampled rounds).
  double overhead_ci_low_pct = 0, overhead_ci_high_pct = 0;
  // Training-thread CPU cycles per iteration over `none`'s, paired by round
  // like overhead_pct, and instructions per cycle (medians; NaN: no counters).
  double cycles_overhead_pct = std::nan(""), ipc = std::nan("");
  // Mean optimizer step (hooks included) per iteration, and the extra time
  // per iteration over `none` split into step and zero_grad + forward +
  // backward (paired by round, medians).
  double step_ms = 0, extra_step_ms = 0, extra_forward_backward_ms = 0;
  // Cold start: the warm-up iterations' mean (median over rounds) and its
  // overhead over `none`'s warm-up, paired by round; page faults per
  // iteration of the whole process and of the training thread (NaN: none).
  double cold_ms = 0, cold_overhead_pct = std::nan("");
  double cold_faults_per_iter = std::nan(""), faults_per_iter = std::nan("");
  double training_faults_per_iter = std::nan("");
  Stall stall_per_iter;  // seconds per measured iteration, medians of rounds
  double stall_per_checkpoint_ms = 0;
  double commits_per_min = 0, iterations_per_commit = 0;
  double bytes_per_iter = 0;
  std::uint64_t conflicts = 0;
  double cost_per_checkpoint_s = 0;  // extra wall time per commit vs none
  std::uint64_t k35 = 0;             // longest-frequency estimate: every k35 iterations
  int rounds_ok = 0;
  std::string note, error;
};

struct RestoreRow {
  std::string workload, device, method;
  double open_ms = 0, restore_ms = 0, total_ms = 0;
  std::uint64_t bytes = 0;
  // torch::load's time over this method's in the same round: median, range.
  double speedup = 0, speedup_min = 0, speedup_max = 0;
};

// ---------------------------------------------------------------- output

void WriteCsv(const Options& o, const std::vector<Row>& rows,
              const std::vector<RestoreRow>& restores,
              const std::vector<std::string>& trial_lines) {
  std::filesystem::create_directories(o.out);
  std::ofstream csv(o.out + "/" + o.tag + ".csv");
  csv << "workload,device,method,family,median_ms,p99_ms,mean_ms,overhead_pct,"
         "stall_ms_per_iter,conflict_ms,boundary_ms,copy_ms,save_ms,hook_ms,"
         "stall_ms_per_checkpoint,commits_per_min,iterations_per_commit,mb_written_per_iter,"
         "conflicts,cost_per_checkpoint_ms,k_under_3.5pct,rounds,note,overhead_min_pct,"
         "overhead_max_pct,overhead_ci95_low_pct,overhead_ci95_high_pct,cycles_overhead_pct,"
         "training_ipc,step_ms,extra_step_ms,extra_forward_backward_ms,cold_ms,cold_overhead_pct,"
         "cold_faults_per_iter,faults_per_iter,training_faults_per_iter\n";
  for (const auto& r : rows) {
    const double n = 1e3;
    csv << r.workload << "," << r.device << "," << r.method << "," << r.family << "," << r.median_ms
        << "," << r.p99_ms << "," << r.mean_ms << "," << r.overhead_pct << ","
        << r.stall_per_iter.total() * n << "," << r.stall_per_iter.conflict * n << ","
        << r.stall_per_iter.boundary * n << "," << r.stall_per_iter.copy * n << ","
        << r.stall_per_iter.save * n << "," << r.stall_per_iter.hook * n << ","
        << r.stall_per_checkpoint_ms << "," << r.commits_per_min << "," << r.iterations_per_commit
        << "," << r.bytes_per_iter / 1e6 << "," << r.conflicts << ","
        << r.cost_per_checkpoint_s * 1e3 << "," << r.k35 << "," << r.rounds_ok << ",\""
        << (r.error.empty() ? r.note : "ERROR " + r.error) << "\"," << r.overhead_min_pct << ","
        << r.overhead_max_pct << "," << r.overhead_ci_low_pct << "," << r.overhead_ci_high_pct
        << "," << r.cycles_overhead_pct << "," << r.ipc << "," << r.step_ms << ","
        << r.extra_step_ms << "," << r.extra_forward_backward_ms << "," << r.cold_ms << ","
        << r.cold_overhead_pct << "," << r.cold_faults_per_iter << "," << r.faults_per_iter << ","
        << r.training_faults_per_iter << "\n";
  }
  std::ofstream rcsv(o.out + "/" + o.tag + "_restore.csv");
  rcsv << "workload,device,method,open_ms,restore_ms,total_ms,bytes,speedup_vs_torch_load,"
          "speedup_min,speedup_max\n";
  for (const auto& r : restores)
    rcsv << r.workload << "," << r.device << "," << r.method << "," << r.open_ms << ","
         << r.restore_ms << "," << r.total_ms << "," << r.bytes << "," << r.speedup << ","
         << r.speedup_min << "," << r.speedup_max << "\n";
  std::ofstream tcsv(o.out + "/" + o.tag + "_trials.csv");
  tcsv << "workload,device,method,round,iteration,seconds,step_seconds\n";
  for (const auto& line : trial_lines) tcsv << line << "\n";
}

// ---------------------------------------------------------------- driver

struct Results {
  std::vector<Row> rows;
  std::vector<RestoreRow> restores;
  std::vector<std::string> trial_lines;
};

// ---------------------------------------------------------------- restore

constexpr const char* kRestorePmsnapVerified = "pmsnap-verify";
constexpr const char* kRestorePmsnapUnverified = "pmsnap-noverify";
constexpr const char* kRestoreTorchLoad = "torch-load";
constexpr const char* kRestoreSampleTag = "restore-sample";

struct RestoreSample {
  double open_s = 0;     // pmsnap: open, verify and register; torch::load: 0
  double restore_s = 0;  // copy into the model and optimizer (and across the link)
  std::uint64_t bytes = 0;
};

// pmsnap: CheckpointedOptimizer::Create on `pool` with a fresh optimizer (the
// stepper allocates the state) + Restore (copy from the mapping).
Result<RestoreSample> TimePmsnapRestore(const Options& o, Workload& w, runtime::Device& device,
                                        const std::string& pool, bool verify) {
  runtime::EngineOptions e;
  e.pool_path = pool;
  e.workers = o.workers;
  e.device = &device;
  e.verify_on_open = verify;
  e.print_summary = false;
  auto fresh = w.make_optimizer();
  const auto t0 = Clock::now();
  PMSNAP_ASSIGN_OR_RETURN(auto opt, hooks::CheckpointedOptimizer::Create(*w.module, *fresh, e));
  RestoreSample sample;
  sample.open_s = Since(t0);
  const auto t1 = Clock::now();
  PMSNAP_RETURN_IF_ERROR(opt->Restore().status());
  sample.restore_s = Since(t1);
  for (const auto& u : opt->stats().units) sample.bytes += u.bytes;
  (void)opt->Close(runtime::CloseMode::kAbandon);
  return sample;
}

// torch::load of `file` into the module and a fresh optimizer; on a device,
// the loaded state then crosses the link into device memory, as pmsnap's
// restore does: into the model's initialized parameters (torch::load gave
// the module new storage; the old one stands for the parameters already on
// the device) and into optimizer state allocated untimed but first touched
// by the copy (a simulated device's memory is host memory: pmsnap's restore
// pays the same page faults for the state its stepper allocates).
Result<RestoreSample> TimeTorchLoad(Workload& w, runtime::Device& device, const std::string& file) {
  try {
    auto fresh = w.make_optimizer();
    std::vector<torch::Tensor> initialized;
    for (const auto& p : w.module->parameters()) initialized.push_back(p.detach());
    const auto t0 = Clock::now();
    LoadFull(*w.module, *fresh, file);
    RestoreSample sample;
    sample.restore_s = Since(t0);
    sample.bytes = FileBytes(file);
    if (device.cpu_addressable()) return sample;
    std::vector<torch::Tensor> loaded, on_device;
    const auto parameters = w.module->parameters();
    for (std::size_t i = 0; i < parameters.size(); ++i) {
      loaded.push_back(parameters[i]);
      on_device.push_back(initialized.at(i));
      for (const auto& t : hooks::ViewOptimizerState(*fresh, parameters[i]).tensors) {
        loaded.push_back(t);
        on_device.push_back(torch::empty_like(t));
      }
    }
    const auto t1 = Clock::now();
    for (std::size_t i = 0; i < loaded.size(); ++i) {
      PMSNAP_RETURN_IF_ERROR(device.CopyFromHost(
          on_device[i].data_ptr(), loaded[i].data_ptr(),
          static_cast<std::size_t>(loaded[i].numel() * loaded[i].element_size())));
    }
    sample.restore_s += Since(t1);
    return sample;
  } catch (const std::exception& e) {
    return Status(StatusCode::kIOError, "torch::load of '" + file + "': " + e.what());
  }
}

// Builds the workload and times one restore (the --restore-* flags), then
// prints it on stdout as "restore-sample <open s> <restore s> <bytes>".
int RunRestoreChild(const Options& o) {
  std::optional<Workload> w = MakeWorkload(o.workloads.empty() ? "" : o.workloads.front(), o);
  if (!w) return 2;
  auto device = runtime::MakeDevice(o.restore_device, nullptr);
  if (!device.ok()) {
    std::fprintf(stderr, "device %s: %s\n", o.restore_device.c_str(),
                 device.status().ToString().c_str());
    return 2;
  }
  Result<RestoreSample> sample =
      Status(StatusCode::kInvalidArgument, "unknown restore method '" + o.restore_child + "'");
  if (o.restore_child == kRestoreTorchLoad) {
    sample = TimeTorchLoad(*w, **device, o.restore_path);
  } else if (o.restore_child == kRestorePmsnapVerified ||
             o.restore_child == kRestorePmsnapUnverified) {
    sample = TimePmsnapRestore(o, *w, **device, o.restore_path,
                               o.restore_child == kRestorePmsnapVerified);
  }
  if (!sample.ok()) {
    std::fprintf(stderr, "%s\n", sample.status().ToString().c_str());
    return 3;
  }
  std::printf("%s %.9f %.9f %llu\n", kRestoreSampleTag, sample->open_s, sample->restore_s,
              static_cast<unsigned long long>(sample->bytes));
  return 0;
}

// Runs RunRestoreChild in a fresh copy of this program, with this run's
// flags (model sizes, workers) and the restore's own.
Result<RestoreSample> RestoreInFreshProcess(const Options& o, const std::string& workload,
                                            const std::string& device_spec,
                                            const std::string& method, const std::string& path) {
  std::vector<std::string> argv = o.command_line;
  std::error_code ec;
  argv.at(0) = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  if (ec) return Status(StatusCode::kIOError, "cannot find this program: " + ec.message());
  argv.push_back("--workloads=" + workload);
  argv.push_back("--restore-child=" + method);
  argv.push_back("--restore-path=" + path);
  argv.push_back("--restore-device=" + device_spec);
  ChildProcess child(argv);
  if (!child.started()) {
    return Status(StatusCode::kIOError, "cannot start '" + argv[0] + "' for a restore");
  }
  std::optional<RestoreSample> sample;
  std::string line;
  while (child.ReadLine(&line)) {
    std::istringstream in(line);
    std::string tag;
    RestoreSample s;
    if (in >> tag >> s.open_s >> s.restore_s >> s.bytes && tag == kRestoreSampleTag) sample = s;
  }
  const int exit_code = child.Wait();
  if (exit_code != 0 || !sample) {
    return Status(StatusCode::kInternal, "restore child for " + workload + "/" + method + " on '" +
                                             path + "' exited with " + std::to_string(exit_code) +
                                             " (stderr above)");
  }
  return *sample;
}

void RunWorkloadDevice(const Options& o, Workload& w, const std::string& device_name,
                       Results* results) {
  // Optimizer state exists after one plain step.
  w.forward_backward(0);
  w.optimizer->step();
  const std::uint64_t state_bytes = Bytes(StateTensors(w));
  std::string spec = "host";
  if (device_name == "simulated") {
    char b[64];
    std::snprintf(b, sizeof(b), "simulated:%g:%llu", o.sim_gbps,
                  static_cast<unsigned long long>(std::max(
                      1.0, o.sim_memory_fraction * static_cast<double>(state_bytes) / (1 << 20))));
    spec = b;
  }
  std::string note;
  auto made = runtime::MakeDevice(spec, &note);
  if (!made.ok()) {
    std::fprintf(stderr, "device %s: %s\n", spec.c_str(), made.status().ToString().c_str());
    return;
  }
  std::unique_ptr<runtime::Device> device = std::move(made).value();
  const std::string label = device_name == "simulated" ? "simulated" : "host";
  const std::string dir =
      o.dir + "/pmsnap-bench-stall-" + std::to_string(getpid()) + "/" + w.name + "-" + label;
  std::filesystem::create_directories(dir);

  // Time one iteration to size trials of small models.
  const auto t = Clock::now();
  for (int i = 0; i < 2; ++i) {
    w.forward_backward(1);
    w.optimizer->step();
  }
  const double it = Since(t) / 2;
  const int iterations =
      std::max(o.iters, static_cast<int>(std::min(200.0, o.trial_seconds / std::max(it, 1e-4))));
  const bool target_cell = w.name == kTargetWorkload && label == kTargetDevice;
  const std::string target_note =
      target_cell && o.target_rounds > o.repeats
          ? " (" + std::to_string(o.target_rounds) +
                " for none, none-libtorch, pmsnap-adaptive-k1 and pmsnap-hooks-only: the overhead "
                "target)"
          : "";
  std::printf(
      "\n== %s on %s%s: %lld parameters, %.1f MB checkpoint state, ~%.1f ms/iteration, "
      "%d measured iterations x %d round(s)%s\n",
      w.name.c_str(), device->name().c_str(),
      device_name == "simulated" ? " [SIMULATED device]" : "", static_cast<long long>(w.parameters),
      static_cast<double>(state_bytes) / 1e6, it * 1e3, iterations, o.repeats, target_note.c_str());
  std::fflush(stdout);

  Context c{o, w, *device, label, dir, iterations};
  const auto methods = AllMethods(o);
  auto rounds_of = [&](const MethodSpec& m) {
    return target_cell && InTargetCellMethods(m.name) ? std::max(o.repeats, o.target_rounds)
                                                      : o.repeats;
  };
  int rounds = 0;
  for (const auto& m : methods) rounds = std::max(rounds, rounds_of(m));
  std::map<std::string, std::vector<Trial>> trials;
  for (int r = 0; r < rounds; ++r) {
    std::vector<const MethodSpec*> in_round;
    for (const auto& m : methods)
      if (r < rounds_of(m)) in_round.push_back(&m);
    // Rotate the order each round so no method always runs in the same slot
    // (a stride of 3 would leave a round of 3 or 6 methods in place).
    const std::size_t stride = in_round.size() % 3 == 0 ? 1 : 3;
    for (std::size_t j = 0; j < in_round.size(); ++j) {
      const MethodSpec& m = *in_round[(j + static_cast<std::size_t>(r) * stride) % in_round.size()];
      const bool last = r == rounds_of(m) - 1;
      const bool keep = last && (m.name == "pmsnap-adaptive-k1" || m.family == 2);
      Trial trial = RunTrial(c, m, keep);
      const double mean = Mean(trial.iteration_seconds);
      if (trial.ok) {
        std::printf(
            "  [%s/%s] round %d/%d %-22s median %8.1f ms  mean %8.1f ms  step %7.1f ms  stall "
            "%7.2f ms/it"
            "  %3llu ckpt%s  %s\n",
            w.name.c_str(), label.c_str(), r + 1, rounds_of(m), m.name.c_str(),
            Median(trial.iteration_seconds) * 1e3, mean * 1e3, Mean(trial.step_seconds) * 1e3,
            trial.counters.stall.total() / iterations * 1e3,
            static_cast<unsigned long long>(trial.counters.commits),
            CountersText(trial.per_iteration).c_str(), trial.note.c_str());
        for (std::size_t i = 0; i < trial.iteration_seconds.size(); ++i) {
          char line[256];
          std::snprintf(line, sizeof(line), "%s,%s,%s,%d,%zu,%.6f,%.6f", w.name.c_str(),
                        label.c_str(), m.name.c_str(), r + 1, i + 1, trial.iteration_seconds[i],
                        trial.step_seconds[i]);
          results->trial_lines.push_back(line);
        }
      } else {
        std::printf("  [%s/%s] round %d/%d %-22s FAILED: %s\n", w.name.c_str(), label.c_str(),
                    r + 1, rounds_of(m), m.name.c_str(), trial.error.c_str());
      }
      std::fflush(stdout);
      trials[m.name].push_back(std::move(trial));
    }
  }

  // Aggregate: per round, overhead is paired with that round's `none`.
  const auto& none = trials["none"];
  for (const auto& m : methods) {
    Row row;
    row.workload = w.name;
    row.device = label;
    row.method = m.name;
    row.family = m.family;
    std::vector<double> all, means, overheads, conflict, boundary, copy, save, hook, cpm, bytes,
        per_ckpt, cost, ipc, cycle_overheads, instructions_per_cycle, steps, extra_steps,
        extra_forward_backwards, colds, cold_overheads, cold_faults, faults, training_faults;
    for (std::size_t r = 0; r < trials[m.name].size(); ++r) {
      const Trial& t = trials[m.name][r];
      if (!t.ok) {
        row.error = t.error;
        continue;
      }
      ++row.rounds_ok;
      all.insert(all.end(), t.iteration_seconds.begin(), t.iteration_seconds.end());
      const double mean = Mean(t.iteration_seconds);
      means.push_back(mean);
      double base = 0;
      if (r < none.size() && none[r].ok) base = Mean(none[r].iteration_seconds);
      if (base > 0) overheads.push_back((mean / base - 1) * 100);
      const double step = Mean(t.step_seconds);
      steps.push_back(step);
      if (base > 0) {
        const double base_step = Mean(none[r].step_seconds);
        extra_steps.push_back(step - base_step);
        extra_forward_backwards.push_back((mean - step) - (base - base_step));
      }
      if (!t.cold_iteration_seconds.empty()) {
        const double cold = Mean(t.cold_iteration_seconds);
        colds.push_back(cold);
        if (r < none.size() && none[r].ok && !none[r].cold_iteration_seconds.empty())
          cold_overheads.push_back((cold / Mean(none[r].cold_iteration_seconds) - 1) * 100);
      }
      if (t.cold_process_faults >= 0) cold_faults.push_back(t.cold_process_faults);
      if (t.process_faults >= 0) faults.push_back(t.process_faults);
      if (t.per_iteration[4] >= 0) training_faults.push_back(t.per_iteration[4]);
      const double cycles = t.per_iteration[0], instructions = t.per_iteration[1];
      if (cycles > 0 && instructions >= 0) instructions_per_cycle.push_back(instructions / cycles);
      if (cycles > 0 && r < none.size() && none[r].ok && none[r].per_iteration[0] > 0)
        cycle_overheads.push_back((cycles / none[r].per_iteration[0] - 1) * 100);
      const double n = static_cast<double>(t.iteration_seconds.size());
      conflict.push_back(t.counters.stall.conflict / n);
      boundary.push_back(t.counters.stall.boundary / n);
      copy.push_back(t.counters.stall.copy / n);
      save.push_back(t.counters.stall.save / n);
      hook.push_back(t.counters.stall.hook / n);
      cpm.push_back(t.wall > 0 ? static_cast<double>(t.counters.commits) * 60 / t.wall : 0);
      bytes.push_back(static_cast<double>(t.counters.bytes) / n);
      row.conflicts += t.counters.conflicts;
      if (t.counters.commits > 0) {
        per_ckpt.push_back(t.counters.stall.total() / static_cast<double>(t.counters.commits));
        ipc.push_back(n / static_cast<double>(t.counters.commits));
        if (base > 0) cost.push_back((mean - base) * n / static_cast<double>(t.counters.commits));
      }
      row.note = t.note;
    }
    row.median_ms = Median(all) * 1e3;
    row.p99_ms = Quantile(all, 0.99) * 1e3;
    row.mean_ms = Median(means) * 1e3;
    row.overhead_pct = Median(overheads);
    std::tie(row.overhead_ci_low_pct, row.overhead_ci_high_pct) = MedianInterval95(overheads);
    if (!cycle_overheads.empty()) row.cycles_overhead_pct = Median(cycle_overheads);
    if (!instructions_per_cycle.empty()) row.ipc = Median(instructions_per_cycle);
    row.step_ms = Median(steps) * 1e3;
    row.extra_step_ms = Median(extra_steps) * 1e3;
    row.extra_forward_backward_ms = Median(extra_forward_backwards) * 1e3;
    row.cold_ms = Median(colds) * 1e3;
    if (!cold_overheads.empty()) row.cold_overhead_pct = Median(cold_overheads);
    if (!cold_faults.empty()) row.cold_faults_per_iter = Median(cold_faults);
    if (!faults.empty()) row.faults_per_iter = Median(faults);
    if (!training_faults.empty()) row.training_faults_per_iter = Median(training_faults);
    if (!overheads.empty()) {
      row.overhead_min_pct = *std::min_element(overheads.begin(), overheads.end());
      row.overhead_max_pct = *std::max_element(overheads.begin(), overheads.end());
    }
    row.stall_per_iter = {Median(conflict), Median(boundary), Median(copy), Median(save),
                          Median(hook)};
    row.stall_per_checkpoint_ms = Median(per_ckpt) * 1e3;
    row.commits_per_min = Median(cpm);
    row.iterations_per_commit = Median(ipc);
    row.bytes_per_iter = Median(bytes);
    row.cost_per_checkpoint_s = Median(cost);
    // Longest-frequency estimate under 3.5%: every k iterations, from the
    // measured wall-time cost of one checkpoint over `none`'s iteration.
    double base_iter = 0;
    for (const auto& r : results->rows)
      if (r.workload == w.name && r.device == label && r.method == "none")
        base_iter = r.mean_ms / 1e3;
    if (m.family > 1 && base_iter > 0 && !cost.empty()) {
      const double c35 = std::max(0.0, row.cost_per_checkpoint_s);
      row.k35 = std::max<std::uint64_t>(
          1, static_cast<std::uint64_t>(std::ceil(c35 / (kOverheadBudget * base_iter) - 1e-9)));
      // A pipelined method cannot checkpoint more often than it commits.
      row.k35 = std::max<std::uint64_t>(
          row.k35, static_cast<std::uint64_t>(std::ceil(row.iterations_per_commit - 1e-9)));
    }
    results->rows.push_back(row);
  }

  // Restore of the newest checkpoint, as after a crash: each restore runs in
  // a fresh process that builds the model as a restarted trainer would
  // (initialized parameters, no optimizer state) and then either restores
  // from the pool kept from the last pmsnap-adaptive-k1 trial or
  // torch::loads the torch-save file. A fresh process pays what a restart
  // pays (first touch of the optimizer state and of what torch::load
  // allocates); restores in this process would find memory glibc kept from
  // the trials. The three take turns within each round, so a slow spell of
  // the machine slows all of them alike and the ratios stay comparable.
  const std::string pool = PoolPath(c, "pmsnap-adaptive-k1");
  const std::string file = dir + "/torch-save.pt";
  struct RestoreSamples {
    explicit RestoreSamples(std::string name) : method(std::move(name)) {}
    std::string method;
    std::vector<double> open_s, restore_s;
    std::uint64_t bytes = 0;
    bool failed = false;
  };
  RestoreSamples verified(kRestorePmsnapVerified), unverified(kRestorePmsnapUnverified),
      loaded(kRestoreTorchLoad);
  const bool have_pool = std::filesystem::exists(pool);
  const bool have_file = std::filesystem::exists(file);
  auto restore = [&](RestoreSamples& out, const std::string& path) {
    Result<RestoreSample> sample = RestoreInFreshProcess(o, w.name, spec, out.method, path);
    if (!sample.ok()) {
      std::printf("  restore %s: %s\n", out.method.c_str(), sample.status().ToString().c_str());
      out.failed = true;
      return;
    }
    out.open_s.push_back(sample->open_s);
    out.restore_s.push_back(sample->restore_s);
    out.bytes = sample->bytes;
  };
  for (int r = 0; r < o.restore_rounds; ++r) {
    if (have_pool && !verified.failed) restore(verified, pool);
    if (have_file && !loaded.failed) restore(loaded, file);
    if (have_pool && !unverified.failed) restore(unverified, pool);
  }
  for (const RestoreSamples* s : {&verified, &unverified, &loaded}) {
    if (s->restore_s.empty()) continue;
    RestoreRow rr{w.name, label,   s->method, Median(s->open_s) * 1e3, Median(s->restore_s) * 1e3,
                  0,      s->bytes};
    rr.total_ms = rr.open_ms + rr.restore_ms;
    // Paired by round: both ran back to back, so a slow spell cancels out.
    std::vector<double> speedups;
    for (std::size_t r = 0; r < s->restore_s.size() && r < loaded.restore_s.size(); ++r)
      speedups.push_back(loaded.restore_s[r] / (s->open_s[r] + s->restore_s[r]));
    if (!speedups.empty() && s != &loaded) {
      rr.speedup = Median(speedups);
      rr.speedup_min = *std::min_element(speedups.begin(), speedups.end());
      rr.speedup_max = *std::max_element(speedups.begin(), speedups.end());
    }
    results->restores.push_back(rr);
  }
  for (const auto& r : results->restores)
    if (r.workload == w.name && r.device == label)
      std::printf("  [%s/%s] restore %-36s %8.1f ms (open %.1f + restore %.1f)\n", w.name.c_str(),
                  label.c_str(), r.method.c_str(), r.total_ms, r.open_ms, r.restore_ms);
  std::filesystem::remove_all(dir);
  std::error_code ignored;  // the per-process folder goes once its last workload is done
  std::filesystem::remove(std::filesystem::path(dir).parent_path(), ignored);
}

void PrintTable(const Results& res) {
  std::printf("\n%-11s %-9s %-22s %8s %8s %8s %8s | %8s %7s %7s %7s %7s %7s | %7s %6s %7s %6s\n",
              "workload", "device", "method", "med ms", "p99 ms", "mean ms", "ovh %", "stall/it",
              "confl", "bound", "copy", "save", "hook", "ckpt/min", "it/ckpt", "MB/it", "k<3.5%");
  for (const auto& r : res.rows) {
    if (r.rounds_ok == 0) {
      std::printf("%-11s %-9s %-22s FAILED: %s\n", r.workload.c_str(), r.device.c_str(),
                  r.method.c_str(), r.error.c_str());
      continue;
    }
    const double n = 1e3;
    std::printf(
        "%-11s %-9s %-22s %8.1f %8.1f %8.1f %+8.1f | %8.2f %7.2f %7.2f %7.2f %7.2f %7.2f | %8.1f "
        "%6.1f %7.1f %6s\n",
        r.workload.c_str(), r.device.c_str(), r.method.c_str(), r.median_ms, r.p99_ms, r.mean_ms,
        r.overhead_pct, r.stall_per_iter.total() * n, r.stall_per_iter.conflict * n,
        r.stall_per_iter.boundary * n, r.stall_per_iter.copy * n, r.stall_per_iter.save * n,
        r.stall_per_iter.hook * n, r.commits_per_min, r.iterations_per_commit,
        r.bytes_per_iter / 1e6, r.k35 ? std::to_string(r.k35).c_str() : "-");
  }
  std::printf(
      "(stall columns: ms per measured iteration on the training thread; k<3.5%%: "
      "estimated longest-frequency interval keeping overhead under 3.5%%)\n");
  std::printf("\n%-11s %-9s %-22s %9s %9s | %12s %12s %12s\n", "workload", "device", "method",
              "cold ms", "cold ovh%", "cold flt/it", "flt/it", "train flt/it");
  for (const auto& r : res.rows) {
    if (r.rounds_ok == 0) continue;
    std::printf("%-11s %-9s %-22s %9.1f %+9.1f | %12.0f %12.0f %12.0f\n", r.workload.c_str(),
                r.device.c_str(), r.method.c_str(), r.cold_ms, r.cold_overhead_pct,
                r.cold_faults_per_iter, r.faults_per_iter, r.training_faults_per_iter);
  }
  std::printf(
      "(cold: the --warmup iterations right after a method was set up, i.e. a fresh pool, "
      "file or buffer, against none's; flt/it: page faults per iteration, whole process "
      "and training thread)\n");
  std::printf("\n%-11s %-9s %-36s %9s %9s %9s %9s\n", "workload", "device", "restore", "open ms",
              "copy ms", "total ms", "MB");
  for (const auto& r : res.restores)
    std::printf("%-11s %-9s %-36s %9.1f %9.1f %9.1f %9.1f\n", r.workload.c_str(), r.device.c_str(),
                r.method.c_str(), r.open_ms, r.restore_ms, r.total_ms,
                static_cast<double>(r.bytes) / 1e6);
}

const Row* Find(const Results& res, const std::string& w, const std::string& d,
                const std::string& m) {
  for (const auto& r : res.rows)
    if (r.workload == w && r.device == d && r.method == m && r.rounds_ok > 0) return &r;
  return nullptr;
}

void PrintTargets(const Results& res) {
  std::printf("\ntargets\n");
  if (const Row* a = Find(res, kTargetWorkload, kTargetDevice, "pmsnap-adaptive-k1")) {
    std::string control;
    if (const Row* h = Find(res, kTargetWorkload, kTargetDevice, "pmsnap-hooks-only")) {
      char text[128];
      std::snprintf(text, sizeof(text), "; hooks-only control %+.1f%%, %+.1f%% to %+.1f%%",
                    h->overhead_pct, h->overhead_min_pct, h->overhead_max_pct);
      control = text;
    }
    char where[160];
    std::snprintf(where, sizeof(where),
                  "; extra per iteration %+.1f ms in the step, %+.1f ms in forward+backward",
                  a->extra_step_ms, a->extra_forward_backward_ms);
    std::string details = where;  // where the time went, then cycles
    if (!std::isnan(a->cycles_overhead_pct)) {
      char text[128];
      std::snprintf(text, sizeof(text), "; training-thread cycles per iteration %+.1f%%",
                    a->cycles_overhead_pct);
      details += text;
    }
    std::printf(
        "  pmsnap adaptive every iteration, MLP, host: overhead %+.1f%% over none, the same "
        "optimizer step without checkpoints, i.e. what checkpointing costs (median of %d rounds, "
        "95%% interval %+.1f%% to %+.1f%%, rounds %+.1f%% to %+.1f%%%s%s) (target <= 3.5%%): %s\n",
        a->overhead_pct, a->rounds_ok, a->overhead_ci_low_pct, a->overhead_ci_high_pct,
        a->overhead_min_pct, a->overhead_max_pct, details.c_str(), control.c_str(),
        a->overhead_pct <= 3.5 ? "MET" : "MISSED");
    if (const Row* l = Find(res, kTargetWorkload, kTargetDevice, "none-libtorch")) {
      // From the two medians against `none`.
      const double versus_libtorch =
          ((1 + a->overhead_pct / 100) / (1 + l->overhead_pct / 100) - 1) * 100;
      std::printf(
          "  the same against none-libtorch, libtorch's own step without checkpoints (what a "
          "libtorch user runs today; %+.1f%% on none): %+.1f%% (target <= 3.5%%): %s\n",
          l->overhead_pct, versus_libtorch, versus_libtorch <= 3.5 ? "MET" : "MISSED");
    }
  }
  for (const auto& r : res.rows) {
    if (r.method != "pmsnap-adaptive-k1") continue;
    const Row* cf = Find(res, r.workload, r.device, "checkfreq-k1");
    if (!cf) continue;
    const double ratio = cf->stall_per_iter.total() / std::max(r.stall_per_iter.total(), 1e-9);
    std::printf(
        "  %s/%s: stall %.2f ms/it vs checkfreq-k1 %.2f ms/it: %.1fx less (target >= 5x): %s\n",
        r.workload.c_str(), r.device.c_str(), r.stall_per_iter.total() * 1e3,
        cf->stall_per_iter.total() * 1e3, ratio, ratio >= 5 ? "MET" : "MISSED");
  }
  for (const auto& p : res.restores) {
    if (p.method != "pmsnap-verify") continue;
    for (const auto& t : res.restores) {
      if (t.workload != p.workload || t.device != p.device || t.method != "torch-load") continue;
      std::printf(
          "  %s/%s: restore %.1f ms (open+verify+copy; copy alone %.1f ms) vs torch::load "
          "%.1f ms: %.1fx faster (paired rounds, median; %.1fx to %.1fx) (target >= 3x): %s\n",
          p.workload.c_str(), p.device.c_str(), p.total_ms, p.restore_ms, t.total_ms, p.speedup,
          p.speedup_min, p.speedup_max, p.speedup >= 3 ? "MET" : "MISSED");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (auto exit_code = ParseCommandLine(argc, argv, "pmsnap_bench_stall", kUsage,
                                        [&o](const std::string& key, const std::string& value) {
                                          return ParseFlag(key, value, &o);
                                        })) {
    return *exit_code;
  }
  if (o.dir.empty()) {
    const char* env = std::getenv("PMSNAP_POOL_DIR");
    o.dir = env && *env ? env : "/dev/shm";
  }
  if (o.iters < 1 || o.repeats < 1 || o.warmup < 0 || o.k < 1 || o.threads < 1 || o.workers < 1 ||
      o.restore_rounds < 1 || o.target_rounds < 1) {
    std::fprintf(stderr, "pmsnap_bench_stall: counts must be positive\n");
    return 1;
  }
  // Pools in /dev/shm take the PM code path (non-temporal stores + drain), as
  // in the tests and the other benchmarks.
  setenv("PMEM_IS_PMEM_FORCE", "1", 0);
  torch::set_num_threads(o.threads);
  // Debian's libtorch reaches OpenBLAS through libblas.so.3, and OpenBLAS's
  // own thread pool ignores torch::set_num_threads: left alone it runs GEMMs
  // on every core, including the one meant for the checkpoint workers.
  using SetBlasThreads = void (*)(int);
  const auto set_blas_threads =
      reinterpret_cast<SetBlasThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set_blas_threads != nullptr) set_blas_threads(o.threads);
  torch::manual_seed(1);
  if (!o.restore_child.empty()) {
    // A restart is not pinned: undo the training CPU mask inherited from the
    // parent, so the restore's workers may use every CPU.
    std::vector<int> every_cpu(static_cast<std::size_t>(ConfiguredCpus()));
    std::iota(every_cpu.begin(), every_cpu.end(), 0);
    (void)PinCurrentThread(every_cpu, "restore child");
    try {
      return RunRestoreChild(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pmsnap_bench_stall restore child: %s\n", e.what());
      return 2;
    }
  }
  o.command_line.assign(argv, argv + argc);
  const auto start = Clock::now();
  std::string pinning = "threads not pinned";
  const std::vector<int> cpus = AllowedCpus();
  if (o.pin && cpus.size() >= 2) {
    const std::size_t workers = std::min<std::size_t>(cpus.size() - 1, o.workers);
    const std::vector<int> training(cpus.begin(), cpus.end() - workers);
    g_worker_cpus.assign(cpus.end() - workers, cpus.end());
    Status pinned = PinCurrentThread(training, "training thread");
    if (!pinned.ok()) {
      std::fprintf(stderr, "pmsnap_bench_stall: %s\n", pinned.ToString().c_str());
      return 1;
    }
    pinning = "training on CPU " + CpuList(training) + ", checkpoint threads on CPU " +
              CpuList(g_worker_cpus);
  }
  std::printf(
      "pmsnap_bench_stall: %u hardware threads, torch intra-op threads %d (OpenBLAS %s), %d "
      "checkpoint worker(s) per method, %s, pmsnap parts %llu MiB, stepper's blocks %llu KiB, "
      "files and pools in %s\n",
      std::thread::hardware_concurrency(), o.threads,
      set_blas_threads != nullptr ? "capped alike" : "not found", o.workers, pinning.c_str(),
      static_cast<unsigned long long>(o.part_mib), static_cast<unsigned long long>(o.block_kib),
      o.dir.c_str());
  Results results;
  try {
    for (const auto& name : o.workloads) {
      std::optional<Workload> w = MakeWorkload(name, o);
      if (!w) return 1;
      std::printf("\nworkload %s: %s\n", w->name.c_str(), w->description.c_str());
      for (const auto& d : o.devices) {
        if (d != "host" && d != "simulated") {
          std::fprintf(stderr, "unknown device %s (host | simulated)\n", d.c_str());
          return 1;
        }
        RunWorkloadDevice(o, *w, d, &results);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pmsnap_bench_stall: %s\n", e.what());
    return 2;
  }
  PrintTable(results);
  PrintTargets(results);
  WriteCsv(o, results.rows, results.restores, results.trial_lines);
  std::printf("\ncsv: %s/%s.csv, %s_restore.csv, %s_trials.csv; total %.0f s\n", o.out.c_str(),
              o.tag.c_str(), o.tag.c_str(), o.tag.c_str(), Since(start));
  if (o.plot) {
    const std::string cmd = std::string(PMSNAP_BENCH_PYTHON " ") + PMSNAP_BENCH_SOURCE_DIR +
                            "/stall_plot.py " + o.out + " " + o.tag;
    if (std::system(cmd.c_str()) == 0)
      std::printf("plot: %s/%s.png\n", o.out.c_str(), o.tag.c_str());
  }
  return 0;
}
