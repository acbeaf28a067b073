// Registered user buffers: peers' allocations mapped through CUDA IPC (cached), data moved by
// the copy engines (cudaMemcpyAsync between IPC-mapped pointers), no scratch copy.
//
// Synchronisation is one tiny kernel between copies, sig_kernel. Roles: one block of 32
// threads; thread t < nranks (t != rank) serves peer t: first it posts (red.release.sys.add
// of `add` into peer t's Control.sig[kind][rank], after __threadfence_system so that every
// earlier write of this stream, copy-engine writes included, is visible first), then it
// waits (ld.acquire.sys until our Control.sig[kind][t] >= want). The host keeps the
// cumulative totals of each (kind, peer) in issue order (EngineImpl::posted / seen), so no
// counter is ever reset. Pipelines:
//  * all_gather: rendezvous (every peer's stream reached the op: its x is ready) -> pull
//    every peer's x into out (rotated order, so no peer serves two pullers at once) ->
//    rendezvous (every peer finished pulling from our x before our stream moves on).
//  * broadcast: a chain root -> root+1 -> ... ; rank i pulls piece k from rank i-1's x once
//    i-1 posted kSigChain for it, then posts it to i+1; at the end it posts kSigChainDone to
//    i-1 and waits for i+1's, so nobody's x changes while its successor still reads it.
//    From 3 ranks LINKWISE_GPU_BCAST_ALGO selects a scatter-allgather instead: "push" (one
//    kernel, bcast_push.cu) or "pull" (copy engines on two streams, reg_pipeline.cu);
//    "dchain" (any ranks; the default, bcast_dchain.cu) and "pchain"
//    (bcast_chain.cu) are chains of SM stores in one kernel; "chain" is the copy-engine chain
//    here (on 2 ranks in one piece: nobody downstream to overlap with).
//  * all_reduce as reduce_scatter + all_gather (all_reduce_rsag_reg): reduce kernel,
//    rendezvous, copy-engine pulls of every peer's reduced chunk, rendezvous.
//  * send/recv: the sender posts kSigP2pReady and waits kSigP2pDone; the receiver waits
//    ready, pulls the sender's x, posts done (a deferred receive: p2p_defer.cu).
//  * all_reduce / reduce_scatter (large): rendezvous -> reg_reduce_kernel -> rendezvous; the
//    ordering contract is stated at reduce_reg below.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"
#include "cuda/launch.h"

namespace linkwise::cuda {
namespace {

__global__ void sig_kernel(DevComm c, SigArgs a) {
  const int t = threadIdx.x;
  if (t < c.nranks && t != c.rank) {
    for (int i = 0; i < a.np; ++i)
      if (a.pp[i] == t) {
        __threadfence_system();
        red_release_sys_add(&c.ctrl(t)->sig[a.pk[i]][c.rank], a.pa[i]);
      }
    if (a.all_kind >= 0) {
      __threadfence_system();
      red_release_sys_add(&c.ctrl(t)->sig[a.all_kind][c.rank], 1);
      wait_ge(c, &c.ctrl(c.rank)->sig[a.all_kind][t], a.all_want[t]);
    }
    for (int i = 0; i < a.nw; ++i)
      if (a.wp[i] == t) wait_ge(c, &c.ctrl(c.rank)->sig[a.wk[i]][t], a.want[i]);
  }
}

using GetRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetRangeFn get_range_fn() {
  static GetRangeFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<GetRangeFn>(p);
  }();
  return fn;
}


// Tuning knob (read per call, so a sweep can change it in one process): reg_reduce_kernel
// variant, LINKWISE_GPU_REG_REDUCE_UNROLL = 1, 2 (default) or 4 (see launch.h).
int reg_reduce_variant() {
  const char* v = std::getenv("LINKWISE_GPU_REG_REDUCE_UNROLL");
  int u = v ? std::atoi(v) : 2;
  return u == 1 || u == 4 ? u : 2;
}

}  // namespace

