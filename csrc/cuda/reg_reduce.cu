// Large all_reduce / reduce_scatter straight from peers' registered user buffers (no scratch).
//
// The host half (reg_engine.cu, GpuEngine::all_reduce_reg / reduce_scatter_reg) brackets one
// launch of reg_reduce_kernel between two rendezvous (sig_kernel, kSigRendezvous); the
// ordering contract is stated there. This file is only the data movement.
//
// reg_reduce_kernel. Roles: every block is alike; the grid strides over the `len` elements of
// the one slice this rank reduces (all_reduce: chunk `rank` of the buffer; reduce_scatter:
// block `rank` of every rank's x). Pipeline per thread, for each of its 16-byte packs:
//   (1) issue the loads of that pack from all sources at once (rank q's input as mapped here,
//       NVLink loads for peers; kUnroll packs x kGroup sources in flight per thread, so the
//       ~1-2 us NVLink latency is covered by many outstanding requests per SM),
//   (2) reduce them in rank order 0..n-1 (float16/bfloat16 in float32), so every rank's
//       slice is reduced exactly as every other rank would, and results are bitwise identical,
//   (3) store the result to every destination: our own out first, then (all_reduce) the same
//       chunk of every peer's out (remote NVLink stores).
// In place (out == x) is safe: a pack is read (from all sources) and written (to all
// destinations) by the same thread, and no other thread or rank reads it during the kernel
// (rank q only reads chunk q). Every thread ends with __threadfence_system(), so all its
// remote stores are visible system-wide before the kernel completes; the closing rendezvous
// (a later kernel on the stream) then publishes them with a release.
// Unaligned pointers (any source or destination not 16-byte aligned) fall back to one element
// per thread, same order of reduction.
#include <type_traits>

#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

// Variants (tuning, launch_reg_reduce): kUnroll packs per thread per step, kGroup sources
// loaded together (nranks > kGroup: several groups, in order), kTh threads per block (its
// register cap: the loads in flight must fit without spilling).
template <typename T, class Op, int kUnroll, int kGroup, int kTh>
__global__ void __launch_bounds__(kTh) reg_reduce_kernel(RegReduceArgs a) {
  using A = typename AccT<T>::type;
  constexpr int V = Pack<T>::kN;
  Op op;
  const int ns = a.nsrc, nd = a.ndst;
  bool vec = true;
  for (int s = 0; s < ns; ++s) vec &= aligned16(a.src[s]);
  for (int d = 0; d < nd; ++d) vec &= aligned16(a.dst[d]);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vec) {
    const size_t nvec = a.len / V;
    for (size_t base = tid; base < nvec; base += kUnroll * stride) {
      A acc[kUnroll][V];
      for (int g = 0; g < ns; g += kGroup) {
        Pack<T> p[kUnroll][kGroup];
#pragma unroll
        for (int s = 0; s < kGroup; ++s)
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            size_t i = base + u * stride;
            if (g + s < ns && i < nvec) p[u][s].u = reinterpret_cast<const uint4*>(a.src[g + s])[i];
          }
#pragma unroll
        for (int s = 0; s < kGroup; ++s) {
          if (g + s >= ns) break;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int k = 0; k < V; ++k)
              acc[u][k] = g + s == 0 ? up<T>(p[u][s].v[k]) : op(acc[u][k], up<T>(p[u][s].v[k]));
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        size_t i = base + u * stride;
        if (i >= nvec) break;
        Pack<T> r;
#pragma unroll
        for (int k = 0; k < V; ++k)
          r.v[k] = down<T>(a.avg ? acc[u][k] / static_cast<A>(a.nranks) : acc[u][k]);
        for (int d = 0; d < nd; ++d) reinterpret_cast<uint4*>(a.dst[d])[i] = r.u;
      }
    }
    done = nvec * V;
  }
  for (size_t i = done + tid; i < a.len; i += stride) {
    A acc = up<T>(static_cast<const T*>(a.src[0])[i]);
    for (int s = 1; s < ns; ++s) acc = op(acc, up<T>(static_cast<const T*>(a.src[s])[i]));
    T r = down<T>(a.avg ? acc / static_cast<A>(a.nranks) : acc);
    for (int d = 0; d < nd; ++d) static_cast<T*>(a.dst[d])[i] = r;
  }
  __threadfence_system();
}

template <typename T, class Op> struct RegReduce {
  static void run(const RegReduceArgs& a, int blocks, int variant, cudaStream_t s) {
    constexpr bool kTuned = std::is_same<Op, OpSum>::value &&
                            (std::is_same<T, float>::value || std::is_same<T, __nv_bfloat16>::value ||
                             std::is_same<T, __half>::value);
    if constexpr (kTuned) {
      if (variant == 1) return reg_reduce_kernel<T, Op, 1, 8, 512><<<blocks, 512, 0, s>>>(a);
      if (variant == 4) return reg_reduce_kernel<T, Op, 4, 4, 256><<<blocks, 256, 0, s>>>(a);
    }
    reg_reduce_kernel<T, Op, 2, 8, kThreads><<<blocks, kThreads, 0, s>>>(a);
  }
};

}  // namespace

int reg_reduce_threads(int variant) { return variant == 4 ? 256 : kThreads; }

void launch_reg_reduce(int dtype, int op, const RegReduceArgs& a, int blocks, int variant,
                       cudaStream_t s) {
  dispatch<RegReduce>(dtype, op, a, blocks, variant, s);
}

}  // namespace linkwise::cuda
