#!/usr/bin/env python3
"""GPU stall benchmark: what checkpointing costs a training run on one GPU,
for a GPT-2-small-shaped transformer (12 layers, d_model 768, 12 heads,
vocabulary 50257, untied output head: 162.6M parameters) and a 1.3B one (24
layers, d_model 2048, 16 heads), AdamW, bf16 autocast.

Methods, each from a fresh model, interleaved in rounds (every method once
per round, the baseline first) so that drift hits all alike:
  none                no checkpoint (the baseline)
  pmsnap              pmsnap.CheckpointedOptimizer, device "cuda" (copies
                      ordered by events on torch's current stream), every k
  pmsnap-continuous   the same, a checkpoint at every step boundary after the
                      previous one committed (only with --every 1)
  pmsnap-staged       continuous with a host staging buffer
                      (dram_staging_buffers=1; only with --every 1)
  <pmsnap method>@wN  the same with N copy/persist worker threads
                      (pmsnap@w8), against its default
  dcp_async           torch.distributed.checkpoint.async_save of model and
                      optimizer state every k steps, with torch's pinned-memory
                      stager (DefaultStager: pinned, asynchronous staging; a
                      new one per save, as torch 2.11's stages only once);
                      the next optimizer step waits for the staging, the next
                      save for the previous upload
  checkfreq           CheckFreq-style: snapshot into pinned host memory on a
                      side stream, the next optimizer step waits for it
                      (event), a thread persists it with torch.save
  torch_save          torch.save of model and optimizer state_dicts every k
                      steps, synchronously (written, fsynced, then training
                      goes on)
  safetensors         safetensors.torch.save_file of every model and optimizer
                      tensor every k steps, synchronously (the same)

Per (model, interval, method), medians over rounds: step time (wall), its
overhead against the same round's baseline, the stall (the step time above
the baseline's, ms), the GPU-side stall (the compute stream's busy time per
step from CUDA events, minus the baseline's), and for pmsnap the checkpoint
rate (bytes per checkpoint over the last epoch's seconds) against the card's
pinned device-to-host bandwidth measured here. After each run the method's
last checkpoint is restored into a fresh model and optimizer and timed
(restore_ms: pmsnap restore(), torch.load + load_state_dict, dcp.load,
safetensors load_file + load_state_dict; checkfreq's flat file is not).
Prints a table and writes CSV (one row per model, interval and method).

Each run also reports its peak resident set (peak_rss_mb: VmHWM, reset per
run; a pool on /dev/shm counts where the process mapped it) and what its
checkpoint files hold after the run (files_mb: the pool, the kept file).

--device cpu runs the same code on the CPU (no GPU-side figures): --tiny is a
smoke test of the script, --models small a GPT-like model of 36M parameters
for the CPU half of bench/RESULTS.md's headline table, --models 6gb a 483M
one (5.8 GB of weights and AdamW state; with --torch-load-mmap torch_save's
restore is torch.load(mmap=True)).
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
    p.add_argument("--models", default="gpt2:3,1.3b:1:6",
                   help="models, each name[:rounds[:measured steps]] (gpt2, 1.3b)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", default="1,5", help="checkpoint intervals (comma-separated)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--methods",
                   default="none,pmsnap,pmsnap-continuous,pmsnap-staged,dcp_async,checkfreq,"
                           "torch_save,safetensors")
    p.add_argument("--strategy", default="adaptive", help="pmsnap conflict strategy")
    p.add_argument("--torch-load-mmap", action="store_true",
                   help="torch_save's restore loads with torch.load(mmap=True)")
    p.add_argument("--pool-dir", default=os.environ.get("PMSNAP_POOL_DIR", "/dev/shm"))
    p.add_argument("--file-dir", default=None,
                   help="where the other methods' checkpoint files go (default: --pool-dir); "
                        "a disk when two copies of the state do not fit in /dev/shm")
    p.add_argument("--csv", default="bench/results/gpu_stall.csv")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds: no round starts that would end after them, as far as the "
                        "rounds so far tell, and no run starts after them (the first run "
                        "always does; a first round stopped so keeps what it measured); "
                        "0: no limit")
    return p.parse_args()


MODELS = {  # vocab, d_model, heads, layers
    "gpt2": (50257, 768, 12, 12),
    "1.3b": (50257, 2048, 16, 24),
    "tiny": (1000, 64, 4, 2),
    "small": (16000, 512, 8, 6),
    # 483M parameters: 5.8 GB of weights and AdamW state, [perf2] item 4's
    # "about 6 GB" model for a 24 GiB CPU machine (--device cpu).
    "6gb": (50257, 1280, 20, 18),
}


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

    def settle(self, train_step, last_step):
        """After the timed steps (the last was `last_step`), before close():
        makes the last state trained the last checkpoint where the method
        might have skipped it (`train_step(k)` trains step k). Every k:
        trains up to the next multiple of k."""
        while last_step % getattr(self, "every", 1):
            last_step += 1
            train_step(last_step)

    def close(self):
        """Finishes pending saves; the last checkpoint stays for restore()."""

    def restore(self, model, optimizer):
        """Loads the last checkpoint into a fresh `model` and `optimizer`;
        False when the method has no restore to time."""
        return False

    def cleanup(self):
        """Removes the method's files."""

    def footprint_bytes(self):
        """Bytes the method's checkpoint files hold (pool, files) after close()."""
        return 0

    def extra(self):
        return {}


