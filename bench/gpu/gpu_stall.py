#!/usr/bin/env python3
"""GPU stall benchmark: what checkpointing every k steps costs a training run
on one GPU, for a GPT-2-small-sized transformer (12 layers, d_model 768, 12
heads, vocabulary 50257: about 124M parameters, AdamW).

Methods, each from a fresh model in the same process:
  none        no checkpoint (the baseline)
  pmsnap      pmsnap.CheckpointedOptimizer, device "cuda" (copies ordered by
              events on torch's current stream), pool in $PMSNAP_POOL_DIR
  dcp_async   torch.distributed.checkpoint.async_save of model and optimizer
              state (one process group of one rank, gloo), waiting for the
              previous save before starting the next
  checkfreq   CheckFreq-style: snapshot model and optimizer state into pinned
              host memory on a side stream, the next optimizer step waits for
              the snapshot (event), a thread persists it with torch.save

Per method: mean step time (wall, the GPU synchronized once per step only
for the measurement window's ends), overhead against the baseline, and the
GPU-side stall: the compute stream's mean busy time per step from CUDA
events recorded at each step's start and end, minus the baseline's. For
pmsnap also the stall its CUDA device measured at conflict waits
(cudaEventElapsedTime). Prints a table and writes CSV.

--device cpu --tiny runs the same code on a small model on the CPU (a smoke
test of the script; no GPU-side figures).
"""
import argparse
import csv
import os
import shutil
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a small model (smoke test)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per method")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=5, help="checkpoint every k steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--methods", default="none,pmsnap,dcp_async,checkfreq")
    p.add_argument("--strategy", default="adaptive", help="pmsnap conflict strategy")
    p.add_argument("--pool-dir", default=os.environ.get("PMSNAP_POOL_DIR", "/dev/shm"))
    p.add_argument("--csv", default="bench/results/gpu_stall.csv")
    return p.parse_args()


