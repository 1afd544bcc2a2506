#!/usr/bin/env bash
# One entry point for a fresh machine: installs the Debian packages pmsnap
# needs (only those missing), configures and builds, then runs the demo or the
# whole test suite.
#
#   scripts/pmsnap.sh demo    build and run the main demo
#   scripts/pmsnap.sh test    build and run every test (what CI runs)
#   scripts/pmsnap.sh build   build only
#
# Environment: PMSNAP_BUILD_DIR (default build), PMSNAP_POOL_DIR (default
# /dev/shm), PMSNAP_CRASH_TRIALS (crash-test trials, default 200).
set -euo pipefail

mode="${1:-demo}"
shift || true
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_BUILD_DIR:-$root/build}"

packages=(
  cmake ninja-build g++ pkg-config ccache
  libpmem-dev libpmemobj-dev pmdk-tools libxxhash-dev libtbb-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libtorch-dev python3-torch pybind11-dev libopenblas0-pthread python3-pytest python3-matplotlib python3-dev
)

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

build() {
  local werror=OFF
  if [[ -n "${CI:-}" ]]; then werror=ON; fi
  cmake -S "$root" -B "$build_dir" -G Ninja -DPMSNAP_WERROR="$werror" >/dev/null
  cmake --build "$build_dir" -j "$(nproc)"
}

install_missing
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
    echo "usage: scripts/pmsnap.sh demo|test|build" >&2
    exit 2
    ;;
esac
