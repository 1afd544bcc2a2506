"""Trainer run as a child process by test_crash_resume.py (not a test itself).

Trains a small MLP with batch norm and dropout on data drawn from the global
torch, Python and numpy RNGs, so a resumed run matches an uninterrupted one
only if the parameters, the buffers, the optimizer state, the RNG states and
the iteration all come back exactly. With --pool it checkpoints every iteration through pmsnap and
resumes from the pool when it holds a checkpoint; with --plain it uses the bare
optimizer (the reference). Prints "step <k> <seconds the step took> <end on
time.monotonic()>" after each step, so the test can time its SIGKILL by this
machine's own step time, and saves the final training state to --out. With
--linger it then prints "done" and waits to be killed, so that a kill drawn
after the last step still lands.

--device cuda trains on the GPU (the batches are drawn on the CPU, as
before, then moved), --optimizer picks one of OPTIMIZERS (torch's default
implementation unless the name says fused, capturable or single-tensor),
--every / --strategy / --update-in-backward choose how pmsnap checkpoints.

Thread-safety: single-threaded script.
"""

import argparse
import random
import signal
import sys
import time

import numpy
import torch

import pmsnap

torch.set_num_threads(1)


# The optimizers a checkpoint must restore bit-exactly, as torch builds them
# (Adam/AdamW keep `step` on the CPU unless capturable or fused).
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3, weight_decay=1e-4),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=3e-3, fused=True),
    "adamw-capturable": lambda p: torch.optim.AdamW(p, lr=3e-3, capturable=True),
    "adamw-single": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=False),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
}
# capturable needs a device that can capture: not the CPU.
CUDA_ONLY = {"adamw-capturable"}


def build(optimizer_name, device):
    torch.manual_seed(7)
    # BatchNorm: its running statistics (buffers, changed by every forward)
    # must come back with the parameters.
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
    return model, OPTIMIZERS[optimizer_name](model.parameters())


def batch(device):
    scale = 1.0 + random.random()            # Python RNG
    shift = float(numpy.random.rand())       # numpy RNG
    x = torch.randn(8, 16) * scale + shift   # torch RNG
    y = torch.randn(8, 4)
    return x.to(device), y.to(device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--every", type=int, default=1, help="0: continuous")
    parser.add_argument("--strategy", default="adaptive")
    parser.add_argument("--update-in-backward", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--linger", action="store_true")
    args = parser.parse_args()

    random.seed(11)
    numpy.random.seed(13)
    model, opt = build(args.optimizer, args.device)
    torch.manual_seed(17)
    if args.device.startswith("cuda"):
        torch.cuda.manual_seed_all(19)
    start = 0
    if args.plain:
        stepper = opt
    else:
        how = {"every": args.every} if args.every else {"mode": "continuous"}
        stepper = pmsnap.CheckpointedOptimizer(
            opt, pool=args.pool, model=model, device="cuda" if args.device.startswith("cuda")
            else "host", strategy=args.strategy, update_in_backward=args.update_in_backward,
            **how)
        if pmsnap.has_checkpoint(args.pool):
            start, extra = stepper.restore()
            assert extra["position"] == start, extra
            print(f"resumed {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        began = time.monotonic()
        x, y = batch(args.device)
        stepper.zero_grad()
        # With update_in_backward the updates run inside backward(); step()
        # then ends the iteration.
        torch.nn.functional.mse_loss(model(x), y).backward()
        if args.plain:
            opt.step()
        else:
            stepper.step(extra_state={"position": step})
        ended = time.monotonic()
        print(f"step {step} {ended - began:.9f} {ended:.9f}", flush=True)
    if not args.plain:
        stepper.close()
    torch.save({"params": [p.detach().cpu().clone() for p in model.parameters()],
                "buffers": {n: b.detach().cpu().clone() for n, b in model.named_buffers()},
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state()}, args.out)
    if args.linger:
        print("done", flush=True)
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
