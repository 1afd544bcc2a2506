"""The installable package: an extension free of libtorch, and
`python -m pmsnap` behaving as the C++ `pmsnap` command line."""

import json
import os
import subprocess
import sys

import pytest
import torch

import pmsnap
from pmsnap import _pmsnap


def _needed_libraries(path):
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                         text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines()
            if "(NEEDED)" in line]


def test_extension_links_no_libtorch():
    """One wheel serves every torch 2.x only if the extension never links libtorch."""
    needed = _needed_libraries(_pmsnap.__file__)
    assert any(n.startswith("libpmemobj") for n in needed), needed  # the parse works
    torch_libs = [n for n in needed if n.startswith(("libtorch", "libc10", "libshm"))]
    assert not torch_libs, f"{_pmsnap.__file__} links {torch_libs}"


def _make_pool(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with pmsnap.CheckpointedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), path,
                                      model=model, every=1) as opt:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()


def _python_m(*args):
    return subprocess.run([sys.executable, "-m", "pmsnap", *args], capture_output=True, text=True)


def _cli(*args):
    cli = os.environ.get("PMSNAP_CLI")
    if not cli:
        pytest.skip("PMSNAP_CLI (the C++ pmsnap executable) not given")
    return subprocess.run([cli, *args], capture_output=True, text=True)


@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["verify"],
                                     ["verify", "--json"]])
def test_python_m_pmsnap_prints_what_the_cli_prints(command, pool_path):
    _make_pool(pool_path)
    py, cpp = _python_m(*command, pool_path), _cli(*command, pool_path)
    assert (py.returncode, py.stdout, py.stderr) == (cpp.returncode, cpp.stdout, cpp.stderr)
    assert py.returncode == 0
    if "--json" in command:
        report = json.loads(py.stdout)
        assert report["path"] == pool_path
        if command[0] == "verify":
            assert report["consistent"] is True


def test_python_m_pmsnap_names_a_missing_pool_and_rejects_bad_usage(tmp_path):
    missing = str(tmp_path / "nothing.pool")
    result = _python_m("info", missing)
    assert result.returncode == 1
    assert missing in result.stderr
    assert _python_m("frobnicate", missing).returncode == 2
    assert "usage" in _python_m().stderr
