"""The extension owns its C++ runtime ([gpu2] item 5).

On the first GPU machine (Ubuntu 24.04, gcc 13), `python -m pmsnap verify`
aborted with `free(): invalid pointer` once torch was imported: libtorch.so
exports its own copies of libstdc++ symbols, `import torch` makes them
global, and the extension's std:: references bound to them. The same
happens to any symbol the extension leaves for the dynamic linker to find,
so the extension must leave none of its runtime's: libstdc++ (and the CUDA
runtime) are linked in statically with every archive symbol local, and
references bind inside it (python/CMakeLists.txt).

Checked here, on any machine: the extension exports nothing but its module
init; it has no undefined std:: symbol; with torch imported first, the
dynamic linker binds no symbol of it to libtorch (LD_DEBUG=bindings); and
the pool commands run after `import torch`, in the process that imported it.
"""

import os
import subprocess
import sys

import pytest
import torch

import pmsnap
from pmsnap import _pmsnap

# Itanium-mangled names in namespace std (functions, objects, typeinfo,
# vtables of std:: types) and CUDA runtime entry points.
STD_PREFIXES = ("_ZNSt", "_ZNKSt", "_ZSt", "_ZTISt", "_ZTSSt", "_ZTVSt", "_ZThn")
CUDA_PREFIXES = ("cuda", "__cuda")


def _dynamic_symbols(which):
    out = subprocess.run(["nm", "-D", which, _pmsnap.__file__], check=True,
                         capture_output=True, text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def test_the_extension_exports_only_its_module_init():
    exported = [s for s in _dynamic_symbols("--defined-only") if not s.startswith("_init")
                and s not in ("_fini", "_edata", "_end", "__bss_start")]
    assert exported == ["PyInit__pmsnap"], exported[:20]


def test_the_extension_leaves_no_std_or_cuda_symbol_to_other_libraries():
    undefined = _dynamic_symbols("--undefined-only")
    assert any(s.startswith("pmemobj_") for s in undefined), undefined[:20]  # the parse works
    std = [s for s in undefined if s.startswith(STD_PREFIXES)]
    cuda = [s for s in undefined if s.startswith(CUDA_PREFIXES)]
    assert not std, f"{_pmsnap.__file__} needs std:: symbols from elsewhere: {std[:10]}"
    assert not cuda, f"{_pmsnap.__file__} needs CUDA runtime symbols from elsewhere: {cuda[:10]}"


def test_with_torch_imported_first_no_symbol_of_the_extension_binds_to_libtorch(pool_path):
    _make_pool(pool_path)
    # The commands that aborted on the GPU machine, in a process that
    # imported torch first; LD_DEBUG lists every symbol binding.
    code = ("import torch, pmsnap\n"
            "from pmsnap import _pmsnap\n"
            f"assert _pmsnap.run_cli(['verify', {pool_path!r}])[0] == 0\n"
            f"assert _pmsnap.run_cli(['info', {pool_path!r}])[0] == 0\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, LD_DEBUG="bindings"))
    assert result.returncode == 0, result.stderr[-3000:]
    bindings = [line for line in result.stderr.splitlines() if "binding file" in line]
    assert any("_pmsnap" in line for line in bindings), "LD_DEBUG printed no binding of _pmsnap"
    to_torch = [line for line in bindings
                if "_pmsnap" in line.split(" to ")[0] and
                any(lib in line.split(" to ")[-1] for lib in ("libtorch", "libc10", "libcudart"))]
    assert not to_torch, "\n".join(to_torch[:10])


@pytest.mark.parametrize("command", ["verify", "info", "list", "export"])
def test_pool_commands_run_after_import_torch(command, pool_path, tmp_path):
    _make_pool(pool_path)
    args = [command, pool_path]
    if command == "export":
        args += ["--to", str(tmp_path / "model.safetensors")]
    code = ("import sys, runpy, torch\n"
            f"sys.argv = ['pmsnap'] + {args!r}\n"
            "runpy.run_module('pmsnap', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, (result.returncode, result.stdout[-2000:],
                                    result.stderr[-3000:])


def _make_pool(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with pmsnap.CheckpointedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1), path,
                                      model=model, every=1) as opt:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
