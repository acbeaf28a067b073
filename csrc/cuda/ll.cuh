// LL ("low latency") lines for small collectives: data and its flag travel in one 8-byte
// store, so a receiver polls the data itself and no fence + separate flag round trip is
// needed. Device code; internal to csrc/cuda (ll_kernels.cu).
//
// Region: rank r's LL area (gpu_device.cuh kControlStructBytes .. kControlBytes) holds one
// slot of kLLSlotBytes per (parity, src); ll_slot(c, r, par, src) is written only by rank src
// (remote stores) and read only by rank r. Parity = epoch & 1, as for the data regions.
//
// Line format: u64 = (flag << 32) | 4 data bytes, flag = ll_flag(epoch) != 0. A 16-byte pack
// of data is 4 lines (32 bytes), written with two st.volatile.v2.u64: each u64 element is a
// single-copy-atomic access, so a reader never sees a line's flag without its data.
//
// Contracts:
//  * every LL line a writer stores in an epoch is read exactly once by the slot's owner in
//    that epoch, and the owner then stores 0 into it (ll_load_pack), so the region is all
//    zeros between epochs: a stale line can never carry a matching flag (no wrap-around or
//    leftover-data aliasing, whatever the epoch count);
//  * a writer stores into ll_slot(peer, e&1, me) only after peer started epoch e-1
//    (wait_peers_started), i.e. after peer's kernel of epoch e-2, resets included, finished;
//    the chain reset -> kernel boundary -> peer's st.release of start -> our ld.acquire
//    orders our new lines after the reset.
#pragma once

#include <cstdint>

#include "cuda/gpu_device.cuh"

namespace linkwise::cuda {

constexpr size_t kLLPackBytes = 32;  // 16 data bytes as 4 lines
constexpr size_t kLLMaxData = kLLSlotBytes / 2;  // data bytes one LL slot carries
constexpr size_t kLLDefaultMax = 32 * 1024;      // LINKWISE_GPU_LL_MAX default

__device__ __forceinline__ uint64_t* ll_slot(const DevComm& c, int r, int par, int src) {
  return reinterpret_cast<uint64_t*>(c.base[r] + kControlStructBytes +
                                     (static_cast<size_t>(par) * kMaxRanks + src) * kLLSlotBytes);
}

__device__ __forceinline__ uint32_t ll_flag(uint64_t epoch) {
  uint32_t f = static_cast<uint32_t>(epoch);
  return f ? f : 1u;
}

// Stores 16 data bytes d as 4 lines at line (32-byte aligned).
__device__ __forceinline__ void ll_store_pack(uint64_t* line, uint4 d, uint32_t flag) {
  const uint64_t f = static_cast<uint64_t>(flag) << 32;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line), "l"(f | d.x), "l"(f | d.y)
               : "memory");
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(line + 2), "l"(f | d.z),
               "l"(f | d.w)
               : "memory");
}

// Waits until the 4 lines at `line` carry `flag`, returns their data, and zeroes the lines.
// When the wait gives up (gpu_device.cuh's WaitGuard: timeout, abort or an earlier failure;
// the error is recorded) returns zeros.
__device__ __forceinline__ uint4 ll_load_pack(const DevComm& c, uint64_t* line, uint32_t flag) {
  uint64_t a, b, d0, d1;
  WaitGuard guard;
  while (true) {
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(line) : "memory");
    asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(d0), "=l"(d1) : "l"(line + 2) : "memory");
    if ((a >> 32) == flag && (b >> 32) == flag && (d0 >> 32) == flag && (d1 >> 32) == flag) break;
    if (guard.give_up(c)) {
      a = b = d0 = d1 = 0;
      break;
    }
  }
  asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(line), "l"(0ull) : "memory");
  asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(line + 2), "l"(0ull) : "memory");
  return make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(d0),
                    static_cast<uint32_t>(d1));
}

// Epoch start of an LL writer (all_reduce, broadcast root): epoch_begin + announce_start +
// wait_peers_started, with the start-flag loads (warp 1, lane t < nranks: acquire of start[t])
// issued at once with the seq read (warp 0) instead of after it; the block barrier then orders
// every thread's later stores after those acquires. Needs blockDim.x >= 64.
__device__ __forceinline__ uint64_t ll_begin(const DevComm& c) {
  __shared__ uint64_t seen[kMaxRanks];
  const int t = threadIdx.x - 32;
  if (t >= 0 && t < c.nranks && t != c.rank) seen[t] = ld_acquire_sys(&c.ctrl(c.rank)->start[t]);
  const uint64_t epoch = epoch_begin(c);
  __syncthreads();
  announce_start(c, epoch);
  if (t >= 0 && t < c.nranks && t != c.rank && epoch >= 2 && seen[t] < epoch - 1)
    wait_ge(c, &c.ctrl(c.rank)->start[t], epoch - 1);
  __syncthreads();
  return epoch;
}

