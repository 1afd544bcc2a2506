"""Reading a pool never changes it, and never stops a trainer ([lossless]
items 3-5): `pmsnap verify`, `info`, `list` and `export` changed 134-171
bytes of every pool they read (libpmemobj's own open), a verify running in
a loop made 2 of 3 trainer starts fail with BusyError, a pool held open
exited 1 like a damaged one, `list` showed damaged checkpoints as fine, and
a truncated pool said only "pool initialization failed".

Readers now map the pool read-only without libpmemobj and take no lock.
Exit codes: 0 ok, 1 damaged or unreadable, 2 usage, 3 busy."""

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

import pmsnap
from pmsnap import _pmsnap

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE, EXIT_BUSY = 0, 1, 2, 3


def digest(path):
    """Every byte of the file, libpmemobj's descriptor included."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def make_pool(path, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    with pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), path,
                                      model=model, every=1) as opt:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()


def damage_newest(path):
    """Flips a byte of the newest epoch's first tensor, in the file."""
    reader = _pmsnap.CheckpointReader(path)
    newest = reader.epochs()[0]["epoch"]
    offset = reader.tensor_file_offset(newest, 0, 0)
    reader.close()
    flip_byte(path, offset)
    return newest


def flip_byte(path, offset):
    """Inverts the byte at `offset` of the file (damage a checksum catches)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def pmsnap_cli(*args):
    return subprocess.run([sys.executable, "-m", "pmsnap", *args], capture_output=True,
                          text=True)


READERS = {
    "verify": lambda p, out: pmsnap_cli("verify", p).returncode,
    "info": lambda p, out: pmsnap_cli("info", p).returncode,
    "list": lambda p, out: pmsnap_cli("list", p).returncode,
    "export": lambda p, out: pmsnap_cli("export", p, "--to", out + ".safetensors").returncode,
    "read_pool": lambda p, out: _call(_pmsnap.read_pool, p),
    "load_state_dict": lambda p, out: _call(pmsnap.load_state_dict, p),
    "export()": lambda p, out: _call(pmsnap.export, p, out + "2.pt"),
}


def _call(f, *args):
    try:
        f(*args)
        return EXIT_OK
    except pmsnap.Error:
        return EXIT_DAMAGED


@pytest.mark.parametrize("state", ["healthy", "damaged", "truncated"])
def test_every_reader_leaves_the_pool_byte_for_byte_as_it_was(pool_path, tmp_path, state):
    make_pool(pool_path)
    if state == "damaged":
        damage_newest(pool_path)
    elif state == "truncated":
        os.truncate(pool_path, os.path.getsize(pool_path) // 2)
    before = digest(pool_path)
    for name, read in READERS.items():
        code = read(pool_path, str(tmp_path / name))
        assert digest(pool_path) == before, f"{name} changed the {state} pool"
        if state == "healthy":
            assert code == EXIT_OK, name


def test_exit_codes_tell_damage_usage_and_busy_apart(pool_path):
    make_pool(pool_path)
    assert pmsnap_cli("verify", pool_path).returncode == EXIT_OK
    assert pmsnap_cli("verify").returncode == EXIT_USAGE
    assert pmsnap_cli("list", pool_path, "--bogus").returncode == EXIT_USAGE
    help_text = pmsnap_cli("--help").stdout + pmsnap_cli("--help").stderr
    assert "3 busy" in help_text
    # Held open by a trainer (this process): busy, not damaged.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 4))
    with pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2), pool_path,
                                      model=model) as opt:
        opt.restore()
        for command in ("verify", "info", "list"):
            run = pmsnap_cli(command, pool_path)
            assert run.returncode == EXIT_BUSY, (command, run.stdout, run.stderr)
            assert f"process {os.getpid()}" in run.stderr, (command, run.stderr)
    damage_newest(pool_path)
    assert pmsnap_cli("verify", pool_path).returncode == EXIT_DAMAGED


def test_list_flags_a_damaged_checkpoint_and_exits_1(pool_path):
    make_pool(pool_path)
    newest = damage_newest(pool_path)
    run = pmsnap_cli("list", pool_path)
    assert run.returncode == EXIT_DAMAGED, run.stdout + run.stderr
    assert "1 DAMAGED" in run.stdout
    assert f"damaged: epoch {newest}" in run.stdout
    healthy = [line for line in run.stdout.splitlines() if line.strip().startswith(
        str(newest - 1))]
    assert healthy and "DAMAGED" not in healthy[0]


def test_a_truncated_pool_says_how_long_it_is_and_must_be(pool_path):
    make_pool(pool_path)
    size = os.path.getsize(pool_path)
    os.truncate(pool_path, size // 2)
    run = pmsnap_cli("verify", pool_path)
    assert run.returncode == EXIT_DAMAGED
    assert "truncated" in run.stderr and f"{size // 2} bytes" in run.stderr, run.stderr
    assert f"expected a file of {size} bytes" in run.stderr, run.stderr
    # A trainer opening it says the same, instead of libpmemobj's "pool
    # initialization failed".
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with pytest.raises(pmsnap.CorruptionError, match=f"expected a file of {size} bytes"):
        pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool_path,
                                     model=model).restore()


def test_readers_in_a_loop_never_stop_a_trainer_from_starting(pool_path):
    make_pool(pool_path)
    loop = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, pmsnap\n"
         "from pmsnap import _pmsnap\n"
         "while True:\n"
         "    _pmsnap.run_cli(['verify', sys.argv[1]])\n"
         "    try:\n"
         "        _pmsnap.read_pool(sys.argv[1])\n"
         "    except pmsnap.Error:\n"
         "        pass\n", pool_path])
    try:
        time.sleep(0.5)  # the loop is reading
        for start in range(5):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                        torch.nn.Linear(16, 4))
            opt = pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                               pool_path, model=model, every=1)
            iteration, _ = opt.restore()  # opens the pool: no BusyError from the readers
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.close()
            assert iteration == 3 + start
        assert loop.poll() is None, "the reader loop died"
    finally:
        loop.kill()
        loop.wait()


def test_read_range_reads_and_checks_only_the_parts_a_byte_range_lies_in(pool_path):
    """CheckpointReader.read_range (how a rank of another world size reads
    the rows of an old shard): the same bytes as the whole tensor's, a
    damaged part outside the range unread, inside it CorruptionError."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 256)  # weight: 64 KiB, 16 parts of 4 KiB
    with pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), pool_path,
                                      model=model, every=1, part_bytes=4096) as opt:
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
    reader = _pmsnap.CheckpointReader(pool_path)
    epoch = reader.epochs()[0]["epoch"]
    names = [name for name, _, _ in reader.describe()["units"]]
    unit = names.index("weight")
    whole = torch.empty(256 * 64, dtype=torch.float32)
    reader.read_tensor(epoch, unit, 0, whole.data_ptr())
    raw = whole.view(torch.uint8)
    for offset, count in ((0, 4096), (100, 5000), (4095, 2), (61440, 4096), (0, 65536)):
        out = torch.empty(count, dtype=torch.uint8)
        reader.read_range(epoch, unit, 0, offset, count, out.data_ptr())
        assert torch.equal(out, raw[offset:offset + count]), (offset, count)
    with pytest.raises(pmsnap.InvalidArgumentError, match="past its 65536 bytes"):
        reader.read_range(epoch, unit, 0, 65000, 1000, out.data_ptr())
    damaged_at = reader.tensor_file_offset(epoch, unit, 0) + 10  # in part 0
    reader.close()
    flip_byte(pool_path, damaged_at)
    reader = _pmsnap.CheckpointReader(pool_path)
    try:
        out = torch.empty(4096, dtype=torch.uint8)
        reader.read_range(epoch, unit, 0, 5 * 4096, 4096, out.data_ptr())  # part 5 only
        assert torch.equal(out, raw[5 * 4096:6 * 4096])
        with pytest.raises(pmsnap.CorruptionError, match=os.path.basename(pool_path)):
            reader.read_range(epoch, unit, 0, 8, 16, out.data_ptr())
    finally:
        reader.close()
