"""Checkpoints that leave the pool: pmsnap.load_state_dict without a model,
export to safetensors / torch.save / DCP read back by those libraries into a
fresh model and optimizer bitwise equal to what the pool restores, a damaged
newest slot, bounded memory, the `pmsnap list/export/prune/diff` commands,
and bad inputs that leave the pool untouched.

Models: a small transformer encoder with AdamW, and the DLRM of
test_embedding_diff with its table checkpointed under an embedding policy
(Adagrad: the table's "sum" rows in the encoded unit, "step" in its dense
companion).
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import shutil
import textwrap

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import pmsnap
from pmsnap import cli
from conftest import assert_same_training_state, pool_dir
from test_embedding_diff import Dlrm, train_step as dlrm_step

TABLE = "bag.weight"


class Transformer(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Linear(8, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x))).mean(dim=1)


def transformer_step(model, opt, step):
    g = torch.Generator().manual_seed(77 + step)
    x, y = torch.randn(4, 6, 8, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def make_transformer(seed=0):
    model = Transformer(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_dlrm(seed=0):
    model = Dlrm(seed=seed)
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)


DLRM_KWARGS = {"embedding_policy": "incrcp", "retain": 2}
MODELS = {
    "transformer": (make_transformer, transformer_step, {}),
    "dlrm": (make_dlrm, dlrm_step, DLRM_KWARGS),
}


def train(pool, kind, steps=4):
    """Trains `steps` steps into `pool`; returns (model, optimizer, snapshots
    {iteration: model state dict copy})."""
    make, step, kwargs = MODELS[kind]
    model, optimizer = make(seed=1)
    snapshots = {}
    with pmsnap.CheckpointedOptimizer(optimizer, pool, model=model, every=1, **kwargs) as opt:
        for s in range(1, steps + 1):
            step(model, opt, s)
            opt.flush()
            snapshots[s] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, optimizer, snapshots


def restored(pool, kind):
    """A fresh model and optimizer restored from the pool: the reference."""
    make, _, kwargs = MODELS[kind]
    model, optimizer = make(seed=9)
    pmsnap.restore(pool, model, optimizer, restore_rng=False, **kwargs)
    return model, optimizer


def fresh(kind):
    make, _, _ = MODELS[kind]
    return make(seed=5)


def pool_digest(path):
    """Hash of a pool file's bytes past libpmemobj's pool descriptor (the
    first 8 KiB, whose run id libpmemobj's open bumps, even to read): every
    byte of pmsnap's header, manifest, commit records, slots and chunks."""
    with open(path, "rb") as f:
        f.seek(8192)
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def out_path():
    """A unique output path prefix in the pool directory; removed afterwards."""
    import uuid
    base = os.path.join(pool_dir(), f"pmsnap-export-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield base
    for name in os.listdir(pool_dir()):
        full = os.path.join(pool_dir(), name)
        if full.startswith(base):
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def damage_tensor(pool, name, epoch, role="param"):
    """Flips one byte of parameter `name`'s tensor `role` at `epoch` in the file."""
    reader = pmsnap._pmsnap.CheckpointReader(pool)
    units = reader.describe()["units"]
    for u, (unit, _, tensors) in enumerate(units):
        if unit == name:
            t = [r for r, *_ in tensors].index(role)
            offset = reader.tensor_file_offset(epoch, u, t)
            break
    del reader
    with open(pool, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# --- load_state_dict ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["transformer", "dlrm"])
def test_load_state_dict_without_model_equals_what_the_pool_restores(pool_path, kind):
    model, optimizer, snapshots = train(pool_path, kind)
    sd = pmsnap.load_state_dict(pool_path)
    assert sd["pmsnap"]["iteration"] == 4 and sd["pmsnap"]["warnings"] == []
    ref_model, ref_opt = restored(pool_path, kind)
    target_model, target_opt = fresh(kind)
    target_model.load_state_dict(sd["model"])
    set_optimizer_state_dict(target_model, target_opt, sd["optimizer"])
    assert_same_training_state(ref_model, ref_opt, target_model, target_opt)
    assert_same_training_state(model, optimizer, target_model, target_opt)

    # The older retained epoch is the model one step earlier.
    older = pmsnap.load_state_dict(pool_path, epoch=sd["pmsnap"]["epoch"] - 1)
    assert older["pmsnap"]["iteration"] == 3
    for name, tensor in older["model"].items():
        assert torch.equal(tensor, snapshots[3][name]), name


def test_mmap_views_are_zero_copy_and_writes_never_reach_the_pool(pool_path):
    model, _, _ = train(pool_path, "transformer")
    before = pool_digest(pool_path)
    sd = pmsnap.load_state_dict(pool_path, mmap=True)
    copy = pmsnap.load_state_dict(pool_path)
    first = next(iter(sd["model"]))
    a, b = pmsnap.load_state_dict(pool_path, mmap=True, names=[first], model_only=True)["model"], \
        pmsnap.load_state_dict(pool_path, mmap=True, names=[first], model_only=True)["model"]
    for name, p in model.named_parameters():
        assert torch.equal(sd["model"][name], p), name
        for role, value in copy["optimizer"]["state"][name].items():
            assert torch.equal(sd["optimizer"]["state"][name][role], value)
    # Zero-copy: the two views of one tensor are mappings of the same file bytes
    # (not a buffer of this process); a write to one changes neither the pool
    # nor the other (copy-on-write, as torch.load(mmap=True)).
    a[first].add_(1.0)
    assert torch.equal(b[first], copy["model"][first])
    assert pool_digest(pool_path) == before


def test_reading_one_tensor_reads_only_that_tensor(pool_path):
    model, _, _ = train(pool_path, "transformer")
    epoch = pmsnap.load_state_dict(pool_path, names=["head.bias"],
                                   model_only=True)["pmsnap"]["epoch"]
    damage_tensor(pool_path, "encoder.layers.0.linear1.weight", epoch)
    one = pmsnap.load_state_dict(pool_path, epoch=epoch, names=["head.bias"], model_only=True)
    assert list(one["model"]) == ["head.bias"] and "optimizer" not in one
    assert torch.equal(one["model"]["head.bias"], model.head.bias)
    with pytest.raises(pmsnap.CorruptionError) as e:
        pmsnap.load_state_dict(pool_path, epoch=epoch)
    assert pool_path in str(e.value) and f"epoch {epoch}" in str(e.value)
    assert "encoder.layers.0.linear1.weight" in str(e.value)
    with pytest.raises(pmsnap.NotFoundError, match="no parameter 'nope'"):
        pmsnap.load_state_dict(pool_path, names=["nope"])


def test_quantized_table_is_dequantized_as_recover_table_gives_it(pool_path):
    model, optimizer = make_dlrm(seed=1)
    with pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model, quantize_bits=8,
                                      embedding_policy="full", every=1) as opt:
        for s in range(1, 4):
            dlrm_step(model, opt, s)
    sd = pmsnap.load_state_dict(pool_path)
    table = sd["model"][TABLE]
    assert table.dtype == torch.float32 and table.shape == model.bag.weight.shape
    assert torch.equal(table, pmsnap.recover_table(pool_path, TABLE))
    assert (table - model.bag.weight).abs().max() < 0.05  # 8-bit rowwise
    assert torch.equal(sd["model"]["fc1.weight"], model.fc1.weight)
    # PyTorch's fused 8-bit rowwise layout, as its quantized embedding_bag ops take it.
    fused = pmsnap.load_state_dict(pool_path, embedding_layout="fused8")["model"][TABLE]
    assert fused.dtype == torch.uint8 and fused.shape == (table.shape[0], table.shape[1] + 8)
    unpacked = torch.ops.quantized.embedding_bag_byte_unpack(fused)
    row_range = table.max(dim=1).values - table.min(dim=1).values
    assert ((unpacked - table).abs().max(dim=1).values <= row_range / 255 + 1e-6).all()
    ids, offsets = torch.tensor([3, 70, 5, 9]), torch.tensor([0, 2])
    pooled = torch.ops.quantized.embedding_bag_byte_rowwise_offsets(fused, ids, offsets)
    assert torch.allclose(pooled, torch.nn.functional.embedding_bag(ids, unpacked, offsets,
                                                                   mode="sum"), atol=1e-5)
    with pytest.raises(pmsnap.InvalidArgumentError, match="unknown embedding_layout"):
        pmsnap.load_state_dict(pool_path, embedding_layout="int3")


# --- export: round trips through each library ----------------------------------------------

def load_into_fresh(kind, fmt, path):
    """A fresh model and optimizer loaded from an export with the format's own library."""
    model, optimizer = fresh(kind)
    if fmt == "safetensors":
        tensors = safetensors.torch.load_file(path)
        model.load_state_dict({k: v for k, v in tensors.items() if "/" not in k})
        osd = pmsnap.read_export(path)["optimizer"]
    elif fmt == "pt":
        obj = torch.load(path, weights_only=True)
        model.load_state_dict(obj["model"])
        osd = obj["optimizer"]
    else:
        sd = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd["model"])
        osd = sd["optimizer"]
    set_optimizer_state_dict(model, optimizer, osd)
    return model, optimizer


SUFFIX = {"safetensors": ".safetensors", "pt": ".pt", "dcp": "-dcp"}


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "dcp"])
@pytest.mark.parametrize("kind", ["transformer", "dlrm"])
def test_export_loads_bitwise_into_a_fresh_model(pool_path, out_path, kind, fmt):
    train(pool_path, kind)
    before = pool_digest(pool_path)
    target = out_path + SUFFIX[fmt]
    result = pmsnap.export(pool_path, target, format=fmt if fmt == "dcp" else None)
    assert result["format"] == fmt and result["iteration"] == 4 and os.path.exists(target)
    assert not [n for n in os.listdir(pool_dir()) if ".partial-" in n and out_path in
                os.path.join(pool_dir(), n)]
    ref_model, ref_opt = restored(pool_path, kind)
    model, optimizer = load_into_fresh(kind, fmt, target)
    assert_same_training_state(ref_model, ref_opt, model, optimizer)
    assert pool_digest(pool_path) == before


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_model_only_export_is_a_plain_state_dict(pool_path, out_path, fmt):
    model, _, _ = train(pool_path, "transformer")
    target = out_path + SUFFIX[fmt]
    pmsnap.export(pool_path, target, model_only=True)
    tensors = (safetensors.torch.load_file(target) if fmt == "safetensors"
               else torch.load(target, weights_only=True))
    fresh_model, _ = fresh("transformer")
    fresh_model.load_state_dict(tensors)  # strict: exactly the model's keys
    for name, p in model.named_parameters():
        assert torch.equal(getattr_path(fresh_model, name), p), name


