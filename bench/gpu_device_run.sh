#!/bin/bash
# One device call: build the CUDA extension, run the given pytest targets and benches.
# Usage: bench/gpu_device_run.sh "<pytest args>" "<bench command>"...   (logs to $OUT)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD/src
t0=$(date +%s)
( cmake -S . -B build/dev -G Ninja -DLINKWISE_CUDA=ON -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null \
  && cmake --build build/dev -j$(nproc) >$OUT/build.txt 2>&1 ) || { tail -40 $OUT/build.txt; exit 1; }
cp build/dev/_native*.so src/linkwise/
echo "build: $(( $(date +%s) - t0 )) s"
tests="$1"; shift
if [ -n "$tests" ]; then
  timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest $tests -q -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/tests.txt
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
for b in "$@"; do
  echo "## $b"
  timeout ${BENCH_TIMEOUT:-120} bash -c "$b" 2>&1 | grep -v Warning | tee -a $OUT/bench.txt
  echo "elapsed: $(( $(date +%s) - t0 )) s"
done
