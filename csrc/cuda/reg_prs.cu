// Push reduce-scatter + push all-gather all_reduce in one kernel per rank
// (LINKWISE_GPU_AR_ALGO=prs). Unlike reg_reduce.cu, nobody loads from a peer: every byte
// crosses NVLink as an SM store.
//
// Data: x (count elements) is cut into chunks of m elements (m a multiple of 16 bytes), chunk p
// owned by rank p, and each chunk into K items of `item` bytes (the last ones short or empty;
// K is the same for every owner). Every rank's out is mapped here (EngineImpl::reg[0]), and so is
// every rank's prs scratch (reg[2], GpuEngine::prs_scratch, used by nothing else): in owner p's
// scratch, sender q owns the region (q - p - 1) mod n of kPrsPeerBytes, cut into S = slots of
// `item` bytes; item k of chunk p from q goes to slot k mod S.
//
// Units: U = (K + lag) * n, claimed in increasing order by the blocks (atomicAdd on our
// Control.prs_claim, work-claiming as bcast_dchain.cu). Unit u: step = u / n, r = u % n;
// r < n-1: "send item `step` of chunk p = (rank + 1 + r) mod n to p" (copy it from our x into
// our slot in p's scratch); r = n-1: "reduce item step - lag of our chunk": read it from our x
// and from every sender's slot (local HBM), reduce in rank order 0..n-1 (float16/bfloat16 in
// float32, avg divides at the end, as reg_reduce.cu: results bitwise equal to it and the same
// on every rank since only the owner reduces), store it into our out and every peer's out.
//
// Flags (u64 in the Control of the rank named; seq(k) = seq_base + k + 1, seq_base the sum of K
// over earlier prs calls, the same on every rank, so values only grow and are never reset):
//  * prs_arrive[q][j] on owner p = seq(k): sender q's item k is in slot j. Written by q's
//    control lane (st.release.sys) after its copy warps' stores (bar 2) and a system fence;
//    p's control lane acquires it before its block reduces item k.
//  * prs_ack[p][j] on sender q = seq(k): owner p has read slot j's item k (posted after the
//    block's loads, bar 2, fence). q waits for ack >= seq(k - S) before storing item k into
//    slot j, for k >= S. Items k < S reuse slots of an earlier call, all consumed: q's earlier
//    call ended only after every reduced item of p arrived (prs_ag below), and p reduces an
//    item only after it read q's contribution.
//  * prs_ag[p] on every peer q: +1 (red.release.sys) per item of chunk p that p stored into
//    q's out. Before our kernel ends, lanes of block 0 wait until every peer's count reached
//    the host's cumulative total (EngineImpl::prs_ag_seen), so out is final at kernel end.
// Entry: no rendezvous. A peer's out is written only with item k's reduction, which needs that
// peer's own send of item k: its kernel has started (its stream reached the call; its out is
// free), and it has already read that part of its x (out == x in place is safe). Nobody reads
// another rank's x or out, so no exit rendezvous either.
// Progress: a control lane never blocks while it holds a posted-less unit whose stores are
// done: it claims the next unit, polls its dependencies once, and if they are not met it
// posts the current unit before waiting (waiting first could deadlock: two ranks each holding
// the send the other's next reduce needs). Dependencies point to strictly earlier steps
// (S > lag), so the earliest unposted unit of all ranks can always go on.
// Waits are wait_ge (bounded): a wait that gives up lets the kernel go on without the data
// (claims continue, so Control.prs_claim stays consistent); the host raises at its next call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "core/status.h"
#include "cuda/chain_util.cuh"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"
#include "cuda/reduce_ops.cuh"