def getattr_path(module, name):
    return module.get_parameter(name)


def test_export_of_an_older_epoch_and_the_extra_state(pool_path, out_path):
    model, optimizer = make_transformer(seed=1)
    with pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model, every=1) as opt:
        for s in range(1, 4):
            transformer_step(model, opt, s)
            opt.extra_state = {"batch": s, "name": "run"}
            opt.flush()
    newest = pmsnap.load_state_dict(pool_path)["pmsnap"]["epoch"]
    result = pmsnap.export(pool_path, out_path + ".pt", epoch=newest - 1)
    obj = torch.load(out_path + ".pt", weights_only=True)
    assert result["iteration"] == 2 and obj["pmsnap"]["iteration"] == 2
    assert obj["extra"]["batch"] == 1 and "rng" in obj["extra"]  # step 2 stored step 1's dict
    meta = safetensors.safe_open(pmsnap.export(pool_path, out_path + ".safetensors")["path"],
                                 "pt").metadata()
    assert json.loads(meta["pmsnap.extra"]) == {"batch": 2, "name": "run"}
    assert meta["pmsnap.epoch"] == str(newest)


def test_export_takes_the_intact_epoch_when_the_newest_slot_is_damaged(pool_path, out_path):
    _, _, snapshots = train(pool_path, "transformer")
    newest = pmsnap.load_state_dict(pool_path, model_only=True)["pmsnap"]["epoch"]
    damage_tensor(pool_path, "head.weight", newest)
    result = pmsnap.export(pool_path, out_path + ".safetensors")
    assert result["epoch"] == newest - 1 and result["iteration"] == 3
    assert any("damaged" in w and f"epoch {newest}" in w for w in result["warnings"])
    tensors = safetensors.torch.load_file(out_path + ".safetensors")
    for name, value in snapshots[3].items():
        assert torch.equal(tensors[name], value), name
    # The command line says so too.
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["export", pool_path, "--to", out_path + "2.pt"], out, err) == 0
    assert f"newest epoch {newest} is damaged" in out.getvalue()
    # Asked for explicitly, the damaged epoch is an error naming pool and epoch.
    with pytest.raises(pmsnap.CorruptionError, match=f"epoch {newest}"):
        pmsnap.export(pool_path, out_path + "3.pt", epoch=newest)
    assert not os.path.exists(out_path + "3.pt")


