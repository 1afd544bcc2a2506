"""The Python commands of `pmsnap` / `python -m pmsnap`: list, export, prune, diff.

  pmsnap list POOL [--json]
      the retained checkpoints: epoch, iteration, commit time, bytes,
      embedding policy (and the slots whose record is damaged)
  pmsnap export POOL --to OUT [--format safetensors|pt|dcp] [--epoch E]
                [--model-only] [--progress | --quiet] [--json]
      writes one checkpoint as .safetensors, .pt or a DCP folder
      (pmsnap.export); a multi-rank pool ("{rank}" in POOL) as one file
  pmsnap prune POOL --keep N [--json]
      keeps the newest N retained epochs (see prune() for what that means
      with the pool's two slots)
  pmsnap diff POOL --epochs A B [--json]
      per tensor: max |a - b| and the L2 norm of a - b

Human tables by default, --json for scripts. Exit codes as the C++ commands
(tools/cli.cc): 0 success, 1 damaged or unreadable (the message names the
pool; `list` also when a retained checkpoint fails its checksums), 2 a usage
error, 3 busy (another process has the pool open). `info` and `verify` are
the C++ ones (_pmsnap.run_cli). Only prune writes to the pool.

Thread-safety: a command line runs on one thread.
"""

import argparse
import datetime
import json
import math
import sys

import torch

from . import _pmsnap
from .errors import make_error
from .export import FORMATS, export
from .state_dict import PoolCheckpoint

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BUSY = 3


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{self.prog}: {message}")


def _parser():
    parser = _Parser(prog="pmsnap", description="Inspect, export and prune pmsnap pools.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="the retained checkpoints of a pool")
    p.add_argument("pool")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("export", help="write a checkpoint as safetensors, torch.save or DCP")
    p.add_argument("pool")
    p.add_argument("--to", required=True, help="out.safetensors, out.pt or a folder (dcp)")
    p.add_argument("--format", help="safetensors, pt or dcp (default: from --to)")
    p.add_argument("--epoch", type=int)
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--progress", action="store_true", default=None,
                   help="progress lines on stderr (default: when stderr is a terminal)")
    p.add_argument("--quiet", dest="progress", action="store_false")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("prune", help="keep only the newest N retained epochs")
    p.add_argument("pool")
    p.add_argument("--keep", type=int, required=True)
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("diff", help="per-tensor differences between two retained epochs")
    p.add_argument("pool")
    p.add_argument("--epochs", type=int, nargs=2, required=True, metavar=("A", "B"))
    p.add_argument("--json", action="store_true")
    return parser


COMMANDS = ("list", "export", "prune", "diff")


