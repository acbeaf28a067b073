// Deferred point-to-point receives: the receive is placed on the caller's stream now, and
// enqueued for real later by a native helper thread (bindings/defer_workers.h; the Python side
// is linkwise/cuda/deferred.py).
//
// Why. A registered receive (LINKWISE_GPU_REG_MIN bytes and up) pulls from the sender's buffer,
// whose description is a host message that the sender's send() issues. Enqueuing that copy
// inside irecv() blocked this host until the sender got there, so "irecv, then isend" on both
// ranks of a pair (NCCL's and MPI's usual order) deadlocked until the timeout.
//
// How (per receive from `src`):
//  * recv_defer_begin, on the caller's thread in issue order: records an event E on the
//    caller's stream s (from there on x may be written), then enqueues on s a wait until our
//    own Control.sig[kSigP2pLocal][src] reaches the next cumulative total (reserved here, in
//    seen[kSigP2pLocal][src]). Work the caller enqueues on s later runs after the data is in.
//  * recv_defer_finish, later, on the helper thread of `src`: on src's private stream P, waits
//    for E, enqueues the receive itself (recv_now), then adds 1 to that counter, which lets s
//    go on.
//  recv_now is the receive itself, enqueued on the stream it is given: the scratch receive, or
//  with the sender's description the registered pull (wait kSigP2pReady, copy from the
//  sender's mapped buffer, post kSigP2pDone; the sender's side is send_reg). The caller's
//  thread calls it directly when the description is already here and nothing from src is
//  deferred: no helper, no extra launches.
//  Deferred receives from one source finish in issue order on one stream, so the cumulative
//  totals agree; receives from different sources do not wait for each other.
//
// Threading contract. recv_defer_finish and recv_now touch only src's receive state (recv_pieces[src],
// recv_cum[src], seen[kSigP2pReady][src], defer_stream[src]) and p2p_cache (under p2p_mu). The
// callers (deferred.py and DeferWorkers) give src's receive state one user at a time: while a receive from src is
// deferred, every later receive from src is deferred behind it, so pieces are still matched in
// issue order; only one helper thread serves a source. Everything else stays on the caller's
// thread (GpuEngine's contract). A failure in recv_defer_finish throws; the helper then
// aborts the engine (GpuEngine::abort), so the wait on s gives up and the host raises.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"

namespace linkwise::cuda {
namespace {

// One thread: waits until our sig[kind][idx] >= want (want > 0), or posts `add` into rank
// owner's sig[kind][idx] after a system fence, so every earlier write of this stream (the copy
// engines' included) is visible first (want == 0).
__global__ void p2p_sig_kernel(DevComm c, int kind, int owner, int idx, uint64_t add, uint64_t want) {
  if (threadIdx.x != 0) return;
  if (want) {
    wait_ge(c, &c.ctrl(c.rank)->sig[kind][idx], want);
    return;
  }
  __threadfence_system();
  red_release_sys_add(&c.ctrl(owner)->sig[kind][idx], add);
}

void sig_wait(const DevComm& c, int kind, int idx, uint64_t want, cudaStream_t s) {
  p2p_sig_kernel<<<1, 32, 0, s>>>(c, kind, c.rank, idx, 0, want);
}
void sig_post(const DevComm& c, int kind, int owner, int idx, cudaStream_t s) {
  p2p_sig_kernel<<<1, 32, 0, s>>>(c, kind, owner, idx, 1, 0);
}

}  // namespace

cudaError_t preload_defer_kernels() {
  // Loaded when the engine is made. Under CUDA's lazy loading a kernel's first load may
  // synchronise the context, so it waits for a wait already spinning on s, which waits for
  // work still to be enqueued (ours, or the peer's sig_kernel of its send_reg, loaded the
  // same way): both ranks of "irecv, then isend" timed out at 8 MiB until sig_kernel was
  // preloaded too (launch.h, preload_copy_kernels, has the first case).
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(p2p_sig_kernel));
  return e != cudaSuccess ? e : preload_sig_kernel();
}

void release_defer(EngineImpl& im) {
  {
    std::lock_guard<std::mutex> lock(im.p2p_mu);
    im.p2p_cache.close_all();
  }
  for (auto& s : im.defer_stream)
    if (s) cudaStreamDestroy(s), s = nullptr;
  for (auto& se : im.p2p_pending) cudaEventDestroy(se.second);
  im.p2p_pending.clear();
}

bool engine_quiet(EngineImpl& im) {
  // A finished deferred receive needs no look at its stream: its copy is a piece (recv_now),
  // and the counter post after it waits for nothing.
  if (im.defer_open.load(std::memory_order_acquire) > 0) return false;
  auto& pend = im.p2p_pending;
  pend.erase(std::remove_if(pend.begin(), pend.end(), [](const std::pair<cudaStream_t, cudaEvent_t>& se) {
               if (cudaEventQuery(se.second) == cudaErrorNotReady) return false;
               cudaEventDestroy(se.second);
               return true;
             }),
             pend.end());
  cudaGetLastError();  // a sticky failure is the waits' to report, not this thread's
  return pend.empty();
}