def _ddp_rank(rank, world, init_file, pool, sharding, results):
    """One rank of a 2-rank DDP run checkpointing into `pool` ({rank})."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        ddp = DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        with pmsnap.CheckpointedOptimizer(optimizer, pool, model=model, every=1,
                                          sharding=sharding) as opt:
            for step in range(1, 4):
                g = torch.Generator().manual_seed(10 * step + rank)
                x = torch.randn(4, 6, generator=g)
                torch.nn.functional.mse_loss(ddp(x), x[:, :2]).backward()
                opt.step()
                opt.zero_grad()
        results[rank] = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharding", [None, "replicated"])
def test_a_multi_rank_pool_exports_as_one_consolidated_file(out_path, sharding):
    import tempfile
    import torch.multiprocessing as mp
    template = out_path + ".{rank}.pool"
    # Spawned, not forked: this process has run engines (worker threads) by now.
    with tempfile.TemporaryDirectory() as d, mp.Manager() as manager:
        shared = manager.dict()
        mp.start_processes(_ddp_rank,
                           args=(2, os.path.join(d, "init"), template, sharding, shared),
                           nprocs=2, join=True, start_method="spawn")
        results = [shared[r] for r in range(2)]
    result = pmsnap.export(template, out_path + ".safetensors", model_only=True)
    assert result["iteration"] == 3, result
    tensors = safetensors.torch.load_file(out_path + ".safetensors")
    assert sorted(tensors) == sorted(results[0])
    for name, value in results[0].items():
        assert torch.equal(tensors[name], value), name
        assert torch.equal(results[1][name], value), name  # DDP keeps the replicas equal
    sd = pmsnap.load_state_dict(template)
    assert sd["optimizer"]["param_groups"][0]["params"] == list(results[0])
    if sharding:  # each rank's pool holds only the parameters it owns: half the model
        units = [len(pmsnap.read_pool(template.replace("{rank}", str(r)))["units"])
                 for r in range(2)]
        assert sum(units) == len(results[0]) and min(units) > 0


# --- memory ----------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent("""
    import sys
    import pmsnap, safetensors, torch  # noqa: F401

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident set
    base = status("VmRSS:")
    if sys.argv[2] == "load":
        sd = pmsnap.load_state_dict(sys.argv[1])  # every tensor at once: the control
    else:
        pmsnap.export(sys.argv[1], sys.argv[2])
    print(status("VmHWM:") - base)
