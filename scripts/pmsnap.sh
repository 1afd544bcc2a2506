#!/usr/bin/env bash
# One entry point for a fresh machine: installs the Debian packages pmsnap
# needs (only those missing) and the pinned Python environment with torch 2.x
# (scripts/requirements.txt; created once per machine, reused by every clone),
# configures and builds, then runs the demo or the whole test suite.
#
#   scripts/pmsnap.sh demo    build and run the main demo
#   scripts/pmsnap.sh test    build and run every test (what CI runs)
#   scripts/pmsnap.sh build   build only
#
#   scripts/pmsnap.sh env     install and print the environment's python path
#   scripts/pmsnap.sh wheel [DIR]  a wheel carrying its native libraries, into DIR
#                             (default dist/; scripts/build_wheel.sh)
#
# Environment: PMSNAP_BUILD_DIR (default build), PMSNAP_VENV (the Python
# environment; default ~/.cache/pmsnap/venv-torch-<version>), PMSNAP_POOL_DIR
# (default /dev/shm), PMSNAP_CRASH_TRIALS (crash-test trials, default 200).
set -euo pipefail

mode="${1:-demo}"
shift || true
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_BUILD_DIR:-$root/build}"

packages=(
  cmake ninja-build g++ pkg-config ccache
  clang libclang-rt-dev
  libpmem-dev libpmemobj-dev pmdk-tools libxxhash-dev libtbb-dev
  libgtest-dev libgmock-dev libbenchmark-dev libgloo-dev
  python3 python3-dev python3-venv pybind11-dev
)
requirements="$root/scripts/requirements.txt"
requirements_nodeps="$root/scripts/requirements-nodeps.txt"
torch_version="$(sed -n 's/^torch==//p' "$requirements")"
venv="${PMSNAP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/pmsnap/venv-torch-$torch_version}"

install_missing() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    return
  fi
  echo "pmsnap: installing ${missing[*]}"
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
}

# The venv is keyed by the requirements file's hash: a fresh clone on a machine
# that has it reuses it as it is; an edited requirements file installs only
# what changed. Debian's python3 (not a pyenv or conda one on PATH) so that
# the interpreter is the one python3-dev's headers belong to.
install_python_env() {
  local stamp="$venv/.pmsnap-requirements.sha256"
  local want
  want="$(cat "$requirements" "$requirements_nodeps" | sha256sum | cut -d' ' -f1)"
  if [[ ! -x "$venv/bin/python" || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "pmsnap: preparing $venv (torch $torch_version from PyPI; the first install downloads ~3 GB)"
    if [[ ! -x "$venv/bin/python" ]]; then
      mkdir -p "$(dirname "$venv")"
      /usr/bin/python3 -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install -q --no-input -r "$requirements" </dev/null
    "$venv/bin/python" -m pip install -q --no-input --no-deps -r "$requirements_nodeps" </dev/null
    echo "$want" >"$stamp"
  fi
  ln -sfn "$venv" "$root/.venv"
}

build() {
  local werror=OFF
  if [[ -n "${CI:-}" ]]; then werror=ON; fi
  local torch_cmake
  torch_cmake="$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S "$root" -B "$build_dir" -G Ninja -DPMSNAP_WERROR="$werror" \
    -DCMAKE_PREFIX_PATH="$torch_cmake" -DPython_EXECUTABLE="$venv/bin/python" >/dev/null
  cmake --build "$build_dir" -j "$(nproc)"
}

install_missing
install_python_env
if [[ "$mode" == env ]]; then
  echo "$venv/bin/python"
  exit 0
fi
if [[ "$mode" == wheel ]]; then
  # A wheel that carries its native libraries, into dist/ (or $1).
  exec "$root/scripts/build_wheel.sh" "$venv/bin/python" "${1:-$root/dist}"
fi
build

case "$mode" in
  build) ;;
  demo)
    # The training demo needs libtorch; without it, the pool round trip.
    if [[ -x "$build_dir/tools/demo/pmsnap-demo" ]]; then
      exec "$build_dir/tools/demo/pmsnap-demo" "$@"
    fi
    exec "$build_dir/tools/pmsnap-pool-demo" "$@"
    ;;
  test)
    cd "$build_dir"
    ctest --output-on-failure -j "$(nproc)" --timeout 900 "$@"
    ;;
  *)
    echo "usage: scripts/pmsnap.sh demo|test|build|env|wheel" >&2
    exit 2
    ;;
esac