std::string GpuEngine::reg_describe(uintptr_t ptr) const {
  DeviceGuard g(device_);
  GetRangeFn fn = get_range_fn();
  if (!fn) throw Error(ErrorKind::Internal, "cuMemGetAddressRange is not available from the driver");
  CUdeviceptr base = 0;
  size_t size = 0;
  if (fn(&base, &size, static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
    throw Error(ErrorKind::Invalid, "rank " + std::to_string(rank_) +
                                        ": the buffer is not in a cudaMalloc allocation (cannot register it)");
  cudaIpcMemHandle_t h;
  cudaError_t e = cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it, or the next launch check would report it
    fail("cudaIpcGetMemHandle (user buffer)", e);
  }
  uint64_t meta[3] = {static_cast<uint64_t>(base), static_cast<uint64_t>(ptr - base),
                      static_cast<uint64_t>(size)};
  std::string out(kDescBytes, '\0');
  std::memcpy(&out[0], &h, sizeof(h));
  std::memcpy(&out[sizeof(h)], meta, sizeof(meta));
  return out;
}

void init_reg_cache(RegCache& cache, int rank, IpcCloser& closer) {
  RegCache::Hooks h;
  h.open = [rank](const std::string& handle, int peer) -> void* {
    cudaIpcMemHandle_t ih;
    std::memcpy(&ih, handle.data(), sizeof(ih));
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it, or the next launch check would report it
      throw Error(ErrorKind::Peer, "rank " + std::to_string(rank) + ": cannot map rank " +
                                       std::to_string(peer) + "'s buffer (cudaIpcOpenMemHandle: " +
                                       cudaGetErrorString(e) + ")", peer);
    }
    return p;
  };
  h.close = [&closer](void* p) { closer.post(p); };  // never here: it waits for the device
  h.done = [](const RegCache::Token& t) {
    return cudaEventQuery(static_cast<cudaEvent_t>(t.get())) != cudaErrorNotReady;
  };
  cache.set_hooks(std::move(h));
}

RegUse::~RegUse() {
  RegCache& c = cache ? *cache : im.reg_cache;
  cudaEvent_t ev = nullptr;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess &&
      cudaEventRecord(ev, s) == cudaSuccess) {
    c.note_use(reinterpret_cast<uintptr_t>(s),
               RegCache::Token(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); }));
    return;
  }
  cudaGetLastError();  // handled here: an empty token keeps the entries mapped until close()
  if (ev) cudaEventDestroy(ev);
  c.note_use(reinterpret_cast<uintptr_t>(s), RegCache::Token());
}

Described read_description(const std::string& desc, int peer) {
  if (desc.size() != kDescBytes)
    throw Error(ErrorKind::Invalid, "malformed buffer description from rank " + std::to_string(peer));
  Described d;
  d.handle = desc.substr(0, sizeof(cudaIpcMemHandle_t));
  uint64_t meta[3];  // base, offset, allocation size (reg_describe's layout)
  std::memcpy(meta, desc.data() + sizeof(cudaIpcMemHandle_t), sizeof(meta));
  d.base = meta[0], d.offset = meta[1], d.bytes = meta[2];
  return d;
}

char* map_described(RegCache& cache, int slot, int peer, const std::string& desc) {
  const Described d = read_description(desc, peer);
  return static_cast<char*>(cache.map(slot, peer, d.base, d.bytes, d.handle)) + d.offset;
}

void GpuEngine::reg_map(const std::vector<std::string>& descs, int slot) {
  if (slot < 0 || slot > 2 || static_cast<int>(descs.size()) != nranks_)
    throw Error(ErrorKind::Invalid, "reg_map: one description per rank, slot 0, 1 or 2");
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  for (int r = 0; r < nranks_; ++r) {
    im.reg[slot][r] = nullptr;
    im.reg_cache.unset(slot, r);
    if (descs[r].empty()) continue;
    im.reg[slot][r] = r == rank_ ? read_description(descs[r], r).local()
                                 : map_described(im.reg_cache, slot, r, descs[r]);
  }
  im.reg_cache.trim();
  // A peer's new allocation retires its old entries that it overlaps (they were freed): a
  // slot that still pointed into one forgets it (reg_cache.h).
  for (int s = 0; s < RegCache::kSlots; ++s)
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_ && im.reg[s][r] && !im.reg_cache.is_set(s, r)) im.reg[s][r] = nullptr;
}

