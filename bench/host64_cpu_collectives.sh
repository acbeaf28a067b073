#!/usr/bin/env bash
# CPU collectives on the GPU machine's 64-core host, side by side with Open MPI (mpi4py) and
# Gloo (torch.distributed), 4 and 16 ranks. Run from the repository root on that machine:
#   bash bench/host64_cpu_collectives.sh OUTDIR
# (no registry there: builds the CPU part with the image's cmake/ninja/nanobind).
# Everything goes to OUTDIR/host64.txt (the device tool returns at most 8 files), plus the
# JSON of each comparison sweep. After the sweeps (the defaults), the same all_reduce sizes
# with the single-copy path off (LINKWISE_SHM_CMA=0: the copy-through-shared-memory path) and
# with it on but one thread per rank, to see what each part brings on this host.
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
{ nproc; python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])"; } 2>&1 | tee -a "$log"
# Which path the executor takes here (CMA permitted? threads per rank?)
for n in 4 16; do
  python3 - "$n" <<'PY' 2>&1 | tee -a "$log"
import sys; sys.path.insert(0, "tests")
import numpy as np
from multirank import run_ranks
from linkwise.collectives import _cma_settings
def body(comm):
    x = np.ones(1 << 20, np.float32); comm.all_reduce(x)
    return bool(comm._shm.cma), comm._shm.cma_calls, _cma_settings(comm.local_size, comm.size)[-1], float(x[0])
print(f"{sys.argv[1]} ranks: (cma, cma_calls, threads, x[0]) =", run_ranks(int(sys.argv[1]), body)[0])
PY
done
for n in 4 16; do
  for coll in all_reduce broadcast; do
    stamp "linkwise bench $coll -N $n -b 8 -e 16M -f 8 -n 20 -w 5 --compare mpi,gloo"
    timeout 60 python3 -m linkwise.cli bench "$coll" -N "$n" -b 8 -e 16M -f 8 -n 20 -w 5 \
        --compare mpi,gloo --no-progress --json "$out/${coll}_n${n}.json" 2>&1 | tee -a "$log"
  done
done
for n in 4 16; do
  for variant in "LINKWISE_SHM_CMA=0" "LINKWISE_COLL_THREADS=1 LINKWISE_COLL_CMA_MIN=1M"; do
    stamp "$variant linkwise bench all_reduce -N $n -b 1M -e 16M -f 4 -n 20 -w 5"
    env $variant timeout 30 python3 -m linkwise.cli bench all_reduce -N "$n" -b 1M -e 16M -f 4 -n 20 -w 5 \
        --no-progress 2>&1 | grep -v '^#' | tee -a "$log"
  done
done
stamp "tests/test_coll_cma.py"
timeout 60 python3 -m pytest -q -x tests/test_coll_cma.py 2>&1 | tail -3 | tee -a "$log"
stamp done