def optimizer_tensors(optimizer):
    """{"optim.<index>.<key>": tensor} of an optimizer's state."""
    return {f"optim.{i}.{key}": value
            for i, state in enumerate(optimizer.state_dict()["state"].values())
            for key, value in state.items() if torch.is_tensor(value)}


def load_optimizer_tensors(optimizer, tensors, param_groups):
    """The inverse of optimizer_tensors, for a fresh optimizer."""
    state = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


class FileMethod(Method):
    """Synchronous saves every k steps into a file of its own, one kept."""

    suffix = ""

    def __init__(self, model, optimizer, args, every):
        super().__init__(model, optimizer)
        self.every = every
        self.dir = tempfile.mkdtemp(prefix=type(self).__name__ + "-", dir=args.file_dir)
        self.path = None
        self.saves = 0

    def step(self, k):
        self.optimizer.step()
        if k % self.every:
            return
        path = os.path.join(self.dir, f"{k}{self.suffix}")
        self.save(path)
        fsync(path)
        if self.path is not None:
            os.remove(self.path)
        self.path = path
        self.saves += 1

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def footprint_bytes(self):
        return folder_bytes(self.dir)

    def extra(self):
        return {"checkpoints": self.saves}


def folder_bytes(folder):
    """Bytes the files under `folder` occupy (allocated blocks)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(folder) for f in files)


class TorchSaveMethod(FileMethod):
    suffix = ".pt"

    def __init__(self, model, optimizer, args, every):
        super().__init__(model, optimizer, args, every)
        self.mmap = args.torch_load_mmap

    def save(self, path):
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, path)

    def restore(self, model, optimizer):
        if self.path is None:
            return False
        state = torch.load(self.path, map_location=next(model.parameters()).device,
                           mmap=self.mmap)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        return True


class SafetensorsMethod(FileMethod):
    suffix = ".safetensors"

    def save(self, path):
        import safetensors.torch
        tensors = {"model." + n: t for n, t in self.model.state_dict().items()}
        tensors.update(optimizer_tensors(self.optimizer))
        safetensors.torch.save_file(tensors, path)
        self.param_groups = self.optimizer.state_dict()["param_groups"]

    def restore(self, model, optimizer):
        import safetensors.torch
        if self.path is None:
            return False
        device = next(model.parameters()).device
        tensors = safetensors.torch.load_file(self.path, device=str(device))
        model.load_state_dict({n[len("model."):]: t for n, t in tensors.items()
                               if n.startswith("model.")})
        load_optimizer_tensors(optimizer, {n: t for n, t in tensors.items()
                                           if n.startswith("optim.")}, self.param_groups)
        return True


class PmsnapMethod(Method):
    def __init__(self, model, optimizer, args, device, every, mode="every", workers=None):
        import pmsnap
        super().__init__(model, optimizer)
        self.pool = os.path.join(args.pool_dir, f"pmsnap-gpu-stall-{os.getpid()}.pool")
        how = {"every": every} if mode == "every" else {"mode": "continuous"}
        if mode == "staged":
            how["dram_staging_buffers"] = 1
        if workers is not None:
            how["workers"] = workers
        self.device = "cuda" if device == "cuda" else "host"
        self.opt = pmsnap.CheckpointedOptimizer(
            optimizer, pool=self.pool, model=model, device=self.device, strategy=args.strategy,
            capture_rng=False, **how)
        self.note = self.opt.device_note
        self.opt_workers = workers if workers is not None else "default"
        # Every k: settle() trains up to a multiple of k. Continuous mode's
        # close() checkpoints the last step itself if its boundary skipped it.
        self.every = every if mode == "every" else 1

    def step(self, k):
        self.opt.step()

    def close(self):
        self.opt.close()  # waits for the last epoch: stats() then counts it
        self.stats = self.opt.stats()

    def restore(self, model, optimizer):
        import pmsnap
        with pmsnap.CheckpointedOptimizer(optimizer, pool=self.pool, model=model,
                                          device=self.device, capture_rng=False) as fresh:
            fresh.restore()
        return True

    def cleanup(self):
        if os.path.exists(self.pool):
            os.remove(self.pool)

    def footprint_bytes(self):
        return os.stat(self.pool).st_blocks * 512 if os.path.exists(self.pool) else 0

    def extra(self):
        s = self.stats
        epochs = s["epochs_committed"]
        rate = (s["bytes_written"] / epochs / s["last_epoch_seconds"] / 1e9
                if epochs and s["last_epoch_seconds"] else float("nan"))
        steps = max(1, s["steps"])
        units = s.get("units", [])
        return {"checkpoints": epochs, "conflicts": s["conflicts"],
                "device_stall_ms": 1e3 * s.get("compute_stall_seconds", 0.0),
                "host_blocked_ms": 1e3 * s["blocked_seconds"], "ckpt_gbps": rate,
                # Per step, and the last epoch's parts (summed over units):
                # where a checkpoint's time goes.
                "blocked_ms_per_step": 1e3 * s["blocked_seconds"] / steps,
                "boundary_wait_ms_per_step": 1e3 * s["boundary_wait_seconds"] / steps,
                "epoch_ms": 1e3 * s["last_epoch_seconds"],
                "copy_ms": 1e3 * sum(u["last_copy_seconds"] for u in units),
                "persist_ms": 1e3 * sum(u["last_persist_seconds"] for u in units),
                "workers": self.opt_workers, "note": self.note}


class DcpAsyncMethod(Method):
    """DCP async_save with torch's pinned-memory stager where torch has one
    (torch.distributed.checkpoint.staging.DefaultStager, torch >= 2.9)."""

    def __init__(self, model, optimizer, args, every):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        super().__init__(model, optimizer)
        self.dcp, self.every = dcp, every
        self.dir = tempfile.mkdtemp(prefix="dcp-", dir=args.file_dir)
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(self.dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        # A DefaultStager per save: torch 2.11's stages once, then clears its
        # own copy table (DefaultStager._stage calls StateDictStager.close(),
        # and the next stage() fails with KeyError: <class 'type'>, seen on
        # the H200), so its pinned buffers are allocated anew for each save
        # as they would be for a user of that torch.
        # Pinned memory and non-blocking copies need a GPU; on the CPU the
        # stager still stages in its own thread.
        cuda = torch.cuda.is_available()
        self.make_stager = None
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            self.make_stager = lambda: DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                use_non_blocking_copy=cuda))
        except ImportError:
            pass  # an older torch: async_save's own staging
        self.stager = None
        self.staging = None  # the staging of the last save, which the next update must wait for
        self.upload = None
        self.saved_dir = None  # the previous save's, removed once the next one is written
        self.saves = 0

    def _wait_staging(self):
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def step(self, k):
        self._wait_staging()
        self.optimizer.step()
        if k % self.every == 0:
            if self.upload is not None:
                self.upload.result()
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optim": optim_state}  # DCP's keys (FQNs)
            if self.stager is not None:
                self.stager.close()  # its staging finished (_wait_staging)
            self.stager = self.make_stager() if self.make_stager is not None else None
            kwargs = {"async_stager": self.stager} if self.stager is not None else {}
            target = os.path.join(self.dir, str(k))
            response = self.dcp.async_save(state, checkpoint_id=target, **kwargs)
            if self.saved_dir is not None:  # one checkpoint kept, as a pool keeps its slots
                shutil.rmtree(self.saved_dir, ignore_errors=True)
            self.saved_dir = target
            if hasattr(response, "staging_completion"):
                self.staging, self.upload = response.staging_completion, response.upload_completion
            else:
                self.upload = response
            self.saves += 1

    def close(self):
        self._wait_staging()
        if self.upload is not None:
            self.upload.result()
        if self.stager is not None and hasattr(self.stager, "close"):
            self.stager.close()

    def restore(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        if self.saved_dir is None:
            return False
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        self.dcp.load(state, checkpoint_id=self.saved_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return True

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def extra(self):
        return {"checkpoints": self.saves}


class CheckFreqMethod(Method):
    """Snapshot (GPU -> pinned host, side stream) then persist (thread)."""

    def __init__(self, model, optimizer, args, device, every):
        super().__init__(model, optimizer)
        self.every, self.device = every, device
        self.dir = tempfile.mkdtemp(prefix="checkfreq-", dir=args.file_dir)
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
        previous = getattr(self, "saved_path", None)
        self.saved_path = path

        def persist():
            if done is not None:
                done.synchronize()
            torch.save(self.host, path)
            fsync(path)
            if previous is not None and os.path.exists(previous):
                os.remove(previous)  # one checkpoint kept

        self.persist = threading.Thread(target=persist)
        self.persist.start()
        self.saves += 1

    def close(self):
        if self.persist is not None:
            self.persist.join()

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def footprint_bytes(self):
        return folder_bytes(self.dir)

    def extra(self):
        return {"checkpoints": self.saves}


PMSNAP_MODES = {"pmsnap": "every", "pmsnap-continuous": "continuous", "pmsnap-staged": "staged"}


def make_method(name, model, optimizer, args, device, every):
    """`name`, or a pmsnap method with "@wN" (N worker threads)."""
    name, _, workers = name.partition("@w")
    if name in PMSNAP_MODES:
        return PmsnapMethod(model, optimizer, args, device, every, mode=PMSNAP_MODES[name],
                            workers=int(workers) if workers else None)
    if workers:
        raise SystemExit(f"@w (workers) is for the pmsnap methods, not {name}")
    if name == "none":
        return Method(model, optimizer)
    if name == "dcp_async":
        return DcpAsyncMethod(model, optimizer, args, every)
    if name == "checkfreq":
        return CheckFreqMethod(model, optimizer, args, device, every)
    if name == "torch_save":
        return TorchSaveMethod(model, optimizer, args, every)
    if name == "safetensors":
        return SafetensorsMethod(model, optimizer, args, every)
    raise SystemExit(f"unknown method {name}")


def run(method_name, model_name, every, args, device):
    """One run: a fresh model trained warmup + steps steps; its row."""
    vocab, d, heads, layers = MODELS[model_name]
    seq, batch = (64, 4) if model_name == "tiny" else (args.seq, args.batch)

    def fresh():
        torch.manual_seed(0)
        model = Gpt2Small(vocab, d, heads, layers, seq).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    reset_peak_rss()
    model, optimizer = fresh()
    params = sum(p.numel() for p in model.parameters())
    method = make_method(method_name, model, optimizer, args, device, every)
    x = torch.randint(0, vocab, (batch, seq), device=device)
    y = torch.randint(0, vocab, (batch, seq), device=device)
    cuda = device == "cuda"
    events = []
    start = None

    def train_step(k):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        method.step(k)
        optimizer.zero_grad(set_to_none=True)

    for k in range(1, args.warmup + args.steps + 1):
        if k == args.warmup + 1:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        if cuda and k > args.warmup:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
        train_step(k)
        if cuda and k > args.warmup:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((begin, end))
    if cuda:
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    method.settle(train_step, args.warmup + args.steps)
    method.close()
    train_peak_rss = peak_rss_bytes()
    footprint = method.footprint_bytes()
    # The trained weights stay for check_restored; their optimizer state is
    # not needed any more (a 6 GB model's restore would not fit beside it).
    optimizer.state.clear()
    restore_ms = float("nan")
    if method_name != "none":
        restored_model, restored_optimizer = fresh()
        began = time.perf_counter()
        if method.restore(restored_model, restored_optimizer):
            if cuda:
                torch.cuda.synchronize()
            restore_ms = (time.perf_counter() - began) * 1e3
            check_restored(model, restored_model, method_name)
        del restored_model, restored_optimizer
    method.cleanup()
    gpu_ms = (sum(b.elapsed_time(e) for b, e in events) / len(events)) if events else float("nan")
    row = {"model": model_name, "every": every, "method": method_name, "params_m": params / 1e6,
           "steps": args.steps, "step_ms": wall * 1e3, "gpu_step_ms": gpu_ms,
           "restore_ms": restore_ms, "peak_rss_mb": train_peak_rss / 2**20,
           "files_mb": footprint / 2**20}
    row.update(method.extra())
    del model, optimizer, method
    if cuda:
        torch.cuda.empty_cache()
    return row


def reset_peak_rss():
    """Starts a new peak resident set for this process (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then peak_rss_mb is the process's peak so far


def peak_rss_bytes():
    """The process's peak resident set since reset_peak_rss() (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return float("nan")


def check_restored(model, restored, method_name):
    """The restored weights are the trained ones, bitwise: a restore that
    loaded nothing (or something else) is not a restore time."""
    for (name, want), got in zip(model.state_dict().items(), restored.state_dict().values()):
        if not torch.equal(want, got):
            raise SystemExit(f"gpu_stall: {method_name} restored '{name}' wrong")


def pinned_d2h_gbps():
    """The card's device -> pinned host copy rate (GB/s), 1 GiB, best of 3."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, (1 << 30) / (begin.elapsed_time(end) * 1e-3) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return best


# Printed for each run as it ends (where the method has them).
RUN_DETAILS = ("restore_ms", "peak_rss_mb", "files_mb", "gpu_step_ms", "blocked_ms_per_step",
               "boundary_wait_ms_per_step", "epoch_ms", "copy_ms", "persist_ms", "ckpt_gbps",
               "device_stall_ms")


def approx_params(model_name):
    """Parameters of a MODELS entry, without building it (embeddings, head
    and 12 d^2 per layer)."""
    vocab, d, _, layers = MODELS[model_name]
    return 2 * vocab * d + 12 * layers * d * d


def median(values):
    values = sorted(v for v in values if v == v)  # drop NaN
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def main():
    args = parse_args()
    args.file_dir = args.file_dir or args.pool_dir
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_stall: no CUDA device visible to torch; use --device cpu --tiny for a smoke test",
              file=sys.stderr)
        return 2
    label = (torch.cuda.get_device_name(0) if device == "cuda"
             else "cpu smoke test (not a GPU)" if args.tiny else "cpu (not a GPU)")
    d2h = pinned_d2h_gbps() if device == "cuda" else float("nan")
    models = [("tiny", 1, args.steps)]
    if not args.tiny:
        models = []
        for spec in args.models.split(","):
            name, *rest = spec.split(":")
            models.append((name, int(rest[0]) if rest else 1,
                           int(rest[1]) if len(rest) > 1 else args.steps))
    intervals = [int(e) for e in str(args.every).split(",")]
    methods = args.methods.split(",")
    if "safetensors" in methods:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:  # e.g. a GPU machine's torch environment without it
            print("gpu_stall: safetensors is not installed here; that method is left out",
                  file=sys.stderr)
            methods.remove("safetensors")
    summary = []
    began = time.perf_counter()
    last_round_seconds, last_params = 0.0, 1.0
    runs_done = 0  # the budget never stops the first run: something is measured
    cut_short = []
    for model_name, rounds, steps in models:
        args.steps = steps
        # Continuous and staged checkpoint as often as they can: one interval.
        wanted = {every: [m for m in methods if every == intervals[0] or m.partition("@")[0] in
                          ("none", "pmsnap", "dcp_async", "checkfreq", "torch_save",
                           "safetensors")]
                  for every in intervals}
        # Rounds outermost: a budget that ends the runs early still leaves
        # every interval and method measured in the same rounds.
        per_round = {every: [] for every in intervals}
        # The longest round so far; before a model's first round, the last
        # model's scaled by parameter count (a model that cannot finish one
        # round in the budget left is not started).
        round_seconds = last_round_seconds * approx_params(model_name) / last_params
        for round_index in range(rounds):
            spent = time.perf_counter() - began
            if args.time_budget > 0 and runs_done and spent + round_seconds > args.time_budget:
                cut_short.append(f"{model_name}: {round_index} of {rounds} rounds run "
                                 f"(time budget {args.time_budget:.0f} s)")
                break
            round_began = time.perf_counter()
            stopped = None
            for every in intervals:
                rows = {}
                for m in wanted[every]:
                    # A round that outlasts the budget stops between runs,
                    # before a caller's timeout could lose every figure. A
                    # model's first round keeps what it measured; a later
                    # round's cut interval is dropped, so each median comes
                    # from whole rounds.
                    spent = time.perf_counter() - began
                    if args.time_budget > 0 and runs_done and spent > args.time_budget:
                        stopped = f"every {every}, before {m}"
                        break
                    rows[m] = run(m, model_name, every, args, device)
                    runs_done += 1
                    details = " ".join(f"{key} {rows[m][key]:.1f}" for key in RUN_DETAILS
                                       if isinstance(rows[m].get(key), float))
                    print(f"gpu_stall: {model_name} every {every} round {round_index + 1}: "
                          f"{m} {rows[m]['step_ms']:.2f} ms/step; {details}", file=sys.stderr,
                          flush=True)
                base = rows.get("none")
                for r in rows.values():
                    if base is not None:
                        r["overhead_pct"] = 100.0 * (r["step_ms"] / base["step_ms"] - 1.0)
                        r["stall_ms"] = r["step_ms"] - base["step_ms"]
                        r["gpu_stall_ms"] = r["gpu_step_ms"] - base["gpu_step_ms"]
                if rows and (stopped is None or round_index == 0):
                    per_round[every].append(rows)
                if stopped:
                    break
            if stopped:
                kept = "its runs so far kept" if round_index == 0 else "dropped"
                cut_short.append(f"{model_name}: round {round_index + 1} stopped {stopped} "
                                 f"(time budget {args.time_budget:.0f} s; {kept})")
                break
            round_seconds = max(round_seconds if round_index else 0.0,
                                time.perf_counter() - round_began)
            last_round_seconds, last_params = round_seconds, approx_params(model_name)
        for every in intervals:
            if not per_round[every]:
                continue
            for m in wanted[every]:
                runs = [rows[m] for rows in per_round[every] if m in rows]
                if not runs:
                    continue
                row = dict(runs[-1])
                for key in ("step_ms", "overhead_pct", "stall_ms", "gpu_stall_ms",
                            "host_blocked_ms") + RUN_DETAILS:
                    if key in row:
                        row[key] = median([r.get(key, float("nan")) for r in runs])
                row["step_ms_min"] = min(r["step_ms"] for r in runs)
                row["step_ms_max"] = max(r["step_ms"] for r in runs)
                row["rounds"] = len(runs)
                row["pinned_d2h_gbps"] = d2h
                row["ckpt_pct_of_d2h"] = 100.0 * row.get("ckpt_gbps", float("nan")) / d2h
                summary.append(row)
    print(f"GPU stall benchmark on {label}: AdamW, bf16 autocast, "
          f"{', '.join(f'{m} {s} measured steps x {r} rounds' for m, r, s in models)} "
          f"(medians over rounds); pinned D2H {d2h:.1f} GB/s")
    for line in cut_short:
        print(f"cut short by --time-budget: {line}")
    header = ["model", "every", "method", "rounds", "step_ms", "overhead_pct", "stall_ms",
              "gpu_stall_ms",
              "checkpoints", "conflicts", "device_stall_ms", "host_blocked_ms", "ckpt_gbps",
              "ckpt_pct_of_d2h", "restore_ms", "peak_rss_mb", "files_mb"]
    print(" | ".join(f"{h:>14}" for h in header))
    for r in summary:
        cells = []
        for h in header:
            v = r.get(h, "")
            cells.append(f"{v:>14.2f}" if isinstance(v, float) else f"{str(v):>14}")
        print(" | ".join(cells))
    for r in summary:
        if r.get("note"):
            print(f"note ({r['model']} {r['method']}): {r['note']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        keys = ["device"] + header + ["gpu_step_ms", "params_m", "steps",
                                     "step_ms_min", "step_ms_max", "pinned_d2h_gbps",
                                     "workers", "blocked_ms_per_step",
                                     "boundary_wait_ms_per_step", "epoch_ms", "copy_ms",
                                     "persist_ms"]
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in summary:
            w.writerow(dict(r, device=label))
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
