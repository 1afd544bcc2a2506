"""CPR's emulation framework (Maeng et al., section 5.1) on this machine.

A DLRM with the paper's Kaggle shape (bottom MLP 13-512-256-64-16, 26
EmbeddingBag tables of dim 16 with the Criteo Kaggle cardinalities capped at
--cap rows, dot interactions, top MLP 512-256-1 over them) trains on
synthetic clicks: dense features Gaussian, sparse ids Zipf-distributed, labels
from a fixed random teacher DLRM (as examples/train_dlrm.py); AUC on a
held-out test set. The tables are sharded over N_emb = 8 shards (greedy by
size). Two failures at random iterations each clear 12.5%, 25% or 50% of the
shards. Strategies:

  full         full recovery at T_save = sqrt(2 O_save T_fail): every shard,
               the dense part and the optimizer go back to the last save and
               the lost iterations are re-executed;
  partial      baseline partial recovery at the same interval;
  cpr-vanilla  partial recovery at Eq. 4's interval for PLS 0.1;
  cpr-mfu      CPR-MFU: the 7 largest tables save the r*N most used rows every
               r*T_save (r = 0.125), the other tables in full;
  cpr-ssu      CPR-SSU: the same with the sub-sampled used-row list (period 2).

Partial strategies restore failed shards through pmsnap.cpr (ShardSaves pools
in /dev/shm, the engine's pipeline and chunk heap); the PLS is the ledger's.

Time is emulated, as in the paper: the run stands for a 56-hour job with
2 failures (T_fail = 28 h); O_save (one save of every table), O_load and
O_res are projected figures (defaults give full recovery the paper's ~8.5%
overhead), scaled to iterations. Saves cost O_save times the fraction of the
tables' bytes they wrote (measured). "simulated" marks these columns; the
measured wall seconds of pmsnap's saves on this machine are reported beside.

    .venv/bin/python bench/cpr/cpr_emulation.py [--iterations 500 --seeds 3]

Writes bench/results/cpr_emulation.csv (one row per run) and
cpr_emulation.png, and prints the table. Thread-safety: a script.
"""

import argparse
import copy
import csv
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import pmsnap
from pmsnap import cpr

# Criteo Kaggle (Display Advertising Challenge) cardinalities of C1..C26.
KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
DIM = 16
EMB_SHARDS = 8
STRATEGIES = ["full", "partial", "cpr-vanilla", "cpr-mfu", "cpr-ssu"]


class DLRM(nn.Module):
    def __init__(self, table_rows, sparse):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                    nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, DIM), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(r, DIM, mode="sum", sparse=sparse)
                                    for r in table_rows)
        features = len(table_rows) + 1
        width = DIM + features * (features - 1) // 2  # 367 for 26 tables
        self.top = nn.Sequential(nn.Linear(width, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, dense, ids, offsets):
        x = self.bottom(dense)
        feats = [x] + [t(i, o) for t, i, o in zip(self.tables, ids, offsets)]
        stacked = torch.stack(feats, dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        r, c = torch.tril_indices(len(feats), len(feats), offset=-1)
        return self.top(torch.cat([x, dots[:, r, c]], dim=1)).squeeze(1)


def zipf_ids(rows, count, exponent, generator):
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    probs = ranks.pow(-exponent)
    ids = torch.multinomial(probs / probs.sum(), count, replacement=True, generator=generator)
    return (ids * 2654435761) % rows


def make_data(rows, batches, batch, seed, teacher_scale):
    """Train batches and one test batch from a fixed random teacher DLRM."""
    g = torch.Generator().manual_seed(10_000 + seed)
    torch.manual_seed(10_000 + seed)
    teacher = DLRM(rows, sparse=False)
    with torch.no_grad():
        for t in teacher.tables:
            t.weight.mul_(teacher_scale)
    probs = [torch.arange(1, r + 1, dtype=torch.float64).pow(-1.05) for r in rows]
    # Per-row click propensities beside the teacher's interactions (a "wide"
    # first-order part): what a failure's lost embedding updates cost shows
    # in a short run.
    biases = [torch.randn(r, generator=g) for r in rows]

    def one(n):
        dense = torch.randn(n, 13, generator=g)
        ids, offsets = [], []
        for r, p in zip(rows, probs):
            lengths = torch.randint(1, 3, (n,), generator=g)
            offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]]))
            picks = torch.multinomial(p / p.sum(), int(lengths.sum()), replacement=True,
                                      generator=g)
            ids.append((picks * 2654435761) % r)
        with torch.no_grad():
            logit = teacher(dense, ids, offsets)
            logit = logit / logit.std() + teacher_scale * sum(
                torch.nn.functional.embedding_bag(i, b.unsqueeze(1), o, mode="sum").squeeze(1)
                for i, o, b in zip(ids, offsets, biases)) / len(rows) ** 0.5
        return dense, ids, offsets, logit

    train = [one(batch) for _ in range(batches)]
    test = one(8192)
    threshold = torch.cat([b[3] for b in train[:20]]).median()
    train = [(d, i, o, (l > threshold).float()) for d, i, o, l in train]
    test = (test[0], test[1], test[2], (test[3] > threshold).float())
    return train, test


