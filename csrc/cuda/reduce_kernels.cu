// all_reduce and reduce_scatter kernels over peer memory (CUDA IPC, NVLink).
//
// Every launch is one "epoch" of the communicator and uses the slots of parity epoch&1
// (layout and flag contracts in gpu_device.cuh). Elements are reduced in rank order 0..n-1 on
// whichever rank reduces them, so every rank ends bitwise identical. float16/bfloat16 are
// reduced in float32; avg is sum followed by a division by nranks.
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

// Reduces elements [0, len) of srcs[0..nsrc) (in that order) into `ndst` destinations, using
// the calling block's threads. 16-byte accesses when every pointer allows it.
template <typename T, class Op>
__device__ void reduce_range(const T* const* srcs, int nsrc, T* const* dsts, int ndst, size_t len,
                             bool avg, int nranks) {
  using A = typename AccT<T>::type;
  Op op;
  bool vec = true;
  for (int i = 0; i < nsrc; ++i) vec &= aligned16(srcs[i]);
  for (int i = 0; i < ndst; ++i) vec &= aligned16(dsts[i]);
  size_t done = 0;
  if (vec) {
    constexpr int V = Pack<T>::kN;
    size_t nvec = len / V;
    for (size_t i = threadIdx.x; i < nvec; i += blockDim.x) {
      Pack<T> p;
      p.u = reinterpret_cast<const uint4*>(srcs[0])[i];
      A acc[V];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = up<T>(p.v[k]);
      for (int s = 1; s < nsrc; ++s) {
        p.u = reinterpret_cast<const uint4*>(srcs[s])[i];
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] = op(acc[k], up<T>(p.v[k]));
      }
#pragma unroll
      for (int k = 0; k < V; ++k) p.v[k] = down<T>(avg ? acc[k] / static_cast<A>(nranks) : acc[k]);
      for (int d = 0; d < ndst; ++d) reinterpret_cast<uint4*>(dsts[d])[i] = p.u;
    }
    done = nvec * V;
  }
  for (size_t i = done + threadIdx.x; i < len; i += blockDim.x) {
    A acc = up<T>(srcs[0][i]);
    for (int s = 1; s < nsrc; ++s) acc = op(acc, up<T>(srcs[s][i]));
    T r = down<T>(avg ? acc / static_cast<A>(nranks) : acc);
    for (int d = 0; d < ndst; ++d) dsts[d][i] = r;
  }
}

// One-shot all_reduce. Roles: every block is alike and owns one slice of the elements.
// Pipeline per block: (1) wait until peers may be written (start flags), (2) push our slice
// of x into in_slot[rank] of every peer, (3) signal ready[0] to every peer, (4) wait for
// every peer's ready[0], (5) reduce the slice from x (own) and the local in_slots, in rank
// order, into out. In place (out == x) is safe: each element is read before it is written by
// the same thread.
template <typename T, class Op>
__device__ __forceinline__ void oneshot_body(DevComm c, const T* x, T* out, size_t count,
                                             uint64_t epoch, bool avg) {
  announce_start(c, epoch);
  wait_peers_started(c, epoch);
  const int par = epoch & 1;
  size_t lo, hi;
  block_slice(count, Pack<T>::kN, &lo, &hi);
  char* dsts[kMaxRanks];
  int nd = 0;
  for (int p = 0; p < c.nranks; ++p)
    if (p != c.rank) dsts[nd++] = c.in_slot(p, par, c.rank) + lo * sizeof(T);
  copy_bytes(dsts, nd, reinterpret_cast<const char*>(x + lo), (hi - lo) * sizeof(T));
  signal_all(c, 0, epoch);
  wait_all(c, 0, epoch);
  const T* srcs[kMaxRanks];
  for (int q = 0; q < c.nranks; ++q)
    srcs[q] = q == c.rank ? x + lo : reinterpret_cast<const T*>(c.in_slot(c.rank, par, q)) + lo;
  T* o = out + lo;
  reduce_range<T, Op>(srcs, c.nranks, &o, 1, hi - lo, avg, c.nranks);
}

