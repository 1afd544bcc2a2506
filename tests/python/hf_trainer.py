"""A Hugging Face Trainer run for test_hf.py: a tiny GPT-2 built from a
config (dropout on, no download), AdamW with warm-up and a cosine schedule,
a shuffled dataset over several epochs, trained with
pmsnap.hf.PmsnapCallback (or without it, the reference).

    hf_trainer.py MODE POOL STEPS OUT [KILL_AT]

MODE: plain | pmsnap. A pmsnap run resumes from resume_dir(POOL) when the
pool holds a checkpoint. Prints "start N" (the first step it takes) and
"step k" after each step; with KILL_AT it waits at that step until the
checkpoint committed before printing, then waits to be killed. At the end
it saves the final state (model, optimizer, scheduler, RNG draws) to OUT.
"""

import sys
import tempfile
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import pmsnap
from pmsnap.hf import PmsnapCallback, resume_dir

SEQUENCES, BATCH = 24, 4  # 6 steps per epoch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seed=5, vocab=96, length=16):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(vocab, (SEQUENCES, length), generator=generator)

    def __len__(self):
        return SEQUENCES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    return GPT2LMHeadModel(config)


def training_args(output_dir, steps):
    return TrainingArguments(output_dir=output_dir, max_steps=steps,
                             per_device_train_batch_size=BATCH, learning_rate=3e-3,
                             warmup_steps=3, lr_scheduler_type="cosine", weight_decay=0.01,
                             save_strategy="no", report_to="none", logging_steps=4,
                             use_cpu=True, seed=42, dataloader_num_workers=0,
                             disable_tqdm=True)


class Reporter(TrainerCallback):
    """Prints each step; at KILL_AT waits for the checkpoint, then for the kill."""

    def __init__(self, kill_at, checkpoint):
        self.kill_at, self.checkpoint = kill_at, checkpoint

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.kill_at:
            self.checkpoint.optimizer.flush()
        print(f"step {state.global_step}", flush=True)
        if state.global_step == self.kill_at:
            time.sleep(600)


def main():
    mode, pool, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    callbacks, resume = [], None
    if mode == "pmsnap":
        checkpoint = PmsnapCallback(pool, every=1)
        callbacks = [checkpoint, Reporter(kill_at, checkpoint)]
        if pmsnap.has_checkpoint(pool):
            resume = resume_dir(pool)
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(model=tiny_gpt2(), args=training_args(output_dir, steps),
                          train_dataset=Tokens(), callbacks=callbacks)
        start = 1
        if resume is not None:
            start = pmsnap.read_pool(pool)["latest"]["iteration"] + 1
        print(f"start {start}", flush=True)
        trainer.train(resume_from_checkpoint=resume)
    optimizer = trainer.optimizer
    torch.save({"model": trainer.model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": trainer.lr_scheduler.state_dict(),
                "lrs": [g["lr"] for g in optimizer.param_groups],
                "global_step": trainer.state.global_step, "rng_next": torch.rand(4)}, out)


if __name__ == "__main__":
    main()
