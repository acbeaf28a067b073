// Mid-size all_reduce and broadcast over LL128 lines (ll128.cuh): the shapes of ll_kernels.cu
// (one pass; two phases = reduce-scatter + all-gather / scatter + all-gather among the
// non-roots) with 128-byte lines instead of 8-byte LL lines, so ~1.14x instead of 2x the
// payload crosses NVLink. launch_ll_allreduce / launch_ll_broadcast (ll_kernels.cu) route a
// message here from LINKWISE_GPU_LL128_MIN / _LL128_BCAST_MIN bytes (defaults: ll128.cuh).
// Results are bitwise those of the other kernels (reduction in rank order 0..n-1, same
// accumulation types). The fifth session's wrong, rank-dependent elements came from
// l128_load keeping data loaded by the same instruction that saw the flag; it now reloads
// the line after the flag (ll128.cuh).
//
// Thread layout: warp-synchronous. Global warp w handles lines 4w + g (g = lane / 8, its line
// group), then 4w + g + 4 * (warps in the grid), ...; lane k = lane % 8 of a group carries
// pack 7L + k (k < 7) or the flag (k == 7). Every loop that polls runs the same number of
// iterations on all lanes of a warp (l128_load uses warp shuffles / votes); a lane whose line
// does not exist takes part with live = false.
#include "cuda/ll128.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

constexpr int kMaxThreads = 256;
constexpr int G = 8;  // sources polled at once

__device__ __forceinline__ uint32_t peers_of(const DevComm& c) {
  return ((1u << c.nranks) - 1) & ~(1u << c.rank);
}
// First line of this warp's groups, and the lines all data warps cover per round
// (kLLSpareBlock: block 0 carries none; kernels return there first).
__device__ __forceinline__ size_t warp0(int var) {
  return 4 * ((ll_data_block(var) * blockDim.x + threadIdx.x) >> 5);
}
__device__ __forceinline__ size_t line_stride(int var) {
  return 4 * (ll_data_blocks(var) * blockDim.x >> 5);
}
__device__ __forceinline__ uint4 zero4() { return make_uint4(0, 0, 0, 0); }

// Pack `pk` of p (n bytes, npk packs) when `valid`, else zeros.
__device__ __forceinline__ uint4 pack_if(bool valid, const char* p, size_t pk, size_t n, int elem) {
  return valid ? load_pack(p, pk, n, elem) : zero4();
}

// Polls line L (half `half` of our slots) from every rank q with bit q of `from` set, G at a
// time; fn(q, d) gets this lane's 16 bytes of q's line. Warp-synchronous.
template <class Fn>
__device__ __forceinline__ void l128_gather(const DevComm& c, uint32_t from, int par, int half,
                                            bool live, size_t L, int k, uint64_t flag, Fn fn) {
  for (int g0 = 0; g0 < c.nranks; g0 += G) {
    uint64_t* slots[G];
    uint32_t want = 0;
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int q = g0 + j;
      slots[j] = q < c.nranks ? ll_slot(c, c.rank, par, q, half) : nullptr;
      if (q < c.nranks && ((from >> q) & 1)) want |= 1u << j;
    }
    uint4 d[G];
    l128_load<G>(c, slots, want, live, L, k, flag, d);
#pragma unroll
    for (int j = 0; j < G; ++j)
      if (live && ((want >> j) & 1)) fn(g0 + j, d[j]);
  }
}

// Line L of every peer reduced with `own` in rank order (avg: / nranks at the end).
template <typename T, class Op>
__device__ __forceinline__ uint4 l128_reduce(const DevComm& c, uint4 own, int par, int half,
                                             bool live, size_t L, int k, uint64_t flag, bool avg) {
  using A = typename AccT<T>::type;
  constexpr int V = Pack<T>::kN;
  Op op;
  A acc[V];
  for (int g0 = 0; g0 < c.nranks; g0 += G) {  // G sources polled at once, folded in rank order
    uint64_t* slots[G];
    uint32_t want = 0;
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int q = g0 + j;
      slots[j] = q < c.nranks ? ll_slot(c, c.rank, par, q, half) : nullptr;
      if (q < c.nranks && q != c.rank) want |= 1u << j;
    }
    uint4 d[G];
    l128_load<G>(c, slots, want, live, L, k, flag, d);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int q = g0 + j;
      if (q >= c.nranks) break;
      Pack<T> p;
      p.u = q == c.rank ? own : d[j];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = q == 0 ? up<T>(p.v[v]) : op(acc[v], up<T>(p.v[v]));
    }
  }
  Pack<T> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = down<T>(avg ? acc[j] / static_cast<A>(c.nranks) : acc[j]);
  return r.u;
}