namespace linkwise::cuda {
namespace {

constexpr int kPrsThreads = 1024;

struct PrsArgs {
  const char* x = nullptr;
  char* out[kMaxRanks] = {};  // every rank's out (element 0) as mapped here
  char* scr[kMaxRanks] = {};  // every rank's prs scratch as mapped here
  size_t count = 0, m = 0, item_el = 0, item_bytes = 0, es = 0;
  uint64_t K = 0, units = 0, seq_base = 0, claim_base = 0;
  uint64_t ag_want[kMaxRanks] = {};
  int lag = 0, slots = 0;
  bool avg = false;
};

// One unit as the copy warps need it (written by the control lane, double-buffered).
struct Desc {
  uint64_t u;      // >= units: the end
  int reduce;      // 0: copy src[0] -> dst[0]; 1: reduce src[0..n) into dst[0..n)
  int empty;       // step outside [0, K): nothing to do, nothing to post
  uint64_t k;      // item
  int peer;        // send: the owner
  size_t len;      // elements
  const char* src[kMaxRanks];
  char* dst[kMaxRanks];
};

__device__ __forceinline__ char* slot_of(const DevComm& c, const PrsArgs& a, int owner, int sender, uint64_t k) {
  const int region = (sender - owner - 1 + c.nranks) % c.nranks;
  return a.scr[owner] + static_cast<size_t>(region) * kPrsPeerBytes + (k % a.slots) * a.item_bytes;
}

__device__ void describe(const DevComm& c, const PrsArgs& a, uint64_t u, Desc* d) {
  const int n = c.nranks, me = c.rank;
  d->u = u;
  if (u >= a.units) return;
  const uint64_t step = u / n;
  const int r = static_cast<int>(u % n);
  d->reduce = r == n - 1;
  d->empty = d->reduce ? (step < static_cast<uint64_t>(a.lag)) : (step >= a.K);
  if (d->empty) return;
  d->k = d->reduce ? step - a.lag : step;
  d->peer = d->reduce ? me : (me + 1 + r) % n;
  const size_t lo = d->peer * a.m + d->k * a.item_el;
  const size_t cend = (d->peer + 1) * a.m, end = cend < a.count ? cend : a.count;
  d->len = lo >= end ? 0 : end - lo < a.item_el ? end - lo : a.item_el;
  if (!d->reduce) {
    d->src[0] = a.x + lo * a.es;
    d->dst[0] = slot_of(c, a, d->peer, me, d->k);
    return;
  }
  for (int q = 0; q < n; ++q) {
    d->src[q] = q == me ? a.x + lo * a.es : slot_of(c, a, me, q, d->k);
    d->dst[q] = a.out[(me + q) % n] + lo * a.es;  // our own out first
  }
}

// Dependencies of unit d (control lane): send item k >= S: the owner acked item k - S of our
// slot; reduce item k: every sender's item k arrived. poll: one look (true = met).
__device__ bool deps(const DevComm& c, const PrsArgs& a, const Desc& d, bool poll) {
  if (d.u >= a.units || d.empty) return true;
  Control* my = c.ctrl(c.rank);
  const int j = static_cast<int>(d.k % a.slots);
  if (!d.reduce) {
    if (d.k < static_cast<uint64_t>(a.slots)) return true;
    const uint64_t want = a.seq_base + d.k - a.slots + 1;
    return poll ? ld_acquire_sys(&my->prs_ack[d.peer][j]) >= want : (wait_ge(c, &my->prs_ack[d.peer][j], want), true);
  }
  const uint64_t want = a.seq_base + d.k + 1;
  for (int q = 0; q < c.nranks; ++q) {
    if (q == c.rank) continue;
    if (poll) {
      if (ld_acquire_sys(&my->prs_arrive[q][j]) < want) return false;
    } else {
      wait_ge(c, &my->prs_arrive[q][j], want);
    }
  }
  return true;
}

// Publishes unit d (control lane, after bar 2 and __threadfence_system).
__device__ void post(const DevComm& c, const PrsArgs& a, const Desc& d) {
  if (d.u >= a.units || d.empty) return;
  const int j = static_cast<int>(d.k % a.slots), me = c.rank;
  const uint64_t seq = a.seq_base + d.k + 1;
  if (!d.reduce) {
    st_release_sys(&c.ctrl(d.peer)->prs_arrive[me][j], seq);
    return;
  }
  for (int q = 0; q < c.nranks; ++q) {
    if (q == me) continue;
    st_release_sys(&c.ctrl(q)->prs_ack[me][j], seq);
    red_release_sys_add(&c.ctrl(q)->prs_ag[me], 1);
  }
}

// Loads that skip L1 (ld.global.cg): a scratch slot is rewritten over NVLink between uses, so a
// line an SM cached from slot j's previous item must never be read again for this one (the
// control lane's acquire is the ordering; this keeps stale L1 lines out of it regardless).
template <typename T> __device__ __forceinline__ T ldcg(const T* p) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8, "element size");
  T v;
  if constexpr (sizeof(T) == 2) {
    const unsigned short b = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&v, &b, 2);
  } else if constexpr (sizeof(T) == 4) {
    const unsigned int b = __ldcg(reinterpret_cast<const unsigned int*>(p));
    memcpy(&v, &b, 4);
  } else {
    const unsigned long long b = __ldcg(reinterpret_cast<const unsigned long long*>(p));
    memcpy(&v, &b, 8);
  }
  return v;
}

