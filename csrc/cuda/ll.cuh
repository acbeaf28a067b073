// LL ("low latency") lines for small collectives: data and its flag travel in one 8-byte
// store, so a receiver polls the data itself and no fence + separate flag round trip is
// needed. Device code; internal to csrc/cuda (ll_kernels.cu).
//
// Region: rank r's LL area (gpu_device.cuh kControlStructBytes .. kControlBytes) holds one
// slot of kLLSlotBytes per (parity, src); ll_slot(c, r, par, src, half) is written only by
// rank src (remote stores) and read only by rank r. Parity = epoch & 1, as for the data
// regions. A slot has two halves (half 1 starts at kLLSlotBytes / 2): one-pass kernels use the
// whole slot from half 0, two-phase kernels (ll_twophase.cu) one half per phase.
//
// Line format: u64 = (flag << 32) | 4 data bytes, flag = ll_flag(epoch) != 0. A 16-byte pack
// of data is 4 lines (32 bytes), written with two st.volatile.v2.u64 (ll_lines: where pack i's
// two 16-byte halves live): each u64 element is a single-copy-atomic access, so a reader never
// sees a line's flag without its data.
//
// Contracts:
//  * every LL line a writer stores in an epoch is read exactly once by the slot's owner in
//    that epoch, and the owner then stores 0 into it (ll_load_pack), so the region is all
//    zeros between epochs: a stale line can never carry a matching flag (no wrap-around or
//    leftover-data aliasing, whatever the epoch count);
//  * a writer stores into ll_slot(peer, e&1, me, *) only after peer started epoch e-1
//    (ll_begin), i.e. after peer's kernel of epoch e-2, resets included, finished; the chain
//    reset -> kernel boundary -> peer's st.release of start -> our ld.acquire orders our new
//    lines after the reset.
#pragma once

#include <cstdint>

#include "cuda/gpu_device.cuh"

namespace linkwise::cuda {

constexpr size_t kLLPackBytes = 32;  // 16 data bytes as 4 lines
constexpr size_t kLLMaxData = kLLSlotBytes / 2;  // data bytes one LL slot carries
constexpr size_t kLLDefaultMax = 256 * 1024;     // LINKWISE_GPU_LL_MAX default
// Two-phase kernels (3+ ranks) from this many bytes: LINKWISE_GPU_LL_TWOPHASE_MIN (all_reduce)
// and LINKWISE_GPU_LL_BCAST2_MIN (broadcast) defaults; they apply to LL and LL128 lines alike.
// all_reduce up to kLLOnePassRanks ranks: never (above the LL cap): LL128 one pass measured
// faster at 256 KiB on 4xH200 (fifth session: 5.84 vs 6.01 us); more ranks (one pass pushes
// (n-1)x the message; not measured): from 192 KiB, as before. Broadcast: LL lines from 192
// KiB; LL128 lines (from kL128BcastMin, ll128.cuh) like all_reduce: never up to
// kLLOnePassRanks ranks (fifth session, 256 KiB: one pass 3.64 vs two phases 4.85 us).
constexpr int kLLTwoPhaseMin = 192 * 1024, kLLBcast2Min = 192 * 1024;
constexpr int kLLOnePassRanks = 4;

// Variant bits of the LL kernels (LINKWISE_GPU_LL_VARIANT, tuning sweeps):
//  kLLAtomicEpoch: epoch_arrive instead of epoch_begin/epoch_end (nothing at the kernel's end);
//  kLLDeferAnnounce: an all_reduce announces its start after its stores, not before them
//    (broadcast kernels ignore it: a root that defers ends later, measured slower);
//  kLLWarpLines: pack i of warp group w = i / 32, lane l = i % 32, has its halves at
//    w*1024 + l*16 and w*1024 + 512 + l*16 (a warp's store covers 512 contiguous bytes)
//    instead of i*32 and i*32 + 16;
//  kLLPdl: launched with programmatic dependent launch (launch side only, ll_kernels.cu);
//  kLLSpareAnnounce: the start announce (a system-scope release, i.e. a fence on the issuing
//    thread) is made by lanes of warp 1 instead of warp 0, so the threads that carry the first
//    packs (warp 0; all of them up to 512 bytes) store their data without waiting for it.
//  kLLSpareBlock: the grid has one more block, block 0, which carries no data: it makes the
//    start announce at once and ends; the data blocks (1..) never announce, so no data warp
//    waits for that fence and no announce needs deferring (kLLDeferAnnounce, kLLSpareAnnounce
//    have no effect with it).
constexpr int kLLAtomicEpoch = 1, kLLDeferAnnounce = 2, kLLWarpLines = 4, kLLPdl = 8,
              kLLSpareAnnounce = 16, kLLSpareBlock = 32;

// With kLLSpareBlock: whether this is the spare block 0; the data blocks' index and count.
__device__ __forceinline__ bool ll_is_spare(int var) {
  return (var & kLLSpareBlock) && blockIdx.x == 0;
}
__device__ __forceinline__ size_t ll_data_block(int var) {
  return blockIdx.x - ((var & kLLSpareBlock) ? 1 : 0);
}
__device__ __forceinline__ size_t ll_data_blocks(int var) {
  return gridDim.x - ((var & kLLSpareBlock) ? 1 : 0);
}
// Default: A, D, W, P (sweep on 4xH200, docs/benchmarks.md "third session") and the spare
// block (fifth session: the start-announce fence off every data warp's path).
constexpr int kLLDefaultVariant =
    kLLAtomicEpoch | kLLDeferAnnounce | kLLWarpLines | kLLPdl | kLLSpareBlock;

__device__ __forceinline__ uint64_t* ll_slot(const DevComm& c, int r, int par, int src,
                                             int half = 0) {
  return reinterpret_cast<uint64_t*>(c.base[r] + kControlStructBytes +
                                     (static_cast<size_t>(par) * kMaxRanks + src) * kLLSlotBytes +
                                     static_cast<size_t>(half) * (kLLSlotBytes / 2));
}

struct LLLines {
  uint64_t* a;  // lines 0, 1 of the pack (data bytes 0..7)
  uint64_t* b;  // lines 2, 3 (data bytes 8..15)
};
__device__ __forceinline__ LLLines ll_lines(uint64_t* slot, size_t i, bool warp_lines) {
  if (!warp_lines) return {slot + i * 4, slot + i * 4 + 2};
  uint64_t* w = slot + (i >> 5) * 128 + (i & 31) * 2;
  return {w, w + 64};
}

__device__ __forceinline__ uint32_t ll_flag(uint64_t epoch) {
  uint32_t f = static_cast<uint32_t>(epoch);
  return f ? f : 1u;
}

// Programmatic dependent launch: wait for the previous kernel in the stream (a no-op when we
// were launched without the attribute), then let the next one be scheduled.
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Stores 16 data bytes d as 4 lines.
__device__ __forceinline__ void ll_store_pack(LLLines l, uint4 d, uint32_t flag) {
  const uint64_t f = static_cast<uint64_t>(flag) << 32;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(l.a), "l"(f | d.x), "l"(f | d.y)
               : "memory");
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(l.b), "l"(f | d.z), "l"(f | d.w)
               : "memory");
}

