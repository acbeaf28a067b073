// Push-chain broadcast on registered user buffers, one kernel per rank, any number of ranks
// (LINKWISE_GPU_BCAST_ALGO=pchain). The chain root -> root+1 -> ... -> root-1: every rank but
// the last stores each piece, once it is in its own x, straight into its successor's x with
// SM stores over NVLink (writes need no request/response round trip, unlike the copy-engine
// chain's pulls), and the hand-off is a flag inside the kernel (no per-piece stream turnaround).
//
// Geometry: B blocks (grid), `slice` bytes per block per piece (a multiple of 4096); piece k is
// bytes [k*B*slice, (k+1)*B*slice) of x, block b owns [k*B*slice + b*slice, +slice) of every
// piece (clipped to nbytes; the last pieces may be short or empty in some blocks). Block b of
// every rank handles the same bytes, so each block is an independent pipeline that talks only
// to block b of its predecessor and successor: no grid-wide synchronisation at all.
//
// Ordering contract, per call (every rank issues the same calls in the same order, with the
// same B and slice, hence the same P pieces):
//  (1) a non-root's kernel starts (its stream reached the call, so its x is free: earlier
//      operations on it are complete) and block 0 posts sig[kSigChainDone][us] += 1 on its
//      predecessor (red.release.sys);
//  (2) a rank with a successor: thread 0 of every block waits for that post (ld.acquire.sys)
//      before the block's first store into the successor's x;
//  (3) block b, piece k: a non-root's control lane waits until our chain_blk[b] >= base + k + 1
//      (the predecessor's block b stored piece k's slice into our x; acquire; base = our
//      chain_used[b]), a barrier releases the block's copy warps, which copy the slice from our
//      x to the successor's x; a second barrier orders their stores before the control lane's
//      system fence (cumulative) and its red.release.sys +1 on the successor's chain_blk[b];
//  (4) the last rank's blocks only wait for chain_blk[b] >= base + P: when its kernel ends,
//      every byte of x has arrived. Nobody reads another rank's x, and every store into our x
//      is complete (acquired) when our kernel ends, so no exit rendezvous is needed.
// chain_blk[b] is written only by the (per-call) predecessor's block b, chain_used[b] only by
// our own block b (+P at the end of each call in which we are not the root; a block that does
// not exist in a call, b >= B, gets no posts and consumes none), so no counter is ever reset
// and calls with different B follow each other safely. kSigChainDone totals are shared with
// the copy-engine chain, which posts it in the same pattern (one per call from each non-root
// to its predecessor; the host keeps the total in EngineImpl::seen).
// Waits are wait_ge (bounded, abort polling): a wait that gives up lets the kernel finish
// without the data and the host raises (PeerError / TimeoutError) at its next call.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/chain_util.cuh"
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"

