// Push scatter-allgather broadcast on registered user buffers, one kernel per rank (3+ ranks;
// LINKWISE_GPU_BCAST_ALGO=push). The copy-engine forms (chain, two-stream pull) pay ~6-8 us of
// stream turnaround for every wait-kernel / copy step; here the pieces are handed on with
// flags inside one kernel, so the pipeline can use small pieces.
//
// x is split into P = m * rounds pieces (m = nranks-1 non-roots, piece bytes a multiple of
// 4096, the last ones short or empty); piece t*m + i belongs to non-root i (position among
// the non-roots). Ordering contract, per call (every rank issues it in the same order):
//  (1) entry rendezvous (sig_kernel): every x is free (its owner's stream reached the call),
//      and the root's x is final;
//  (2) root: blocks form m groups; group i stores the pieces of non-root i, round after
//      round, into that non-root's x (remote NVLink stores); after each piece every thread
//      fences at system scope, the group's last block to finish it (arrival counted in our
//      Control's piece_arrive) posts kSigPiece +1 to the owner;
//  (3) non-root j, round t: thread 0 of every block waits for the root's (t+1)-th post (this
//      call's), __syncthreads, then the grid stores piece t*m+j from our x into every other
//      non-root's x and the last block posts kSigPiece +1 to each of them;
//  (4) non-root, block 0: waits for `rounds` posts from every other non-root: when the kernel
//      ends, every byte of x has arrived. Nobody reads another rank's x and all stores into
//      our x are complete at kernel end, so no exit rendezvous is needed (the next registered
//      operation starts with its own entry rendezvous).
// Waits are wait_ge (bounded, abort polling), as in every registered path: a wait that gives
// up lets the kernel finish without the data and the host raises (PeerError / TimeoutError)
// at its next call. Pieces per call are at most kMaxPieces (rounds clamped).
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"

namespace linkwise::cuda {
namespace {

struct BcastPushArgs {
  char* x[kMaxRanks];        // every rank's x as mapped here (ours: our own pointer)
  uint64_t base[kMaxRanks];  // kSigPiece totals seen from each rank before this call
  size_t nbytes = 0, piece = 0;
  int root = 0, rounds = 0, m = 0;
};

__device__ __forceinline__ int nonroot_rank(int i, int root) { return i < root ? i : i + 1; }

// Piece k's bytes [off, off + len), and the [lo, hi) of it that block gi of gsz copies.
__device__ __forceinline__ void piece_slice(const BcastPushArgs& a, size_t k, int gi, int gsz,
                                            size_t* off, size_t* lo, size_t* hi) {
  *off = k * a.piece;
  size_t len = *off >= a.nbytes ? 0 : (a.nbytes - *off < a.piece ? a.nbytes - *off : a.piece);
  size_t per = ((len + gsz - 1) / gsz + 15) / 16 * 16;
  size_t s = per * gi;
  *lo = s < len ? s : len;
  *hi = s + per < len ? s + per : len;
}

// After this block's stores of one piece: count the block in *arrive; the last of `expect`
// blocks resets it (it is 0 again for the next launch) and posts +1 to every *post[i].
__device__ __forceinline__ void piece_done(unsigned int* arrive, int expect, uint64_t* const* post,
                                           int npost) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(arrive, 1u) == static_cast<unsigned>(expect - 1)) {
    *arrive = 0;
    __threadfence_system();
    for (int i = 0; i < npost; ++i) red_release_sys_add(post[i], 1);
  }
}

// Block-wide copy of n bytes from src to nd destinations with kU 16-byte loads in flight per
// thread before their stores (remote NVLink stores need many bytes in flight per SM).
template <int kU>
__device__ __forceinline__ void push_copy(char* const* d, int nd, const char* src, size_t n) {
  bool vec = aligned16(src);
  for (int j = 0; j < nd; ++j) vec &= aligned16(d[j]);
  size_t done = 0;
  if (vec) {
    const size_t nv = n / 16, step = static_cast<size_t>(kU) * blockDim.x;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (size_t i = threadIdx.x; i < nv; i += step) {
      uint4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i + u * blockDim.x < nv) v[u] = s[i + u * blockDim.x];
      for (int j = 0; j < nd; ++j)
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (i + u * blockDim.x < nv) reinterpret_cast<uint4*>(d[j])[i + u * blockDim.x] = v[u];
    }
    done = nv * 16;
  }
  for (size_t i = done + threadIdx.x; i < n; i += blockDim.x)
    for (int j = 0; j < nd; ++j) d[j][i] = src[i];
}

