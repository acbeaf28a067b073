#!/bin/bash
# One device call that checks a whole tree: the GPU test files in three pytest processes at
# once (they share the GPUs), then the benches given as arguments, one at a time (nothing else
# running). Measured on 4xH200 (fifth session): side by side the three groups finished 39 tests
# in 260 s (~6.7 s a test, against ~15 s one at a time), so the whole GPU suite (~60 tests)
# still needs ~400 s: give TEST_T that much or split the files over two calls. Usage, repo
# root on the device:
#   [SKIP_BUILD=1] [TEST_T=300] [BENCH_T=90] [GROUP_A|B|C|SOLO="<test files>"] bash bench/gpu_verify_run.sh "<bench cmd>"...
# GROUP_SOLO runs after the three groups, alone on the GPU: tests that measure the device's free
# memory or the GPU falling behind the host (tests/test_gpu_open_fixes.py) read other
# processes' work as theirs when they share it.
# LINKWISE_TEST_GPU_RANKS=n runs n ranks on the GPUs there are (they share one on a 1-GPU kind).
# Logs go to $OUT (tests-<group>.txt, bench.txt, log.txt). SKIP_BUILD=1 uses the extension
# already in src/linkwise (built elsewhere for the device's Python and carried).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src
t0=$(date +%s)
stamp() { echo "== $1: $(( $(date +%s) - t0 )) s" | tee -a $OUT/log.txt; }
if [ -z "$SKIP_BUILD" ]; then
  ( cmake -S . -B build/dev -G Ninja -DLINKWISE_CUDA=ON -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build build/dev -j$(nproc) >$OUT/build.txt 2>&1 ) || { tail -40 $OUT/build.txt; exit 1; }
  cp build/dev/_native*.so src/linkwise/
  stamp build
fi
GROUP_A=${GROUP_A-tests/test_gpu_large.py}
GROUP_B=${GROUP_B-tests/test_gpu_collectives.py tests/test_gpu_eager.py tests/test_gpu_graph.py tests/test_gpu_streams.py tests/test_gpu_nan.py}
GROUP_C=${GROUP_C-tests/test_gpu_ll.py tests/test_gpu_ll_twophase.py tests/test_gpu_ll128.py tests/test_gpu_robust.py tests/test_coll_gpu_dispatch.py}
for g in A B C; do
  files=GROUP_$g
  [ -n "${!files}" ] || continue
  ( timeout ${TEST_T:-300} python3 -m pytest ${!files} -q -rs -p no:cacheprovider --durations=5 \
      > $OUT/tests-$g.txt 2>&1; echo "exit $?" >> $OUT/tests-$g.txt ) &
done
wait
GROUP_SOLO=${GROUP_SOLO-tests/test_gpu_open_fixes.py}
if [ -n "$GROUP_SOLO" ]; then
  timeout ${SOLO_T:-200} python3 -m pytest $GROUP_SOLO -q -rs -p no:cacheprovider --durations=5 \
      > $OUT/tests-SOLO.txt 2>&1; echo "exit $?" >> $OUT/tests-SOLO.txt
fi
for g in A B C SOLO; do
  [ -f $OUT/tests-$g.txt ] && { echo "## tests $g"; grep -E "passed|failed|error|exit|FAILED|ERROR|s call" $OUT/tests-$g.txt | tail -14; }
done
stamp tests
for b in "$@"; do
  echo "## $b" | tee -a $OUT/bench.txt
  timeout ${BENCH_T:-90} bash -c "$b" 2>&1 | grep -v Warning >> $OUT/bench.txt
  stamp "bench"
done
[ $# -gt 0 ] && cat $OUT/bench.txt
exit 0