__device__ __forceinline__ void ll_zero(LLLines l) {
  asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(l.a), "l"(0ull) : "memory");
  asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(l.b), "l"(0ull) : "memory");
}

// Waits until the 4 lines carry `flag`, returns their data, and zeroes the lines. When the
// wait gives up (gpu_device.cuh's WaitGuard: timeout, abort or an earlier failure; the error
// is recorded) returns zeros.
__device__ __forceinline__ uint4 ll_load_pack(const DevComm& c, LLLines l, uint32_t flag) {
  uint64_t a, b, d0, d1;
  WaitGuard guard;
  while (true) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(l.a) : "memory");
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(d0), "=l"(d1) : "l"(l.b) : "memory");
    if ((a >> 32) == flag && (b >> 32) == flag && (d0 >> 32) == flag && (d1 >> 32) == flag) break;
    if (guard.give_up(c)) {
      a = b = d0 = d1 = 0;
      break;
    }
  }
  ll_zero(l);
  return make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(d0),
                    static_cast<uint32_t>(d1));
}

// announce_start (gpu_device.cuh), by lanes 32 + t of block 0 with kLLSpareAnnounce (blocks
// of 64+ threads), else by threads t.
__device__ __forceinline__ void ll_announce_start(const DevComm& c, int var, uint64_t epoch) {
  if (!(var & kLLSpareAnnounce)) {
    announce_start(c, epoch);
    return;
  }
  const int t = threadIdx.x - 32;
  if (blockIdx.x == 0 && t >= 0 && t < c.nranks && t != c.rank)
    st_release_sys(&c.ctrl(t)->start[c.rank], epoch);
}

// Epoch start of an LL kernel. Every rank: the epoch (epoch_begin, or with kLLAtomicEpoch
// epoch_arrive) and, unless a writer defers it (kLLDeferAnnounce: ll_announce after its
// stores), announce_start. A writer (dst_mask: bit p = this rank stores into p's slots) also
// waits until each such peer may be written (it started epoch e-1); the start-flag loads
// (warp 1, lane t < nranks) are issued at once with the epoch read (warp 0); the block barrier
// then orders every thread's later stores after those acquires. Needs blockDim.x >= 64. The
// kernels return right after it in the spare block (kLLSpareBlock), after ll_end.
__device__ __forceinline__ uint64_t ll_begin(const DevComm& c, int var, uint32_t dst_mask) {
  __shared__ uint64_t seen[kMaxRanks];
  __shared__ uint64_t arrived;
  const int t = threadIdx.x - 32;
  const bool mine = t >= 0 && t < c.nranks && ((dst_mask >> t) & 1);
  if (mine) seen[t] = ld_acquire_sys(&c.ctrl(c.rank)->start[t]);
  uint64_t epoch = 0;
  if (var & kLLAtomicEpoch) {
    if (threadIdx.x == 0) arrived = epoch_arrive(c);
  } else {
    epoch = epoch_begin(c);
  }
  __syncthreads();
  if (var & kLLAtomicEpoch) epoch = arrived;
  if (var & kLLSpareBlock) {
    if (blockIdx.x == 0) announce_start(c, epoch);  // the spare block, threads t < nranks
  } else if (!(dst_mask && (var & kLLDeferAnnounce))) {
    ll_announce_start(c, var, epoch);
  }
  if (dst_mask && !ll_is_spare(var)) {
    if (mine && epoch >= 2 && seen[t] < epoch - 1)
      wait_ge(c, &c.ctrl(c.rank)->start[t], epoch - 1);
    __syncthreads();
  }
  return epoch;
}

