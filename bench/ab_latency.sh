#!/usr/bin/env bash
# Alternated A/B of two builds' small-message collective latency (the latency entries):
#   bash bench/ab_latency.sh OLD_SRC NEW_SRC [ROUNDS] [NRANKS] [BYTES]
# OLD_SRC / NEW_SRC: each a directory holding a built linkwise package (src/ of a tree whose
# _native*.so was copied in). Every round runs each collective once per tree, old first, as
# `linkwise bench <coll> -N NRANKS -b BYTES -e BYTES -n 20000 -w 2000`; a line per run gives
# the out-of-place and in-place µs a call. Compare the rounds' medians, not single lines.
set -u
old=$1; new=$2; rounds=${3:-3}; n=${4:-2}; bytes=${5:-8}
for r in $(seq "$rounds"); do
  for tree in old new; do
    src=$old; [ "$tree" = new ] && src=$new
    for c in all_reduce broadcast reduce all_gather reduce_scatter; do
      line=$(OPENBLAS_NUM_THREADS=1 PYTHONPATH=$src timeout 120 python3 -m linkwise.cli bench "$c" -N "$n" \
             -b "$bytes" -e "$bytes" -n 20000 -w 2000 --no-progress 2>&1 | grep -v "^#" | head -1)
      echo "round $r $tree $c $(echo "$line" | awk '{print $6, $10}')"
    done
  done
done