""")


def _big_pool(path, total_bytes, tensor_bytes=16 << 20):
    """A pool of `total_bytes` of float32 parameters (SGD: no state), one epoch."""
    numel = tensor_bytes // 4
    params = [torch.nn.Parameter(torch.full((numel,), float(i))) for i in
              range(total_bytes // tensor_bytes)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    with pmsnap.CheckpointedOptimizer(optimizer, path, workers=1) as opt:
        opt.step()  # no gradients: the parameters stay, the pool captures them
    del params, optimizer


def _peak_growth(pool, target):
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, pool, target],
                         capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="resident-set bounds hold for an uninstrumented process; ASan's "
                           "shadow memory and quarantine grow it (scripts/sanitize.sh asan)")
@pytest.mark.parametrize("fmt", ["safetensors", "pt", "dcp"])
def test_export_peak_memory_does_not_grow_with_the_model(pool_path, out_path, fmt):
    growth = {}
    for size in (256 << 20, 1 << 30):
        _big_pool(pool_path, size)
        target = out_path + SUFFIX[fmt] + (os.sep if fmt == "dcp" else "")
        growth[size] = _peak_growth(pool_path, target)
        written = (sum(os.path.getsize(os.path.join(target, n)) for n in os.listdir(target))
                   if fmt == "dcp" else os.path.getsize(target))
        assert written > size
        shutil.rmtree(target) if fmt == "dcp" else os.remove(target)
        if size == 256 << 20:
            # The control: the same measure sees a load of every tensor at once.
            loaded = _peak_growth(pool_path, "load")
            assert loaded > size * 0.9
        os.remove(pool_path)
    print(f"peak RSS growth of a {fmt} export: 256 MiB model {growth[256 << 20] >> 20} MiB, "
          f"1 GiB model {growth[1 << 30] >> 20} MiB; loading the 256 MiB one whole: "
          f"{loaded >> 20} MiB")
    # About one 16 MiB tensor (its read buffer) plus the writer's own, whatever the model.
    assert growth[1 << 30] < 96 << 20
    assert growth[1 << 30] - growth[256 << 20] < 32 << 20


# --- bad inputs ---------------------------------------------------------------------------------

def test_bad_inputs_give_clear_errors_and_leave_the_pool_untouched(pool_path, out_path):
    train(pool_path, "transformer")
    before = pool_digest(pool_path)
    with pytest.raises(pmsnap.InvalidArgumentError, match="unknown export format 'onnx'"):
        pmsnap.export(pool_path, out_path + ".bin", format="onnx")
    with pytest.raises(pmsnap.InvalidArgumentError, match="cannot tell the export format"):
        pmsnap.export(pool_path, out_path + ".bin")
    with pytest.raises(pmsnap.NotFoundError) as e:
        pmsnap.export(pool_path, out_path + ".pt", epoch=1)
    assert pool_path in str(e.value) and "epoch 1 is not retained" in str(e.value)
    assert "retained epochs: 4 (iteration 4), 3 (iteration 3)" in str(e.value)
    not_a_folder = out_path + ".file"
    open(not_a_folder, "w").close()
    with pytest.raises(pmsnap.FailedPreconditionError, match="cannot write there"):
        pmsnap.export(pool_path, os.path.join(not_a_folder, "out.pt"))
    with pytest.raises(pmsnap.NotFoundError, match="does not exist"):
        pmsnap.export(pool_path + ".missing", out_path + ".pt")
    foreign = out_path + ".pt"
    with open(foreign, "wb") as f:
        f.write(b"this is not a checkpoint" * 100)
    with pytest.raises(pmsnap.InvalidArgumentError, match="not a checkpoint pmsnap can import"):
        pmsnap.read_export(foreign)
    with pytest.raises(pmsnap.NotAPoolError):
        pmsnap.load_state_dict(foreign)
    assert pool_digest(pool_path) == before
    assert not [n for n in os.listdir(pool_dir()) if ".partial-" in n]


# --- the command line -------------------------------------------------------------------------

def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(args), out, err)
    return code, out.getvalue(), err.getvalue()


def test_cli_list_export_diff_and_prune(pool_path, out_path):
    model, _, snapshots = train(pool_path, "dlrm")
    code, out, _ = run_cli("list", pool_path)
    assert code == 0 and "2 retained checkpoint(s)" in out and "incrcp-2d" in out
    code, out, _ = run_cli("list", pool_path, "--json")
    rows = json.loads(out)["checkpoints"]
    assert [(r["epoch"], r["iteration"], r["latest"]) for r in rows] == [(4, 4, True),
                                                                         (3, 3, False)]
    assert all(r["policy"] == "incrcp-2d" and r["bytes"] > 0 for r in rows)

    code, out, err = run_cli("export", pool_path, "--to", out_path + ".pt", "--progress")
    assert code == 0 and "exported epoch 4 (iteration 4)" in out and "100%" in err
    assert torch.equal(torch.load(out_path + ".pt", weights_only=True)["model"]["fc2.bias"],
                       model.fc2.bias)

    code, out, _ = run_cli("diff", pool_path, "--epochs", "3", "4", "--json")
    rows = {r["tensor"]: r for r in json.loads(out)["tensors"]}
    delta = (snapshots[4]["fc1.weight"].double() - snapshots[3]["fc1.weight"].double())
    assert rows["fc1.weight"]["max_abs"] == pytest.approx(float(delta.abs().max()))
    assert rows["fc1.weight"]["l2"] == pytest.approx(float(delta.norm()))
    assert rows[TABLE]["max_abs"] > 0 and "optimizer/bag.weight/sum" in rows
    code, out, _ = run_cli("diff", pool_path, "--epochs", "3", "4")
    assert code == 0 and "max_abs" in out and "fc1.weight" in out

    code, out, _ = run_cli("prune", pool_path, "--keep", "2")
    assert code == 0 and "dropped none" in out
    code, out, _ = run_cli("prune", pool_path, "--keep", "1", "--json")
    assert json.loads(out) == {"pool": pool_path, "kept": [4], "dropped": [3], "warnings": []}
    code, out, _ = run_cli("list", pool_path, "--json")
    assert [r["epoch"] for r in json.loads(out)["checkpoints"]] == [4]
    with pytest.raises(pmsnap.NotFoundError, match="epoch 3 is not retained"):
        pmsnap.load_state_dict(pool_path, epoch=3)
    ref_model, ref_opt = restored(pool_path, "dlrm")  # the kept epoch still restores
    assert torch.equal(ref_model.fc2.bias, model.fc2.bias)


def test_cli_errors_name_the_pool_and_exit_non_zero(pool_path, out_path):
    train(pool_path, "transformer", steps=2)
    before = pool_digest(pool_path)
    code, out, err = run_cli("export", pool_path, "--to", out_path + ".pt", "--epoch", "9")
    assert code == 1 and pool_path in err and "epoch 9 is not retained" in err
    code, out, err = run_cli("export", pool_path, "--to", out_path + ".x", "--format", "onnx")
    assert code == 1 and pool_path in err and "unknown export format" in err
    code, out, err = run_cli("list", pool_path + ".missing", "--json")
    assert code == 1 and json.loads(out)["pool"] == pool_path + ".missing"
    code, _, err = run_cli("prune", pool_path, "--keep", "0")
    assert code == 1 and pool_path in err
    code, _, err = run_cli("diff", pool_path, "--epochs", "1")
    assert code == 2 and "usage" in err.lower() or "expected 2" in err
    assert pool_digest(pool_path) == before
    # python -m pmsnap reaches both the C++ commands and these.
    env = dict(os.environ)
    run = subprocess.run([sys.executable, "-m", "pmsnap", "list", pool_path], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "retained checkpoint" in run.stdout
    run = subprocess.run([sys.executable, "-m", "pmsnap", "info", pool_path], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0 and "format version" in run.stdout


# --- import: init_from ---------------------------------------------------------------------------

def assert_same_checkpoint(a, b):
    """Two load_state_dict results hold bitwise the same model and optimizer."""
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert tensor.dtype == b["model"][name].dtype and torch.equal(tensor, b["model"][name]), \
            name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for name, state in a["optimizer"]["state"].items():
        other = b["optimizer"]["state"][name]
        assert state.keys() == other.keys(), name
        for role, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[role]), f"{name} {role}"
            else:
                assert value == other[role], f"{name} {role}"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "dcp"])
@pytest.mark.parametrize("kind", ["transformer", "dlrm"])
def test_init_from_an_export_seeds_a_new_pool_bitwise(pool_path, out_path, kind, fmt):
    train(pool_path, kind)
    target = out_path + SUFFIX[fmt] + (os.sep if fmt == "dcp" else "")
    pmsnap.export(pool_path, target)
    make, step, kwargs = MODELS[kind]
    model, optimizer = make(seed=7)
    seeded = out_path + "-seeded.pool"
    opt = pmsnap.CheckpointedOptimizer(optimizer, seeded, model=model, init_from=target, **kwargs)
    assert opt.iteration == 4
    opt.close()
    # The new pool holds the imported checkpoint before any step.
    assert_same_checkpoint(pmsnap.load_state_dict(pool_path), pmsnap.load_state_dict(seeded))
    model, optimizer = restored(seeded, kind)
    with pmsnap.CheckpointedOptimizer(optimizer, seeded, model=model, start_iteration=4,
                                      **kwargs) as opt:
        step(model, opt, 5)
    # Training goes on as it would have from the original pool.
    ref_model, ref_opt = restored(pool_path, kind)
    with pmsnap.CheckpointedOptimizer(ref_opt, pool_path, model=ref_model, start_iteration=4,
                                      **kwargs) as ref:
        step(ref_model, ref, 5)
    assert_same_training_state(ref_model, ref_opt, model, optimizer)
    assert pmsnap.load_state_dict(seeded)["pmsnap"]["iteration"] == 5


def test_init_from_a_plain_model_state_dict(pool_path, out_path):
    source, _ = make_transformer(seed=3)
    torch.save(source.state_dict(), out_path + ".pt")
    model, optimizer = make_transformer(seed=4)
    with pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model,
                                      init_from=out_path + ".pt") as opt:
        for name, p in source.named_parameters():
            assert torch.equal(model.get_parameter(name), p), name
        assert not os.path.exists(pool_path)  # no optimizer state yet: the first step lays it out
        transformer_step(model, opt, 1)
    assert pmsnap.load_state_dict(pool_path)["pmsnap"]["iteration"] == 1


def test_init_from_refuses_foreign_files_and_used_pools_leaving_them_untouched(pool_path,
                                                                                out_path):
    foreign = out_path + ".pt"
    with open(foreign, "wb") as f:
        f.write(b"\x00not a checkpoint" * 64)
    model, optimizer = make_transformer(seed=4)
    with pytest.raises(pmsnap.InvalidArgumentError, match=f"{foreign} is not a checkpoint"):
        pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model, init_from=foreign)
    assert not os.path.exists(pool_path)
    other, _ = fresh("dlrm")
    torch.save(other.state_dict(), out_path + "-dlrm.pt")
    with pytest.raises(pmsnap.ModelMismatchError, match="no tensor for parameter"):
        pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model,
                                     init_from=out_path + "-dlrm.pt")
    train(pool_path, "transformer", steps=2)
    before = pool_digest(pool_path)
    pmsnap.export(pool_path, out_path + ".safetensors")
    model, optimizer = make_transformer(seed=4)
    with pytest.raises(pmsnap.FailedPreconditionError, match="already holds iteration 2"):
        pmsnap.CheckpointedOptimizer(optimizer, pool_path, model=model,
                                     init_from=out_path + ".safetensors")
    assert pool_digest(pool_path) == before


# --- DCP's own API on a pool: pmsnap.dcp.PoolWriter / PoolReader ------------------------------

def dcp_state(model, optimizer, step):
    return {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, optimizer),
            "step": step}


def test_dcp_save_and_load_through_a_pool(pool_path):
    model, optimizer = make_transformer(seed=1)
    for s in range(1, 3):
        transformer_step(model, optimizer, s)
    dcp.save(dcp_state(model, optimizer, 2), storage_writer=pmsnap.dcp.PoolWriter(pool_path))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    transformer_step(model, optimizer, 3)
    dcp.save(dcp_state(model, optimizer, 3), storage_writer=pmsnap.dcp.PoolWriter(pool_path))

    fresh_model, fresh_opt = make_transformer(seed=5)
    sd = dcp_state(fresh_model, fresh_opt, 0)
    dcp.load(sd, storage_reader=pmsnap.dcp.PoolReader(pool_path))
    fresh_model.load_state_dict(sd["model"])
    set_optimizer_state_dict(fresh_model, fresh_opt, sd["optimizer"])
    assert sd["step"] == 3
    assert_same_training_state(model, optimizer, fresh_model, fresh_opt)

    # The pool keeps the previous save too.
    older_model, older_opt = make_transformer(seed=6)
    sd = dcp_state(older_model, older_opt, 0)
    newest = pmsnap._pmsnap.CheckpointReader(pool_path)
    epoch = newest.epochs()[0]["epoch"]
    newest.close()
    dcp.load(sd, storage_reader=pmsnap.dcp.PoolReader(pool_path, epoch=epoch - 1))
    assert sd["step"] == 2
    for name, value in saved.items():
        assert torch.equal(sd["model"][name], value), name


def test_dcp_save_that_fails_midway_leaves_the_last_save_and_reads_check_checksums(pool_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    model, optimizer = make_transformer(seed=1)
    transformer_step(model, optimizer, 1)
    dcp.save(dcp_state(model, optimizer, 1), storage_writer=pmsnap.dcp.PoolWriter(pool_path))
    before = pool_digest(pool_path)
    committed = {k: v.clone() for k, v in model.state_dict().items()}

    class FailingPlanner(DefaultSavePlanner):
        calls = 0

        def resolve_data(self, write_item):
            FailingPlanner.calls += 1
            if FailingPlanner.calls == 5:
                raise RuntimeError("simulated failure in the middle of a save")
            return super().resolve_data(write_item)

    transformer_step(model, optimizer, 2)
    from torch.distributed.checkpoint.api import CheckpointException
    with pytest.raises(CheckpointException) as failed:
        dcp.save(dcp_state(model, optimizer, 2), storage_writer=pmsnap.dcp.PoolWriter(pool_path),
                 planner=FailingPlanner())
    assert "simulated failure" in repr(failed.value.failures)
    fresh_model, fresh_opt = make_transformer(seed=5)
    sd = dcp_state(fresh_model, fresh_opt, 0)
    dcp.load(sd, storage_reader=pmsnap.dcp.PoolReader(pool_path))
    assert sd["step"] == 1
    for name, value in committed.items():
        assert torch.equal(sd["model"][name], value), name
    assert pmsnap.has_checkpoint(pool_path) and pool_digest(pool_path) != before  # slot written

    damage_tensor(pool_path, "model.head.weight", 1, role="value")
    with pytest.raises(CheckpointException) as failed:
        dcp.load(dcp_state(*make_transformer(seed=5), 0),
                 storage_reader=pmsnap.dcp.PoolReader(pool_path))
    (error,) = [f[0] if isinstance(f, tuple) else f for f in failed.value.failures.values()]
    assert isinstance(error, pmsnap.CorruptionError), repr(error)
    assert pool_path in str(error) and "epoch 1" in str(error) and "model.head.weight" in str(error)


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    import pmsnap

    pool, kill_at = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters())

    class KillingPlanner(DefaultSavePlanner):
        resolved = 0

        def resolve_data(self, item):
            KillingPlanner.resolved += 1
            if KillingPlanner.resolved == kill_at:  # inside the second save's writes
                os.kill(os.getpid(), signal.SIGKILL)
            return super().resolve_data(item)

    planner = KillingPlanner()
    for step in (1, 2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sd = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.save(sd, storage_writer=pmsnap.dcp.PoolWriter(pool), planner=planner)
        if step == 1:
            torch.save(model.state_dict(), pool + ".first.pt")
            print(KillingPlanner.resolved, flush=True)
""")


def test_dcp_save_killed_midway_leaves_the_previous_save_bitwise(pool_path):
    items = subprocess.run([sys.executable, "-c", _KILLED_SAVE, pool_path, "0"],
                           capture_output=True, text=True, check=True)
    per_save = int(items.stdout.split()[0])  # resolve_data calls of one save
    os.remove(pool_path)
    for kill_at in (per_save + 1, per_save + per_save // 2, 2 * per_save):
        run = subprocess.run([sys.executable, "-c", _KILLED_SAVE, pool_path, str(kill_at)],
                             capture_output=True, text=True)
        assert run.returncode == -9, run.stderr  # SIGKILL
        first = torch.load(pool_path + ".first.pt", weights_only=True)
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2))
        sd = {"model": model.state_dict()}
        dcp.load(sd, storage_reader=pmsnap.dcp.PoolReader(pool_path))
        for name, value in first.items():
            assert torch.equal(sd["model"][name], value), (kill_at, name)
        os.remove(pool_path)
        os.remove(pool_path + ".first.pt")
