// Small all_reduce and broadcast over LL lines (ll.cuh): one kernel, one epoch, no fence and
// no separate ready flag on the critical path. Used for messages of at most ll_max() bytes
// (LINKWISE_GPU_LL_MAX, default kLLDefaultMax, cap kLLMaxData); larger ones take
// reduce_kernels.cu / copy_kernels.cu. Results are bitwise those of the other kernels: same
// reduction order (rank 0..n-1), same accumulation types.
//
// Two shapes: one pass (every rank pushes its whole message to every peer; the latency
// optimum) and, from LINKWISE_GPU_LL_TWOPHASE_MIN / _LL_BCAST2_MIN bytes with 3+ ranks, two
// phases (reduce-scatter + all-gather, scatter + all-gather for broadcast) that move each
// byte over fewer links.
#include <cctype>
#include <cstdlib>
#include <string>

#include "cuda/ll128.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

// Block size cap of the LL kernels (registers: G sources' packs in flight per thread).
constexpr int kLLMaxThreads = 256;
constexpr int G = 8;  // sources polled at once (more ranks: several groups, in order)

__device__ __forceinline__ uint32_t peers_of(const DevComm& c) {
  return ((1u << c.nranks) - 1) & ~(1u << c.rank);
}
// Data threads (kLLSpareBlock: block 0 is not one of them; kernels return there first).
__device__ __forceinline__ size_t global_tid(int var) {
  return ll_data_block(var) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t grid_threads(int var) {
  return ll_data_blocks(var) * blockDim.x;
}

// Pack i reduced in rank order 0..n-1: `own` for q == rank, else q's lines from our
// ll_slot(rank, par, q, half) (polled, then zeroed); avg divides by nranks at the end.
template <typename T, class Op>
__device__ __forceinline__ uint4 ll_reduce_pack(const DevComm& c, uint4 own, int par, int half,
                                                size_t i, bool wl, uint32_t flag, bool avg) {
  using A = typename AccT<T>::type;
  constexpr int V = Pack<T>::kN;
  Op op;
  A acc[V];
  for (int g0 = 0; g0 < c.nranks; g0 += G) {
    uint4 d[G];
    ll_load_group<G>(c, g0, peers_of(c), par, half, i, wl, flag, d);  // every peer at once
#pragma unroll
    for (int k = 0; k < G; ++k) {
      const int q = g0 + k;
      if (q >= c.nranks) break;
      Pack<T> p;
      p.u = q == c.rank ? own : d[k];
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] = q == 0 ? up<T>(p.v[j]) : op(acc[j], up<T>(p.v[j]));
    }
  }
  Pack<T> r;
#pragma unroll
  for (int k = 0; k < V; ++k) r.v[k] = down<T>(avg ? acc[k] / static_cast<A>(c.nranks) : acc[k]);
  return r.u;
}

// For every source q in `from` (a bit per rank): its pack i from our ll_slot(rank, par, q,
// half) goes to pack q_pack(q) of p (n bytes, elements of `elem` bytes).
template <class PackOf>
__device__ __forceinline__ void ll_gather_packs(const DevComm& c, uint32_t from, int par, int half,
                                                size_t i, bool wl, uint32_t flag, char* p,
                                                size_t n, int elem, PackOf q_pack) {
  for (int g0 = 0; g0 < c.nranks; g0 += G) {
    if (!((from >> g0) & ((1u << G) - 1))) continue;
    uint4 d[G];
    ll_load_group<G>(c, g0, from, par, half, i, wl, flag, d);
#pragma unroll
    for (int k = 0; k < G; ++k)
      if (((from >> (g0 + k)) & 1) && g0 + k < c.nranks) store_pack(p, q_pack(g0 + k), n, elem, d[k]);
  }
}