def auc(scores, labels):
    order = torch.argsort(scores)
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def shard_tables(rows):
    """Greedy by size: each table to the least loaded of EMB_SHARDS shards."""
    load = [0] * EMB_SHARDS
    shard_of = [0] * len(rows)
    for t in sorted(range(len(rows)), key=lambda t: -rows[t]):
        s = min(range(EMB_SHARDS), key=lambda s: load[s])
        shard_of[t] = s
        load[s] += rows[t]
    return shard_of


def run(strategy, args, rows, large, train, test, failures, plan, seed, pool_dir):
    torch.manual_seed(seed)
    model = DLRM(rows, sparse=True)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables.")]
    # Adagrad, as DLRM's reference uses for Criteo: sparse row updates.
    dense_opt = torch.optim.Adagrad(dense_params, lr=args.lr)
    sparse_opt = torch.optim.Adagrad(model.tables.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    n = args.iterations
    hours_per_it = args.total_hours / n
    shard_of = shard_tables(rows)
    table_bytes = sum(r * DIM * 4 for r in rows)

    full_interval_h = plan["full_interval"]
    if strategy in ("full", "partial"):
        every = max(1, round(full_interval_h / hours_per_it))
    else:
        every = max(1, round(plan["partial_interval"] / hours_per_it))
        if strategy in ("cpr-mfu", "cpr-ssu"):
            every = max(1, round(every * args.ratio))

    saves = {}
    recovery = None
    snapshot = None
    if strategy != "full":
        policy = {"cpr-mfu": "mfu", "cpr-ssu": "ssu"}.get(strategy, "full")
        for s in range(EMB_SHARDS):
            mine = [t for t in range(len(rows)) if shard_of[t] == s]
            groups = []
            big = [t for t in mine if t in large] if policy != "full" else []
            small = [t for t in mine if t not in big]
            for kind, tables in (("prio", big), ("full", small)):
                if not tables:
                    continue
                path = os.path.join(pool_dir, f"{strategy}.s{s}.{kind}.pool")
                groups.append(cpr.ShardSaves(
                    path, {f"t{t}": model.tables[t].weight.data for t in tables},
                    policy=policy if kind == "prio" else "full", ratio=args.ratio,
                    ssu_period=2, modules={f"t{t}": model.tables[t] for t in tables},
                    chunk_heap_bytes=8 * sum(rows[t] for t in tables) * DIM * 4 + (8 << 20)))
            saves[s] = groups
        recovery = cpr.PartialRecovery(saves, total_samples=n * args.batch,
                                       emb_shards=EMB_SHARDS)

    def save(it):
        nonlocal snapshot
        if strategy == "full":
            snapshot = (it, {k: v.clone() for k, v in model.state_dict().items()},
                        copy.deepcopy(dense_opt.state_dict()),
                        copy.deepcopy(sparse_opt.state_dict()))
            return 1.0  # every table (and the dense part)
        written = 0
        for groups in saves.values():
            for g in groups:
                before = g.bytes_saved
                g.save(it, it * args.batch)
                written += g.bytes_saved - before
        return written / table_bytes

    save_cost_h = 0.0
    saves_made = 0
    lost_h = 0.0
    pending = sorted(failures)
    wall_save = 0.0
    start = time.perf_counter()
    t0 = time.perf_counter()
    save_cost_h += args.o_save * save(0)
    wall_save += time.perf_counter() - t0
    saves_made += 1
    it = 1
    executed = 0
    while it <= n:
        dense, ids, offsets, labels = train[it - 1]
        dense_opt.zero_grad()
        sparse_opt.zero_grad()
        loss_fn(model(dense, ids, offsets), labels).backward()
        dense_opt.step()
        sparse_opt.step()
        executed += 1
        if it % every == 0:
            t0 = time.perf_counter()
            save_cost_h += args.o_save * save(it)
            wall_save += time.perf_counter() - t0
            saves_made += 1
        if pending and it == pending[0][0]:
            _, failed = pending.pop(0)
            if strategy == "full":
                last, state, dense_state, sparse_state = snapshot
                model.load_state_dict(state)
                dense_opt.load_state_dict(dense_state)
                sparse_opt.load_state_dict(sparse_state)
                lost_h += (it - last) * hours_per_it
                it = last  # re-execute the lost iterations
            else:
                recovery.recover(failed, samples=it * args.batch)
        it += 1
    wall = time.perf_counter() - start
    with torch.no_grad():
        model.eval()
        score = auc(model(test[0], test[1], test[2]), test[3])
    overhead_h = save_cost_h + lost_h + len(failures) * (args.o_load + args.o_res)
    out = {"strategy": strategy, "seed": seed, "save_every_it": every, "saves": saves_made,
           "test_auc": score, "pls": recovery.pls if recovery else 0.0,
           "overhead_pct_simulated": 100 * overhead_h / args.total_hours,
           "save_pct_simulated": 100 * save_cost_h / args.total_hours,
           "lost_pct_simulated": 100 * lost_h / args.total_hours,
           "iterations_executed": executed, "wall_s": wall, "save_wall_s": wall_save}
    if recovery:
        mem = sum(g.stats()["access_record_bytes"] for gs in saves.values() for g in gs)
        out["access_record_bytes"] = mem
        recovery.close()
    else:
        out["access_record_bytes"] = 0
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--cap", type=int, default=20000, help="rows per table at most")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    p.add_argument("--strategies", nargs="+", default=STRATEGIES)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--teacher-scale", type=float, default=2.0,
                   help="weight of the per-row propensities against the teacher DLRM's logit")
    p.add_argument("--ratio", type=float, default=0.125, help="r of CPR-MFU / CPR-SSU")
    p.add_argument("--target-pls", type=float, default=0.1)
    p.add_argument("--total-hours", type=float, default=56.0)
    p.add_argument("--failures", type=int, default=2)
    p.add_argument("--o-save", type=float, default=0.09, help="hours per full save (simulated)")
    p.add_argument("--o-load", type=float, default=0.05, help="hours per load (simulated)")
    p.add_argument("--o-res", type=float, default=0.05, help="hours per reschedule (simulated)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [min(r, args.cap) for r in KAGGLE_ROWS]
    large = set(sorted(range(26), key=lambda t: -KAGGLE_ROWS[t])[:7])
    t_fail = args.total_hours / args.failures
    plan = cpr.plan(args.o_save, args.o_load, args.o_res, t_fail, args.total_hours,
                    args.target_pls, EMB_SHARDS)
    print(f"CPR plan (simulated 56 h job, T_fail {t_fail:g} h, N_emb {EMB_SHARDS}): "
          f"{plan['reason']}")
    print(f"tables: 26, capped at {args.cap} rows ({sum(rows)} rows, "
          f"{sum(rows) * DIM * 4 / 2**20:.1f} MiB); {args.iterations} iterations x {args.batch}")
    rows_out = []
    pool_dir = tempfile.mkdtemp(prefix="pmsnap-cpr-bench-", dir="/dev/shm")
    try:
        for seed in range(args.seeds):
            train, test = make_data(rows, args.iterations, args.batch, seed, args.teacher_scale)
            for fraction in args.fractions:
                rng = random.Random(seed * 1000 + int(fraction * 1000))
                k = max(1, round(fraction * EMB_SHARDS))
                when = sorted(rng.sample(range(1, args.iterations + 1), args.failures))
                failures = [(w, sorted(rng.sample(range(EMB_SHARDS), k))) for w in when]
                for strategy in args.strategies:
                    for f in os.listdir(pool_dir):
                        os.remove(os.path.join(pool_dir, f))
                    r = run(strategy, args, rows, large, train, test, failures, plan, seed,
                            pool_dir)
                    r["fail_fraction"] = fraction
                    r["failures_at"] = " ".join(str(w) for w, _ in failures)
                    rows_out.append(r)
                    print(f"seed {seed} fail {fraction:5.3f} {strategy:12s} AUC {r['test_auc']:.4f} "
                          f"overhead {r['overhead_pct_simulated']:6.2f}% (simulated) "
                          f"PLS {r['pls']:.4f} saves {r['saves']:3d} every {r['save_every_it']} it "
                          f"wall {r['wall_s']:.1f}s", flush=True)
    finally:
        shutil.rmtree(pool_dir, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cpr_emulation.csv")
    fields = ["strategy", "fail_fraction", "seed", "failures_at", "save_every_it", "saves",
              "test_auc", "pls", "overhead_pct_simulated", "save_pct_simulated",
              "lost_pct_simulated", "iterations_executed", "wall_s", "save_wall_s",
              "access_record_bytes"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows_out:
            w.writerow({k: r[k] for k in fields})
    print(f"\nwrote {path}")
    print("\nmean over seeds (overhead: simulated 56 h job; AUC: held-out synthetic test set)")
    print(f"{'fail':>6s} {'strategy':12s} {'test AUC':>9s} {'+-':>7s} {'overhead %':>10s} "
          f"{'PLS':>7s} {'save wall s':>11s}")
    summary = {}
    for fraction in args.fractions:
        for strategy in args.strategies:
            sel = [r for r in rows_out if r["fail_fraction"] == fraction
                   and r["strategy"] == strategy]
            a = [r["test_auc"] for r in sel]
            o = statistics.mean(r["overhead_pct_simulated"] for r in sel)
            summary[(fraction, strategy)] = (statistics.mean(a), o)
            print(f"{fraction:6.3f} {strategy:12s} {statistics.mean(a):9.4f} "
                  f"{(statistics.stdev(a) if len(a) > 1 else 0):7.4f} {o:10.2f} "
                  f"{statistics.mean(r['pls'] for r in sel):7.4f} "
                  f"{statistics.mean(r['save_wall_s'] for r in sel):11.2f}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        width = 0.8 / len(args.strategies)
        for j, strategy in enumerate(args.strategies):
            xs = [i + j * width for i in range(len(args.fractions))]
            axes[0].bar(xs, [summary[(f, strategy)][1] for f in args.fractions], width,
                        label=strategy)
            axes[1].bar(xs, [summary[(f, strategy)][0] for f in args.fractions], width,
                        label=strategy)
        for ax, title in ((axes[0], "checkpoint-related overhead, % (simulated 56 h job)"),
                          (axes[1], "test AUC (synthetic teacher data)")):
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(args.fractions))])
            ax.set_xticklabels([f"{f:.1%} of shards fail" for f in args.fractions])
            ax.set_title(title, fontsize=9)
        lo = min(v[0] for v in summary.values())
        hi = max(v[0] for v in summary.values())
        axes[1].set_ylim(lo - 0.01, hi + 0.005)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"CPR emulation: DLRM Kaggle shape, tables capped at {args.cap} rows, "
                     f"{args.iterations} it, {args.seeds} seeds (overheads simulated)", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "cpr_emulation.png"), dpi=110)
        print(f"wrote {os.path.join(args.out, 'cpr_emulation.png')}")
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
