#!/usr/bin/env python3
"""A torchtitan-style training loop that resumes bit-exact after any crash.

The loop keeps what a real one keeps: a small GPT-like transformer (dropout
on), AdamW, a warm-up + cosine LR schedule, a data loader that knows its
position, gradient clipping and the RNG. pmsnap.TrainingState checkpoints
all of it with every step into one pool and resume() brings all of it back:

    state = pmsnap.TrainingState(pool, model, optimizer, lr_scheduler=scheduler,
                                 stateful={"data": loader})
    for step in range(state.resume(), steps + 1):
        tokens = loader.next_batch()
        loss = ...; state.zero_grad(); loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        state.step()

Kill it (Ctrl-C, kill -9) and run it again with the same --pool: it goes on
from the last committed step with the same batches, learning rates and
dropout masks as if it had never stopped.

    python3 examples/train_loop.py --steps 200
    python3 examples/train_loop.py --steps 200 --fresh

Thread-safety: a single-threaded script.
"""

import argparse
import math
import os
import time

import torch
from torch import nn

import pmsnap


class TokenLoader:
    """Batches of random token windows from a fixed synthetic corpus, with a
    state (the next window and the sampling generator) like torchdata's
    StatefulDataLoader: state_dict() / load_state_dict()."""

    def __init__(self, vocab, length, batch, seq, seed=0):
        corpus_generator = torch.Generator().manual_seed(seed)
        self.corpus = torch.randint(vocab, (length,), generator=corpus_generator)
        self.batch, self.seq = batch, seq
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.batches_served = 0

    def next_batch(self):
        starts = torch.randint(len(self.corpus) - self.seq - 1, (self.batch,),
                               generator=self.generator)
        windows = torch.stack([self.corpus[s:s + self.seq + 1] for s in starts.tolist()])
        self.batches_served += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self):
        return {"batches_served": self.batches_served, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.batches_served = state["batches_served"]
        self.generator.set_state(state["generator"])


class TinyGPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[:tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


def warmup_cosine(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


def small_gpt_arguments(doc, pool_name):
    """The command line of the small-GPT examples (this one, train_lightning.py,
    train_hf.py): the pool, the steps, --fresh and the model's size."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--pool", default=os.path.join(os.environ.get("PMSNAP_POOL_DIR",
                                                                      "/dev/shm"), pool_name))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fresh", action="store_true", help="delete the pool first")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    return parser


def main():
    args = small_gpt_arguments(__doc__, "pmsnap-loop.pool").parse_args()
    torch.set_num_threads(1)
    if args.fresh and os.path.exists(args.pool):
        os.remove(args.pool)

    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.dim, args.layers, 4, args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  warmup_cosine(args.steps // 10, args.steps))
    loader = TokenLoader(args.vocab, 50_000, args.batch, args.seq)

    state = pmsnap.TrainingState(args.pool, model, optimizer, lr_scheduler=scheduler,
                                 stateful={"data": loader})
    start = state.resume()
    if start > 1:
        print(f"resumed from {args.pool}: continuing at step {start}")
    else:
        print(f"new pool {args.pool}")
    began = time.perf_counter()
    with state:
        for step in range(start, args.steps + 1):
            inputs, targets = loader.next_batch()
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
            state.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            state.step()
            if step % 20 == 0 or step == args.steps:
                s = state.stats()
                print(f"step {step:5d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.2e}"
                      f"  checkpoints {s['epochs_committed']}"
                      f"  blocked {1e3 * s['blocked_seconds'] / max(1, s['steps']):.3f} ms/step",
                      flush=True)
    print(f"{args.steps - start + 1} steps in {time.perf_counter() - began:.1f} s; "
          f"{state.stats()['summary']}")
    print(f"pool {args.pool}: last committed step "
          f"{pmsnap.read_pool(args.pool)['latest']['iteration']}")


if __name__ == "__main__":
    main()
