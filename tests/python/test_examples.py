"""The runnable examples under examples/, run as a user runs them.

examples/train_dlrm.py trains into a pool and, run again with the same pool,
resumes from its last committed iteration; with --measure-overhead it
measures in interleaved rounds (a plain and a checkpointed run each, the
order alternating) and prints medians with their spread, leaving no pool
behind. examples/train_loop.py (pmsnap.TrainingState in a torchtitan-style
loop) continues from its pool at the step after the last committed one, and
so do examples/train_lightning.py and examples/train_hf.py (the Lightning
and Hugging Face Trainer callbacks).
examples/train_fsdp2.py (FSDP2 under torchrun) resumes after a killed rank
with the losses of the uninterrupted steps, then continues on 3 ranks;
examples/train_torchrec.py (torchrec's DLRM, table-wise) the same, then
continues row-wise on 4 ranks. bench/python_overhead.py, the Python front
end's overhead benchmark, runs at a tiny size on both of its workloads.

Thread-safety: each test runs the example in a child process of its own.
"""

import csv
import os
import re
import shutil
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
NUMBER = r"[-+]?\d+\.\d+"


def run_example(name, *args):
    completed = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args],
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return completed.stdout


SMALL_DLRM = ("--table-rows", "2000", "500", "--batch", "32", "--no-pin")


def assert_resumes(script, pool_path, count_flag, unit, resumed_line, args):
    """Runs `script` for 6 steps into a new pool, then for 10: the second
    run prints `resumed_line` and both end at their last step committed."""
    first = run_example(script, "--pool", pool_path, count_flag, "6", *args)
    assert f"new pool {pool_path}" in first
    assert first.rstrip().endswith(f"last committed {unit} 6")
    second = run_example(script, "--pool", pool_path, count_flag, "10", *args)
    assert resumed_line in second, second
    assert second.rstrip().endswith(f"last committed {unit} 10")


def test_train_dlrm_resumes_from_its_pool_where_it_stopped(pool_path):
    assert_resumes("train_dlrm.py", pool_path, "--iterations", "iteration",
                   f"resumed from {pool_path} at iteration 6", SMALL_DLRM)


def test_measure_overhead_reports_medians_and_spreads_of_interleaved_rounds(pool_path):
    out = run_example("train_dlrm.py", "--pool", pool_path, "--iterations", "8",
                      "--measure-overhead", "--rounds", "2", *SMALL_DLRM)
    rounds = re.findall(rf"^  round (\d)/2  plain ({NUMBER}) ms/it, checkpointed ({NUMBER}) ms/it",
                        out, re.MULTILINE)
    assert [r[0] for r in rounds] == ["1", "2"], out
    assert "median of 2 interleaved rounds of 8 iterations" in out
    for line in ("iteration time, plain optimizer", "iteration time, checkpointed",
                 r"overhead \(checkpointed / plain - 1\)", "blocked in hooks per iteration"):
        match = re.search(rf"^  {line} +({NUMBER})  \[({NUMBER}) \.\. ({NUMBER})\] (ms|%)$", out,
                          re.MULTILINE)
        assert match, f"no '{line}' line with a median and a spread:\n{out}"
        median, low, high = (float(match.group(i)) for i in (1, 2, 3))
        assert low <= median <= high
    # The spread is the rounds' own range (the same numbers, printed alike).
    plain = sorted((r[1] for r in rounds), key=float)
    assert f"[{plain[0]} .. {plain[1]}] ms" in out, out
    # The rounds' pools are gone, and the user's pool was never created.
    assert not os.path.exists(pool_path)
    assert not os.path.exists(pool_path + ".overhead")


def test_train_loop_continues_at_the_step_after_the_last_committed_one(pool_path):
    small = ("--dim", "16", "--layers", "1", "--seq", "8", "--batch", "2", "--vocab", "64")
    assert_resumes("train_loop.py", pool_path, "--steps", "step",
                   f"resumed from {pool_path}: continuing at step 7", small)


def test_train_lightning_continues_at_the_step_after_the_last_committed_one(pool_path):
    small = ("--dim", "16", "--layers", "1", "--seq", "8", "--batch", "2", "--vocab", "64",
             "--batches-per-epoch", "4")
    assert_resumes("train_lightning.py", pool_path, "--steps", "step",
                   f"resumed from {pool_path}: continuing at step 7", small)