def main(argv, out=sys.stdout, err=sys.stderr):
    """Runs one command; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        err.write(f"{e}\n")
        return EXIT_USAGE
    try:
        if args.command == "list":
            return _list(args, out)
        if args.command == "export":
            return _export(args, out, err)
        if args.command == "prune":
            return _prune(args, out)
        return _diff(args, out)
    except _pmsnap.Error as e:
        if getattr(args, "json", False):
            out.write(json.dumps({"pool": args.pool, "error": str(e)}) + "\n")
        err.write(f"pmsnap: {e}\n")
        return EXIT_BUSY if isinstance(e, _pmsnap.BusyError) else EXIT_ERROR


def _iso(unix_ns):
    if not unix_ns:
        return "-"
    return datetime.datetime.fromtimestamp(unix_ns / 1e9, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


def _human(nbytes):
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _table(out, header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    out.write("  ".join(str(h).ljust(w) for h, w in zip(header, widths)).rstrip() + "\n")
    for r in rows:
        out.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def list_checkpoints(pool):
    """[{epoch, iteration, time, commit_time_unix_ns, bytes, policy, latest,
    damaged}] of the retained epochs, newest first, and the warnings. Every
    checksum of each is checked: `damaged` lists what fails ([] when none)."""
    with PoolCheckpoint(pool) as checkpoint:
        problems = checkpoint.verify()
        rows = []
        for epoch in checkpoint.retained:
            row = _list_row(checkpoint.at(epoch), epoch == checkpoint.retained[0])
            row["damaged"] = problems.get(epoch, [])
            rows.append(row)
        return rows, checkpoint.warnings


def _list_row(c, latest):
    dense = sum(e.nbytes for e in c.entries if e.table is None)
    chunk_bytes = 0
    policies = set()
    for reader, table in {(id(e.reader), e.table): (e.reader, e.table)
                          for e in c.entries if e.table is not None}.values():
        for info in reader.list_checkpoints(table):
            if info["epoch"] == c.epoch:
                chunk_bytes += info["chunk_bytes"]
                policies.add(info["policy"])
    return {"epoch": c.epoch, "iteration": c.iteration, "time": _iso(c.commit_time_unix_ns),
            "commit_time_unix_ns": c.commit_time_unix_ns, "bytes": dense + chunk_bytes,
            "policy": ",".join(sorted(policies)) if policies else "dense", "latest": latest}


def _list(args, out):
    rows, warnings = list_checkpoints(args.pool)
    damaged = [r for r in rows if r["damaged"]]
    code = EXIT_ERROR if damaged else EXIT_OK
    if args.json:
        out.write(json.dumps({"pool": args.pool, "checkpoints": rows, "warnings": warnings})
                  + "\n")
        return code
    out.write(f"pool {args.pool}: {len(rows)} retained checkpoint(s)"
              f"{f', {len(damaged)} DAMAGED' if damaged else ''}\n")
    _table(out, ("epoch", "iteration", "time", "bytes", "policy", ""),
           [(r["epoch"], r["iteration"], r["time"], _human(r["bytes"]), r["policy"],
             ", ".join((["latest"] if r["latest"] else []) +
                       (["DAMAGED"] if r["damaged"] else []))) for r in rows])
    for r in damaged:
        more = len(r["damaged"]) - 1
        out.write(f"damaged: epoch {r['epoch']}: {r['damaged'][0]}"
                  f"{f' (+{more} more)' if more else ''}\n")
    for w in warnings:
        out.write(f"warning: {w}\n")
    return code


def _export(args, out, err):
    if args.format is not None and args.format not in FORMATS:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"unknown export format '{args.format}' (safetensors, pt or dcp); "
                         f"pool {args.pool} is untouched")
    progress = args.progress
    if progress is None:
        progress = err.isatty() if hasattr(err, "isatty") else False
    result = export(args.pool, args.to, format=args.format, epoch=args.epoch,
                    model_only=args.model_only, progress=err if progress else None)
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        for w in result["warnings"]:
            out.write(f"warning: {w}\n")
        out.write(f"exported epoch {result['epoch']} (iteration {result['iteration']}) of "
                  f"{result['pool']}: {result['tensors']} tensors, {_human(result['bytes'])} "
                  f"-> {result['path']} ({result['format']})\n")
    return EXIT_OK


def _prune(args, out):
    result = prune(args.pool, args.keep)
    if args.json:
        out.write(json.dumps(result) + "\n")
    else:
        dropped = ", ".join(str(e) for e in result["dropped"]) or "none"
        out.write(f"pool {args.pool}: kept epochs {', '.join(map(str, result['kept']))}; "
                  f"dropped {dropped}\n")
    return EXIT_OK


def prune(pool, keep):
    """Keeps the newest `keep` retained epochs of `pool`, drops the others.

    A pool retains at most two epochs (its two slots, preallocated at
    creation): keep >= 2 keeps both and changes nothing; keep 1 drops the
    older epoch: its slot is marked empty (one 8-byte atomic store,
    crash-consistent), so that no restore, load or export can pick it any
    more. The file keeps its size: slots are preallocated. keep < 1 is
    refused (delete the file instead). Returns {"pool", "kept", "dropped"}.
    """
    if keep < 1:
        raise make_error(_pmsnap.InvalidArgumentError,
                         f"pool {pool}: prune --keep must be at least 1 (the newest checkpoint "
                         f"cannot be pruned; remove the file instead), got {keep}")
    return _pmsnap.prune_pool(pool, keep)


def _diff(args, out):
    rows = diff(args.pool, *args.epochs)
    if args.json:
        out.write(json.dumps({"pool": args.pool, "epochs": args.epochs, "tensors": rows}) + "\n")
        return EXIT_OK
    a, b = args.epochs
    out.write(f"pool {args.pool}: epoch {a} vs epoch {b}\n")
    _table(out, ("tensor", "dtype", "shape", "max_abs", "l2"),
           [(r["tensor"], r["dtype"], "x".join(map(str, r["shape"])) or "scalar",
             f"{r['max_abs']:.6g}", f"{r['l2']:.6g}") for r in rows])
    return EXIT_OK


def diff(pool, epoch_a, epoch_b):
    """[{tensor, dtype, shape, max_abs, l2}] of b - a for every tensor of two
    retained epochs (computed in float64, one tensor pair at a time)."""
    rows = []
    with PoolCheckpoint(pool, epoch_a) as a:
        b = a.at(epoch_b)
        for ea, eb in zip(a.entries, b.entries):
            ta = a.read(ea).to(torch.float64)
            tb = b.read(eb).to(torch.float64)
            delta = (tb - ta).reshape(-1)
            rows.append({"tensor": ea.key, "dtype": ea.dtype, "shape": list(ea.shape),
                         "max_abs": float(delta.abs().max()) if delta.numel() else 0.0,
                         "l2": float(math.sqrt(float((delta * delta).sum())))})
    return rows
