// Large all_reduce on registered user buffers with the copy engines carrying every NVLink byte
// (LINKWISE_GPU_AR_ALGO=ce; measured against the direct kernel in docs/benchmarks.md). The
// direct kernel (reg_reduce.cu) moves the reduce-scatter with SM loads and the all-gather with
// SM stores; here both halves are copy-engine pulls, and the SMs only reduce in local memory.
//
// Rank r reduces chunk r (the same 16-byte aligned chunks as all_reduce_reg). Per call, every
// rank issuing the same calls in the same order:
//  (1) entry rendezvous: every x is final and every out free (each owner's stream got here);
//  (2) reduce-scatter, pipelined in pieces of `pe` elements of chunk r. The engine's side
//      stream (forked after (1)) pulls piece k of chunk r from every peer's x (copy engine,
//      peers in rotated order) into staging slot k % D of our own scratch data regions, then
//      records copied[k % D]; the caller's stream waits for that event and runs
//      reg_reduce_kernel on the piece (sources in rank order: bitwise the direct kernel's
//      result) into our out, then records reduced[k % D], which the side stream waits for
//      before it reuses the slot for piece k + D. Nobody writes any x or peer memory here;
//      our scratch slots are free because every peer's stream passed (1), so no scratch
//      kernel of an earlier call still writes into them, and (5) keeps later ones out (as
//      for every collective: one stream of collectives per communicator at a time);
//  (3) join the side stream; mid rendezvous (sig_kernel fences first): every rank's chunk is
//      final in its out, and every rank finished reading our x (so, in place, out may change);
//  (4) all-gather: pull chunk q of every peer's out into our out (copy engine, rotated);
//  (5) exit rendezvous: every peer finished pulling from our out before our stream moves on.
// The staging slots hold D pieces of (nranks-1) sources; D is at most kCeSlots.
#include <cuda_runtime.h>

#include <cstdlib>
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

void GpuEngine::all_reduce_ce(size_t count, int dtype, int op, uintptr_t stream) {
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t es = dtype_size(dtype), V = 16 / es;
  const int n = nranks_;
  for (int q = 0; q < n; ++q)
    if (!im.reg[0][q] || !im.reg[1][q]) throw Error(ErrorKind::Invalid, "all_reduce: buffers not mapped");
  const size_t chunk = ((count + n - 1) / n + V - 1) / V * V;
  auto lo_of = [&](int q) { return chunk * q < count ? chunk * q : count; };
  auto hi_of = [&](int q) { return lo_of(q) + chunk < count ? lo_of(q) + chunk : count; };
  const size_t lo = lo_of(rank_), len = hi_of(rank_) - lo;
  // Piece (LINKWISE_GPU_AR_PIECE bytes per source, default 4 MiB) and slots: the staging
  // space is the in + gather slots of our scratch's parity-0 region (2 x nranks x slot_bytes;
  // the p2p slots are left alone).
  const char* e = std::getenv("LINKWISE_GPU_AR_PIECE");
  size_t pb = e && std::atoll(e) > 0 ? static_cast<size_t>(std::atoll(e)) : (4u << 20);
  const size_t room = 2 * static_cast<size_t>(n) * slot_bytes_;
  if (pb * (n - 1) > room) pb = room / (n - 1);
  size_t pe = pb / es / V * V;
  if (pe == 0) pe = V;
  int D = static_cast<int>(room / (pe * es * (n - 1)));
  if (D > kCeSlots) D = kCeSlots;
  const size_t K = (len + pe - 1) / pe;
  char* stage = im.dev.region(rank_, 0);
  const size_t slot = pe * es * (n - 1);
  if (!im.ce_copied[0])
    for (int j = 0; j < kCeSlots; ++j) {
      LW_CUDA(cudaEventCreateWithFlags(&im.ce_copied[j], cudaEventDisableTiming), "all_reduce");
      LW_CUDA(cudaEventCreateWithFlags(&im.ce_reduced[j], cudaEventDisableTiming), "all_reduce");
    }
  if (sm_count_ == 0) LW_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), "all_reduce");
  const int variant = 2, threads = reg_reduce_threads(variant);
  const size_t per_block = static_cast<size_t>(threads) * 2 * V;
  rendezvous(im, rank_, n, s);  // (1)
  check_launch("all_reduce");
  LW_CUDA(fork_side(im, s), "all_reduce");
  for (size_t k = 0; k < K; ++k) {  // (2)
    const int j = static_cast<int>(k % D);
    const size_t off = lo + k * pe, nk = len - k * pe < pe ? len - k * pe : pe;
    char* sl = stage + j * slot;
    if (k >= static_cast<size_t>(D)) LW_CUDA(cudaStreamWaitEvent(im.side, im.ce_reduced[j], 0), "all_reduce");
    for (int i = 1; i < n; ++i) {
      const int q = (rank_ + i) % n;
      LW_CUDA(cudaMemcpyAsync(sl + (i - 1) * pe * es, im.reg[0][q] + off * es, nk * es, cudaMemcpyDefault,
                              im.side), "all_reduce");
    }
    LW_CUDA(cudaEventRecord(im.ce_copied[j], im.side), "all_reduce");
    LW_CUDA(cudaStreamWaitEvent(s, im.ce_copied[j], 0), "all_reduce");
    RegReduceArgs a;
    a.nsrc = n, a.nranks = n, a.avg = op == kAvg, a.len = nk, a.ndst = 1;
    for (int q = 0; q < n; ++q)
      a.src[q] = q == rank_ ? im.reg[0][q] + off * es : sl + ((q - rank_ + n) % n - 1) * pe * es;
    a.dst[0] = im.reg[1][rank_] + off * es;
    const size_t want = (nk + per_block - 1) / per_block;
    const int blocks = static_cast<int>(want < static_cast<size_t>(sm_count_) ? want : sm_count_);
    launch_reg_reduce(dtype, op, a, blocks, variant, s);
    check_launch("all_reduce");
    LW_CUDA(cudaEventRecord(im.ce_reduced[j], s), "all_reduce");
  }
  LW_CUDA(join_side(im, s), "all_reduce");  // (3)
  rendezvous(im, rank_, n, s);
  check_launch("all_reduce");
  for (int i = 1; i < n; ++i) {  // (4)
    const int q = (rank_ + i) % n;
    const size_t ql = lo_of(q), qn = hi_of(q) - ql;
    if (qn)
      LW_CUDA(cudaMemcpyAsync(im.reg[1][rank_] + ql * es, im.reg[1][q] + ql * es, qn * es, cudaMemcpyDefault, s),
              "all_reduce");
  }
  rendezvous(im, rank_, n, s);  // (5)
  check_launch("all_reduce");
}

}  // namespace linkwise::cuda