// all_reduce, one pass: (1) ll_begin; (2) every line of x (7 packs + flag) to every peer's
// ll_slot(p, par, rank); (3) every line polled from every peer, reduced with x in rank order
// into out. In place is safe: pack i is read and written only by the lane that owns it.
template <typename T, class Op>
__global__ void __launch_bounds__(kMaxThreads) l128_allreduce_kernel(DevComm c, const T* x, T* out,
                                                                size_t count, bool avg, int var) {
  pdl_begin();
  const uint64_t epoch = ll_begin(c, var, peers_of(c));
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const L128Lane ln = l128_lane();
  const size_t n = count * sizeof(T), npk = (n + 15) / 16, nl = (npk + kL128Packs - 1) / kL128Packs;
  const char* xb = reinterpret_cast<const char*>(x);
  for (size_t L0 = warp0(var); L0 < nl; L0 += line_stride(var)) {
    const size_t L = L0 + ln.g, i = L * kL128Packs + ln.k;
    if (L >= nl) continue;
    const uint4 d = pack_if(ln.k < 7 && i < npk, xb, i, n, sizeof(T));
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank) l128_store(ll_slot(c, p, par, c.rank), L, ln.k, d, epoch);
  }
  ll_announce(c, var, epoch);
  for (size_t L0 = warp0(var); L0 < nl; L0 += line_stride(var)) {
    const size_t L = L0 + ln.g, i = L * kL128Packs + ln.k;
    const bool live = L < nl, mine = live && ln.k < 7 && i < npk;
    const uint4 r = l128_reduce<T, Op>(c, pack_if(mine, xb, i, n, sizeof(T)), par, 0, live, L,
                                       ln.k, epoch, avg);
    if (mine) store_pack(reinterpret_cast<char*>(out), i, n, sizeof(T), r);
  }
  ll_end(c, var);
}

// all_reduce, two phases (3+ ranks). Chunk q = packs [q*C, (q+1)*C), C = ceil(npk / nranks),
// as lines 0..CL-1 (pack j of a chunk in line j / 7); line L of chunk q exists iff L < CL and
// q*C + 7L < npk (writer and reader test the same). (1) ll_begin; (2) line L of chunk p to
// peer p (half 0); (3) our chunk's line L reduced in rank order into out and to every peer
// (half 1); (4) every peer q's reduced line L (half 1) into out. In place is safe: the lane
// that writes out's pack q*C + j read x's pack q*C + j before (same lane layout every phase).
template <typename T, class Op>
__global__ void __launch_bounds__(kMaxThreads) l128_allreduce2_kernel(DevComm c, const T* x, T* out,
                                                                 size_t count, bool avg, int var) {
  pdl_begin();
  const uint32_t peers = peers_of(c);
  const uint64_t epoch = ll_begin(c, var, peers);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const L128Lane ln = l128_lane();
  const size_t n = count * sizeof(T), npk = (n + 15) / 16;
  const size_t C = (npk + c.nranks - 1) / c.nranks, CL = (C + kL128Packs - 1) / kL128Packs;
  auto exists = [&](int q, size_t L) { return L < CL && q * C + L * kL128Packs < npk; };
  auto valid = [&](int q, size_t j) { return ln.k < 7 && j < C && q * C + j < npk; };
  const char* xb = reinterpret_cast<const char*>(x);
  char* ob = reinterpret_cast<char*>(out);
  for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
    const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank && exists(p, L))
        l128_store(ll_slot(c, p, par, c.rank, 0), L, ln.k,
                   pack_if(valid(p, j), xb, p * C + j, n, sizeof(T)), epoch);
  }
  ll_announce(c, var, epoch);
  for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
    const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
    const bool live = exists(c.rank, L), mine = live && valid(c.rank, j);
    const size_t pk = c.rank * C + j;
    const uint4 r = l128_reduce<T, Op>(c, pack_if(mine, xb, pk, n, sizeof(T)), par, 0, live, L,
                                       ln.k, epoch, avg);
    if (mine) store_pack(ob, pk, n, sizeof(T), r);
    if (live)
      for (int p = 0; p < c.nranks; ++p)
        if (p != c.rank) l128_store(ll_slot(c, p, par, c.rank, 1), L, ln.k, r, epoch);
  }
  for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
    const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
    uint32_t from = 0;
    for (int q = 0; q < c.nranks; ++q)
      if (((peers >> q) & 1) && exists(q, L)) from |= 1u << q;
    l128_gather(c, from, par, 1, L < CL, L, ln.k, epoch, [&](int q, uint4 d) {
      if (valid(q, j)) store_pack(ob, q * C + j, n, sizeof(T), d);
    });
  }
  ll_end(c, var);
}

