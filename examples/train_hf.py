#!/usr/bin/env python3
"""A Hugging Face Trainer with every optimizer step checkpointed into a pool.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[PmsnapCallback(pool)])
    trainer.train(resume_from_checkpoint=resume_dir(pool) if pmsnap.has_checkpoint(pool)
                  else None)

A small GPT-2 built from a config (nothing is downloaded), AdamW with
warm-up and a cosine schedule, dropout on. Kill it (Ctrl-C, kill -9) and run
it again with the same --pool: train() resumes from the last committed step
with the same batches, learning rates and dropout masks.

    python3 examples/train_hf.py --steps 200
    python3 examples/train_hf.py --steps 200 --fresh

Thread-safety: a single-threaded script.
"""

import os
import shutil
import tempfile
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import pmsnap
from pmsnap.hf import PmsnapCallback, resume_dir

from train_loop import small_gpt_arguments


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences: a language-modelling dataset without a download."""

    def __init__(self, count, length, vocab, seed=0):
        self.ids = torch.randint(vocab, (count, length),
                                 generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(TrainerCallback):
    def __init__(self, checkpoint, every=20):
        self.checkpoint, self.every = checkpoint, every

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            s = self.checkpoint.optimizer.stats()
            print(f"step {state.global_step:5d}  checkpoints {s['epochs_committed']}"
                  f"  blocked {1e3 * s['blocked_seconds'] / max(1, s['steps']):.3f} ms/step",
                  flush=True)


def main():
    parser = small_gpt_arguments(__doc__, "pmsnap-hf.pool")
    parser.add_argument("--sequences", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    if args.fresh:
        if os.path.exists(args.pool):
            os.remove(args.pool)
        shutil.rmtree(args.pool + ".resume", ignore_errors=True)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=args.vocab, n_positions=args.seq,
                                       n_embd=args.dim, n_layer=args.layers, n_head=4))
    checkpoint = PmsnapCallback(args.pool)
    resume = None
    if pmsnap.has_checkpoint(args.pool):
        resume = resume_dir(args.pool)
        step = pmsnap.read_pool(args.pool)["latest"]["iteration"]
        print(f"resumed from {args.pool}: continuing at step {step + 1}")
    else:
        print(f"new pool {args.pool}")
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
            learning_rate=3e-3, warmup_steps=args.steps // 10, lr_scheduler_type="cosine",
            weight_decay=0.1, save_strategy="no", report_to="none", logging_strategy="no",
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=training,
                          train_dataset=RandomTokens(args.sequences, args.seq, args.vocab),
                          callbacks=[checkpoint, Progress(checkpoint)])
        began = time.perf_counter()
        trainer.train(resume_from_checkpoint=resume)
    print(f"train() ran {time.perf_counter() - began:.1f} s")
    print(f"pool {args.pool}: last committed step "
          f"{pmsnap.read_pool(args.pool)['latest']['iteration']}")


if __name__ == "__main__":
    main()
