// Two-stream pull scatter-allgather broadcast on registered user buffers (3+ ranks; opt-in,
// LINKWISE_GPU_BCAST_ALGO=pull; measured in docs/benchmarks.md).
//
// It overlaps two kinds of inbound NVLink traffic that one stream would serialise: the
// caller's stream pulls this rank's pieces from the root, piece by piece, and the engine's
// side stream (EngineImpl::side, forked from and joined back into the caller's stream inside
// the call) pulls, with the copy engines, what the other non-roots have finished so far.
// Synchronisation is the sig counters of reg_engine.cu (cumulative totals kept on the host,
// bounded device waits with abort polling, so a dead peer still ends in PeerError). Each
// wait-kernel / copy step costs ~6-8 us of stream turnaround on 4xH200, which is why this
// form loses to the chain and to bcast_push.cu's one-kernel form.
//
// broadcast_pull (m = nranks-1 non-roots; x split into m * rounds pieces; piece k belongs to
// non-root idx(k % m), its position among the non-roots):
//  root: post kSigChain +1 to every non-root (its x is final: stream order), exit rendezvous;
//  non-root j, caller's stream: wait for the root's post; for each round t pull our piece of
//      round t from the root and post kSigChain +1 to every other non-root;
//  non-root j, side stream (forked at entry, when x is free to write): for each round t wait
//      for every other non-root's t-th post, then pull their round-t pieces from their x;
//  join, exit rendezvous (nobody's x changes while a peer still reads it).
// The root's egress carries each byte once, every non-root receives each byte once.
#include <cuda_runtime.h>

#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/launch.h"

namespace linkwise::cuda {

cudaError_t fork_side(EngineImpl& im, cudaStream_t s) {
  cudaError_t e = cudaSuccess;
  if (!im.side) {
    e = cudaStreamCreateWithFlags(&im.side, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&im.fork, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&im.join, cudaEventDisableTiming);
    if (e != cudaSuccess) return e;
  }
  e = cudaEventRecord(im.fork, s);
  return e == cudaSuccess ? cudaStreamWaitEvent(im.side, im.fork, 0) : e;
}

cudaError_t join_side(EngineImpl& im, cudaStream_t s) {
  cudaError_t e = cudaEventRecord(im.join, im.side);
  return e == cudaSuccess ? cudaStreamWaitEvent(s, im.join, 0) : e;
}

uintptr_t GpuEngine::sendrecv_fork(uintptr_t stream) {
  check_open("sendrecv");
  DeviceGuard g(device_);
  LW_CUDA(linkwise::cuda::fork_side(*impl_, reinterpret_cast<cudaStream_t>(stream)), "sendrecv");
  return reinterpret_cast<uintptr_t>(impl_->side);
}

void GpuEngine::sendrecv_join(uintptr_t stream) {
  check_open("sendrecv");
  DeviceGuard g(device_);
  LW_CUDA(linkwise::cuda::join_side(*impl_, reinterpret_cast<cudaStream_t>(stream)), "sendrecv");
}

void release_side(EngineImpl& im) {
  if (im.fork) cudaEventDestroy(im.fork);
  if (im.join) cudaEventDestroy(im.join);
  if (im.side) cudaStreamDestroy(im.side);
  im.side = nullptr, im.fork = im.join = nullptr;
}

void GpuEngine::broadcast_pull(char* xp, size_t nbytes, int root, int rounds, uintptr_t stream) {
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const int m = nranks_ - 1;
  auto idx = [&](int p) { return p < root ? p : p - 1; };
  auto rank_of = [&](int i) { return i < root ? i : i + 1; };
  const size_t P = static_cast<size_t>(m) * rounds;
  size_t piece = (nbytes + P - 1) / P;
  piece = (piece + 4095) / 4096 * 4096;
  if (rank_ == root) {
    SigArgs a;
    for (int p = 0; p < nranks_; ++p)
      if (p != root) a.post(kSigChain, p, 1);
    launch_sig(im.dev, a, s);
    check_launch("broadcast");
    rendezvous(im, rank_, nranks_, s);
    check_launch("broadcast");
    return;
  }
  for (int q = 0; q < nranks_; ++q)
    if (!im.reg[0][q]) throw Error(ErrorKind::Invalid, "broadcast_reg: buffers not mapped");
  auto copy_piece = [&](size_t k, int from, cudaStream_t st) {
    const size_t off = k * piece;
    if (off >= nbytes) return;
    const size_t n = nbytes - off < piece ? nbytes - off : piece;
    LW_CUDA(cudaMemcpyAsync(xp + off, im.reg[0][from] + off, n, cudaMemcpyDefault, st), "broadcast");
  };
  const int me = idx(rank_);
  LW_CUDA(fork_side(im, s), "broadcast (side stream)");
  SigArgs a;
  a.wait(kSigChain, root, ++im.seen[kSigChain][root]);
  launch_sig(im.dev, a, s);
  check_launch("broadcast");
  for (int t = 0; t < rounds; ++t) {
    copy_piece(static_cast<size_t>(t) * m + me, root, s);
    SigArgs b;
    for (int i = 0; i < m; ++i)
      if (i != me) b.post(kSigChain, rank_of(i), 1);
    launch_sig(im.dev, b, s);
    check_launch("broadcast");
  }
  for (int t = 0; t < rounds; ++t) {
    SigArgs w;
    for (int i = 0; i < m; ++i)
      if (i != me) w.wait(kSigChain, rank_of(i), ++im.seen[kSigChain][rank_of(i)]);
    launch_sig(im.dev, w, im.side);
    check_launch("broadcast");
    for (int j = 1; j < m; ++j) {  // rotated, so no owner serves two pullers at once
      const int i = (me + j) % m;
      copy_piece(static_cast<size_t>(t) * m + i, rank_of(i), im.side);
    }
  }
  LW_CUDA(join_side(im, s), "broadcast (side stream)");
  rendezvous(im, rank_, nranks_, s);
  check_launch("broadcast");
}

}  // namespace linkwise::cuda
