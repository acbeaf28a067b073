#!/usr/bin/env bash
# Point-to-point on the GPU machine's host CPUs: sendrecv rings of 2, 4 and 16 ranks and the
# two-rank p2p sweep (latency, bandwidth) against Open MPI (mpi4py), and, given OLD (a copy of
# an earlier tree), the exchange loop of bench/p2p_exchange.py alternated between both builds.
#   bash bench/p2p_host.sh OUTDIR [OLD]   (from the repository root; builds the CPU part)
set -uo pipefail
out=${1:-/tmp/lw-p2p}
old=${2:-}
mkdir -p "$out"
log="$out/p2p_host.txt"
. bench/host_build.sh
if [ -n "$old" ]; then
  (cd "$old" && out="$out/old" && mkdir -p "$out" && log="$log" && host_build) || exit 1
fi
host_build || exit 1
lw() { timeout "$1" python3 -m linkwise.cli "${@:2}" < /dev/null 2>&1 | tee -a "$log"; }
for n in 2 4 16; do
  echo "## sendrecv -N $n" | tee -a "$log"
  lw 240 bench sendrecv -N "$n" -b 8 -e 16M -f 4 -n 100 -w 10 --compare mpi --reps 3 --no-progress
done
echo "## p2p" | tee -a "$log"
lw 240 bench p2p -b 8K -e 64M -f 4 --tests latency,bw --compare mpi --reps 3 --no-progress
if [ -n "$old" ]; then
  for round in 1 2 3; do
    for tree in "$old" .; do
      echo "## exchange loop, round $round, tree $tree" | tee -a "$log"
      PYTHONPATH="$(cd "$tree" && pwd)/src" timeout 120 python3 -m linkwise.cli launch -n 2 \
          bench/p2p_exchange.py 65536 262144 524288 1048576 4194304 < /dev/null 2>&1 | tee -a "$log"
    done
  done
fi