// Loads pack i of every peer q in [g0, g0 + G) (q != rank, q < nranks) from our
// ll_slot(rank, par, q): all loads issued before any is waited on, then the missing ones
// polled (timeout as ll_load_pack); the lines read are zeroed. d[k] = q's data (q = g0 + k).
template <int G>
__device__ __forceinline__ void ll_load_group(const DevComm& c, int g0, int par, size_t i,
                                              uint32_t flag, uint4* d) {
  uint64_t v[G][4];
  bool need[G];
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const int q = g0 + k;
    need[k] = q < c.nranks && q != c.rank;
    if (need[k]) {
      uint64_t* line = ll_slot(c, c.rank, par, q) + i * 4;
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[k][0]), "=l"(v[k][1]) : "l"(line) : "memory");
      asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(v[k][2]), "=l"(v[k][3]) : "l"(line + 2) : "memory");
    }
  }
#pragma unroll
  for (int k = 0; k < G; ++k) {
    if (!need[k]) continue;
    uint64_t* line = ll_slot(c, c.rank, par, g0 + k) + i * 4;
    if ((v[k][0] >> 32) == flag && (v[k][1] >> 32) == flag && (v[k][2] >> 32) == flag &&
        (v[k][3] >> 32) == flag) {
      asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(line), "l"(0ull) : "memory");
      asm volatile("st.global.v2.u64 [%0], {%1, %1};" ::"l"(line + 2), "l"(0ull) : "memory");
      d[k] = make_uint4(static_cast<uint32_t>(v[k][0]), static_cast<uint32_t>(v[k][1]),
                        static_cast<uint32_t>(v[k][2]), static_cast<uint32_t>(v[k][3]));
    } else {
      d[k] = ll_load_pack(c, line, flag);
    }
  }
}

// Bytes [16*i, 16*i + 16) of p (n bytes long) as a pack; missing bytes read as 0. One 16-byte
// load when p is 16-byte aligned and the pack is whole, else element by element (elem bytes,
// p is aligned to elem).
__device__ __forceinline__ uint4 load_pack(const char* p, size_t i, size_t n, int elem) {
  const size_t off = i * 16;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && off + 16 <= n)
    return reinterpret_cast<const uint4*>(p)[i];
  union { uint4 u; char b[16]; uint16_t h[8]; uint32_t w[4]; uint64_t q[2]; } v;
  v.u = make_uint4(0, 0, 0, 0);
  const size_t k = n - off < 16 ? n - off : 16;
  for (size_t j = 0; j < k; j += elem) {
    if (elem == 8) v.q[j / 8] = *reinterpret_cast<const uint64_t*>(p + off + j);
    else if (elem == 4) v.w[j / 4] = *reinterpret_cast<const uint32_t*>(p + off + j);
    else if (elem == 2) v.h[j / 2] = *reinterpret_cast<const uint16_t*>(p + off + j);
    else v.b[j] = p[off + j];
  }
  return v.u;
}

// Stores the valid bytes of pack i (see load_pack) into p.
__device__ __forceinline__ void store_pack(char* p, size_t i, size_t n, int elem, uint4 d) {
  const size_t off = i * 16;
  if ((reinterpret_cast<uintptr_t>(p) & 15) == 0 && off + 16 <= n) {
    reinterpret_cast<uint4*>(p)[i] = d;
    return;
  }
  union { uint4 u; char b[16]; uint16_t h[8]; uint32_t w[4]; uint64_t q[2]; } v;
  v.u = d;
  const size_t k = n - off < 16 ? n - off : 16;
  for (size_t j = 0; j < k; j += elem) {
    if (elem == 8) *reinterpret_cast<uint64_t*>(p + off + j) = v.q[j / 8];
    else if (elem == 4) *reinterpret_cast<uint32_t*>(p + off + j) = v.w[j / 4];
    else if (elem == 2) *reinterpret_cast<uint16_t*>(p + off + j) = v.h[j / 2];
    else p[off + j] = v.b[j];
  }
}

// epoch_end (gpu_device.cuh) without the cross-block counter when the grid is one block:
// every thread of the block has read seq (epoch_begin) before the barrier, so thread 0 may
// advance it; the next kernel reads it after the kernel boundary.
__device__ __forceinline__ void epoch_end_small(const DevComm& c) {
  if (gridDim.x > 1) {
    epoch_end(c);
    return;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Control* k = c.ctrl(c.rank);
    *reinterpret_cast<volatile uint64_t*>(&k->seq) = k->seq + 1;
  }
}

}  // namespace linkwise::cuda