void GpuEngine::reg_cache_limits(size_t entries, uint64_t bytes) {
  if (!impl_) return;
  impl_->reg_cache.max_entries = entries;
  impl_->reg_cache.max_bytes = bytes;
  std::lock_guard<std::mutex> lock(impl_->p2p_mu);
  impl_->p2p_cache.max_entries = entries;  // the same bounds, each cache on its own
  impl_->p2p_cache.max_bytes = bytes;
}

size_t GpuEngine::reg_cached() const { return reg_cache_stats()[0]; }

// Both caches together (the collectives' and the deferred receives').
std::vector<uint64_t> GpuEngine::reg_cache_stats() const {
  if (!impl_) return {0, 0, 0};
  const RegCache& c = impl_->reg_cache;
  std::lock_guard<std::mutex> lock(impl_->p2p_mu);
  const RegCache& p = impl_->p2p_cache;
  return {c.entries() + p.entries(), c.bytes() + p.bytes(), c.retired() + p.retired(),
          impl_->closer->pending()};
}

void GpuEngine::reg_release() { impl_->reg_cache.close_all(); }  // close(): after a device sync

cudaError_t preload_sig_kernel() {
  cudaFuncAttributes attr;  // see preload_defer_kernels (p2p_defer.cu)
  return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(sig_kernel));
}

void launch_sig(const DevComm& c, const SigArgs& a, cudaStream_t s) {
  sig_kernel<<<1, 32, 0, s>>>(c, a);
}

void rendezvous(EngineImpl& im, int rank, int nranks, cudaStream_t s) {
  SigArgs a;
  a.all_kind = kSigRendezvous;
  for (int p = 0; p < nranks; ++p) a.all_want[p] = p == rank ? 0 : ++im.seen[kSigRendezvous][p];
  launch_sig(im.dev, a, s);
}

void GpuEngine::all_gather_reg(uintptr_t out, size_t nbytes, uintptr_t stream) {
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  RegUse use{im, s};
  char* o = reinterpret_cast<char*>(out);
  for (int r = 0; r < nranks_; ++r)
    if (!im.reg[0][r]) throw Error(ErrorKind::Invalid, "all_gather_reg: buffers not mapped");
  SigArgs a;
  a.all_kind = kSigRendezvous;
  for (int p = 0; p < nranks_; ++p) a.all_want[p] = p == rank_ ? 0 : ++im.seen[kSigRendezvous][p];
  launch_sig(im.dev, a, s);
  check_launch("all_gather");
  if (im.reg[0][rank_] != o + rank_ * nbytes)
    LW_CUDA(cudaMemcpyAsync(o + rank_ * nbytes, im.reg[0][rank_], nbytes, cudaMemcpyDeviceToDevice, s),
            "all_gather");
  for (int i = 1; i < nranks_; ++i) {
    int q = (rank_ + i) % nranks_;
    LW_CUDA(cudaMemcpyAsync(o + q * nbytes, im.reg[0][q], nbytes, cudaMemcpyDefault, s), "all_gather");
  }
  for (int p = 0; p < nranks_; ++p) a.all_want[p] = p == rank_ ? 0 : ++im.seen[kSigRendezvous][p];
  launch_sig(im.dev, a, s);
  check_launch("all_gather");
}


