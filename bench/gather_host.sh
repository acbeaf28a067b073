#!/usr/bin/env bash
# gather / scatter on the GPU machine's host CPUs, 4 and 16 ranks: the executor against the
# point-to-point path (alternated in one process, bench/gather_scatter_vs_mpi.py ab) and Open
# MPI (mpi4py), in one run.
#   bash bench/gather_host.sh OUTDIR [SIZES...]   (from the repository root; builds the CPU part)
set -uo pipefail
out=${1:-/tmp/lw-gs}
mkdir -p "$out"
log="$out/gather_host.txt"
sizes=("${@:2}")
[ ${#sizes[@]} -gt 0 ] || sizes=(32768 262144 1048576 4194304 16777216)
. bench/host_build.sh
host_build || exit 1
for n in 4 16; do
  echo "## -N $n executor vs point-to-point" | tee -a "$log"
  timeout 240 python3 -m linkwise.cli launch -n "$n" bench/gather_scatter_vs_mpi.py ab "${sizes[@]}" \
      < /dev/null 2>&1 | tee -a "$log"
  echo "## -N $n Open MPI" | tee -a "$log"
  timeout 120 mpirun -n "$n" --allow-run-as-root python3 bench/gather_scatter_vs_mpi.py mpi \
      "${sizes[@]}" < /dev/null 2>&1 | tee -a "$log"
done