// Threads t0..t0+nt-1: src[0..n) reduced in rank order into every dst[0..n), len elements.
// d.src[q] is rank q's contribution (q-th entry in rank order).
template <typename T, class Op, int kU>
__device__ void reduce_item(const Desc& d, int n, bool avg, int t, int nt) {
  using A = typename AccT<T>::type;
  constexpr int V = Pack<T>::kN;
  constexpr int kG = 4;
  Op op;
  bool vec = true;
  for (int q = 0; q < n; ++q) vec &= aligned16(d.src[q]) && aligned16(d.dst[q]);
  size_t done = 0;
  if (vec) {
    const size_t nv = d.len / V;
    for (size_t i = t; i < nv; i += static_cast<size_t>(kU) * nt) {
      A acc[kU][V];
      for (int g = 0; g < n; g += kG) {
        Pack<T> p[kU][kG];
#pragma unroll
        for (int s = 0; s < kG; ++s)
#pragma unroll
          for (int u = 0; u < kU; ++u)
            if (g + s < n && i + u * nt < nv) p[u][s].u = __ldcg(reinterpret_cast<const uint4*>(d.src[g + s]) + i + u * nt);
#pragma unroll
        for (int s = 0; s < kG; ++s) {
          if (g + s >= n) break;
#pragma unroll
          for (int u = 0; u < kU; ++u)
#pragma unroll
            for (int e = 0; e < V; ++e)
              acc[u][e] = g + s == 0 ? up<T>(p[u][s].v[e]) : op(acc[u][e], up<T>(p[u][s].v[e]));
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const size_t idx = i + u * nt;
        if (idx >= nv) break;
        Pack<T> r;
#pragma unroll
        for (int e = 0; e < V; ++e) r.v[e] = down<T>(avg ? acc[u][e] / static_cast<A>(n) : acc[u][e]);
        for (int q = 0; q < n; ++q) reinterpret_cast<uint4*>(d.dst[q])[idx] = r.u;
      }
    }
    done = nv * V;
  }
  for (size_t i = done + t; i < d.len; i += nt) {
    A acc = up<T>(ldcg(reinterpret_cast<const T*>(d.src[0]) + i));
    for (int q = 1; q < n; ++q) acc = op(acc, up<T>(ldcg(reinterpret_cast<const T*>(d.src[q]) + i)));
    const T r = down<T>(avg ? acc / static_cast<A>(n) : acc);
    for (int q = 0; q < n; ++q) reinterpret_cast<T*>(d.dst[q])[i] = r;
  }
}

// Roles: warp 0 is the control warp (lane 0 claims, describes, awaits and posts units; the
// warp takes part in the named barriers), warps 1.. are copy warps. Barrier 1 = "go with
// s_desc[k & 1]", barrier 2 = "the copy warps issued every load and store of that unit".
template <typename T, class Op>
__global__ void __launch_bounds__(kPrsThreads) prs_kernel(DevComm c, PrsArgs a) {
  __shared__ Desc s_desc[2];
  if (threadIdx.x >= 32) {
    const int t = threadIdx.x - 32, nt = blockDim.x - 32;
    for (uint64_t k = 0;; ++k) {
      bar_sync(1);
      const Desc& d = s_desc[k & 1];
      if (d.u >= a.units) return;
      if (!d.empty) {
        if (d.reduce) reduce_item<T, Op, 1>(d, c.nranks, a.avg, t, nt);
        else slice_copy<4>(d.dst[0], d.src[0], d.len * a.es, t, nt);
      }
      bar_arrive(2);
    }
  }
  Control* my = c.ctrl(c.rank);
  const bool lead = threadIdx.x == 0;
  auto claim = [&]() -> uint64_t {
    return atomicAdd(reinterpret_cast<unsigned long long*>(&my->prs_claim), 1ull) - a.claim_base;
  };
  uint64_t cur = 0;
  if (lead) {
    cur = claim();
    describe(c, a, cur, &s_desc[0]);
    deps(c, a, s_desc[0], false);  // we hold nothing unposted yet
  }
  cur = __shfl_sync(0xffffffffu, cur, 0);
  bar_sync(1);
  for (uint64_t k = 0; cur < a.units; ++k) {
    uint64_t next = 0;
    int ready = 1;
    Desc& dn = s_desc[(k + 1) & 1];
    if (lead) {
      next = claim();
      describe(c, a, next, &dn);
      ready = deps(c, a, dn, true);
    }
    next = __shfl_sync(0xffffffffu, next, 0);
    ready = __shfl_sync(0xffffffffu, ready, 0);
    bar_sync(2);  // the copy warps issued unit cur
    if (ready) {
      bar_sync(1);  // go next, then publish cur (the fence's round trip overlaps next's copy)
      if (lead) {
        __threadfence_system();  // cumulative: the copy warps' accesses of cur (bar 2)
        post(c, a, s_desc[k & 1]);
      }
    } else {
      if (lead) {  // publish cur before blocking on next (Progress, above)
        __threadfence_system();
        post(c, a, s_desc[k & 1]);
        deps(c, a, dn, false);
      }
      __syncwarp();
      bar_sync(1);
    }
    cur = next;
  }
  // Out is final only once every peer's reduced items arrived.
  if (blockIdx.x == 0 && threadIdx.x < c.nranks && threadIdx.x != c.rank)
    wait_ge(c, &my->prs_ag[threadIdx.x], a.ag_want[threadIdx.x]);
}

template <typename T, class Op> struct PrsLaunch {
  static void run(const DevComm& c, const PrsArgs& a, int blocks, cudaStream_t s) {
    prs_kernel<T, Op><<<blocks, kPrsThreads, 0, s>>>(c, a);
  }
};

}  // namespace