// all_reduce, one pass. Roles: every thread alike, owning packs i = tid, tid + stride, ...
// Pipeline: (1) ll_begin (peers are done with this parity's slots); (2) for each own pack:
// read 16 bytes of x, store them as LL lines into ll_slot(p, par, rank) of every peer p;
// (3) for each own pack: combine, in rank order, our x and each peer's lines (ll_reduce_pack)
// and store the valid bytes into out. In place (out == x) is safe: the thread that writes
// out's pack i has read x's pack i (in both loops) before.
template <typename T, class Op>
__global__ void __launch_bounds__(kLLMaxThreads) ll_allreduce_kernel(DevComm c, const T* x, T* out,
                                                                size_t count, bool avg, int var) {
  pdl_begin();
  const uint64_t epoch = ll_begin(c, var, peers_of(c));
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const bool wl = var & kLLWarpLines;
  const size_t n = count * sizeof(T), npk = (n + 15) / 16;
  const char* xb = reinterpret_cast<const char*>(x);
  for (size_t i = global_tid(var); i < npk; i += grid_threads(var)) {
    const uint4 d = load_pack(xb, i, n, sizeof(T));
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank) ll_store_pack(ll_lines(ll_slot(c, p, par, c.rank), i, wl), d, flag);
  }
  ll_announce(c, var, epoch);
  for (size_t i = global_tid(var); i < npk; i += grid_threads(var))
    store_pack(reinterpret_cast<char*>(out), i, n, sizeof(T),
               ll_reduce_pack<T, Op>(c, load_pack(xb, i, n, sizeof(T)), par, 0, i, wl, flag, avg));
  ll_end(c, var);
}

// all_reduce, two phases (3+ ranks). Chunk q = packs [q*C, (q+1)*C) of [0, npk), C =
// ceil(npk / nranks); rank q reduces chunk q. Thread j owns index i = j, j + stride, ... < C
// of every chunk. Pipeline: (1) ll_begin; (2) pack i of chunk p to peer p (half 0 of
// ll_slot(p, par, rank)); (3) pack i of our chunk reduced in rank order (own x + the peers'
// half-0 lines) into out and to every peer (half 1); (4) every peer q's reduced pack i (our
// half-1 lines from q) into out. In place is safe: the thread that writes out's pack k has
// read x's pack k before.
template <typename T, class Op>
__global__ void __launch_bounds__(kLLMaxThreads) ll_allreduce2_kernel(DevComm c, const T* x, T* out,
                                                                 size_t count, bool avg, int var) {
  pdl_begin();
  const uint32_t peers = peers_of(c);
  const uint64_t epoch = ll_begin(c, var, peers);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const bool wl = var & kLLWarpLines;
  const size_t n = count * sizeof(T), npk = (n + 15) / 16;
  const size_t C = (npk + c.nranks - 1) / c.nranks, own = c.rank * C;
  const char* xb = reinterpret_cast<const char*>(x);
  char* ob = reinterpret_cast<char*>(out);
  for (size_t i = global_tid(var); i < C; i += grid_threads(var))
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank && p * C + i < npk)
        ll_store_pack(ll_lines(ll_slot(c, p, par, c.rank, 0), i, wl),
                      load_pack(xb, p * C + i, n, sizeof(T)), flag);
  ll_announce(c, var, epoch);
  for (size_t i = global_tid(var); i < C && own + i < npk; i += grid_threads(var)) {
    const uint4 r = ll_reduce_pack<T, Op>(c, load_pack(xb, own + i, n, sizeof(T)), par, 0, i, wl,
                                          flag, avg);
    store_pack(ob, own + i, n, sizeof(T), r);
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank) ll_store_pack(ll_lines(ll_slot(c, p, par, c.rank, 1), i, wl), r, flag);
  }
  for (size_t i = global_tid(var); i < C; i += grid_threads(var)) {
    uint32_t from = 0;
    for (int q = 0; q < c.nranks; ++q)
      if (((peers >> q) & 1) && q * C + i < npk) from |= 1u << q;
    ll_gather_packs(c, from, par, 1, i, wl, flag, ob, n, sizeof(T), [&](int q) { return q * C + i; });
  }
  ll_end(c, var);
}