// A writer's deferred announce (kLLDeferAnnounce), after its stores.
__device__ __forceinline__ void ll_announce(const DevComm& c, int var, uint64_t epoch) {
  if ((var & kLLDeferAnnounce) && !(var & kLLSpareBlock)) ll_announce_start(c, var, epoch);
}

// The epoch's end: epoch_end (without the cross-block counter when the grid is one block:
// every thread of the block has read seq before the barrier, so thread 0 may advance it), or
// nothing with kLLAtomicEpoch (epoch_arrive advanced seq).
__device__ __forceinline__ void ll_end(const DevComm& c, int var) {
  if (var & kLLAtomicEpoch) return;
  if (gridDim.x > 1) {
    epoch_end(c);
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Control* k = c.ctrl(c.rank);
    *reinterpret_cast<volatile uint64_t*>(&k->seq) = k->seq + (1ull << kArrivalBits);
  }
}

// Loads pack i of every source q in [g0, g0 + G) with bit q of `mask` set from our
// ll_slot(rank, par, q, half): all loads issued before any is waited on, then the missing ones
// polled (timeout as ll_load_pack); the lines read are zeroed. d[k] = q's data (q = g0 + k).
template <int G>
__device__ __forceinline__ void ll_load_group(const DevComm& c, int g0, uint32_t mask, int par,
                                              int half, size_t i, bool warp_lines, uint32_t flag,
                                              uint4* d) {
  uint64_t v[G][4];
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const int q = g0 + k;
    if (q < kMaxRanks && ((mask >> q) & 1)) {
      LLLines l = ll_lines(ll_slot(c, c.rank, par, q, half), i, warp_lines);
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[k][0]), "=l"(v[k][1]) : "l"(l.a) : "memory");
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[k][2]), "=l"(v[k][3]) : "l"(l.b) : "memory");
    }
  }
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const int q = g0 + k;
    if (q >= kMaxRanks || !((mask >> q) & 1)) continue;
    LLLines l = ll_lines(ll_slot(c, c.rank, par, q, half), i, warp_lines);
    if ((v[k][0] >> 32) == flag && (v[k][1] >> 32) == flag && (v[k][2] >> 32) == flag &&
        (v[k][3] >> 32) == flag) {
      ll_zero(l);
      d[k] = make_uint4(static_cast<uint32_t>(v[k][0]), static_cast<uint32_t>(v[k][1]),
                        static_cast<uint32_t>(v[k][2]), static_cast<uint32_t>(v[k][3]));
    } else {
      d[k] = ll_load_pack(c, l, flag);
    }
  }
}

// Bytes [16*i, 16*i + 16) of p (n bytes long) as a pack; missing bytes read as 0. One 16-byte
// load when p is 16-byte aligned and the pack is whole, else element by element (elem bytes,
// p and n aligned to elem; 8-byte elements as two words). Constant indices only, so the pack
// stays in registers (no local-memory union).
__device__ __forceinline__ uint4 load_pack(const char* p, size_t i, size_t n, int elem) {
  const size_t off = i * 16;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && off + 16 <= n)
    return reinterpret_cast<const uint4*>(p)[i];
  const size_t k = n - off < 16 ? n - off : 16;  // valid bytes, a multiple of elem
  const char* q = p + off;
  uint32_t w[4] = {0, 0, 0, 0};
  if (elem >= 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * j < k) w[j] = reinterpret_cast<const uint32_t*>(q)[j];
  } else if (elem == 2) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (2 * j < k) w[j / 2] |= static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(q)[j]) << (16 * (j & 1));
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (j < k) w[j / 4] |= static_cast<uint32_t>(static_cast<unsigned char>(q[j])) << (8 * (j & 3));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Stores the valid bytes of pack i (see load_pack) into p.
__device__ __forceinline__ void store_pack(char* p, size_t i, size_t n, int elem, uint4 d) {
  const size_t off = i * 16;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && off + 16 <= n) {
    reinterpret_cast<uint4*>(p)[i] = d;
    return;
  }
  const size_t k = n - off < 16 ? n - off : 16;
  char* q = p + off;
  const uint32_t w[4] = {d.x, d.y, d.z, d.w};
  if (elem >= 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (4 * j < k) reinterpret_cast<uint32_t*>(q)[j] = w[j];
  } else if (elem == 2) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (2 * j < k) reinterpret_cast<uint16_t*>(q)[j] = static_cast<uint16_t>(w[j / 2] >> (16 * (j & 1)));
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (j < k) q[j] = static_cast<char>(w[j / 4] >> (8 * (j & 3)));
  }
}

}  // namespace linkwise::cuda
