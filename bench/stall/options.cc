#include "stall/options.h"

#include <sstream>

#include "pmsnap/hooks/parameter_stepper.h"

namespace pmsnap::bench::stall {

const std::uint64_t kDefaultBlockKib = hooks::ParameterStepper::kDefaultBlockBytes >> 10;

const char* const kUsage =
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

namespace {

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) parts.push_back(item);
  return parts;
}

}  // namespace

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

}  // namespace pmsnap::bench::stall
