// LL128 lines for mid-size collectives (64-256 KiB): the LL idea (a receiver polls the data
// itself, no fence + separate ready flag) at 128-byte granularity, so the flag costs 16 of
// every 128 bytes (x1.14 on NVLink) instead of half of them (LL, ll.cuh: x2). Device code;
// internal to csrc/cuda (ll128_kernels.cu).
//
// Line format: 128 bytes, 128-byte aligned, written by 8 consecutive lanes of one warp with
// one st.volatile.global.v2.u64 each (the same warp instruction): lanes k = 0..6 carry data
// pack 7*L + k (16 bytes), lane 7 carries {flag, flag}, flag = the epoch (64 bits, never 0,
// never repeats). A reader polls the line's last 8 bytes with lane 7 alone and, once it sees
// the flag, loads the whole line again with all 8 lanes (l128_load) and keeps that data.
//
// HARDWARE ASSUMPTION (not given by the PTX memory model, which makes only each 8-byte element
// single-copy atomic): a warp's 128-byte aligned, fully covered line store over NVLink
// becomes visible in the peer's memory no later than its last 16 bytes do, so once a load has
// returned the flag, loads issued after it see the line's data of the same store. NCCL's
// LL128 protocol relies on the same property (and reloads the same way after its flag poll)
// and enables it by default on NVLink for sm_80/sm_90. NOT assumed (the fifth session's bug):
// that the data lanes' loads of the same instruction that returned the flag see that data.
// It is used here only from LINKWISE_GPU_LL128_MIN / _LL128_BCAST_MIN bytes and is checked by
// the stress tests in tests/test_gpu_ll128.py (all data verified bitwise, many epochs); set
// the knobs above the LL cap to turn it off.
//
// Region and contracts: the LL slots of ll.cuh (ll_slot), shared with the LL kernels, and
// their contracts unchanged: every line a writer stores in an epoch is read exactly once by
// the slot's owner in that epoch, which then zeroes the whole line (so the region is all zeros
// between epochs and an LL kernel of a later epoch can never mistake an LL128 line's bytes for
// its own flags); a writer stores into a peer's slot only after that peer started epoch e-1
// (ll_begin). A line is either stored by all 8 of its lanes or by none, and writer and reader
// decide "this line exists" by the same condition.
#pragma once

#include <cstdint>

#include "cuda/ll.cuh"

namespace linkwise::cuda {

// LINKWISE_GPU_LL128_MIN (all_reduce) and _LL128_BCAST_MIN (broadcast) defaults: LL128 from
// this many bytes (one pass or two phases as ll_kernels.cu chooses), LL lines below; the env
// knobs override them for every rank count. docs/benchmarks.md, "Update (sixth session):
// LL128 reload fix".
//  * 2 ranks: all_reduce from kL128Min2 (2xH200, CUDA graphs, with the reload: 16 KiB LL 3.02
//    us vs LL128 3.15, 32 KiB 3.27 vs 3.21, 256 KiB 5.26 vs 4.21; the GPU tests passed there);
//    broadcast never (LL one pass is faster: 128 KiB 2.34 vs 2.88 us, 256 KiB 2.89 vs 3.16).
//  * 3+ ranks: OFF (kL128Min) until the LL128 GPU tests pass on 3+ GPUs with the reload fix
//    (not run in the sixth session: no 4-GPU machine was lent). Fifth-session timings on
//    4xH200, before the fix, suggest all_reduce from 16 KiB (3.03 us vs 4.02 LL) and
//    broadcast from 128 KiB one pass (2.80 vs 3.47; 256 KiB 3.64 vs 5.47); the eager 256 KiB
//    LL128 broadcast stall of that session (~360 us a call) is not re-measured either.
constexpr int kL128Min2 = 32 * 1024, kL128Min = 1 << 30, kL128BcastMin = 1 << 30;
constexpr int kL128Packs = 7;      // data packs per line
constexpr size_t kL128Bytes = 128;
constexpr unsigned kFullWarp = 0xffffffffu;

// This lane's place: line group g = lane / 8 of the warp, k = lane % 8 (7: the flag lane).
struct L128Lane {
  int k;
  int g;
};
__device__ __forceinline__ L128Lane l128_lane() {
  const int l = threadIdx.x & 31;
  return {l & 7, l >> 3};
}

// Lane k's 16 bytes of line L in slot.
__device__ __forceinline__ uint64_t* l128_at(uint64_t* slot, size_t L, int k) {
  return slot + L * 16 + k * 2;
}

// Stores this lane's part of line L: data d (k < 7) or the flag (k == 7). All 8 lanes of the
// group call it together (the __syncwarp on the group's mask reconverges them, so the 8 stores
// issue as one warp instruction).
__device__ __forceinline__ void l128_store(uint64_t* slot, size_t L, int k, uint4 d, uint64_t flag) {
  __syncwarp(0xffu << (threadIdx.x & 24));
  uint64_t a, b;
  if (k == 7) {
    a = b = flag;
  } else {
    a = (static_cast<uint64_t>(d.y) << 32) | d.x;
    b = (static_cast<uint64_t>(d.w) << 32) | d.z;
  }
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(l128_at(slot, L, k)), "l"(a), "l"(b)
               : "memory");
}

