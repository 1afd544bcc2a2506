"""What the multi-rank examples (train_fsdp2.py, train_torchrec.py) share:
each rank's checkpointed loop, and the job launcher (torchrun as a scheduler
would run it, relaunched once a rank died, then moved to another number of
ranks).

    opt, start = open_checkpointed(optimizer, model, args, rank, moved_line)
    train_and_close(opt, args, rank, start, step_loss)   # step_loss(step): loss, backward done

    run_kill_resume_and_move(__file__, args, world=2, new_world=3)

Starts `script` under torchrun on `world` gloo ranks with --pool, --steps
and --kill-at (the script SIGKILLs a rank there); when the job fails it
relaunches it with --resumed (the ranks restore from their pools), then runs
it on `new_world` ranks with new pools and --init-from the old ones, for 20
more steps. `extra` and `new_extra` are more arguments of the first two runs
and of the last. Removes the pools at the end.
"""

import argparse
import os
import signal
import subprocess
import sys

import pmsnap


def example_arguments(pool, steps, kill_at):
    """The examples' command line: --pool (a "{rank}" template), --steps,
    --kill-at (0: no kill), and the launcher's own --resumed, --init-from."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--pool", default=pool)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--kill-at", type=int, default=kill_at)
    parser.add_argument("--resumed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init-from", default=None, help=argparse.SUPPRESS)
    return parser


def open_checkpointed(optimizer, model, args, rank, moved_line):
    """A rank's CheckpointedOptimizer (every step) and its first step: with
    --init-from, new pools started from the old run's (each rank reads the
    rows of its new shards; `moved_line` printed); else this run's pools,
    restored if they hold a step."""
    if args.init_from:
        opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1,
                                           init_from=args.init_from)
        start = opt.iteration + 1
        if rank == 0:
            print(f"{moved_line}: continuing at step {start}", flush=True)
        return opt, start
    opt = pmsnap.CheckpointedOptimizer(optimizer, args.pool, model=model, every=1)
    start = 1
    try:
        _, extra = opt.restore()
        start = extra["batch"] + 1
        if rank == 0:
            print(f"resumed: continuing at step {start}", flush=True)
    except pmsnap.NotFoundError:
        pass
    return opt, start


def train_and_close(opt, args, rank, start, step_loss):
    """Steps start..args.steps (step_loss(step) runs forward and backward
    and returns the loss), rank 1 killed at --kill-at unless --resumed;
    then the pool closed, rank 0 printing the bytes per checkpoint, and the
    process left without the interpreter's finalization (torch 2.11's gloo
    sometimes aborts there after an FSDP2 run, "terminate called without an
    active exception", pytorch/pytorch#190489; everything is written and
    closed by then)."""
    for step in range(start, args.steps + 1):
        loss = step_loss(step)
        opt.step(extra_state={"batch": step})
        opt.zero_grad()
        if rank == 0 and (step % 10 == 0 or abs(step - args.kill_at) <= 1):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
        if args.kill_at == step and rank == 1 and not args.resumed:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no flush
    opt.close()
    stats = opt.stats()
    if rank == 0:
        print(f"rank 0 wrote {stats['bytes_written'] / max(1, stats['epochs_committed']) / 1e3:.1f} "
              f"kB per checkpoint ({stats['epochs_committed']} checkpoints)", flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run_kill_resume_and_move(script, args, world, new_world, extra=(), new_extra=()):
    pools = [args.pool.replace("{rank}", str(r)) for r in range(world)]
    moved = args.pool.replace("{rank}", f"{new_world}ranks.{{rank}}")
    pools += [moved.replace("{rank}", str(r)) for r in range(new_world)]
    for path in pools:
        if os.path.exists(path):
            os.remove(path)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world}", os.path.abspath(script), "--pool", args.pool,
               "--steps", str(args.steps), "--kill-at", str(args.kill_at), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        first = subprocess.run(command, env=env, capture_output=True, text=True)
        print(first.stdout, end="")
        if first.returncode == 0:
            return
        if not args.kill_at:
            sys.exit(first.stderr[-3000:])
        print(f"-- rank 1 was killed after step {args.kill_at}; relaunching --", flush=True)
        subprocess.run(command + ["--resumed"], env=env, check=True)
        print(f"-- continuing on {new_world} ranks --", flush=True)
        command = command[:len(command) - len(extra)] + list(new_extra)
        command[command.index(f"--nproc_per_node={world}")] = f"--nproc_per_node={new_world}"
        command[command.index(args.pool)] = moved
        command[command.index("--steps") + 1] = str(args.steps + 20)
        subprocess.run(command + ["--resumed", "--init-from", args.pool], env=env, check=True)
    finally:
        for path in pools:
            if os.path.exists(path):
                os.remove(path)
