// Device helpers shared by the chain broadcasts (bcast_chain.cu, bcast_dchain.cu): named
// barriers for the control-warp / copy-warp split, and the block's slice copy.
#pragma once

#include <cstddef>

#include "cuda/kernel_util.cuh"

namespace linkwise::cuda {

// Named barriers (ids 1, 2; __syncthreads is 0) over the whole block. bar.arrive signals
// without waiting; the memory accesses before it are ordered before those after the matching
// bar.sync of the waiting threads (PTX producer/consumer barrier pattern).
static __device__ __forceinline__ void bar_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }
static __device__ __forceinline__ void bar_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory"); }

// Threads t0..t0+nt-1 of the block copy n bytes src -> dst (and, when dst2 is not null, the
// same bytes into dst2 too: the root of an out-of-place broadcast fills its own out while it
// pushes x on), kU 16-byte loads in flight per thread before the stores.
template <int kU>
static __device__ __forceinline__ void slice_copy(char* dst, const char* src, size_t n, int t, int nt,
                                                  char* dst2 = nullptr) {
  size_t done = 0;
  if (aligned16(src) && aligned16(dst) && (dst2 == nullptr || aligned16(dst2))) {
    const size_t nv = n / 16, step = static_cast<size_t>(kU) * nt;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (size_t i = t; i < nv; i += step) {
      uint4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i + u * nt < nv) v[u] = s[i + u * nt];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i + u * nt < nv) d[i + u * nt] = v[u];
      if (dst2 != nullptr) {
        uint4* d2 = reinterpret_cast<uint4*>(dst2);
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (i + u * nt < nv) d2[i + u * nt] = v[u];
      }
    }
    done = nv * 16;
  }
  for (size_t i = done + t; i < n; i += nt) {
    dst[i] = src[i];
    if (dst2 != nullptr) dst2[i] = src[i];
  }
}

}  // namespace linkwise::cuda
