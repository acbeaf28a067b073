#!/usr/bin/env bash
# CPU collectives on the GPU machine's 64-core host, side by side with Open MPI (mpi4py) and
# Gloo (torch.distributed), 4 and 16 ranks. Run from the repository root on that machine:
#   bash bench/host64_cpu_collectives.sh OUTDIR
# (no registry there: builds the CPU part with the image's cmake/ninja/nanobind).
set -euo pipefail
out=${1:-/tmp/lw-host64}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
cmake -S . -B build/host64 -G Ninja -DLINKWISE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" > "$out/build.log"
cmake --build build/host64 >> "$out/build.log"
cp build/host64/_native*.so src/linkwise/
export PYTHONPATH=$PWD/src
nproc; python3 -c "import mpi4py.MPI as M; print(M.Get_library_version().splitlines()[0])"
for n in 4 16; do
  for coll in all_reduce broadcast; do
    python3 -m linkwise.cli bench "$coll" -N "$n" -b 8 -e 16M -f 8 -n 20 -w 5 \
        --compare mpi,gloo --no-progress --json "$out/${coll}_n${n}.json" 2>&1 | tee "$out/${coll}_n${n}.txt"
  done
done
