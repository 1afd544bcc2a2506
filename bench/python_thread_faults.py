#!/usr/bin/env python3
"""Page faults per step of each thread of a pmsnap training process.

On a VM a minor fault costs 13-23 us (../shared/tools/fault_cost.py), so a
copy worker that faults in its buffers again on every step spends
milliseconds doing so (bench/RESULTS.md, eighth session: 148-172 faults a
step on the DLRM example with glibc's default malloc thresholds, 0 with
both fixed). This trains a workload of bench/python_overhead.py through
pmsnap.CheckpointedOptimizer (every=1, the workload's configuration) and
reads each thread's minor faults from /proc/self/task after --warmup steps
and at the end.

    PMEM_IS_PMEM_FORCE=1 PYTHONPATH=build/python .venv/bin/python \\
        bench/python_thread_faults.py --workload dlrm --steps 400

Run it once as it is and once with GLIBC_TUNABLES set to compare. Writes
bench/results/python_thread_faults_<workload>.csv (a row per thread) and
prints the table. The pool goes to $PMSNAP_POOL_DIR (default /dev/shm).
"""

import argparse
import csv
import os
import sys
import threading

import pmsnap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import python_overhead  # noqa: E402  (the workloads)


def thread_faults():
    """{thread id: (name, minor faults so far)} of this process's threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[7]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(python_overhead.WORKLOADS), default="dlrm")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100,
                        help="steps before counting (the pool's first epochs fault it in)")
    python_overhead.add_transformer_arguments(parser)
    parser.add_argument("--out", default=None,
                        help="CSV (default bench/results/python_thread_faults_<workload>.csv)")
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be below --steps")
    if args.out is None:
        args.out = os.path.join(HERE, "results", f"python_thread_faults_{args.workload}.csv")

    allowed, worker_cpus = python_overhead.pin_training_thread()
    workload = python_overhead.WORKLOADS[args.workload](args)
    model, optimizer, loss_of, base = workload.make()
    pool = os.path.join(os.environ.get("PMSNAP_POOL_DIR", "/dev/shm"),
                        f"pmsnap-bench-faults-{os.getpid()}.pool")
    kwargs = python_overhead.checkpoint_kwargs("pmsnap", base, pool, worker_cpus)
    training_thread = threading.get_native_id()
    try:
        stepper = pmsnap.CheckpointedOptimizer(optimizer, **kwargs)
        for it in range(args.steps):
            if it == args.warmup:
                before = thread_faults()
            stepper.zero_grad()
            loss_of(it).backward()
            stepper.step()
        after = thread_faults()
        stats = stepper.stats()
        stepper.close()
    finally:
        if os.path.exists(pool):
            os.remove(pool)

    counted = args.steps - args.warmup
    rows = []
    for tid, (name, faults) in sorted(after.items()):
        if tid not in before:
            continue
        role = "training" if tid == training_thread else "other (pmsnap's workers, ...)"
        rows.append(dict(thread=tid, name=name, role=role,
                         faults_per_step=(faults - before[tid][1]) / counted))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{workload.describe()}; pmsnap every step; faults over steps {args.warmup}-"
          f"{args.steps}; GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '(unset)')}")
    print(f"\n{'thread':>8} {'role':<30} {'minor faults/step':>18}")
    for r in rows:
        print(f"{r['thread']:>8} {r['role']:<30} {r['faults_per_step']:18.1f}")
    print(f"\n{stats['epochs_committed']} checkpoints; boundary wait "
          f"{1e3 * stats.get('boundary_wait_seconds', 0) / max(1, stats['steps']):.3f} ms/step "
          f"(all steps); CSV: {args.out}")


if __name__ == "__main__":
    main()
