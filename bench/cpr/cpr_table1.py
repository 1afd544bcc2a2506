"""CPR's Table 1 on this machine: memory overhead and time per save of CPR-MFU
and CPR-SSU (pmsnap.cpr.ShardSaves: the engine's pipeline and chunk heap)
against SCAR (Qiao et al.: the L2 norm of each row's change since its last
save, which needs a copy of the table; computed here in torch as a baseline).

For 64-byte and 512-byte rows (dim 16 and 128, float32) a table of --mib MiB
gets --batches Zipf-distributed lookup batches, then one save of the r*N
chosen rows (r = 0.125; the first save, a full baseline, is not timed).
Prints a table and writes bench/results/cpr_table1.csv.

    .venv/bin/python bench/cpr/cpr_table1.py [--mib 16 --repeats 3]

Thread-safety: a script.
"""

import argparse
import csv
import os
import statistics
import tempfile
import time

import torch

from pmsnap import cpr

PAPER = {("mfu", 64): "6.25%", ("mfu", 512): "0.78%", ("ssu", 64): "0.78%",
         ("ssu", 512): "0.097%", ("scar", 64): "100%", ("scar", 512): "100%"}


def zipf_batch(rows, count, g):
    u = torch.rand(count, generator=g, dtype=torch.float64)
    # Inverse-CDF of a power law (exponent ~1.05) over the rows, hot rows spread.
    ids = (rows ** u - 1).long().clamp_(0, rows - 1)
    return (ids * 2654435761) % rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=16, help="table size")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--ids", type=int, default=4096, help="lookups per batch")
    p.add_argument("--ratio", type=float, default=0.125)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results"))
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for row_bytes in (64, 512):
        dim = row_bytes // 4
        rows = (args.mib << 20) // row_bytes
        k = int(args.ratio * rows)
        for method in ("mfu", "ssu", "scar"):
            save_s, select_s, mem = [], [], 0
            for rep in range(args.repeats):
                g = torch.Generator().manual_seed(rep)
                table = torch.randn(rows, dim, generator=g)
                batches = [zipf_batch(rows, args.ids, g) for _ in range(args.batches)]
                if method == "scar":
                    saved = table.clone()  # SCAR keeps the last saved values: 100% memory
                    for ids in batches:
                        table[ids] += 0.01
                    start = time.perf_counter()
                    change = (table - saved).norm(dim=1)
                    top = torch.topk(change, k).indices
                    t_select = time.perf_counter() - start
                    saved[top] = table[top]
                    chosen = torch.sort(top).values
                    _ = table[chosen].clone()  # the rows a save would write
                    save_s.append(time.perf_counter() - start)
                    select_s.append(t_select)
                    mem = saved.numel() * 4
                    continue
                with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
                    s = cpr.ShardSaves(os.path.join(d, "t.pool"), {"t": table}, policy=method,
                                       ratio=args.ratio, ssu_period=2,
                                       chunk_heap_bytes=4 * rows * row_bytes + (16 << 20))
                    s.save(0, 0)  # the full baseline
                    for ids in batches:
                        s.mark("t", ids)
                        table[ids] += 0.01
                    save_s.append(s.save(1, 1))
                    info = s.last_checkpoint("t")
                    select_s.append(info["select_seconds"])
                    mem = info["access_record_bytes"]
                    assert info["rows_written"] <= k + 1 and not info["full"], info
                    s.close()
            table_bytes = rows * row_bytes
            results.append({"method": method, "row_bytes": row_bytes, "rows": rows,
                            "memory_bytes": mem, "memory_pct": 100 * mem / table_bytes,
                            "paper_memory": PAPER[(method, row_bytes)],
                            "select_ms": 1000 * statistics.median(select_s),
                            "save_ms": 1000 * statistics.median(save_s)})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "cpr_table1.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(results[0]))
        w.writeheader()
        w.writerows(results)
    print(f"CPR Table 1 on this machine: {args.mib} MiB table, r = {args.ratio}, "
          f"{args.batches} x {args.ids} Zipf lookups, median of {args.repeats}")
    print(f"{'method':6s} {'row B':>5s} {'rows':>8s} {'memory':>10s} {'% of table':>10s} "
          f"{'paper':>7s} {'select ms':>9s} {'save ms':>8s}")
    for r in results:
        print(f"{r['method']:6s} {r['row_bytes']:5d} {r['rows']:8d} {r['memory_bytes']:10d} "
              f"{r['memory_pct']:9.3f}% {r['paper_memory']:>7s} {r['select_ms']:9.2f} "
              f"{r['save_ms']:8.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
