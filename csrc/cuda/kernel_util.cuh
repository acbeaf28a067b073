// Block-wide copy helpers shared by the kernel files (device code only).
#pragma once

#include <cstdint>

namespace linkwise::cuda {

static __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Copies n bytes from src to ndst destinations, whole block.
static __device__ void copy_bytes(char* const* dsts, int ndst, const char* src, size_t n) {
  bool vec = aligned16(src);
  for (int d = 0; d < ndst; ++d) vec &= aligned16(dsts[d]);
  size_t done = 0;
  if (vec) {
    size_t nvec = n / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    size_t i = threadIdx.x;
    // Two loads in flight per thread before the stores.
    for (; i + blockDim.x < nvec; i += 2 * blockDim.x) {
      uint4 a = s[i], b = s[i + blockDim.x];
      for (int d = 0; d < ndst; ++d) {
        reinterpret_cast<uint4*>(dsts[d])[i] = a;
        reinterpret_cast<uint4*>(dsts[d])[i + blockDim.x] = b;
      }
    }
    for (; i < nvec; i += blockDim.x) {
      uint4 a = s[i];
      for (int d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dsts[d])[i] = a;
    }
    done = nvec * 16;
  }
  for (size_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    char v = src[i];
    for (int d = 0; d < ndst; ++d) dsts[d][i] = v;
  }
}

// [lo, hi) of block b when `len` items are split over gridDim.x blocks in multiples of `align`.
static __device__ __forceinline__ void block_slice(size_t len, size_t align, size_t* lo, size_t* hi) {
  size_t per = (len + gridDim.x - 1) / gridDim.x;
  per = (per + align - 1) / align * align;
  size_t a = per * blockIdx.x;
  *lo = a < len ? a : len;
  *hi = a + per < len ? a + per : len;
}

}  // namespace linkwise::cuda
