// Two-stream pipelines on registered user buffers: large all_reduce and broadcast (3+ ranks).
//
// Both overlap two kinds of inbound NVLink traffic that one stream would serialise: the
// caller's stream does the first half of the work piece by piece and the engine's side
// stream (EngineImpl::side, forked from and joined back into the caller's stream inside the
// call) pulls, with the copy engines, what the peers have finished so far. Synchronisation is
// the sig counters of reg_engine.cu (cumulative totals kept on the host, bounded device waits
// with abort polling, so a dead peer still ends in PeerError).
//
// all_reduce_pipe (rank r owns chunk r of `chunk` elements; chunk r split into `pieces`
// pieces of piece_len elements, the same split on every rank):
//  (1) caller's stream: entry rendezvous (every x final, every out free), fork the side
//      stream, then one reg_reduce_kernel in its pipelined form: it reduces chunk r of every
//      rank's x (NVLink loads) into our own out, piece after piece, and after piece k its last
//      block posts kSigPiece +1 to every peer (contract in launch.h: the piece is final in our
//      out before the post is visible);
//  (2) side stream, for each piece k: wait for every peer's k-th kSigPiece post, then pull
//      piece k of chunk q from peer q's out into our out (copy engine; rotated order);
//  (3) join, exit rendezvous: nobody's stream moves on (to reuse x or out) before every peer
//      has finished reading our x (its kernel) and our out (its pulls).
// In place (out == x) is safe: we overwrite piece k of chunk q in our x only after peer q
// posted piece k, i.e. after its kernel read it; peer q reads nothing else of ours in chunk q.
//
// broadcast_pull (m = nranks-1 non-roots; x split into m * rounds pieces; piece k belongs to
// non-root idx(k % m), its position among the non-roots):
//  root: post kSigChain +1 to every non-root (its x is final: stream order), exit rendezvous;
//  non-root j, caller's stream: wait for the root's post; for each round t pull our piece of
//      round t from the root and post kSigChain +1 to every other non-root;
//  non-root j, side stream (forked at entry, when x is free to write): for each round t wait
//      for every other non-root's t-th post, then pull their round-t pieces from their x;
//  join, exit rendezvous (nobody's x changes while a peer still reads it).
// The root's egress carries each byte once, every non-root receives each byte once, and the
// two streams keep both kinds of pulls in flight at once (the one-stream form did not).
#include <cuda_runtime.h>

#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/launch.h"

namespace linkwise::cuda {

#define LW_CUDA(call, op)                        \
  do {                                           \
    cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) fail((op), e_);       \
  } while (0)

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

void release_side(EngineImpl& im) {
  if (im.fork) cudaEventDestroy(im.fork);
  if (im.join) cudaEventDestroy(im.join);
  if (im.side) cudaStreamDestroy(im.side);
  im.side = nullptr, im.fork = im.join = nullptr;
}

void GpuEngine::all_reduce_pipe(size_t count, size_t chunk, int dtype, int op, int pieces,
                                uintptr_t stream) {
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t es = dtype_size(dtype), V = 16 / es;
  for (int r = 0; r < nranks_; ++r)
    if (!im.reg[0][r] || !im.reg[1][r]) throw Error(ErrorKind::Invalid, "all_reduce: buffers not mapped");
  if (pieces > kMaxPieces) pieces = kMaxPieces;
  size_t piece_len = ((chunk + pieces - 1) / pieces + V - 1) / V * V;  // keeps 16-byte alignment
  const int P = static_cast<int>((chunk + piece_len - 1) / piece_len);  // same on every rank
  auto lo_of = [&](int q) { return chunk * q < count ? chunk * q : count; };
  auto hi_of = [&](int q) { return lo_of(q) + chunk < count ? lo_of(q) + chunk : count; };
  const size_t lo = lo_of(rank_), len = hi_of(rank_) - lo;
  RegReduceArgs a;
  a.nsrc = nranks_, a.nranks = nranks_, a.avg = op == kAvg, a.len = len;
  for (int q = 0; q < nranks_; ++q) a.src[q] = im.reg[0][q] + lo * es;
  a.dst[a.ndst++] = im.reg[1][rank_] + lo * es;
  a.pieces = P, a.piece_len = piece_len;
  a.arrive = reinterpret_cast<Control*>(im.own)->piece_arrive;
  for (int q = 0; q < nranks_; ++q)
    if (q != rank_) a.post[a.npost++] = &reinterpret_cast<Control*>(im.dev.base[q])->sig[kSigPiece][rank_];
  const int variant = 2;  // the default kernel (the tuning variants were no faster)
  const int blocks = reg_grid(len, es, variant, false);
  rendezvous(im, rank_, nranks_, s);
  check_launch("all_reduce");
  LW_CUDA(fork_side(im, s), "all_reduce (side stream)");
  launch_reg_reduce(dtype, op, a, blocks, variant, s);  // also with len 0: it posts P times
  check_launch("all_reduce");
  char* out = im.reg[1][rank_];
  for (int k = 0; k < P; ++k) {
    SigArgs w;
    for (int q = 0; q < nranks_; ++q)
      if (q != rank_) w.wait(kSigPiece, q, ++im.seen[kSigPiece][q]);
    launch_sig(im.dev, w, im.side);
    check_launch("all_reduce");
    for (int i = 1; i < nranks_; ++i) {
      const int q = (rank_ + i) % nranks_;
      const size_t plo = lo_of(q) + k * piece_len < hi_of(q) ? lo_of(q) + k * piece_len : hi_of(q);
      const size_t phi = plo + piece_len < hi_of(q) ? plo + piece_len : hi_of(q);
      if (phi > plo)
        LW_CUDA(cudaMemcpyAsync(out + plo * es, im.reg[1][q] + plo * es, (phi - plo) * es,
                                cudaMemcpyDefault, im.side), "all_reduce");
    }
  }
  LW_CUDA(join_side(im, s), "all_reduce (side stream)");
  rendezvous(im, rank_, nranks_, s);
  check_launch("all_reduce");
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