uintptr_t GpuEngine::prs_scratch() {
  EngineImpl& im = *impl_;
  if (im.prs_own == nullptr) {
    DeviceGuard g(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, static_cast<size_t>(nranks_ > 1 ? nranks_ - 1 : 1) * kPrsPeerBytes);
    if (e != cudaSuccess) fail("prs scratch", e);
    im.prs_own = static_cast<char*>(p);
  }
  return reinterpret_cast<uintptr_t>(im.prs_own);
}

// Contract in the file's header. Slot 0 = every rank's out, slot 2 = every rank's prs scratch.
void GpuEngine::all_reduce_prs_reg(uintptr_t x, size_t count, int dtype, int op, uintptr_t stream) {
  const size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "all_reduce: unsupported dtype code");
  if (count == 0 || nranks_ == 1) throw Error(ErrorKind::Invalid, "all_reduce_prs_reg: needs count > 0 and 2+ ranks");
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  RegUse use{im, reinterpret_cast<cudaStream_t>(stream)};  // the cache's safety rule (reg_cache.h)
  for (int r = 0; r < nranks_; ++r)
    if (!im.reg[0][r] || !im.reg[2][r]) throw Error(ErrorKind::Invalid, "all_reduce_prs_reg: buffers not mapped");
  // Tuning knobs (read per call; every rank must see the same values).
  const char* e = std::getenv("LINKWISE_GPU_PRS_BLOCKS");
  // Defaults: the best of the geometries measured on 2xH200 (b48 i192K, three repeats over
  // two calls; docs/benchmarks.md, sixth session). More blocks x bigger items than the slots
  // cover (b64 i512K, b96 i256K) stall on slot acks and were 30-40% slower. Not measured on
  // more ranks.
  const int blocks = e && std::atoi(e) > 0 ? std::min(std::atoi(e), 1024) : 48;
  e = std::getenv("LINKWISE_GPU_PRS_ITEM");
  size_t item = e && std::atoll(e) > 0 ? static_cast<size_t>(std::atoll(e)) : (192u << 10);
  item = std::min<size_t>((item + 4095) / 4096 * 4096, kPrsPeerBytes / 8);
  e = std::getenv("LINKWISE_GPU_PRS_LAG");
  const int lag = e && std::atoi(e) >= 0 ? std::min(std::atoi(e), 4) : 2;
  PrsArgs a;
  a.x = reinterpret_cast<const char*>(x);
  for (int r = 0; r < nranks_; ++r) a.out[r] = im.reg[0][r], a.scr[r] = im.reg[2][r];
  a.count = count, a.es = es;
  const size_t V = 16 / es;
  a.m = ((count + nranks_ - 1) / nranks_ + V - 1) / V * V;
  a.item_bytes = item, a.item_el = item / es;
  a.slots = static_cast<int>(std::min<size_t>(kPrsSlots, kPrsPeerBytes / item));  // >= 8 > lag
  a.K = (a.m + a.item_el - 1) / a.item_el;
  a.lag = lag;
  a.units = (a.K + lag) * nranks_;
  a.avg = op == kAvg;
  a.seq_base = im.prs_items;
  im.prs_items += a.K;
  a.claim_base = im.prs_claimed;
  im.prs_claimed += a.units + blocks;  // every unit once, and one failing claim per block
  for (int q = 0; q < nranks_; ++q)
    if (q != rank_) a.ag_want[q] = im.prs_ag_seen[q] += a.K;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  check_launch("all_reduce");
  dispatch<PrsLaunch>(dtype, op, im.dev, a, blocks, s);
  check_launch("all_reduce");
}

}  // namespace linkwise::cuda
