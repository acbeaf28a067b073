// How fast a copy runs against the distance from source to destination modulo 4 KiB: glibc's
// memcpy and process_vm_readv (the kernel's copy; here from this process itself), 4 MiB in
// 256 KiB copies, best of 5. Prints "distance:memcpy_us/readv_us" for each distance. Why it
// matters: csrc/core/copy.h. Build and run: g++ -O2 -o /tmp/copy_alias bench/copy_alias.cc && /tmp/copy_alias
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/uio.h>
#include <unistd.h>

int main() {
  const size_t piece = 256 << 10, total = 4 << 20;
  char* base = static_cast<char*>(std::aligned_alloc(4096, 64 << 20));
  std::memset(base, 1, 64 << 20);
  for (long dist = 0; dist < 4096; dist += dist < 80 ? 4 : 1008) {
    char* src = base + 64;
    char* dst = base + (24 << 20) + 64 + dist;
    double best[2] = {1e9, 1e9};
    for (int way = 0; way < 2; ++way)
      for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (size_t o = 0; o < total; o += piece) {
          if (way == 0) {
            std::memcpy(dst + o, src + o, piece);
          } else {
            iovec local{dst + o, piece}, remote{src + o, piece};
            if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) < 0) return 1;
          }
        }
        const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (us < best[way]) best[way] = us;
      }
    std::printf("%ld:%.0f/%.0f ", dist, best[0], best[1]);
  }
  std::printf("\n");
  return 0;
}