template <int kU>
__global__ void __launch_bounds__(kThreads) bcast_push_kernel(DevComm c, BcastPushArgs a) {
  const int rank = c.rank, m = a.m, root = a.root;
  unsigned int* arrive = c.ctrl(rank)->piece_arrive;
  size_t off, lo, hi;
  if (rank == root) {
    const int grp = blockIdx.x % m, gsz = (gridDim.x - grp + m - 1) / m, gi = blockIdx.x / m;
    const int owner = nonroot_rank(grp, root);
    uint64_t* post = &c.ctrl(owner)->sig[kSigPiece][rank];
    for (int t = 0; t < a.rounds; ++t) {
      const size_t k = static_cast<size_t>(t) * m + grp;
      piece_slice(a, k, gi, gsz, &off, &lo, &hi);
      char* d = a.x[owner] + off + lo;
      push_copy<kU>(&d, 1, a.x[rank] + off + lo, hi - lo);
      piece_done(arrive + k, gsz, &post, 1);
    }
    return;
  }
  const int me = rank < root ? rank : rank - 1;
  uint64_t* post[kMaxRanks];
  int np = 0;
  for (int i = 0; i < m; ++i)
    if (i != me) post[np++] = &c.ctrl(nonroot_rank(i, root))->sig[kSigPiece][rank];
  for (int t = 0; t < a.rounds; ++t) {
    if (threadIdx.x == 0) wait_ge(c, &c.ctrl(rank)->sig[kSigPiece][root], a.base[root] + t + 1);
    __syncthreads();
    piece_slice(a, static_cast<size_t>(t) * m + me, blockIdx.x, gridDim.x, &off, &lo, &hi);
    char* d[kMaxRanks];
    int nd = 0;
    for (int i = 0; i < m; ++i)
      if (i != me) d[nd++] = a.x[nonroot_rank(i, root)] + off + lo;
    push_copy<kU>(d, nd, a.x[rank] + off + lo, hi - lo);
    piece_done(arrive + t, gridDim.x, post, np);
  }
  if (blockIdx.x == 0) {
    const int q = threadIdx.x;
    if (q < c.nranks && q != rank && q != root)
      wait_ge(c, &c.ctrl(rank)->sig[kSigPiece][q], a.base[q] + a.rounds);
  }
}

}  // namespace

void GpuEngine::broadcast_push(char* xp, size_t nbytes, int root, int rounds, uintptr_t stream) {
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (int q = 0; q < nranks_; ++q)
    if (!im.reg[0][q]) throw Error(ErrorKind::Invalid, "broadcast_reg: buffers not mapped");
  BcastPushArgs a;
  a.m = nranks_ - 1, a.root = root, a.nbytes = nbytes;
  a.rounds = rounds < 1 ? 1 : rounds * a.m > kMaxPieces ? kMaxPieces / a.m : rounds;
  const size_t P = static_cast<size_t>(a.m) * a.rounds;
  a.piece = ((nbytes + P - 1) / P + 4095) / 4096 * 4096;
  for (int q = 0; q < nranks_; ++q) {
    a.x[q] = q == rank_ ? xp : im.reg[0][q];
    a.base[q] = im.seen[kSigPiece][q];
  }
  if (rank_ != root)  // what this call's kernel waits for (host totals, issue order)
    for (int q = 0; q < nranks_; ++q)
      if (q != rank_) im.seen[kSigPiece][q] += a.rounds;
  // Tuning knobs (read per call): blocks of the kernel (at least one per non-root; no flag
  // array is indexed by block here, so kMaxBlocks does not bound it) and loads in flight per
  // thread (LINKWISE_GPU_BCAST_UNROLL 4 or 8).
  const char* b = std::getenv("LINKWISE_GPU_BCAST_BLOCKS");
  int blocks = b && std::atoi(b) > 0 ? std::atoi(b) : 128;
  if (blocks < a.m) blocks = a.m;
  if (blocks > 1024) blocks = 1024;
  const char* u = std::getenv("LINKWISE_GPU_BCAST_UNROLL");
  rendezvous(im, rank_, nranks_, s);
  check_launch("broadcast");
  if (u && std::atoi(u) == 8) bcast_push_kernel<8><<<blocks, kThreads, 0, s>>>(im.dev, a);
  else bcast_push_kernel<4><<<blocks, kThreads, 0, s>>>(im.dev, a);
  check_launch("broadcast");
}

}  // namespace linkwise::cuda