P2pPiece::~P2pPiece() {  // im.close_gate still held (the member is destroyed after this body)
  const cudaStream_t on = s;
  auto it = std::find_if(im.p2p_pending.begin(), im.p2p_pending.end(),
                         [on](const std::pair<cudaStream_t, cudaEvent_t>& se) { return se.first == on; });
  cudaEvent_t ev = it == im.p2p_pending.end() ? nullptr : it->second;
  if (!ev && cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) ev = nullptr;
  // Re-recording moves the stream's one event past the new piece (stream order: it
  // completes after the earlier ones). Not recorded (a failed call): the closer may close
  // under this piece, as before the closer existed.
  if (ev && cudaEventRecord(ev, s) == cudaSuccess) {
    if (it == im.p2p_pending.end()) im.p2p_pending.emplace_back(s, ev);
    return;
  }
  if (ev && it == im.p2p_pending.end()) cudaEventDestroy(ev);
  cudaGetLastError();
}

void GpuEngine::recv_defer_drop(uintptr_t event) {
  if (impl_) impl_->defer_open.fetch_sub(1, std::memory_order_acq_rel);  // no longer outstanding
  event_destroy(event);
}

uintptr_t GpuEngine::recv_defer_begin(int src, uintptr_t stream) {
  check_open("recv");
  if (src < 0 || src >= nranks_ || src == rank_)
    throw Error(ErrorKind::Invalid, "recv: source must be another rank of the communicator");
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  // No close may run from here until this receive's copy is enqueued (ipc_closer.h): the
  // gate keeps out the closer while the wait below goes in, defer_open keeps it out after.
  std::lock_guard<std::mutex> gate(im.close_gate);
  if (!im.defer_stream[src])
    LW_CUDA(cudaStreamCreateWithFlags(&im.defer_stream[src], cudaStreamNonBlocking), "recv");
  cudaEvent_t ev;
  LW_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "recv");
  cudaError_t e = cudaEventRecord(ev, s);  // before the wait below: P waits for this point
  if (e != cudaSuccess) {
    cudaEventDestroy(ev);
    fail("recv", e);
  }
  sig_wait(im.dev, kSigP2pLocal, src, ++im.seen[kSigP2pLocal][src], s);
  e = cudaGetLastError();
  if (e != cudaSuccess) {  // the total is reserved and nothing will post it: stop every wait
    cudaEventDestroy(ev);
    abort(-1);
    fail("recv", e);
  }
  im.defer_open.fetch_add(1, std::memory_order_acq_rel);  // until recv_defer_finish or _drop
  return reinterpret_cast<uintptr_t>(ev);
}

void GpuEngine::recv_defer_finish(uintptr_t event, uintptr_t x, size_t nbytes, int src,
                                  const std::string& desc) {
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  struct Enqueued {  // however this ends, the receive is no longer outstanding on the host
    std::atomic<int>& open;
    ~Enqueued() { open.fetch_sub(1, std::memory_order_acq_rel); }
  } enqueued{im.defer_open};
  cudaStream_t p = im.defer_stream[src];
  auto ev = reinterpret_cast<cudaEvent_t>(event);
  cudaError_t e = cudaStreamWaitEvent(p, ev, 0);
  cudaEventDestroy(ev);  // released once it completed; the wait above stays enqueued
  if (e != cudaSuccess) fail("recv", e);
  recv_now(x, nbytes, src, reinterpret_cast<uintptr_t>(p), desc, /*abort_on_failure=*/false);
  sig_post(im.dev, kSigP2pLocal, rank_, src, p);
  check_launch("recv");
}

void GpuEngine::recv_now(uintptr_t x, size_t nbytes, int src, uintptr_t stream, const std::string& desc,
                         bool abort_on_failure) {
  if (desc.empty()) {
    recv(x, nbytes, src, stream);  // the scratch receive
    return;
  }
  if (nbytes == 0) return;
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  auto s = reinterpret_cast<cudaStream_t>(stream);
  std::lock_guard<std::mutex> lock(im.p2p_mu);
  char* from = nullptr;
  try {
    from = map_described(im.p2p_cache, 0, src, desc);
  } catch (...) {  // the sender waits for our done, and its totals now run ahead of ours
    if (abort_on_failure) abort(src);
    throw;
  }
  im.p2p_cache.trim();
  P2pPiece piece{im, s};  // after trim: it hands closes over, never waits for the gate
  try {
    RegUse use{im, s, &im.p2p_cache};  // its event goes after the copy (declared after the map)
    sig_wait(im.dev, kSigP2pReady, src, ++im.seen[kSigP2pReady][src], s);
    check_launch("recv");
    LW_CUDA(cudaMemcpyAsync(reinterpret_cast<char*>(x), from, nbytes, cudaMemcpyDefault, s), "recv");
    sig_post(im.dev, kSigP2pDone, src, rank_, s);
    check_launch("recv");
  } catch (...) {  // the Ready total is reserved and the sender waits for our done: stop it all
    im.p2p_cache.unset(0, src);
    if (abort_on_failure) abort(-1);
    throw;
  }
  // Noted (RegUse above): the entry is unreferenced now, so the bound or the sender's next
  // allocation may close it once this copy is done; a reference kept would pin it until close.
  im.p2p_cache.unset(0, src);
}

}  // namespace linkwise::cuda