// broadcast, one pass. Root: ll_begin -> read its packs from src, store them as LL lines into
// ll_slot(p, par, root) of every peer p and (out of place, src != x) into its own x; it waits
// for nothing else. Peer: poll its packs from ll_slot(rank, par, root), zero the lines, store
// the bytes into x (src unused). src and x are equal or do not overlap. kCopy = src != x (a
// template parameter so the in-place kernel carries no copy work).
template <bool kCopy>
__global__ void __launch_bounds__(kLLMaxThreads) ll_bcast_kernel(DevComm c, const char* src, char* x,
                                                            size_t n, int root, int elem, int var) {
  pdl_begin();
  const bool is_root = c.rank == root;
  const uint64_t epoch = ll_begin(c, var, is_root ? peers_of(c) : 0u);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const bool wl = var & kLLWarpLines;
  const size_t npk = (n + 15) / 16;
  if (is_root) {
    for (size_t i = global_tid(var); i < npk; i += grid_threads(var)) {
      const uint4 d = load_pack(src, i, n, elem);
      for (int p = 0; p < c.nranks; ++p)
        if (p != root) ll_store_pack(ll_lines(ll_slot(c, p, par, root), i, wl), d, flag);
      if (kCopy) store_pack(x, i, n, elem, d);
    }
    ll_announce(c, var, epoch);
  } else {
    for (size_t i = global_tid(var); i < npk; i += grid_threads(var))
      store_pack(x, i, n, elem, ll_load_pack(c, ll_lines(ll_slot(c, c.rank, par, root), i, wl), flag));
  }
  ll_end(c, var);
}

// broadcast, two phases (3+ ranks): chunk j = packs [j*C, (j+1)*C) of [0, npk), C =
// ceil(npk / (nranks - 1)), belongs to the j-th non-root (idx). Root: ll_begin -> pack i of
// chunk idx(p) to non-root p (half 0 of ll_slot(p, par, root)). Non-root p: ll_begin -> its
// pack i from the root into x and to every other non-root (half 1 of their ll_slot(., par,
// p)) -> every other non-root q's pack i (our half-1 lines from q) into x. Out of place (src
// != x, root only; kCopy): the root reads src and also stores every pack into its own x.
template <bool kCopy>
__global__ void __launch_bounds__(kLLMaxThreads) ll_bcast2_kernel(DevComm c, const char* src, char* x,
                                                             size_t n, int root, int elem, int var) {
  pdl_begin();
  const uint32_t nonroots = ((1u << c.nranks) - 1) & ~(1u << root);
  const uint32_t dst = nonroots & ~(1u << c.rank);
  const uint64_t epoch = ll_begin(c, var, dst);
  if (ll_is_spare(var)) return ll_end(c, var);
  const int par = epoch & 1;
  const uint32_t flag = ll_flag(epoch);
  const bool wl = var & kLLWarpLines;
  const size_t npk = (n + 15) / 16, C = (npk + c.nranks - 2) / (c.nranks - 1);
  auto idx = [&](int p) -> size_t { return p < root ? p : p - 1; };
  if (c.rank == root) {
    // Every pack k < npk is idx(p) * C + i for exactly one (p, i): the copy covers x.
    for (size_t i = global_tid(var); i < C; i += grid_threads(var))
      for (int p = 0; p < c.nranks; ++p)
        if (p != root && idx(p) * C + i < npk) {
          const uint4 d = load_pack(src, idx(p) * C + i, n, elem);
          ll_store_pack(ll_lines(ll_slot(c, p, par, root, 0), i, wl), d, flag);
          if (kCopy) store_pack(x, idx(p) * C + i, n, elem, d);
        }
    ll_announce(c, var, epoch);
  } else {
    const size_t mine = idx(c.rank) * C;
    for (size_t i = global_tid(var); i < C && mine + i < npk; i += grid_threads(var)) {
      const uint4 d = ll_load_pack(c, ll_lines(ll_slot(c, c.rank, par, root, 0), i, wl), flag);
      store_pack(x, mine + i, n, elem, d);
      for (int q = 0; q < c.nranks; ++q)
        if ((dst >> q) & 1) ll_store_pack(ll_lines(ll_slot(c, q, par, c.rank, 1), i, wl), d, flag);
    }
    ll_announce(c, var, epoch);
    for (size_t i = global_tid(var); i < C; i += grid_threads(var)) {
      uint32_t from = 0;
      for (int q = 0; q < c.nranks; ++q)
        if (((dst >> q) & 1) && idx(q) * C + i < npk) from |= 1u << q;
      ll_gather_packs(c, from, par, 1, i, wl, flag, x, n, elem, [&](int q) { return idx(q) * C + i; });
    }
  }
  ll_end(c, var);
}

