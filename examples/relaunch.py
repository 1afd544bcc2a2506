"""The job launcher of the multi-rank examples (train_fsdp2.py,
train_torchrec.py): torchrun as a scheduler would run it, relaunched once a
rank died, then moved to another number of ranks.

    run_kill_resume_and_move(__file__, args, world=2, new_world=3)

Starts `script` under torchrun on `world` gloo ranks with --pool, --steps
and --kill-at (the script SIGKILLs a rank there); when the job fails it
relaunches it with --resumed (the ranks restore from their pools), then runs
it on `new_world` ranks with new pools and --init-from the old ones, for 20
more steps. `extra` and `new_extra` are more arguments of the first two runs
and of the last. Removes the pools at the end.
"""

import os
import subprocess
import sys


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
