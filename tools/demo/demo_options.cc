// pmsnap-demo's command line and CPU plan (demo.h).
#include <algorithm>
#include <sstream>

#include "demo.h"
#include "pmsnap/common/cpu_affinity.h"

namespace pmsnap::demo {

const char* const kUsage =
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

}  // namespace pmsnap::demo