// Large all_reduce / reduce_scatter from registered user buffers. Ordering contract, per call
// (every rank issues the same calls in the same order; the buffers were mapped by reg_map):
//  (1) entry rendezvous: no rank's reg_reduce_kernel starts before every rank's stream has
//      reached the call, so every x is final (its producer ran earlier on its owner's stream)
//      and no out is still in use by an earlier operation of its owner;
//  (2) reg_reduce_kernel: rank r reads chunk r of every rank's x (NVLink loads) and writes the
//      reduced chunk into its own out and, for all_reduce, into chunk r of every peer's out;
//      chunks are disjoint, so nobody reads what another rank writes (out == x included);
//      every thread fences at system scope after its stores;
//  (3) exit rendezvous (sig_kernel fences, then red.release.sys; the waiter ld.acquire.sys):
//      no rank's stream moves past the call (to reuse or free x or out, or read out) before
//      every rank has finished reading its x and writing its out.
void GpuEngine::reduce_reg(uintptr_t own_dst, size_t offset, size_t len, bool push, int dtype,
                           int op, uintptr_t stream, const char* what) {
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const size_t es = dtype_size(dtype);
  for (int r = 0; r < nranks_; ++r)
    if (!im.reg[0][r] || (push && !im.reg[1][r]))
      throw Error(ErrorKind::Invalid, std::string(what) + ": buffers not mapped");
  RegReduceArgs a;
  a.nsrc = nranks_, a.nranks = nranks_, a.avg = op == kAvg, a.len = len;
  for (int q = 0; q < nranks_; ++q) a.src[q] = im.reg[0][q] + offset * es;
  a.dst[a.ndst++] = reinterpret_cast<char*>(own_dst);
  if (push)
    for (int p = 0; p < nranks_; ++p)
      if (p != rank_) a.dst[a.ndst++] = im.reg[1][p] + offset * es;
  if (sm_count_ == 0) LW_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), what);
  const int variant = reg_reduce_variant();
  const int threads = reg_reduce_threads(variant);
  size_t per_block = static_cast<size_t>(threads) * 2 * (16 / es);  // elements one block covers per step
  size_t want = (len + per_block - 1) / per_block;
  // Default grid (reg_blocks 0), from the block sweep on 4xH200 (docs/benchmarks.md): a
  // quarter of the SMs for all_reduce (it also pushes to every peer), half for reduce_scatter;
  // one block per SM was 2-7% slower.
  const int dflt = (push ? sm_count_ / 4 : sm_count_ / 2) * (kThreads / threads);
  size_t cap = static_cast<size_t>(reg_blocks > 0 ? reg_blocks : dflt > 0 ? dflt : 1);
  int blocks = static_cast<int>(want < 1 ? 1 : want < cap ? want : cap);
  rendezvous(im, rank_, nranks_, s);
  check_launch(what);
  if (len > 0) {
    launch_reg_reduce(dtype, op, a, blocks, variant, s);
    check_launch(what);
  }
  rendezvous(im, rank_, nranks_, s);
  check_launch(what);
}

void GpuEngine::all_reduce_reg(size_t count, int dtype, int op, uintptr_t stream) {
  const size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "all_reduce: unsupported dtype code");
  if (count == 0 || nranks_ == 1) throw Error(ErrorKind::Invalid, "all_reduce_reg: needs count > 0 and 2+ ranks");
  DeviceGuard g(device_);
  RegUse use{*impl_, reinterpret_cast<cudaStream_t>(stream)};
  const size_t V = 16 / es;
  size_t chunk = ((count + nranks_ - 1) / nranks_ + V - 1) / V * V;  // chunk r starts 16-byte aligned
  size_t lo = chunk * rank_ < count ? chunk * rank_ : count;
  size_t hi = lo + chunk < count ? lo + chunk : count;
  // Our own out is slot 1 of our rank (our own pointer, not a mapping).
  reduce_reg(reinterpret_cast<uintptr_t>(impl_->reg[1][rank_] + lo * es), lo, hi - lo, true,
             dtype, op, stream, "all_reduce");
}

void GpuEngine::reduce_scatter_reg(uintptr_t out, size_t m, int dtype, int op, uintptr_t stream) {
  const size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "reduce_scatter: unsupported dtype code");
  if (m == 0 || nranks_ == 1) throw Error(ErrorKind::Invalid, "reduce_scatter_reg: needs count > 0 and 2+ ranks");
  DeviceGuard g(device_);
  RegUse use{*impl_, reinterpret_cast<cudaStream_t>(stream)};
  // Sources: block `rank` of every rank's x; the one destination is out itself.
  reduce_reg(out, rank_ * m, m, false, dtype, op, stream, "reduce_scatter");
}