class Gpt2Small(nn.Module):
    def __init__(self, vocab, d_model, heads, layers, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


class Method:
    """Checkpoints through `step(k)`; `close()` finishes pending saves."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def step(self, k):
        self.optimizer.step()

    def close(self):
        pass

    def extra(self):
        return {}


class PmsnapMethod(Method):
    def __init__(self, model, optimizer, args, device):
        import pmsnap
        super().__init__(model, optimizer)
        self.pool = os.path.join(args.pool_dir, f"pmsnap-gpu-stall-{os.getpid()}.pool")
        self.opt = pmsnap.CheckpointedOptimizer(
            optimizer, pool=self.pool, model=model, every=args.every,
            device="cuda" if device == "cuda" else "host", strategy=args.strategy,
            capture_rng=False)
        self.note = self.opt.device_note

    def step(self, k):
        self.opt.step()

    def close(self):
        self.opt.close()  # waits for the last epoch: stats() then counts it
        self.stats = self.opt.stats()
        if os.path.exists(self.pool):
            os.remove(self.pool)

    def extra(self):
        s = self.stats
        return {"checkpoints": s["epochs_committed"], "conflicts": s["conflicts"],
                "device_stall_ms": 1e3 * s.get("compute_stall_seconds", 0.0),
                "host_blocked_ms": 1e3 * s["blocked_seconds"], "note": self.note}


class DcpAsyncMethod(Method):
    def __init__(self, model, optimizer, args):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        super().__init__(model, optimizer)
        self.dcp, self.every = dcp, args.every
        self.dir = tempfile.mkdtemp(prefix="dcp-", dir=args.pool_dir)
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(self.dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        self.pending = None
        self.saves = 0

    def step(self, k):
        self.optimizer.step()
        if k % self.every == 0:
            if self.pending is not None:
                self.pending.result()
            state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
            self.pending = self.dcp.async_save(state, checkpoint_id=os.path.join(self.dir, str(k)))
            self.saves += 1

    def close(self):
        if self.pending is not None:
            self.pending.result()
        shutil.rmtree(self.dir, ignore_errors=True)

    def extra(self):
        return {"checkpoints": self.saves}


class CheckFreqMethod(Method):
    """Snapshot (GPU -> pinned host, side stream) then persist (thread)."""

    def __init__(self, model, optimizer, args, device):
        super().__init__(model, optimizer)
        self.every, self.device = args.every, device
        self.dir = tempfile.mkdtemp(prefix="checkfreq-", dir=args.pool_dir)
        self.side = torch.cuda.Stream() if device == "cuda" else None
        self.snapshot_done = None
        self.host = None
        self.persist = None
        self.saves = 0

    def tensors(self):
        out = dict(("model." + n, t) for n, t in self.model.state_dict().items())
        for i, st in enumerate(self.optimizer.state.values()):
            for n, t in st.items():
                if torch.is_tensor(t):
                    out[f"optim.{i}.{n}"] = t
        return out

    def step(self, k):
        if self.snapshot_done is not None:
            # The update may not overwrite what the snapshot still reads.
            torch.cuda.current_stream().wait_event(self.snapshot_done)
            self.snapshot_done = None
        self.optimizer.step()
        if k % self.every != 0:
            return
        if self.persist is not None:
            self.persist.join()  # one checkpoint in flight, as CheckFreq
        live = self.tensors()
        if self.host is None:
            self.host = {n: torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                        pin_memory=self.side is not None)
                         for n, t in live.items()}
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                for n, t in live.items():
                    self.host[n].copy_(t, non_blocking=True)
            self.snapshot_done = self.side.record_event()
            done = self.snapshot_done
        else:
            for n, t in live.items():
                self.host[n].copy_(t)
            done = None
        path = os.path.join(self.dir, f"{k}.pt")

        def persist():
            if done is not None:
                done.synchronize()
            torch.save(self.host, path)
            os.fsync(os.open(path, os.O_RDONLY))

        self.persist = threading.Thread(target=persist)
        self.persist.start()
        self.saves += 1

    def close(self):
        if self.persist is not None:
            self.persist.join()
        shutil.rmtree(self.dir, ignore_errors=True)

    def extra(self):
        return {"checkpoints": self.saves}


def run(method_name, args, device):
    torch.manual_seed(0)
    if args.tiny:
        vocab, d, heads, layers, seq, batch = 1000, 64, 4, 2, 64, 4
    else:
        vocab, d, heads, layers, seq, batch = 50257, 768, 12, 12, args.seq, args.batch
    model = Gpt2Small(vocab, d, heads, layers, seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    if method_name == "none":
        method = Method(model, optimizer)
    elif method_name == "pmsnap":
        method = PmsnapMethod(model, optimizer, args, device)
    elif method_name == "dcp_async":
        method = DcpAsyncMethod(model, optimizer, args)
    elif method_name == "checkfreq":
        method = CheckFreqMethod(model, optimizer, args, device)
    else:
        raise SystemExit(f"unknown method {method_name}")
    x = torch.randint(0, vocab, (batch, seq), device=device)
    y = torch.randint(0, vocab, (batch, seq), device=device)
    cuda = device == "cuda"
    events = []
    start = None
    for k in range(1, args.warmup + args.steps + 1):
        if k == args.warmup + 1:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        if cuda and k > args.warmup:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        method.step(k)
        optimizer.zero_grad(set_to_none=True)
        if cuda and k > args.warmup:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((begin, end))
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    method.close()
    gpu_ms = (sum(b.elapsed_time(e) for b, e in events) / len(events)) if events else float("nan")
    row = {"method": method_name, "params_m": params / 1e6, "step_ms": wall * 1e3,
           "gpu_step_ms": gpu_ms}
    row.update(method.extra())
    del model, optimizer, method
    if cuda:
        torch.cuda.empty_cache()
    return row


def main():
    args = parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_stall: no CUDA device visible to torch; use --device cpu --tiny for a smoke test",
              file=sys.stderr)
        return 2
    label = torch.cuda.get_device_name(0) if device == "cuda" else "cpu smoke test (not a GPU)"
    rows = [run(m, args, device) for m in args.methods.split(",")]
    base = next((r for r in rows if r["method"] == "none"), rows[0])
    for r in rows:
        r["overhead_pct"] = 100.0 * (r["step_ms"] / base["step_ms"] - 1.0)
        r["gpu_stall_ms"] = r["gpu_step_ms"] - base["gpu_step_ms"]
    print(f"GPU stall benchmark on {label}: {rows[0]['params_m']:.1f}M parameters, AdamW, "
          f"checkpoint every {args.every} steps, {args.steps} measured steps")
    header = ["method", "step_ms", "overhead_pct", "gpu_step_ms", "gpu_stall_ms", "checkpoints",
              "conflicts", "device_stall_ms", "host_blocked_ms"]
    print(" | ".join(f"{h:>15}" for h in header))
    for r in rows:
        cells = []
        for h in header:
            v = r.get(h, "")
            cells.append(f"{v:>15.2f}" if isinstance(v, float) else f"{str(v):>15}")
        print(" | ".join(cells))
    for r in rows:
        if r.get("note"):
            print(f"note ({r['method']}): {r['note']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        keys = ["device"] + header + ["params_m", "every", "steps"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(dict(r, device=label, every=args.every, steps=args.steps))
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
