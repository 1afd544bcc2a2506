#!/usr/bin/env python3
"""PyTorch Lightning with every step checkpointed into a pool, by one callback.

    trainer = L.Trainer(max_steps=..., callbacks=[PmsnapCheckpoint(pool)])
    trainer.fit(model, loader, ckpt_path=pool if pmsnap.has_checkpoint(pool) else None)

A small GPT-like LightningModule (dropout on), AdamW with a per-step warm-up
and cosine schedule, and a data loader that knows its position (state_dict /
load_state_dict, like torchdata's StatefulDataLoader). Kill it (Ctrl-C,
kill -9) and run it again with the same --pool: fit() resumes from the last
committed step with the same batches, learning rates and dropout masks.

    python3 examples/train_lightning.py --steps 200
    python3 examples/train_lightning.py --steps 200 --fresh

Thread-safety: a single-threaded script.
"""

import os
import time
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

import pmsnap
from pmsnap.lightning import PmsnapCheckpoint

from train_loop import TinyGPT, TokenLoader, small_gpt_arguments, warmup_cosine


class Batches:
    """TokenLoader as a sized, stateful iterable of `per_epoch` batches per
    epoch, whose position Lightning checkpoints and restores."""

    def __init__(self, loader, per_epoch):
        self.loader, self.per_epoch = loader, per_epoch
        self.served = per_epoch
        self._restored = False

    def __len__(self):
        return self.per_epoch

    def __iter__(self):
        if not self._restored or self.served >= self.per_epoch:
            self.served = 0
        self._restored = False
        while self.served < self.per_epoch:
            self.served += 1
            yield self.loader.next_batch()

    def state_dict(self):
        return {"served": self.served, "loader": self.loader.state_dict()}

    def load_state_dict(self, state):
        self.served = state["served"]
        self.loader.load_state_dict(state["loader"])
        self._restored = True


class LanguageModel(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        torch.manual_seed(0)
        self.gpt = TinyGPT(args.vocab, args.dim, args.layers, 4, args.seq)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.gpt(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.args.vocab),
                                           targets.reshape(-1))
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(self.args.steps // 10, self.args.steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule,
                                                         "interval": "step"}}


class Progress(pl.Callback):
    def __init__(self, checkpoint, every=20):
        self.checkpoint, self.every = checkpoint, every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            s = self.checkpoint.optimizer.stats()
            print(f"step {step:5d}  loss {pl_module.last_loss.item():.4f}"
                  f"  lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}"
                  f"  checkpoints {s['epochs_committed']}"
                  f"  blocked {1e3 * s['blocked_seconds'] / max(1, s['steps']):.3f} ms/step",
                  flush=True)


def main():
    parser = small_gpt_arguments(__doc__, "pmsnap-lightning.pool")
    parser.add_argument("--batches-per-epoch", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", module="lightning")  # its advice on workers and loggers
    if args.fresh and os.path.exists(args.pool):
        os.remove(args.pool)

    model = LanguageModel(args)
    data = Batches(TokenLoader(args.vocab, 50_000, args.batch, args.seq), args.batches_per_epoch)
    checkpoint = PmsnapCheckpoint(args.pool)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint, Progress(checkpoint)])
    resume = pmsnap.has_checkpoint(args.pool)
    if resume:
        step = pmsnap.read_pool(args.pool)["latest"]["iteration"]
        print(f"resumed from {args.pool}: continuing at step {step + 1}")
    else:
        print(f"new pool {args.pool}")
    began = time.perf_counter()
    trainer.fit(model, data, ckpt_path=args.pool if resume else None)
    print(f"fit() ran {time.perf_counter() - began:.1f} s")
    print(f"pool {args.pool}: last committed step "
          f"{pmsnap.read_pool(args.pool)['latest']['iteration']}")


if __name__ == "__main__":
    main()
