#!/bin/bash
# A/B on one device call (docs/benchmarks.md, thirty-fifth and thirty-sixth sessions): builds
# this tree and abold/ (made here first with `mkdir abold && git archive REF | tar -x -C abold
# && cp bench/gpu_recv_handoff.py bench/gpu_deferred_gil.py abold/bench/`, left untracked so
# that it travels; REF was a3678cb in the thirty-fifth session, 827ba4f in the thirty-sixth), then
#   bash bench/gpu_ab_deferred.sh           bench/gpu_recv_handoff.py with each, then the GPU
#                                           suite on this tree;
#   bash bench/gpu_ab_deferred.sh sendrecv  `linkwise bench sendrecv --device cuda` with each, twice;
#   bash bench/gpu_ab_deferred.sh gil       bench/gpu_deferred_gil.py with each (switch intervals
#                                           5 and 50 ms), then the GPU suite on this tree.
# The suite's files: $SUITE (default below), each group within $TEST_T seconds (default 400).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
b() { (cd $1 && cmake -S . -B build/dev -G Ninja -DLINKWISE_CUDA=ON -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build/dev -j8 > /tmp/build-$2.txt 2>&1 && cp build/dev/_native*.so src/linkwise/) || tail -20 /tmp/build-$2.txt; }
b . new & b abold old & wait
src() { [ $1 = old ] && echo $PWD/abold/src || echo $PWD/src; }
if [ "${1:-}" = sendrecv ]; then
  for round in 1 2; do for t in new old; do
    echo "=== $t round $round"
    PYTHONPATH=$(src $t) timeout 120 python3 -m linkwise.cli bench sendrecv --device cuda -N 2 -b 1M -e 64M -f 2 -n 40 -w 10 2>&1 | grep -vi warn | tail -9
  done; done
  exit 0
fi
if [ "${1:-}" = gil ]; then
  for t in new old; do for sw in 0.005 0.05; do
    PYTHONPATH=$(src $t) timeout 40 python3 -m linkwise.cli launch -n 2 python3 bench/gpu_deferred_gil.py $t $sw 2>&1 | grep -E "median|Error" | head -4 | tee -a $OUT/gil.txt
  done; done
else
  for t in new old; do
    PYTHONPATH=$(src $t) timeout 100 python3 -m linkwise.cli launch -n 2 python3 bench/gpu_recv_handoff.py $t 2>&1 | grep -E "median|Error" | head -4
  done
fi
SKIP_BUILD=1 GROUP_C="${SUITE:-tests/test_gpu_ll.py tests/test_gpu_ll_twophase.py tests/test_gpu_ll128.py tests/test_gpu_robust.py tests/test_coll_gpu_dispatch.py tests/test_gpu_review_fixes.py tests/test_reg_cache.py tests/test_gpu_refusal_alone.py tests/test_gpu_deferred.py tests/test_deferred_model.py tests/test_coll_one_rank.py tests/test_native_error_kinds.py tests/test_p2p_wait_all.py}" TEST_T=${TEST_T:-400} SOLO_T=90 BENCH_T=40 bash bench/gpu_verify_run.sh "PYTHON=python3 bash bench/gpu_open_issues/run_all.sh bench/gpu_open_issues" 2>&1 | grep -E "passed|failed|exit|PASS|FAIL|==" | tail -30
grep -hE "^(FAILED|ERROR)" $OUT/tests-*.txt | head