// all_reduce as reduce_scatter + all_gather in one engine call (GpuComm._rsag). Slot 0 =
// every rank's x (count = m * nranks elements), slot 1 = every rank's own chunk of out
// (out + r * m elements on rank r), both mapped by one host all_gather. Ordering contract:
//  (1) reduce_reg's entry rendezvous, reg_reduce_kernel (rank r reduces chunk r of every x into
//      its own out chunk), and its exit rendezvous: past it every out chunk is final and no
//      rank reads any x any more, so (2) may overwrite out even when out == x;
//  (2) the copy engines pull every peer's out chunk into the same place of our out (rotated
//      order, so no peer serves two pullers at once; half of them on a second stream at the
//      same time was 20-25% slower on 4xH200, docs/benchmarks.md fifth session);
//  (3) exit rendezvous: no rank's stream moves past the call (to reuse out) while a peer may
//      still pull from its out chunk.
// One rendezvous and one host all_gather fewer than reduce_scatter_reg then all_gather_reg.
void GpuEngine::all_reduce_rsag_reg(size_t m, int dtype, int op, uintptr_t stream) {
  const size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "all_reduce: unsupported dtype code");
  if (m == 0 || nranks_ == 1) throw Error(ErrorKind::Invalid, "all_reduce_rsag_reg: needs count > 0 and 2+ ranks");
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  RegUse use{im, s};
  for (int r = 0; r < nranks_; ++r)
    if (!im.reg[1][r]) throw Error(ErrorKind::Invalid, "all_reduce: buffers not mapped");
  const size_t part = m * es;
  char* own = im.reg[1][rank_];
  char* o = own - rank_ * part;
  reduce_reg(reinterpret_cast<uintptr_t>(own), rank_ * m, m, false, dtype, op, stream, "all_reduce");
  for (int i = 1; i < nranks_; ++i) {
    int q = (rank_ + i) % nranks_;
    LW_CUDA(cudaMemcpyAsync(o + q * part, im.reg[1][q], part, cudaMemcpyDefault, s), "all_reduce");
  }
  rendezvous(im, rank_, nranks_, s);
  check_launch("all_reduce");
}