// Launches kernel<<<blocks, threads, 0, s>>>(args...), with programmatic dependent launch
// when var has kLLPdl (the kernels start with pdl_begin, which waits for the previous kernel).
template <typename... K, typename... A>
void ll_launch(void (*kernel)(K...), int blocks, int threads, cudaStream_t s, int var, A... args) {
  if (!(var & kLLPdl)) {
    kernel<<<blocks + ((var & kLLSpareBlock) ? 1 : 0), threads, 0, s>>>(args...);
    return;
  }
  if (var & kLLSpareBlock) ++blocks;  // block 0: the spare block
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <typename T, class Op> struct LLAllReduce {
  static void run(const DevComm& c, const void* x, void* out, size_t count, bool avg, bool two,
                  int blocks, int threads, int var, cudaStream_t s) {
    auto* k = two ? ll_allreduce2_kernel<T, Op> : ll_allreduce_kernel<T, Op>;
    ll_launch(k, blocks, threads, s, var, c, static_cast<const T*>(x), static_cast<T*>(out), count,
              avg, var);
  }
};

// Whether LINKWISE_GPU_TUNE was on at start-up: set and not one of config.py's false
// spellings ("", 0, false, no, off), as `linkwise info` reports it.
bool tuning_on() {
  static const bool on = [] {
    const char* e = std::getenv("LINKWISE_GPU_TUNE");
    if (!e) return false;
    std::string v(e);
    for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return !(v.empty() || v == "0" || v == "false" || v == "no" || v == "off");
  }();
  return on;
}

// Tuning knob read per call only when tuning was on at start-up (sweeps change it in one process).
int env_int(const char* name, int dflt) {
  if (!tuning_on()) return dflt;
  const char* e = std::getenv(name);
  return e && std::atoi(e) > 0 ? std::atoi(e) : dflt;
}

// LINKWISE_GPU_LL_VARIANT (ll.cuh's bits; 0 allowed) when tuning was on at start-up
// (tuning_on), else kLLDefaultVariant.
int ll_variant() {
  const char* e = tuning_on() ? std::getenv("LINKWISE_GPU_LL_VARIANT") : nullptr;
  return e && *e ? std::atoi(e) : kLLDefaultVariant;
}

// Grid for `units` packs per thread pass: one pack per thread, blocks of
// LINKWISE_GPU_LL_THREADS (tuning; default 64: many small blocks spread the NVLink stores and
// polls over many SMs, measured faster than 512-thread blocks at 32 KiB), at most
// LINKWISE_GPU_LL_BLOCKS (default 128) blocks.
void ll_grid(size_t units, int* blocks, int* threads) {
  int t = env_int("LINKWISE_GPU_LL_THREADS", 64);
  *threads = t < 64 ? 64 : t > kLLMaxThreads ? kLLMaxThreads : t;  // ll_begin needs 64
  int cap = env_int("LINKWISE_GPU_LL_BLOCKS", 128);
  cap = cap > 1024 ? 1024 : cap;
  size_t b = (units + *threads - 1) / *threads;
  *blocks = static_cast<int>(b < 1 ? 1 : b > static_cast<size_t>(cap) ? cap : b);
}

// Default two-phase threshold: none up to kLLOnePassRanks ranks, else `dflt`.
int two_min(const DevComm& c, int dflt) { return c.nranks <= kLLOnePassRanks ? 1 << 30 : dflt; }

// Default LL128 thresholds by rank count (ll128.cuh).
int l128_min(const DevComm& c) { return c.nranks == 2 ? kL128Min2 : kL128Min; }

// Two phases fit when a chunk of C packs fits half a slot (warp groups of 32 packs).
bool twophase_fits(size_t npk, int parts) {
  const size_t chunk = (npk + parts - 1) / parts;
  return (chunk + 31) / 32 * 32 <= kLLSlotBytes / 2 / kLLPackBytes;
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
  const int var = ll_variant();
  const size_t npk = (n + 15) / 16;
  const bool two = c.nranks > 2 && n >= static_cast<size_t>(env_int("LINKWISE_GPU_LL_TWOPHASE_MIN", two_min(c, kLLTwoPhaseMin))) &&
                   twophase_fits(npk, c.nranks);
  if (n >= static_cast<size_t>(env_int("LINKWISE_GPU_LL128_MIN", l128_min(c))) &&
      l128_fits(n, two ? c.nranks : 1)) {
    launch_l128_allreduce(c, dtype, op, x, out, count, two, var, s);
    return true;
  }
  int blocks, threads;
  ll_grid(two ? (npk + c.nranks - 1) / c.nranks : npk, &blocks, &threads);
  dispatch<LLAllReduce>(dtype, op, c, x, out, count, op == kAvg, two, blocks, threads, var, s);
  return true;
}

bool launch_ll_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root,
                         cudaStream_t s) {
  if (n == 0 || n > ll_max()) return false;
  const int var = ll_variant();
  const size_t npk = (n + 15) / 16;
  // LL128 lines: two phases by default only above kLLOnePassRanks ranks (as all_reduce; LL128
  // one pass measured faster at 256 KiB on 4xH200), LL lines: from kLLBcast2Min.
  const bool l128 = n >= static_cast<size_t>(env_int("LINKWISE_GPU_LL128_BCAST_MIN", kL128BcastMin));
  const int two_dflt = l128 ? two_min(c, kLLBcast2Min) : kLLBcast2Min;
  const bool two = c.nranks > 2 && n >= static_cast<size_t>(env_int("LINKWISE_GPU_LL_BCAST2_MIN", two_dflt)) &&
                   twophase_fits(npk, c.nranks - 1);
  int blocks, threads;
  ll_grid(two ? (npk + c.nranks - 2) / (c.nranks - 1) : npk, &blocks, &threads);
  if (c.rank != root) src = x;  // only the root reads src
  // the widest element that src, x and n allow
  const uintptr_t a = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(src) | n;
  const int elem = (a & 7) == 0 ? 8 : (a & 3) == 0 ? 4 : (a & 1) == 0 ? 2 : 1;
  const int bvar = var & ~kLLDeferAnnounce;
  if (l128 && l128_fits(n, two ? c.nranks - 1 : 1)) {
    launch_l128_broadcast(c, src, x, n, root, elem, two, bvar, s);
    return true;
  }
  const bool copy = src != x;
  ll_launch(two ? (copy ? ll_bcast2_kernel<true> : ll_bcast2_kernel<false>)
                : (copy ? ll_bcast_kernel<true> : ll_bcast_kernel<false>),
            blocks, threads, s, bvar, c, static_cast<const char*>(src), static_cast<char*>(x), n,
            root, elem, bvar);
  return true;
}

}  // namespace linkwise::cuda
