"""A torchtitan-style training loop for test_training_state.py: a model with
dropout and BatchNorm, AdamW, an LR scheduler, a stateful data stream and
the global RNG, trained with pmsnap.TrainingState (or without pmsnap, the
reference).

    loop_trainer.py MODE POOL STEPS OUT [KILL_AT]

MODE: plain | pmsnap. SCHEDULER (environment LOOP_SCHEDULER): sequential
(linear warm-up then cosine, SequentialLR) or plateau (ReduceLROnPlateau on
the loss). Prints "start N" (the first step it takes) and "step k" after each
step; with KILL_AT it waits at that step until the checkpoint committed
(flush) before printing, then waits to be killed, so that the SIGKILL
lands there and the next run resumes from there. At the end it saves the final state (model, optimizer, scheduler,
data stream, RNG draws) to OUT with torch.save.
"""

import os
import sys
import time

import torch

import pmsnap


class DataStream:
    """An endless stream of batches with a state: its position and generator."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0

    def next(self):
        self.position += 1
        x = torch.randn(8, 12, generator=self.generator)
        return x, x[:, :3].sum(dim=1, keepdim=True).repeat(1, 4)

    def state_dict(self):
        return {"position": self.position, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.position = state["position"]
        self.generator.set_state(state["generator"])


def build():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Dropout(0.2),
                                torch.nn.BatchNorm1d(24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    kind = os.environ.get("LOOP_SCHEDULER", "sequential")
    if kind == "sequential":
        scheduler = torch.optim.lr_scheduler.SequentialLR(
            optimizer,
            [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4),
             torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=20)],
            milestones=[4])
    elif kind == "plateau":
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=1)
    else:
        raise SystemExit(f"unknown LOOP_SCHEDULER {kind}")
    return model, optimizer, scheduler, DataStream(seed=11)


def main():
    mode, pool, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    torch.set_num_threads(1)
    model, optimizer, scheduler, data = build()
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    state = None
    start = 1
    if mode == "pmsnap":
        state = pmsnap.TrainingState(pool, model, optimizer, lr_scheduler=scheduler,
                                     stateful={"data": data}, every=1)
        start = state.resume()
    print(f"start {start}", flush=True)
    for step in range(start, steps + 1):
        x, y = data.next()
        loss = torch.nn.functional.mse_loss(model(x), y)
        metric = loss.item() if plateau else None
        if state is not None:
            state.zero_grad()
            loss.backward()
            state.step(metric=metric)
            if step == kill_at:
                state.optimizer.flush()
        else:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step(metric) if plateau else scheduler.step()
        print(f"step {step}", flush=True)
        if step == kill_at:
            # Waits for the SIGKILL here: a loaded machine could otherwise
            # let the next step commit before the kill lands (the flake
            # hunt's seed 2059588779 resumed one step late).
            time.sleep(600)
    if state is not None:
        state.close()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "lrs": [g["lr"] for g in optimizer.param_groups],
                "data": data.state_dict(), "rng_next": torch.rand(4)}, out)


if __name__ == "__main__":
    main()
