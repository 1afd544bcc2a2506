#!/usr/bin/env bash
# The training demo end to end: exit status 0 (the recovered run is
# bit-exact) and, unless --rounds=0 is among the flags, the overhead table of
# its interleaved rounds with a median and a spread for every line.
#   usage: demo_smoke.sh PMSNAP_DEMO [demo flags...]
set -uo pipefail
demo=$1
shift
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$demo" "$@" > "$out" 2>&1
rc=$?
cat "$out"
if [[ $rc -ne 0 ]]; then
  echo "demo_smoke: pmsnap-demo exited $rc" >&2
  exit 1
fi
grep -q '^bit-exact: YES' "$out" || { echo "demo_smoke: no 'bit-exact: YES' line" >&2; exit 1; }
grep -Eq "^  pmsnap's memory +pool [0-9.]+ [MG]B mapped \([0-9.]+ [MG]B resident" "$out" ||
  { echo "demo_smoke: no line with pmsnap's memory" >&2; exit 1; }
for flag in "$@"; do
  [[ $flag == --rounds=0 ]] && exit 0
done
number='[-+]?[0-9]+\.[0-9]+'
for line in 'iteration time, plain optimizer' 'iteration time, checkpoint [a-z. ]+' \
            'overhead \(checkpointed / plain - 1\)' 'blocked in hooks per iteration' \
            'peak resident set, plain optimizer' 'peak resident set, checkpointed'; do
  grep -Eq "^  $line +$number  \[$number \.\. $number\] (ms|%|MB)\$" "$out" ||
    { echo "demo_smoke: no '$line' line with a median and a spread" >&2; exit 1; }
done
grep -Eq '^overhead \(median of [0-9]+ interleaved rounds' "$out" ||
  { echo "demo_smoke: no overhead table" >&2; exit 1; }