def test_train_hf_continues_at_the_step_after_the_last_committed_one(pool_path):
    small = ("--dim", "16", "--layers", "1", "--seq", "8", "--batch", "2", "--vocab", "64",
             "--sequences", "8")
    try:
        assert_resumes("train_hf.py", pool_path, "--steps", "step",
                       f"resumed from {pool_path}: continuing at step 7", small)
    finally:
        shutil.rmtree(pool_path + ".resume", ignore_errors=True)


def assert_killed_rank_resumes(script, pool_path, new_world, moved_line):
    """`script` (a torchrun example: relaunch.py) resumes after the kill of
    rank 1 at step 12 with the losses of the uninterrupted steps, then
    continues on `new_world` ranks (`moved_line` printed)."""
    template = pool_path.replace(".pool", ".{rank}.pool")
    out = run_example(script, "--pool", template, "--steps", "20", "--kill-at", "12")
    for r in range(new_world):
        for path in (template, template.replace("{rank}", f"{new_world}ranks.{{rank}}")):
            assert not os.path.exists(path.replace("{rank}", str(r))), "pools left behind"
    before, _, after = out.partition("relaunching")
    assert after, out
    resumed = re.search(r"resumed: continuing at step (\d+)", after)
    assert resumed and 1 < int(resumed.group(1)) <= 13, out
    losses = [dict(re.findall(r"step +(\d+)  loss (\S+)", part)) for part in (before, after)]
    common = set(losses[0]) & set(losses[1])
    # Rank 0 printed steps 10-12 before the kill; a resume at or before 12
    # prints 12 again (one at 13, from a commit of 12 that beat the kill,
    # shares no printed step).
    assert common or int(resumed.group(1)) == 13, out
    for step in common:
        assert losses[0][step] == losses[1][step], f"step {step}:\n{out}"
    assert "kB per checkpoint" in after
    assert moved_line in after, out


def test_train_fsdp2_resumes_after_a_killed_rank_with_the_same_losses(pool_path):
    assert_killed_rank_resumes("train_fsdp2.py", pool_path, 3, "on 3 ranks: continuing at step 21")


def test_train_torchrec_resumes_after_a_killed_rank_then_moves_to_row_wise_on_4_ranks(pool_path):
    assert_killed_rank_resumes("train_torchrec.py", pool_path, 4,
                               "on 4 ranks, row_wise: continuing at step 21")


BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python_overhead.py")


def run_bench(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True,
                          timeout=600)


def test_python_overhead_bench_breaks_the_dlrm_overhead_into_its_parts(tmp_path):
    """bench/python_overhead.py --workload dlrm runs the example's model and
    configuration: a table row and a CSV row per method and round, commits
    where the method checkpoints and none where it only hooks or tracks."""
    csv_path = tmp_path / "dlrm.csv"
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    pools_before = set(os.listdir(pool_dir))
    methods = ["plain", "pmsnap", "tracking-only", "pmsnap-notrack", "pmsnap-norng",
               "pmsnap-dense", "hooks-only"]
    done = run_bench("--workload", "dlrm", "--rounds", "2", "--iterations", "4", "--warmup", "1",
                     "--out", str(csv_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dlrm (examples/train_dlrm.py defaults): 4 EmbeddingBag tables" in done.stdout
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["round"]), r["method"]) for r in rows] == [
        (rnd, m) for rnd in range(2) for m in methods]
    commits = {}
    for r in rows:
        commits.setdefault(r["method"], set()).add(int(r["commits"]))
        assert float(r["mean_ms"]) > 0 and float(r["step_cpu_ms"]) >= 0
        # pmsnap's part of step(): what the wrapped optimizer's calls leave.
        assert 0 <= float(r["own_cpu_ms"]) <= float(r["step_cpu_ms"]), r
    for method in methods:
        assert re.search(rf"^{re.escape(method)} +{NUMBER} +{NUMBER} \(", done.stdout,
                         re.MULTILINE), f"no table row for {method}:\n{done.stdout}"
        checkpoints = method not in ("plain", "tracking-only", "hooks-only")
        # every=1: the 4 iterations commit 4 epochs; close() commits no more.
        assert commits[method] == ({4} if checkpoints else {0}), (method, commits)
    assert all(float(r["overhead_pct"]) == 0 for r in rows if r["method"] == "plain")
    left = [p for p in set(os.listdir(pool_dir)) - pools_before
            if p.startswith("pmsnap-bench-python-")]
    assert not left, f"pools left behind: {left}"


