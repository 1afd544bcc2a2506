#!/usr/bin/env bash
# The thread-safety lane: builds pmsnap's libraries with clang's
# -Wthread-safety analysis as errors, so that every member declared
# PMSNAP_GUARDED_BY(mutex) is read and written with that mutex held and every
# PMSNAP_REQUIRES / PMSNAP_EXCLUDES contract is kept
# (common/include/pmsnap/common/thread_annotations.h).
#
#   scripts/thread_safety.sh
#
# First it checks the lane itself: tests/thread_safety/unguarded_access.cc
# breaks each rule once and must be rejected with the analysis' messages.
# Then it builds the libraries (and the libtorch hooks where torch is found
# on CMAKE_PREFIX_PATH) in their own build directory.
#
# Environment: PMSNAP_THREAD_SAFETY_BUILD_DIR (default build-thread-safety),
# CMAKE_PREFIX_PATH (libtorch's CMake files, as scripts/pmsnap.sh passes
# them). Exit status: 0 clean, 1 a violation (or a lane that would not catch
# one), 77 when clang++ is not installed (CTest reports a skip).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${PMSNAP_THREAD_SAFETY_BUILD_DIR:-$root/build-thread-safety}"

if ! command -v clang++ >/dev/null; then
  echo "thread_safety.sh: SKIP: clang++ is not installed (scripts/pmsnap.sh installs clang)" >&2
  exit 77
fi

probe_log="$(mktemp)"
trap 'rm -f "$probe_log"' EXIT
if clang++ -std=c++20 -fsyntax-only -Wthread-safety -Werror=thread-safety \
  -I"$root/common/include" "$root/tests/thread_safety/unguarded_access.cc" 2>"$probe_log"; then
  echo "thread_safety.sh: tests/thread_safety/unguarded_access.cc compiled: the analysis is not" \
    "checking the annotations, so this lane would pass unguarded accesses" >&2
  exit 1
fi
for expected in "requires holding mutex 'mutex_' exclusively" \
  "calling function 'AddLocked' requires holding mutex" \
  "cannot call function 'Add' while mutex 'mutex_' is held"; do
  if ! grep -q "$expected" "$probe_log"; then
    echo "thread_safety.sh: the probe was rejected, but not with \"$expected\":" >&2
    cat "$probe_log" >&2
    exit 1
  fi
done
echo "thread_safety.sh: the probe's 3 violations are caught"

cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DPMSNAP_THREAD_SAFETY=ON -DPMSNAP_WITH_CUDA=OFF -DPMSNAP_BUILD_TESTS=OFF \
  -DPMSNAP_BUILD_BENCH=OFF -DPMSNAP_BUILD_PYTHON=OFF >/dev/null
targets=(pmsnap_layout pmsnap_runtime pmsnap_conflict pmsnap_diff pmsnap_quant pmsnap_frontend
  pmsnap_cli)
if grep -q '^PMSNAP_WITH_TORCH:BOOL=ON' "$build_dir/CMakeCache.txt"; then targets+=(pmsnap_torch); fi
# -k 0: every violation in one run, not only the first file's.
cmake --build "$build_dir" --target "${targets[@]}" -j "$(nproc)" -- -k 0
echo "thread_safety.sh: ${targets[*]} build clean under -Wthread-safety"
