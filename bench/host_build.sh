# Sourced by the host CPU benchmark scripts (rs_host.sh, gather_host.sh), with $out and $log
# set: builds the CPU part of the extension (Release, no CUDA) into build/host64, puts it in
# src/linkwise, points PYTHONPATH there and logs the machine. Returns 1 (build log's tail in
# $log) when the build fails.
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
host_build() {
  cmake -S . -B build/host64 -G Ninja -DLINKWISE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE="$(command -v python3)" > "$out/build.log" 2>&1 &&
    cmake --build build/host64 >> "$out/build.log" 2>&1 || { tail -30 "$out/build.log" >> "$log"; return 1; }
  cp build/host64/_native*.so src/linkwise/
  export PYTHONPATH=$PWD/src
  { python3 -c "import os; print(len(os.sched_getaffinity(0)), 'CPUs')"; lscpu | grep -m1 "Model name"; } 2>&1 |
    tee -a "$log"
}
