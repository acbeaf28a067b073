#!/usr/bin/env bash
# Alternated A/B of several builds on a quiet host (the GPU machine's CPUs), each tree once
# per round in the order given. By default: the two-rank point-to-point ping-pong at
# 8 B-4 KiB and the 8-byte all_reduce, broadcast and reduce (the executor's latency
# entries). With AB_SWEEPS set (lines of `linkwise bench` arguments, e.g.
# "all_reduce -N 4 -b 1M -e 16M -f 4 -n 100 -w 10"), those sweeps instead, a line per size
# with the out-of-place and in-place µs.
#   bash bench/ab_host.sh OUTDIR ROUNDS TREE...
# Each TREE is a directory holding a copy of a tree (`git archive <commit> | tar -x -C DIR`;
# `.` is this one); each is built here (CPU part, bench/host_build.sh). Compare the rounds'
# medians, not single lines.
set -uo pipefail
out=$1; rounds=$2; shift 2
mkdir -p "$out"
log="$out/ab_host.txt"
. bench/host_build.sh
for tree in "$@"; do
  name=$(basename "$(cd "$tree" && pwd)")
  (cd "$tree" && out="$out/build-$name" && mkdir -p "$out" && host_build) || exit 1
done
lw() { PYTHONPATH=$src timeout 240 python3 -m linkwise.cli bench "$@" --no-progress < /dev/null 2>&1 | grep -v "^#"; }
for r in $(seq "$rounds"); do
  for tree in "$@"; do
    src="$(cd "$tree" && pwd)/src"
    name=$(basename "$(cd "$tree" && pwd)")
    if [ -n "${AB_SWEEPS:-}" ]; then
      while read -r args; do
        [ -z "$args" ] && continue
        # shellcheck disable=SC2086
        lw $args | awk -v r="$r" -v t="$name" -v a="${args%% *}" '{print "round", r, t, a, $1, $6, $10}' | tee -a "$log"
      done <<< "$AB_SWEEPS"
      continue
    fi
    lw p2p -N 2 -b 8 -e 4096 -f 8 -n 30000 -w 3000 --tests latency |
      awk -v r="$r" -v t="$name" '{print "round", r, t, "p2p", $1, $2}' | tee -a "$log"
    for c in all_reduce broadcast reduce; do
      echo "round $r $name $c 8 $(lw "$c" -N 2 -b 8 -e 8 -n 20000 -w 2000 | head -1 | awk '{print $6, $10}')" | tee -a "$log"
    done
  done
done