// broadcast, one pass. Root: ll_begin -> every line of src to every peer's ll_slot(p, par,
// root), and with kCopy (out of place) every pack into its own x; it waits for nothing else.
// Peer: polls every line from ll_slot(rank, par, root) into x (src unused).
template <bool kCopy>
__global__ void __launch_bounds__(kMaxThreads) l128_bcast_kernel(DevComm c, const char* src, char* x,
                                                            size_t n, int root, int elem, int var) {
  pdl_begin();
  const bool is_root = c.rank == root;
  const uint64_t epoch = ll_begin(c, var, is_root ? peers_of(c) : 0u);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const L128Lane ln = l128_lane();
  const size_t npk = (n + 15) / 16, nl = (npk + kL128Packs - 1) / kL128Packs;
  if (is_root) {
    for (size_t L0 = warp0(var); L0 < nl; L0 += line_stride(var)) {
      const size_t L = L0 + ln.g, i = L * kL128Packs + ln.k;
      if (L >= nl) continue;
      const bool valid = ln.k < 7 && i < npk;
      const uint4 d = pack_if(valid, src, i, n, elem);
      for (int p = 0; p < c.nranks; ++p)
        if (p != root) l128_store(ll_slot(c, p, par, root), L, ln.k, d, epoch);
      if (kCopy && valid) store_pack(x, i, n, elem, d);
    }
    ll_announce(c, var, epoch);
  } else {
    for (size_t L0 = warp0(var); L0 < nl; L0 += line_stride(var)) {
      const size_t L = L0 + ln.g, i = L * kL128Packs + ln.k;
      l128_gather(c, 1u << root, par, 0, L < nl, L, ln.k, epoch, [&](int, uint4 d) {
        if (ln.k < 7 && i < npk) store_pack(x, i, n, elem, d);
      });
    }
  }
  ll_end(c, var);
}

// broadcast, two phases (3+ ranks): chunk idx(p) (C = ceil(npk / (nranks - 1)) packs, lines
// 0..CL-1) belongs to non-root p; line L of chunk idx(q) exists iff L < CL and idx(q)*C + 7L <
// npk. Root: line L of chunk idx(p) to p (half 0; kCopy: packs into its own x too). Non-root
// p: its line L from the root into x and to every other non-root (half 1) -> every other
// non-root q's line L (half 1) into x.
template <bool kCopy>
__global__ void __launch_bounds__(kMaxThreads) l128_bcast2_kernel(DevComm c, const char* src, char* x,
                                                             size_t n, int root, int elem, int var) {
  pdl_begin();
  const uint32_t nonroots = ((1u << c.nranks) - 1) & ~(1u << root);
  const uint32_t dst = nonroots & ~(1u << c.rank);
  const uint64_t epoch = ll_begin(c, var, dst);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const L128Lane ln = l128_lane();
  const size_t npk = (n + 15) / 16, C = (npk + c.nranks - 2) / (c.nranks - 1);
  const size_t CL = (C + kL128Packs - 1) / kL128Packs;
  auto idx = [&](int p) -> size_t { return p < root ? p : p - 1; };
  auto exists = [&](int q, size_t L) { return L < CL && idx(q) * C + L * kL128Packs < npk; };
  auto valid = [&](int q, size_t j) { return ln.k < 7 && j < C && idx(q) * C + j < npk; };
  if (c.rank == root) {
    for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
      const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
      for (int p = 0; p < c.nranks; ++p) {
        if (p == root || !exists(p, L)) continue;
        const bool v = valid(p, j);
        const uint4 d = pack_if(v, src, idx(p) * C + j, n, elem);
        l128_store(ll_slot(c, p, par, root, 0), L, ln.k, d, epoch);
        if (kCopy && v) store_pack(x, idx(p) * C + j, n, elem, d);
      }
    }
    ll_announce(c, var, epoch);
  } else {
    for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
      const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
      const bool live = exists(c.rank, L);
      l128_gather(c, 1u << root, par, 0, live, L, ln.k, epoch, [&](int, uint4 d) {
        if (valid(c.rank, j)) store_pack(x, idx(c.rank) * C + j, n, elem, d);
        for (int q = 0; q < c.nranks; ++q)
          if ((dst >> q) & 1) l128_store(ll_slot(c, q, par, c.rank, 1), L, ln.k, d, epoch);
      });
    }
    ll_announce(c, var, epoch);
    for (size_t L0 = warp0(var); L0 < CL; L0 += line_stride(var)) {
      const size_t L = L0 + ln.g, j = L * kL128Packs + ln.k;
      uint32_t from = 0;
      for (int q = 0; q < c.nranks; ++q)
        if (((dst >> q) & 1) && exists(q, L)) from |= 1u << q;
      l128_gather(c, from, par, 1, L < CL, L, ln.k, epoch, [&](int q, uint4 d) {
        if (valid(q, j)) store_pack(x, idx(q) * C + j, n, elem, d);
      });
    }
  }
  ll_end(c, var);
}

