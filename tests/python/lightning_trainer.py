"""A PyTorch Lightning run for test_lightning.py: a LightningModule with
dropout and BatchNorm, AdamW with a per-step warm-up schedule, a shuffled
stateful data loader over several epochs, trained by a Trainer with
pmsnap.lightning.PmsnapCheckpoint (or without it, the reference).

    lightning_trainer.py MODE POOL STEPS OUT [KILL_AT]

MODE: plain | pmsnap. A pmsnap run resumes with ckpt_path=POOL when the pool
holds a checkpoint. Prints "start N" (the first step it takes) and "step k"
after each step; with KILL_AT it waits at that step until the checkpoint
committed before printing, then waits to be killed. At the end it saves the
final state (model, optimizer, scheduler, loader, RNG draws) to OUT.
"""

import sys
import time
import warnings

import lightning.pytorch as pl
import torch

import pmsnap
from pmsnap.lightning import PmsnapCheckpoint

BATCHES_PER_EPOCH = 5


class ShuffledBatches:
    """A sized, stateful loader: each epoch a new permutation of a fixed
    dataset, drawn from the loader's own generator; state_dict() holds the
    position, as torchdata's StatefulDataLoader does."""

    def __init__(self, seed, batch=8):
        data = torch.Generator().manual_seed(seed)
        self.x = torch.randn(BATCHES_PER_EPOCH * batch, 12, generator=data)
        self.y = self.x[:, :3].sum(dim=1, keepdim=True).repeat(1, 4)
        self.batch = batch
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.epoch, self.position, self.order = -1, BATCHES_PER_EPOCH, None
        self._loaded = False

    def __len__(self):
        return BATCHES_PER_EPOCH

    def __iter__(self):
        if not self._loaded or self.position >= BATCHES_PER_EPOCH:
            self.epoch += 1
            self.position = 0
            self.order = torch.randperm(len(self.x), generator=self.generator)
        self._loaded = False
        while self.position < BATCHES_PER_EPOCH:
            rows = self.order[self.position * self.batch:(self.position + 1) * self.batch]
            self.position += 1
            yield self.x[rows], self.y[rows]

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "order": self.order,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.epoch, self.position, self.order = state["epoch"], state["position"], state["order"]
        self.generator.set_state(state["generator"])
        self._loaded = True


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Dropout(0.2),
                                       torch.nn.BatchNorm1d(24), torch.nn.ReLU(),
                                       torch.nn.Linear(24, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-2, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 6))
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


class Reporter(pl.Callback):
    """Prints each step; at KILL_AT waits for the checkpoint, then for the kill."""

    def __init__(self, kill_at, checkpoint):
        self.kill_at, self.checkpoint = kill_at, checkpoint

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self.kill_at:
            self.checkpoint.optimizer.flush()
        print(f"step {step}", flush=True)
        if step == self.kill_at:
            time.sleep(600)


def main():
    mode, pool, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and loggers
    model = Regressor()
    loader = ShuffledBatches(seed=11)
    callbacks = []
    ckpt_path = None
    if mode == "pmsnap":
        checkpoint = PmsnapCheckpoint(pool, every=1)
        callbacks = [checkpoint, Reporter(kill_at, checkpoint)]
        if pmsnap.has_checkpoint(pool):
            ckpt_path = pool
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    torch.manual_seed(3)
    start = 1
    if ckpt_path is not None:
        start = pmsnap.read_pool(pool)["latest"]["iteration"] + 1
    print(f"start {start}", flush=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "lrs": [g["lr"] for g in optimizer.param_groups],
                "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                "data": loader.state_dict(), "rng_next": torch.rand(4)}, out)


if __name__ == "__main__":
    main()