namespace linkwise::cuda {
#define LW_CUDA_TRACE(call)                                  \
  do {                                                       \
    cudaError_t e_ = (call);                                 \
    if (e_ != cudaSuccess) fail("pchain_trace", e_);         \
  } while (0)
namespace {

struct PchainArgs {
  const char* src = nullptr;  // our x
  char* dst = nullptr;        // successor's x as mapped here (nullptr on the last rank)
  size_t nbytes = 0, slice = 0;
  uint64_t pieces = 0;
  uint64_t ready_want = 0;  // sig[kSigChainDone][succ] total that means "successor's x is free"
  int pred = 0, succ = 0;
  bool root = false;
  bool trace = false;  // LINKWISE_GPU_PCHAIN_TRACE: stamp g_pchain_trace (diagnostics only)
};

// Diagnostics (LINKWISE_GPU_PCHAIN_TRACE=1, read by GpuEngine::pchain_trace): per block b,
// %globaltimer ns at [b][0] kernel start, [1] piece 0 ready to copy (successor free and piece
// 0 arrived), [2] last piece ready, [3] block done. Written by thread 0 of block b only, in the
// last traced call; read by the host after a synchronise.
__device__ unsigned long long g_pchain_trace[kChainBlocks][4];
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// Roles inside a block of a rank with a successor: warp 0 is the control warp (its lane 0 does
// every wait and post), warps 1.. copy. Per piece k: the control warp acquires "piece k is in
// our x" (non-root) and releases the copy warps with bar.sync(1) ("go k"); they copy slice k
// and bar.arrive(2); the control warp's bar.sync(2) then orders all their stores of piece k
// before its lane 0's system fence and post, and it releases "go k+1" BEFORE that fence, so
// the copy warps never wait for the fence's NVLink round trip (only for piece k+1's arrival).
template <int kU, int kTh>
__global__ void __launch_bounds__(kTh) bcast_pchain_kernel(DevComm c, PchainArgs a) {
  const int b = blockIdx.x;
  Control* me = c.ctrl(c.rank);
  uint64_t* mine = &me->chain_blk[b];
  // chain_used[b]: pieces our block b has consumed in all earlier calls (written only by our
  // own block b's thread 0; the previous kernel's write is visible across the kernel boundary).
  const uint64_t base = me->chain_used[b];
  if (a.trace && threadIdx.x == 0) g_pchain_trace[b][0] = gtimer();
  if (!a.root && b == 0 && threadIdx.x == 0)  // (1) our x is free
    red_release_sys_add(&c.ctrl(a.pred)->sig[kSigChainDone][c.rank], 1);
  if (a.dst == nullptr) {  // (4) last rank
    if (threadIdx.x == 0) {
      wait_ge(c, mine, base + a.pieces);
      me->chain_used[b] = base + a.pieces;
      if (a.trace) g_pchain_trace[b][1] = g_pchain_trace[b][2] = g_pchain_trace[b][3] = gtimer();
    }
    return;
  }
  const size_t piece = a.slice * gridDim.x;
  if (threadIdx.x >= 32) {  // copy warps
    const int t = threadIdx.x - 32, nt = blockDim.x - 32;
    for (uint64_t k = 0; k < a.pieces; ++k) {
      bar_sync(1);  // go k
      const size_t off = k * piece + b * a.slice;
      if (off < a.nbytes) {
        const size_t n = a.nbytes - off < a.slice ? a.nbytes - off : a.slice;
        slice_copy<kU>(a.dst + off, a.src + off, n, t, nt);
      }
      bar_arrive(2);  // our stores of piece k are issued
    }
    return;
  }
  // Control warp.
  uint64_t* theirs = &c.ctrl(a.succ)->chain_blk[b];
  uint64_t have = 0;  // lane 0: the largest value of *mine acquired so far
  auto arrived = [&](uint64_t k) {  // (3) lane 0: piece k is in our x
    if (a.root || have >= base + k + 1) return;
    have = ld_acquire_sys(mine);
    if (have < base + k + 1) have = wait_ge(c, mine, base + k + 1) ? ld_acquire_sys(mine) : ~0ull;
  };
  if (threadIdx.x == 0) {
    wait_ge(c, &me->sig[kSigChainDone][a.succ], a.ready_want);  // (2)
    arrived(0);
    if (a.trace) g_pchain_trace[b][1] = gtimer();
  }
  __syncwarp();
  bar_sync(1);  // go 0
  for (uint64_t k = 0; k < a.pieces; ++k) {
    bar_sync(2);  // every copy warp issued its stores of piece k
    if (k + 1 < a.pieces) {
      if (threadIdx.x == 0) {
        arrived(k + 1);
        if (a.trace && k + 2 == a.pieces) g_pchain_trace[b][2] = gtimer();
      }
      __syncwarp();
      bar_sync(1);  // go k + 1
    }
    if (threadIdx.x == 0) {
      __threadfence_system();  // cumulative: the copy warps' stores of piece k (ordered by bar 2)
      red_release_sys_add(theirs, 1);
    }
  }
  if (threadIdx.x == 0 && !a.root) me->chain_used[b] = base + a.pieces;
  if (a.trace && threadIdx.x == 0) g_pchain_trace[b][3] = gtimer();
}

}  // namespace

void GpuEngine::broadcast_pchain(char* xp, size_t nbytes, int root, uintptr_t stream) {
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int pos = (rank_ - root + nranks_) % nranks_;
  const int pred = (rank_ - 1 + nranks_) % nranks_, succ = (rank_ + 1) % nranks_;
  const bool last = pos == nranks_ - 1;
  if (!last && !im.reg[0][succ]) throw Error(ErrorKind::Invalid, "broadcast_reg: successor's buffer not mapped");
  // Tuning knobs (read per call; every rank must see the same values): blocks and bytes per
  // block per piece (rounded up to 4096), 16-byte loads in flight per thread (4 or 8).
  // Defaults from the sweep on 4xH200 in docs/benchmarks.md (fourth session): 32 blocks x
  // 64 KiB below 128 MiB (best at 64 MiB), 64 x 128 KiB from 128 MiB (best at 128 MiB, level
  // with the best at 512 MiB).
  const bool big = nbytes >= (128u << 20);
  const char* e = std::getenv("LINKWISE_GPU_PCHAIN_THREADS");
  const bool t1k = e && std::atoi(e) == 1024;  // threads per block: 512 (default) or 1024
  e = std::getenv("LINKWISE_GPU_PCHAIN_BLOCKS");
  int blocks = e && std::atoi(e) > 0 ? std::atoi(e) : big ? 64 : 32;
  if (blocks > kChainBlocks) blocks = kChainBlocks;
  e = std::getenv("LINKWISE_GPU_PCHAIN_SLICE");
  size_t slice = e && std::atoll(e) > 0 ? static_cast<size_t>(std::atoll(e)) : big ? (128u << 10) : (64u << 10);
  slice = std::min<size_t>(slice, size_t(1) << 30);  // keeps the rounding and slice * blocks from overflowing
  slice = (slice + 4095) / 4096 * 4096;
  e = std::getenv("LINKWISE_GPU_BCAST_UNROLL");
  const bool u8 = e && std::atoi(e) == 8;
  PchainArgs a;
  a.src = xp, a.dst = last ? nullptr : im.reg[0][succ], a.nbytes = nbytes, a.slice = slice;
  a.pieces = (nbytes + slice * blocks - 1) / (slice * blocks);
  a.pred = pred, a.succ = succ, a.root = pos == 0;
  if (!last) a.ready_want = ++im.seen[kSigChainDone][succ];
  e = std::getenv("LINKWISE_GPU_PCHAIN_TRACE");
  a.trace = e && *e == '1';
  check_launch("broadcast");
  if (t1k) bcast_pchain_kernel<4, 1024><<<blocks, 1024, 0, s>>>(im.dev, a);
  else if (u8) bcast_pchain_kernel<8, kThreads><<<blocks, kThreads, 0, s>>>(im.dev, a);
  else bcast_pchain_kernel<4, kThreads><<<blocks, kThreads, 0, s>>>(im.dev, a);
  check_launch("broadcast");
}

std::vector<uint64_t> GpuEngine::pchain_trace() {
  DeviceGuard g(device_);
  std::vector<uint64_t> v(kChainBlocks * 4);
  LW_CUDA_TRACE(cudaMemcpyFromSymbol(v.data(), g_pchain_trace, v.size() * sizeof(uint64_t)));
  return v;
}

}  // namespace linkwise::cuda