// Same launch as ll_kernels.cu's ll_launch (PDL when var has kLLPdl).
template <typename... K, typename... A>
void l128_launch(void (*kernel)(K...), size_t lines, cudaStream_t s, int var, A... args) {
  // 8 lanes per line; blocks of LINKWISE_GPU_LL128_THREADS (default 64, a multiple of 32,
  // 64..256) up to LINKWISE_GPU_LL128_BLOCKS (default 1024: every line its own lane group up
  // to 256 KiB; 128 and 256 blocks measured slower at 128-256 KiB one pass).
  int t = tune_int("LINKWISE_GPU_LL128_THREADS", 64) / 32 * 32;
  t = t < 64 ? 64 : t > kMaxThreads ? kMaxThreads : t;
  int cap = tune_int("LINKWISE_GPU_LL128_BLOCKS", 1024);
  cap = cap > 1024 ? 1024 : cap;
  const size_t b = (lines * 8 + t - 1) / t;
  const int blocks = static_cast<int>(b < 1 ? 1 : b > static_cast<size_t>(cap) ? cap : b) +
                     ((var & kLLSpareBlock) ? 1 : 0);  // block 0: the spare block
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(t);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = (var & kLLPdl) ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, args...);
}

size_t lines_of(size_t n, int parts) {
  const size_t npk = (n + 15) / 16, chunk = (npk + parts - 1) / parts;
  return (chunk + kL128Packs - 1) / kL128Packs;
}

template <typename T, class Op> struct L128AllReduce {
  static void run(const DevComm& c, const void* x, void* out, size_t count, bool avg, bool two,
                  int var, cudaStream_t s) {
    auto* k = two ? l128_allreduce2_kernel<T, Op> : l128_allreduce_kernel<T, Op>;
    l128_launch(k, lines_of(count * sizeof(T), two ? c.nranks : 1), s, var, c,
                static_cast<const T*>(x), static_cast<T*>(out), count, avg, var);
  }
};

}  // namespace

bool l128_fits(size_t n, int parts) {
  return lines_of(n, parts) * kL128Bytes <= (parts == 1 ? kLLSlotBytes : kLLSlotBytes / 2);
}

void launch_l128_allreduce(const DevComm& c, int dtype, int op, const void* x, void* out,
                           size_t count, bool two, int var, cudaStream_t s) {
  dispatch<L128AllReduce>(dtype, op, c, x, out, count, op == kAvg, two, var, s);
}

void launch_l128_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root,
                           int elem, bool two, int var, cudaStream_t s) {
  const bool copy = src != x;
  auto* k = two ? (copy ? l128_bcast2_kernel<true> : l128_bcast2_kernel<false>)
                : (copy ? l128_bcast_kernel<true> : l128_bcast_kernel<false>);
  l128_launch(k, lines_of(n, two ? c.nranks - 1 : 1), s, var, c, static_cast<const char*>(src),
              static_cast<char*>(x), n, root, elem, var);
}

}  // namespace linkwise::cuda
