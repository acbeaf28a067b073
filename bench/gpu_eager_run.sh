#!/bin/bash
# One device call for the eager fast path work (issue 4): the phases in $PHASES, outputs under
# $OUT. Run from the repo root on the device machine:
#   PHASES="tests host bench" bash bench/gpu_eager_run.sh
# The extension: src/linkwise/_native*.so when it imports with CUDA (built elsewhere for this
# Python), else a Release build here (~35 s).
# tests: pytest $TESTS one file at a time (default tests/test_gpu_eager.py), $PYTEST_T s each
# host:  bench/gpu_eager_host.py (host µs per call and eager GPU µs per op, layer by layer)
# bench: linkwise bench broadcast (--graph both) and all_reduce (eager; $AR_GRAPH, default off)
#        8 B-256 KiB against nccl and nccl-cupy, the command
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src
t0=$(date +%s)
stamp() { echo "== $1: $(( $(date +%s) - t0 )) s" | tee -a $OUT/log.txt; }
if ! python3 -c "import linkwise._native as n; assert hasattr(n, '_GpuEngine') and hasattr(n._GpuEngine, 'all_reduce_fast')" 2>>$OUT/log.txt; then
  rm -f src/linkwise/_native*.so
  ( cmake -S . -B build/dev -G Ninja -DLINKWISE_CUDA=ON -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build build/dev -j$(nproc) >$OUT/build.txt 2>&1 ) || { tail -40 $OUT/build.txt; exit 1; }
  cp build/dev/_native*.so src/linkwise/
  stamp build
fi
B="python3 -m linkwise.cli bench"
for ph in ${PHASES:-tests host bench}; do
  case $ph in
    tests)
      for f in ${TESTS:-tests/test_gpu_eager.py}; do
        timeout ${PYTEST_T:-90} python3 -m pytest $f -q -x -p no:cacheprovider 2>&1 | tail -25 | tee -a $OUT/tests.txt
        stamp "pytest $f"
      done ;;
    host)
      timeout ${HOST_T:-45} python3 -m linkwise.cli launch -n 4 bench/gpu_eager_host.py --bytes ${HOST_BYTES:-8,32768} \
        --json $OUT/host.json 2>&1 | grep -v Warn | tee $OUT/host.txt ;;
    bench)
      timeout ${BENCH_T:-60} $B broadcast --device cuda --compare nccl,nccl-cupy -N 4 -b 8 -e 256K -f 8 -n 100 -w 20 \
        --graph both --no-progress --json $OUT/broadcast.json 2>&1 | grep -v Warn | tee -a $OUT/bench.txt
      stamp "bench broadcast"
      timeout ${BENCH_T:-60} $B all_reduce --device cuda --compare nccl,nccl-cupy -N 4 -b 8 -e 256K -f 8 -n 100 -w 20 \
        --graph ${AR_GRAPH:-off} --no-progress --json $OUT/all_reduce.json 2>&1 | grep -v Warn | tee -a $OUT/bench.txt ;;
  esac
  stamp $ph
done
