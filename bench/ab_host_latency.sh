#!/usr/bin/env bash
# Alternated latency A/B of several builds on a quiet host (the GPU machine's CPUs): the
# two-rank point-to-point ping-pong at 8 B-4 KiB and the 8-byte all_reduce, broadcast and
# reduce (the executor's latency entries), each tree once per round in the order given.
#   bash bench/ab_host_latency.sh OUTDIR ROUNDS TREE...
# Each TREE is a directory holding a copy of a tree (`git archive <commit> | tar -x -C DIR`;
# `.` is this one); each is built here (CPU part, bench/host_build.sh). Compare the rounds'
# medians, not single lines.
set -uo pipefail
out=$1; rounds=$2; shift 2
mkdir -p "$out"
log="$out/ab_host_latency.txt"
. bench/host_build.sh
here=$PWD
for tree in "$@"; do
  name=$(basename "$(cd "$tree" && pwd)")
  (cd "$tree" && out="$out/build-$name" && mkdir -p "$out" && host_build) || exit 1
done
for r in $(seq "$rounds"); do
  for tree in "$@"; do
    src="$(cd "$tree" && pwd)/src"
    name=$(basename "$(cd "$tree" && pwd)")
    PYTHONPATH=$src timeout 120 python3 -m linkwise.cli bench p2p -N 2 -b 8 -e 4096 -f 8 -n 30000 -w 3000 \
        --tests latency --no-progress < /dev/null 2>&1 | grep -v "^#" |
      awk -v r="$r" -v t="$name" '{print "round", r, t, "p2p", $1, $2}' | tee -a "$log"
    for c in all_reduce broadcast reduce; do
      line=$(PYTHONPATH=$src timeout 120 python3 -m linkwise.cli bench "$c" -N 2 -b 8 -e 8 -n 20000 -w 2000 \
             --no-progress < /dev/null 2>&1 | grep -v "^#" | head -1)
      echo "round $r $name $c 8 $(echo "$line" | awk '{print $6, $10}')" | tee -a "$log"
    done
  done
done
cd "$here"