def test_python_overhead_bench_refuses_a_table_method_on_the_transformer(tmp_path):
    done = run_bench("--methods", "plain,pmsnap-dense", "--out", str(tmp_path / "t.csv"))
    assert done.returncode == 2
    assert "pmsnap-dense needs --workload dlrm" in done.stderr
    done = run_bench("--methods", "pmsnap,plain", "--out", str(tmp_path / "t.csv"))
    assert done.returncode == 2 and "the first method must be plain" in done.stderr


def test_python_overhead_bench_trains_one_model_on_in_every_trial_with_same_model(tmp_path):
    """--same-model: every trial steps the same model and optimizer, each
    pmsnap trial into a pool of its own, and each still commits its steps."""
    csv_path = tmp_path / "same.csv"
    done = run_bench("--workload", "dlrm", "--same-model", "--rounds", "2", "--iterations", "4",
                     "--warmup", "1", "--methods", "plain,pmsnap", "--out", str(csv_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every trial on the same model (--same-model)" in done.stdout
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], int(r["commits"])) for r in rows] == [
        ("plain", 0), ("pmsnap", 4), ("plain", 0), ("pmsnap", 4)]
    for r in rows:
        assert 0 <= float(r["own_cpu_ms"]) <= float(r["step_cpu_ms"]), r


PAIRED = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python_paired.py")


def test_python_paired_bench_alternates_blocks_and_swaps_the_copies_halfway(tmp_path):
    """bench/python_paired.py: a CSV row per pair of blocks, the measured
    copy swapped halfway, each half's pool committing every step and
    removed, and the three summary rows printed."""
    csv_path = tmp_path / "paired.csv"
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    pools_before = set(os.listdir(pool_dir))
    done = subprocess.run([sys.executable, PAIRED, "--workload", "dlrm", "--pairs", "20",
                           "--block", "3", "--skip", "1", "--warmup", "2", "--out",
                           str(csv_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pmsnap against plain; 20 pairs of blocks of 3 iterations" in done.stdout
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["half"]), r["measured_copy"]) for r in rows] == (
        [(0, "first")] * 10 + [(1, "second")] * 10)
    for r in rows:
        expected = 100 * (float(r["measured_ms"]) / float(r["plain_ms"]) - 1)
        assert abs(float(r["overhead_pct"]) - expected) < 0.01, r
    for title in ("first half", "second half (swapped)", "all"):
        assert re.search(rf"^{re.escape(title)} +{NUMBER} +{NUMBER} +{NUMBER} \[{NUMBER} \.\. "
                         rf"{NUMBER}\]$", done.stdout, re.MULTILINE), done.stdout
    # Per half: 2 warmup steps, then 10 blocks of 3: every step committed.
    assert done.stdout.count("pmsnap: 32 checkpoints over 32 steps") == 2, done.stdout
    left = [p for p in set(os.listdir(pool_dir)) - pools_before
            if p.startswith("pmsnap-bench-paired-")]
    assert not left, f"pools left behind: {left}"
    refused = subprocess.run([sys.executable, PAIRED, "--pairs", "21"], capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode == 2 and "--pairs must be even" in refused.stderr


FAULTS = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "python_thread_faults.py")


def test_python_thread_faults_bench_counts_each_threads_faults_per_step(tmp_path):
    """bench/python_thread_faults.py: a row per thread, the training thread
    among them, faults per step over the counted steps; the pool removed."""
    csv_path = tmp_path / "faults.csv"
    pool_dir = os.environ.get("PMSNAP_POOL_DIR", "/dev/shm")
    pools_before = set(os.listdir(pool_dir))
    done = subprocess.run([sys.executable, FAULTS, "--steps", "6", "--warmup", "2", "--out",
                           str(csv_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "faults over steps 2-6" in done.stdout
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [r["role"] for r in rows].count("training") == 1, rows
    assert len(rows) >= 2 and all(float(r["faults_per_step"]) >= 0 for r in rows), rows
    assert re.search(rf"^ +\d+ training +{NUMBER}$", done.stdout, re.MULTILINE), done.stdout
    left = [p for p in set(os.listdir(pool_dir)) - pools_before
            if p.startswith("pmsnap-bench-faults-")]
    assert not left, f"pools left behind: {left}"
