// Small all_reduce and broadcast over LL lines (ll.cuh): one kernel, one epoch, no fence and
// no separate ready flag on the critical path. Used for messages of at most ll_max() bytes
// (LINKWISE_GPU_LL_MAX, default and cap kLLMaxData); larger ones take reduce_kernels.cu /
// copy_kernels.cu. Results are bitwise those of the other kernels: same reduction order (rank
// 0..n-1), same accumulation types.
#include <cstdlib>

#include "cuda/ll.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

// Block size cap of the LL kernels (registers: G sources' packs in flight per thread).
constexpr int kLLMaxThreads = 256;

// all_reduce. Roles: every thread alike, owning packs i = tid, tid + stride, ...
// Pipeline: (1) start flags (wait_peers_started: peers are done with this parity's slots);
// (2) for each own pack: read 16 bytes of x, store them as LL lines into ll_slot(p, par, rank)
// of every peer p; (3) for each own pack: combine, in rank order, our x and each peer's lines
// from our ll_slot(rank, par, q) (polling until they carry this epoch's flag, then zeroing
// them), and store the valid bytes into out. In place (out == x) is safe: the thread that
// writes out's pack i has read x's pack i (in both loops) before.
template <typename T, class Op>
__global__ void __launch_bounds__(kLLMaxThreads) ll_allreduce_kernel(DevComm c, const T* x, T* out,
                                                                size_t count, bool avg) {
  using A = typename AccT<T>::type;
  constexpr int V = Pack<T>::kN;
  constexpr int G = 8;  // sources polled at once (more ranks: several groups, in order)
  Op op;
  const uint64_t epoch = ll_begin(c);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const size_t n = count * sizeof(T), npk = (n + 15) / 16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const char* xb = reinterpret_cast<const char*>(x);
  for (size_t i = tid; i < npk; i += stride) {
    uint4 d = load_pack(xb, i, n, sizeof(T));
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank) ll_store_pack(ll_slot(c, p, par, c.rank) + i * 4, d, flag);
  }
  for (size_t i = tid; i < npk; i += stride) {
    A acc[V];
    for (int g0 = 0; g0 < c.nranks; g0 += G) {
      uint4 d[G];
      ll_load_group<G>(c, g0, par, i, flag, d);  // every peer of the group at once
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const int q = g0 + k;
        if (q >= c.nranks) break;
        Pack<T> p;
        p.u = q == c.rank ? load_pack(xb, i, n, sizeof(T)) : d[k];
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = q == 0 ? up<T>(p.v[j]) : op(acc[j], up<T>(p.v[j]));
      }
    }
    Pack<T> r;
#pragma unroll
    for (int k = 0; k < V; ++k) r.v[k] = down<T>(avg ? acc[k] / static_cast<A>(c.nranks) : acc[k]);
    store_pack(reinterpret_cast<char*>(out), i, n, sizeof(T), r.u);
  }
  epoch_end_small(c);
}

// broadcast. Root: start flags -> store its packs as LL lines into ll_slot(p, par, root) of
// every peer p; it waits for nothing else. Peer: poll its packs from ll_slot(rank, par,
// root), zero the lines, store the bytes into x.
__global__ void __launch_bounds__(kLLMaxThreads) ll_bcast_kernel(DevComm c, char* x, size_t n, int root,
                                                            int elem) {
  const uint64_t epoch = c.rank == root ? ll_begin(c) : epoch_begin(c);
  if (c.rank != root) announce_start(c, epoch);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const size_t npk = (n + 15) / 16;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.rank == root) {
    for (size_t i = tid; i < npk; i += stride) {
      uint4 d = load_pack(x, i, n, elem);
      for (int p = 0; p < c.nranks; ++p)
        if (p != root) ll_store_pack(ll_slot(c, p, par, root) + i * 4, d, flag);
    }
  } else {
    for (size_t i = tid; i < npk; i += stride)
      store_pack(x, i, n, elem, ll_load_pack(c, ll_slot(c, c.rank, par, root) + i * 4, flag));
  }
  epoch_end_small(c);
}

template <typename T, class Op> struct LLAllReduce {
  static void run(const DevComm& c, const void* x, void* out, size_t count, bool avg, int blocks,
                  int threads, cudaStream_t s) {
    ll_allreduce_kernel<T, Op><<<blocks, threads, 0, s>>>(c, static_cast<const T*>(x),
                                                          static_cast<T*>(out), count, avg);
  }
};

// Tuning knob read per call only when set at start-up (sweeps change it in one process).
int env_int(const char* name, int dflt) {
  static const bool any = std::getenv("LINKWISE_GPU_TUNE") != nullptr;
  if (!any) return dflt;
  const char* e = std::getenv(name);
  return e && std::atoi(e) > 0 ? std::atoi(e) : dflt;
}

// Grid for npk packs: one pack per thread, blocks of LINKWISE_GPU_LL_THREADS (tuning; default
// 64: many small blocks spread the NVLink stores and polls over many SMs, measured faster than
// 512-thread blocks at 32 KiB), at most 128 blocks.
void ll_grid(size_t npk, int* blocks, int* threads) {
  int t = env_int("LINKWISE_GPU_LL_THREADS", 64);
  *threads = t < 64 ? 64 : t > kLLMaxThreads ? kLLMaxThreads : t;  // ll_begin needs 64
  size_t b = (npk + *threads - 1) / *threads;
  *blocks = static_cast<int>(b < 1 ? 1 : b > 128 ? 128 : b);
}

}  // namespace

int tune_int(const char* name, int dflt) { return env_int(name, dflt); }

size_t ll_max() {
  static const size_t v = [] {
    const char* e = std::getenv("LINKWISE_GPU_LL_MAX");
    size_t m = e ? static_cast<size_t>(std::strtoull(e, nullptr, 10)) : kLLDefaultMax;
    return m < kLLMaxData ? m : kLLMaxData;
  }();
  size_t t = static_cast<size_t>(env_int("LINKWISE_GPU_LL_MAX", static_cast<int>(v)));
  return t < kLLMaxData ? t : kLLMaxData;
}

bool launch_ll_allreduce(const DevComm& c, int dtype, int op, const void* x, void* out,
                         size_t count, cudaStream_t s) {
  size_t n = count * dtype_size(dtype);
  if (n == 0 || n > ll_max()) return false;
  int blocks, threads;
  ll_grid((n + 15) / 16, &blocks, &threads);
  dispatch<LLAllReduce>(dtype, op, c, x, out, count, op == kAvg, blocks, threads, s);
  return true;
}

bool launch_ll_broadcast(const DevComm& c, void* x, size_t n, int root, cudaStream_t s) {
  if (n == 0 || n > ll_max()) return false;
  int blocks, threads;
  ll_grid((n + 15) / 16, &blocks, &threads);
  const uintptr_t a = reinterpret_cast<uintptr_t>(x) | n;  // widest element both allow
  const int elem = (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : (a & 1) == 0 ? 2 : 1;
  ll_bcast_kernel<<<blocks, threads, 0, s>>>(c, static_cast<char*>(x), n, root, elem);
  return true;
}

}  // namespace linkwise::cuda