// Polls line L of up to G sources at once (source j live when bit j of `want` is set and the
// lane's group is live: `live`, identical for the 8 lanes of a group); every lane of the warp
// must call it (warp-synchronous). Returns each source's 16 bytes of this lane in d[j] and
// zeroes the lines read. When the wait gives up (WaitGuard: timeout, abort, earlier failure;
// recorded) the missing data reads as zeros.
//
// Two steps, as NCCL's LL128 receive does:
//  (1) poll: only the flag lane (k == 7) loads, until it sees `flag` in its last 8 bytes;
//  (2) reload: all 8 lanes load the line again (one warp instruction per source) and keep
//      that data. A poll that sees the flag proves the line's store has landed (the flag is
//      the last 16 bytes of the same warp store), but data loaded by the same load
//      instruction may have been served before it landed: a warp's 128-byte load is not a
//      snapshot (sectors are served separately). Taking the poll's data was the cause of the
//      fifth session's wrong, rank-dependent elements; the reload is issued only after the
//      flag lane's load returned (it depends on that value through the shuffle).
// Polling with the flag lane alone also cuts the polling traffic to 1/8. After kL128SpinPolls
// unsuccessful polls the warp backs off with __nanosleep (32..256 ns), and only lane 0 of a
// warp runs the WaitGuard checks (one local error read / host abort read per warp, not per
// lane), so thousands of waiting lanes do not crowd the L2 and PCIe the writers need.
constexpr unsigned kL128SpinPolls = 16;
template <int G>
__device__ __forceinline__ void l128_load(const DevComm& c, uint64_t* const* slots, uint32_t want,
                                          bool live, size_t L, int k, uint64_t flag, uint4* d) {
  const int lane = threadIdx.x & 31, flag_lane = lane | 7;
  const uint32_t mine = live ? want : 0u;  // sources this lane's group reads
  uint32_t pending = mine;                 // sources whose flag has not been seen yet
  uint64_t v[G][2] = {};
  WaitGuard guard;
  unsigned polls = 0, ns = 32;
  __syncwarp();
  while (true) {
    uint32_t got = 0;  // on the flag lane: lines whose flag arrived
    if (k == 7) {
#pragma unroll
      for (int j = 0; j < G; ++j)
        if ((pending >> j) & 1)
          asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                       : "=l"(v[j][0]), "=l"(v[j][1]) : "l"(l128_at(slots[j], L, 7)) : "memory");
#pragma unroll
      for (int j = 0; j < G; ++j)
        if (((pending >> j) & 1) && v[j][1] == flag) got |= 1u << j;
    }
    got = __shfl_sync(kFullWarp, got, flag_lane);  // the group's verdict
    pending &= ~got;
    if (!__any_sync(kFullWarp, pending != 0)) break;
    bool stop = false;
    if (lane == 0) stop = guard.give_up(c);
    if (__shfl_sync(kFullWarp, stop, 0)) break;  // pending sources read as zeros
    if (++polls > kL128SpinPolls) {
      __nanosleep(ns);
      if (ns < 256) ns *= 2;
    }
  }
  const uint32_t seen = mine & ~pending;
  __syncwarp();  // converged: each group's 8 reloads issue as one warp instruction
#pragma unroll
  for (int j = 0; j < G; ++j) {
    if ((seen >> j) & 1)
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
                   : "=l"(v[j][0]), "=l"(v[j][1]) : "l"(l128_at(slots[j], L, k)) : "memory");
    else
      v[j][0] = v[j][1] = 0;
  }
#pragma unroll
  for (int j = 0; j < G; ++j) {
    d[j] = make_uint4(static_cast<uint32_t>(v[j][0]), static_cast<uint32_t>(v[j][0] >> 32),
                      static_cast<uint32_t>(v[j][1]), static_cast<uint32_t>(v[j][1] >> 32));
    if ((mine >> j) & 1)
      asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(l128_at(slots[j], L, k)), "l"(0ull)
                   : "memory");
  }
}

// Host side (ll128_kernels.cu), called by launch_ll_allreduce / launch_ll_broadcast for
// messages they route to LL128; same contracts as those (n fits, 2+ ranks).
void launch_l128_allreduce(const DevComm& c, int dtype, int op, const void* x, void* out,
                           size_t count, bool two, int var, cudaStream_t s);
void launch_l128_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root,
                           int elem, bool two, int var, cudaStream_t s);
// Whether n bytes fit LL128 one pass (parts = 1) or two phases (chunks of n / parts).
bool l128_fits(size_t n, int parts);

}  // namespace linkwise::cuda
