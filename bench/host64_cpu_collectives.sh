#!/usr/bin/env bash
# CPU collectives on the GPU machine's 64-core host, side by side with Open MPI (mpi4py) and
# Gloo (torch.distributed), 4 and 16 ranks. Run from the repository root on that machine:
#   bash bench/host64_cpu_collectives.sh OUTDIR
# (no registry there: builds the CPU part with the image's cmake/ninja/nanobind).
# Everything goes to OUTDIR/host64.txt (the device tool returns at most 8 files), plus the
# JSON of each comparison sweep (8 B to 16 MiB, every power of 2). First the host's
# memory-copy floor (bench/copy_floor.py: 16 and 64 processes copying 16 MiB each at once);
# after the sweeps (the defaults), variant rows: lanes off (LINKWISE_COLL_LANE_MIN=1G: one
# thread per rank in the copy-through-shared-memory paths), 16 helper threads at 4 ranks,
# lanes instead of the single-copy path (LINKWISE_COLL_CMA_MIN / _BCAST_MIN=1G), half the
# helper threads at 16 ranks, and one-shot up to 32 KiB at 16 ranks (before the ninth session).
set -uo pipefail
out=${1:-/tmp/lw-host64}
mkdir -p "$out"
log="$out/host64.txt"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
t0=$(date +%s)
stamp() { echo "# [$(( $(date +%s) - t0 )) s] $*" | tee -a "$log"; }
stamp build
cmake -S . -B build/host64 -G Ninja -DLINKWISE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" > "$out/build.log" 2>&1 &&
  cmake --build build/host64 >> "$out/build.log" 2>&1 || { tail -30 "$out/build.log" >> "$log"; exit 1; }
cp build/host64/_native*.so src/linkwise/
export PYTHONPATH=$PWD/src
{ python3 -c "import os; print(len(os.sched_getaffinity(0)), 'CPUs')"; python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])"; } 2>&1 | tee -a "$log"
# Which path the executor takes here (CMA permitted? threads per rank?)
for n in 4 16; do
  python3 - "$n" <<'PY' 2>&1 | tee -a "$log"
import sys; sys.path.insert(0, "tests")
import numpy as np
from multirank import run_ranks
from linkwise.collectives import _cma_settings
def body(comm):
    x = np.ones(1 << 21, np.float32); comm.all_reduce(x)
    x = np.ones(1 << 19, np.float32); comm.all_reduce(x); comm.broadcast(x)
    return bool(comm._shm.cma), comm._shm.cma_calls, comm._shm.lane_calls, _cma_settings(comm._cpus_per_rank, comm.size)[6], comm._shm.one_shot_max, float(x[0])
print(f"{sys.argv[1]} ranks: (cma, cma_calls after 8 MiB + 2 MiB all_reduce, lane_calls after 2 MiB all_reduce + bcast, threads, one-shot max, x[0]) =", run_ranks(int(sys.argv[1]), body)[0])
PY
done
stamp "copy floor"
timeout 30 python3 bench/copy_floor.py -p 16 64 -s 16M -k 20 2>&1 | tee -a "$log"
for n in 4 16; do
  for coll in all_reduce broadcast; do
    stamp "linkwise bench $coll -N $n -b 8 -e 16M -f 2 -n 20 -w 5 --compare mpi,gloo"
    timeout 150 python3 -m linkwise.cli bench "$coll" -N "$n" -b 8 -e 16M -f 2 -n 20 -w 5 \
        --compare mpi,gloo --no-progress --json "$out/${coll}_n${n}.json" 2>&1 | tee -a "$log"
  done
done
# all_to_all's small messages (no target; an under-load 2-core reading was 3x Open MPI's time)
stamp "linkwise bench all_to_all -N 4 -b 256 -e 64K -f 16 -n 50 -w 10 --compare mpi"
timeout 60 python3 -m linkwise.cli bench all_to_all -N 4 -b 256 -e 64K -f 16 -n 50 -w 10 \
    --compare mpi --no-progress < /dev/null 2>&1 | tee -a "$log"
while read -r n coll b e variant; do
  stamp "$variant linkwise bench $coll -N $n -b $b -e $e -f 8 -n 20 -w 5"
  env $variant timeout 30 python3 -m linkwise.cli bench "$coll" -N "$n" -b "$b" -e "$e" -f 8 -n 20 -w 5 \
      --no-progress < /dev/null 2>&1 | grep -v "^#" | tee -a "$log"
done <<'EOF'
4 all_reduce 2M 2M LINKWISE_COLL_LANE_MIN=1G
4 all_reduce 4M 8M LINKWISE_COLL_THREADS=16
4 all_reduce 16M 16M LINKWISE_COLL_CMA_MIN=1G
4 broadcast 16M 16M LINKWISE_COLL_CMA_BCAST_MIN=1G
16 all_reduce 2M 2M LINKWISE_COLL_LANE_MIN=1G
16 all_reduce 1M 4M LINKWISE_COLL_THREADS=2
16 all_reduce 16M 16M LINKWISE_COLL_CMA_MIN=1G
16 all_reduce 1K 32K LINKWISE_COLL_ONE_SHOT_MAX=32K
EOF
tests="tests/test_coll_lanes.py tests/test_coll_cma.py tests/test_cpu_share.py tests/test_coll_paths.py
       tests/test_coll_mismatch.py tests/test_coll_fuzz.py tests/test_coll_bf16_torch.py
       tests/test_coll_failure_spread.py"
stamp "$(echo $tests)"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider $tests 2>&1 | tail -3 | tee -a "$log"
stamp done
