#!/bin/bash
# A/B of the CUDA build's target: the sm_90 build (the default from the twenty-eighth session)
# against the compute_75 PTX build every earlier session measured (JIT-compiled by the driver,
# programmatic dependent launch compiled out). Needs 2+ GPUs (NCCL refuses two ranks on one).
# Usage, repo root on the device: [ROUNDS=2] bash bench/gpu_arch_ab.sh
# Builds both into build/arch{75,90} and a package copy of each in a temporary directory (not
# $OUT: only the logs should come back), then runs each bench once per build per round,
# alternating. Logs: $OUT/ab.txt, $OUT/build{75,90}.txt. Its mechanics were checked on one H100
# (-N 1, 134 s with both builds; a 1-rank collective measures nothing of the kernels).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
work=$(mktemp -d)
for a in 75 90; do
  cmake -S . -B build/arch$a -G Ninja -DLINKWISE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$a \
    -DPython_EXECUTABLE=$(which python3) -DCMAKE_BUILD_TYPE=Release >/dev/null \
    && cmake --build build/arch$a -j$(nproc) >$OUT/build$a.txt 2>&1 || { tail -30 $OUT/build$a.txt; exit 1; }
  mkdir -p $work/$a && cp -r src/linkwise $work/$a/ && cp build/arch$a/_native*.so $work/$a/linkwise/
done
N=$(nvidia-smi -L | wc -l)
benches=(
  "bench all_reduce --device cuda --compare nccl-cupy -N $N -b 8 -e 256K -f 8 -n 100 -w 20 --graph both"
  "bench broadcast --device cuda --compare nccl-cupy -N $N -b 8 -e 256K -f 8 -n 100 -w 20 --graph both"
)
for round in $(seq ${ROUNDS:-2}); do
  for b in "${benches[@]}"; do
    for a in 75 90; do
      # The first launch of the 75 build JIT-compiles its kernels (~24 s), outside the timing.
      echo "## round $round sm_$a: $b" | tee -a $OUT/ab.txt
      PYTHONPATH=$work/$a timeout 150 python3 -m linkwise.cli $b 2>&1 | grep -v Warning >> $OUT/ab.txt
    done
  done
done
cat $OUT/ab.txt
