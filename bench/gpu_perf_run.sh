#!/bin/bash
# One device call for the GPU performance work: build, then the phases named in $PHASES
# (default: small tune bench), every output under $OUT. Usage (repo root, on the device):
#   PHASES="small tune bench" bash bench/gpu_perf_run.sh
# llsweep: bench/gpu_ll_sweep.py (LL kernel variants and sizes, NCCL called directly in the
#        same run) under LINKWISE_GPU_TUNE=1
# small: bench/gpu_tune.py --small with the LL kernels and without (LINKWISE_GPU_LL_MAX=0)
# tune:  bench/gpu_tune.py $TUNE_ARGS (default --reduce --bcast: registered-path sweeps, NCCL
#        in the same run; --final: the >= 64 MiB comparison with default settings)
# bench: linkwise bench all_reduce / broadcast, 8 B-256 KiB, eager and --graph, against
#        nccl (torch.distributed) and nccl-cupy; $LARGE adds the >= 64 MiB sweep of every op
# tests: pytest $TESTS (default: the GPU test files of this work)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src
t0=$(date +%s)
stamp() { echo "== $1: $(( $(date +%s) - t0 )) s" | tee -a $OUT/log.txt; }
( cmake -S . -B build/dev -G Ninja -DLINKWISE_CUDA=ON -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && cmake --build build/dev -j$(nproc) >$OUT/build.txt 2>&1 ) || { tail -40 $OUT/build.txt; exit 1; }
cp build/dev/_native*.so src/linkwise/
stamp build
N=${N:-4}
L="python3 -m linkwise.cli launch -n $N"
B="python3 -m linkwise.cli bench"
for ph in ${PHASES:-small tune bench}; do
  case $ph in
    llsweep)
      LINKWISE_TIMEOUT=20 LINKWISE_GPU_TUNE=1 timeout ${SWEEP_T:-100} $L bench/gpu_ll_sweep.py --json $OUT/sweep.json 2>&1 | grep -v Warn > $OUT/sweep.txt
      tail -40 $OUT/sweep.txt ;;
    small)
      LINKWISE_GPU_TUNE=1 timeout 60 $L bench/gpu_tune.py --small --json $OUT/small.json 2>&1 | grep -v Warn | tail -40 ;;
    final)
      timeout ${FINAL_T:-120} $L bench/gpu_tune.py --final --sizes ${FINAL_SIZES:-64M,128M,512M} --json $OUT/final.json 2>&1 | grep -v Warn | tail -20 ;;
    tune)
      timeout ${TUNE_T:-150} $L bench/gpu_tune.py ${TUNE_ARGS:---reduce --bcast} --sizes ${TUNE_SIZES:-64M,128M,512M} --json $OUT/tune.json 2>&1 | grep -v Warn | tail -80 ;;
    bench)
      for op in ${SMALL_OPS:-all_reduce broadcast}; do
        timeout ${BENCH_T:-60} $B $op --device cuda --compare nccl,nccl-cupy -N $N -b 8 -e 256K -f 8 -n 100 -w 20 --graph both --no-progress --json $OUT/$op.json 2>&1 | grep -v Warn | tee -a $OUT/bench.txt
      done
      for op in $LARGE; do
        timeout 100 $B $op --device cuda --compare nccl,nccl-cupy -N $N -b 64M -e 512M -f 2 -n 20 -w 5 -c 0 --no-progress 2>&1 | grep -v Warn | tee -a $OUT/bench.txt
      done ;;
    tests)  # $TESTS and $TESTS2 in two pytest processes at once (GPUs shared)
      ( timeout ${PYTEST_T:-150} python3 -m pytest ${TESTS:-tests/test_gpu_ll.py} -q -x -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests.txt ) &
      if [ -n "$TESTS2" ]; then
        timeout ${PYTEST_T:-150} python3 -m pytest $TESTS2 -q -x -p no:cacheprovider 2>&1 | tail -25 > $OUT/tests2.txt
      fi
      wait; cat $OUT/tests*.txt ;;
  esac
  stamp $ph
done
