#!/usr/bin/env bash
# reduce_scatter / all_gather on the GPU machine's host CPUs, 4 and 16 ranks: the executor's
# rounds in its two-shot areas (default) against the message ring (LINKWISE_ALGO=ring, the
# path before the seventeenth session), Open MPI (mpi4py) and Gloo, in one run.
#   bash bench/rs_host.sh OUTDIR [COLLECTIVE...]   (default reduce_scatter; from the
#   repository root; builds the CPU part)
set -uo pipefail
out=${1:-/tmp/lw-rs}
mkdir -p "$out"
log="$out/rs_host.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
. bench/host_build.sh
host_build || exit 1
colls=("${@:2}")
[ ${#colls[@]} -gt 0 ] || colls=(reduce_scatter)
for coll in "${colls[@]}"; do
for n in 4 16; do
  echo "## $coll -N $n executor, --compare mpi,gloo" | tee -a "$log"
  timeout 200 python3 -m linkwise.cli bench "$coll" -N "$n" -b 64K -e 16M -f 4 -n 20 -w 5 \
      --compare mpi,gloo --no-progress < /dev/null 2>&1 | tee -a "$log"
  echo "## $coll -N $n LINKWISE_ALGO=ring" | tee -a "$log"
  LINKWISE_ALGO=ring timeout 100 python3 -m linkwise.cli bench "$coll" -N "$n" -b 64K -e 16M -f 4 \
      -n 20 -w 5 --no-progress < /dev/null 2>&1 | grep -v "^#" | tee -a "$log"
done
done