// Two-shot all_reduce (allgather = true) or reduce_scatter (allgather = false) of one piece.
// Chunk q is x[q*x_stride .. +len(q)), len(q) = clamp(count - q*chunk, 0, chunk); rank q
// reduces chunk q. Roles: every block alike, owning the same sub-slice of every chunk.
// Pipeline per block: (1) start flags, (2) push sub-slice of chunk p to in_slot[rank] of peer
// p, (3) signal/wait ready[0], (4) reduce our chunk's sub-slice in rank order into out (own
// chunk) and, for all_reduce, into gather_slot[rank] of every peer, (5) signal/wait ready[1],
// (6) copy the peers' reduced sub-slices from our gather_slots into out.
template <typename T, class Op>
__device__ __forceinline__ void twoshot_body(DevComm c, const T* x, size_t x_stride, T* out,
                                             size_t out_stride, size_t count, size_t chunk,
                                             bool allgather, uint64_t epoch, bool avg) {
  announce_start(c, epoch);
  wait_peers_started(c, epoch);
  const int par = epoch & 1;
  size_t lo, hi;
  block_slice(chunk, Pack<T>::kN, &lo, &hi);
  auto clen = [&](int q) -> size_t {
    size_t s = static_cast<size_t>(q) * chunk;
    size_t l = s < count ? count - s : 0;
    l = l < chunk ? l : chunk;
    return l > lo ? (l < hi ? l : hi) - lo : 0;  // elements of chunk q in [lo, hi)
  };
  for (int p = 0; p < c.nranks; ++p) {
    if (p == c.rank) continue;
    char* d = c.in_slot(p, par, c.rank) + lo * sizeof(T);
    copy_bytes(&d, 1, reinterpret_cast<const char*>(x + p * x_stride + lo), clen(p) * sizeof(T));
  }
  signal_all(c, 0, epoch);
  wait_all(c, 0, epoch);
  const T* srcs[kMaxRanks];
  for (int q = 0; q < c.nranks; ++q)
    srcs[q] = q == c.rank ? x + c.rank * x_stride + lo
                          : reinterpret_cast<const T*>(c.in_slot(c.rank, par, q)) + lo;
  T* dsts[kMaxRanks];
  int nd = 0;
  dsts[nd++] = out + (allgather ? c.rank * out_stride : 0) + lo;
  if (allgather)
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank) dsts[nd++] = reinterpret_cast<T*>(c.gather_slot(p, par, c.rank)) + lo;
  reduce_range<T, Op>(srcs, c.nranks, dsts, nd, clen(c.rank), avg, c.nranks);
  if (!allgather) return;
  signal_all(c, 1, epoch);
  wait_all(c, 1, epoch);
  for (int q = 0; q < c.nranks; ++q) {
    if (q == c.rank) continue;
    char* d = reinterpret_cast<char*>(out + q * out_stride + lo);
    copy_bytes(&d, 1, c.gather_slot(c.rank, par, q) + lo * sizeof(T), clen(q) * sizeof(T));
  }
}

// Kernels: one epoch each, numbered on the device (gpu_device.cuh) so that launches can be
// captured in a CUDA graph and replayed.
template <typename T, class Op>
__global__ void __launch_bounds__(kThreads) oneshot_kernel(DevComm c, const T* x, T* out,
                                                           size_t count, bool avg) {
  oneshot_body<T, Op>(c, x, out, count, epoch_begin(c), avg);
  epoch_end(c);
}
template <typename T, class Op>
__global__ void __launch_bounds__(kThreads) twoshot_kernel(DevComm c, const T* x, size_t x_stride,
                                                           T* out, size_t out_stride, size_t count,
                                                           size_t chunk, bool allgather, bool avg) {
  twoshot_body<T, Op>(c, x, x_stride, out, out_stride, count, chunk, allgather, epoch_begin(c), avg);
  epoch_end(c);
}

template <typename T, class Op>
void run_oneshot(const DevComm& c, const void* x, void* out, size_t count, bool avg,
                 int blocks, cudaStream_t s) {
  oneshot_kernel<T, Op><<<blocks, kThreads, 0, s>>>(c, static_cast<const T*>(x),
                                                     static_cast<T*>(out), count, avg);
}

template <typename T, class Op>
void run_twoshot(const DevComm& c, const void* x, size_t xs, void* out, size_t os, size_t count,
                 size_t chunk, bool ag, bool avg, int blocks, cudaStream_t s) {
  twoshot_kernel<T, Op><<<blocks, kThreads, 0, s>>>(c, static_cast<const T*>(x), xs,
                                                     static_cast<T*>(out), os, count, chunk, ag,
                                                     avg);
}

template <typename T, class Op> struct OneShot {
  template <typename... A> static void run(A&&... a) { run_oneshot<T, Op>(a...); }
};
template <typename T, class Op> struct TwoShot {
  template <typename... A> static void run(A&&... a) { run_twoshot<T, Op>(a...); }
};

}  // namespace

size_t dtype_size(int dtype) {
  switch (dtype) {
    case kF32: case kI32: return 4;
    case kF16: case kBF16: return 2;
    case kF64: case kI64: return 8;
  }
  return 0;
}

void launch_oneshot(const DevComm& c, int dtype, int op, const void* x, void* out, size_t count,
                    int blocks, cudaStream_t s) {
  if (launch_ll_allreduce(c, dtype, op, x, out, count, s)) return;
  // One block per LINKWISE_GPU_ONESHOT_BLOCK_BYTES (tuning knob; default 8 KiB, measured
  // faster than the engine's 16 KiB blocks at 64-256 KiB on 4xH200), at most kMaxBlocks.
  const size_t bb = static_cast<size_t>(tune_int("LINKWISE_GPU_ONESHOT_BLOCK_BYTES", 8192));
  const size_t b = (count * dtype_size(dtype) + bb - 1) / bb;
  blocks = static_cast<int>(b < 1 ? 1 : b > static_cast<size_t>(kMaxBlocks) ? kMaxBlocks : b);
  dispatch<OneShot>(dtype, op, c, x, out, count, op == kAvg, blocks, s);
}

void launch_twoshot(const DevComm& c, int dtype, int op, const void* x, size_t x_stride, void* out,
                    size_t out_stride, size_t count, size_t chunk, bool allgather,
                    int blocks, cudaStream_t s) {
  dispatch<TwoShot>(dtype, op, c, x, x_stride, out, out_stride, count, chunk, allgather,
                    op == kAvg, blocks, s);
}

}  // namespace linkwise::cuda
