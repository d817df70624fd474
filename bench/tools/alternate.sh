#!/usr/bin/env bash
# Criterion medians of saved bench binaries, run alternately, one spec per process.
# On a shared machine the same binary's median moves by tens of percent between sittings, so
# builds are compared within the same sittings, never across them.
#
#   bench/tools/alternate.sh ROUNDS FILTER BINARY...
#   bench/tools/alternate.sh 10 "70b full" /tmp/bench-before /tmp/bench-after
#
# A bench binary: `cargo bench -p headroom --bench estimate --no-run` prints its path.
# Prints, per binary, its medians in ms, sorted.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: $0 ROUNDS FILTER BINARY..." >&2
  exit 2
fi
rounds=$1
filter=$2
shift 2
for _ in $(seq "$rounds"); do
  for binary in "$@"; do
    median=$("$binary" --bench --warm-up-time 0.5 --measurement-time 2 "$filter" 2>&1 |
      sed -nE 's/.*time: +\[[0-9.]+ [mµ]s ([0-9.]+) ms.*/\1/p')
    echo "$binary $median"
  done
done | sort -k1,1 -k2,2n | awk '{ m[$1] = m[$1] " " $2 } END { for (b in m) print b ":" m[b] }'