void GpuEngine::broadcast_reg(uintptr_t x, size_t nbytes, int root, size_t piece, uintptr_t stream,
                              uintptr_t root_src) {
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  RegUse use{im, s};  // every form below, the two-stream one joined back into s
  char* xp = reinterpret_cast<char*>(x);
  const char* root_x =
      rank_ == root && root_src != 0 && root_src != x ? reinterpret_cast<const char*>(root_src) : nullptr;
  // LINKWISE_GPU_BCAST_ALGO: "dchain" = work-claiming push chain in one kernel
  // (bcast_dchain.cu), any number of ranks, and the default (faster than every other form at
  // 64-512 MiB on 4xH200, docs/benchmarks.md fifth session; on 2xH200 1.02-1.05x NCCL out of
  // place and 0.98-1.05x in place, where the copy-engine chain lost ~8% out of place to the
  // root's x -> out copy, sixth session); "pchain" = the push chain with a fixed slice per
  // block (bcast_chain.cu, the fourth session's default), any number of ranks; "chain" = the
  // copy-engine chain below; from 3 ranks "push" = one-kernel push scatter-allgather
  // (bcast_push.cu), "pull" = two-stream pull scatter-allgather (reg_pipeline.cu). Measured
  // in docs/benchmarks.md.
  const char* algo = std::getenv("LINKWISE_GPU_BCAST_ALGO");
  const bool push = algo && std::strcmp(algo, "push") == 0, pull = algo && std::strcmp(algo, "pull") == 0;
  if (nranks_ > 1 && (!algo || !*algo || std::strcmp(algo, "dchain") == 0))
    return broadcast_dchain(xp, nbytes, root, stream, root_x);  // the root's kernel also fills out
  // The other forms broadcast out itself: the root copies x into it first, on the stream.
  if (root_x) LW_CUDA(cudaMemcpyAsync(xp, root_x, nbytes, cudaMemcpyDeviceToDevice, s), "broadcast");
  if (nranks_ == 1) return;
  if (algo && std::strcmp(algo, "pchain") == 0) return broadcast_pchain(xp, nbytes, root, stream);
  if (nranks_ >= 3 && (push || pull)) {
    const char* r = std::getenv("LINKWISE_GPU_BCAST_ROUNDS");
    int rounds = r && std::atoi(r) > 0 ? std::atoi(r) : 8;
    if (push) broadcast_push(xp, nbytes, root, rounds, stream);
    else broadcast_pull(xp, nbytes, root, rounds, stream);
    return;
  }
  const int pos = (rank_ - root + nranks_) % nranks_;
  const int pred = (rank_ - 1 + nranks_) % nranks_, succ = (rank_ + 1) % nranks_;
  const bool last = pos == nranks_ - 1;
  if (piece == 0) piece = nbytes;
  const size_t P = (nbytes + piece - 1) / piece;
  if (pos == 0) {  // root: every piece is ready now; wait until the successor pulled them all
    SigArgs a;
    a.post(kSigChain, succ, P);
    a.wait(kSigChainDone, succ, ++im.seen[kSigChainDone][succ]);
    launch_sig(im.dev, a, s);
    check_launch("broadcast");
    return;
  }
  const char* src = im.reg[0][pred];
  if (!src) throw Error(ErrorKind::Invalid, "broadcast_reg: predecessor's buffer not mapped");
  for (size_t k = 0; k < P; ++k) {
    SigArgs a;
    if (k > 0 && !last) a.post(kSigChain, succ, 1);
    a.wait(kSigChain, pred, ++im.seen[kSigChain][pred]);
    launch_sig(im.dev, a, s);
    check_launch("broadcast");
    size_t off = k * piece, n = nbytes - off < piece ? nbytes - off : piece;
    LW_CUDA(cudaMemcpyAsync(xp + off, src + off, n, cudaMemcpyDefault, s), "broadcast");
  }
  SigArgs a;
  a.post(kSigChainDone, pred, 1);
  if (!last) {
    a.post(kSigChain, succ, 1);
    a.wait(kSigChainDone, succ, ++im.seen[kSigChainDone][succ]);
  }
  launch_sig(im.dev, a, s);
  check_launch("broadcast");
}

void GpuEngine::send_reg(size_t nbytes, int dst, uintptr_t stream) {
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  P2pPiece piece{im, reinterpret_cast<cudaStream_t>(stream)};  // waits for dst's receive (ipc_closer.h)
  SigArgs a;
  a.post(kSigP2pReady, dst, 1);
  a.wait(kSigP2pDone, dst, ++im.seen[kSigP2pDone][dst]);
  launch_sig(im.dev, a, reinterpret_cast<cudaStream_t>(stream));
  check_launch("send");
}

// -- host-staged path helpers ---------------------------------------------------------------
uintptr_t GpuEngine::host_alloc(size_t nbytes) {
  void* p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocPortable);
  if (e != cudaSuccess)
    throw Error(ErrorKind::Internal, std::string("cudaHostAlloc failed: ") + cudaGetErrorString(e));
  return reinterpret_cast<uintptr_t>(p);
}

void GpuEngine::host_free(uintptr_t p) { cudaFreeHost(reinterpret_cast<void*>(p)); }

void GpuEngine::copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  LW_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                          cudaMemcpyDefault, reinterpret_cast<cudaStream_t>(stream)), "staged copy");
}

uintptr_t GpuEngine::event_record(uintptr_t stream) {
  DeviceGuard g(device_);
  cudaEvent_t ev;
  LW_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event");
  LW_CUDA(cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream)), "event");
  return reinterpret_cast<uintptr_t>(ev);
}

void GpuEngine::event_sync(uintptr_t ev) {
  DeviceGuard g(device_);
  auto e = reinterpret_cast<cudaEvent_t>(ev);
  cudaError_t r = cudaEventSynchronize(e);
  cudaEventDestroy(e);
  if (r != cudaSuccess) fail("staged copy", r);
}

}  // namespace linkwise::cuda
