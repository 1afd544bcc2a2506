"""Trainer run as a child process by test_crash_resume.py (not a test itself).

Trains a small MLP with dropout on data drawn from the global torch, Python
and numpy RNGs, so a resumed run matches an uninterrupted one only if the
parameters, the optimizer state, the RNG states and the iteration all come
back exactly. With --pool it checkpoints every iteration through pmsnap and
resumes from the pool when it holds a checkpoint; with --plain it uses the bare
optimizer (the reference). Prints "step <k> <seconds the step took> <end on
time.monotonic()>" after each step, so the test can time its SIGKILL by this
machine's own step time, and saves the final training state to --out. With
--linger it then prints "done" and waits to be killed, so that a kill drawn
after the last step still lands.

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


def build(optimizer_name):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    if optimizer_name == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-4)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    return model, opt


def batch():
    scale = 1.0 + random.random()            # Python RNG
    shift = float(numpy.random.rand())       # numpy RNG
    x = torch.randn(8, 16) * scale + shift   # torch RNG
    y = torch.randn(8, 4)
    return x, y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--out", required=True)
    parser.add_argument("--linger", action="store_true")
    args = parser.parse_args()

    random.seed(11)
    numpy.random.seed(13)
    model, opt = build(args.optimizer)
    torch.manual_seed(17)
    start = 0
    if args.plain:
        stepper = opt
    else:
        stepper = pmsnap.CheckpointedOptimizer(opt, pool=args.pool, model=model, every=1)
        if pmsnap.has_checkpoint(args.pool):
            start, extra = stepper.restore()
            assert extra["position"] == start, extra
            print(f"resumed {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        began = time.monotonic()
        x, y = batch()
        stepper.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if args.plain:
            opt.step()
        else:
            stepper.step(extra_state={"position": step})
        ended = time.monotonic()
        print(f"step {step} {ended - began:.9f} {ended:.9f}", flush=True)
    if not args.plain:
        stepper.close()
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "optimizer": opt.state_dict(),
                "rng": torch.get_rng_state()}, args.out)
    if args.linger:
        print("done", flush=True)
        while True:
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
