// GpuEngine's failure handling (contracts: gpu_device.cuh "Failure contract" for the device
// side, peer_watch.h for the watcher): a peer's death, this rank's own abort and what it tells
// its peers, argument refusals, and the errors check() raises for them.
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "core/status.h"
#include "cuda/engine_impl.h"
#include "cuda/gpu_engine.h"

namespace linkwise::cuda {

void GpuEngine::watch_peers(const std::vector<int64_t>& pids) {
  if (static_cast<int>(pids.size()) != nranks_)
    throw Error(ErrorKind::Invalid, "watch_peers: expected one pid per rank");
  std::vector<int64_t> p(pids);
  p[rank_] = 0;
  impl_->watch.start(p);
}

bool GpuEngine::abort(int peer) {
  if (!impl_ || !impl_->watch.trip(peer)) return false;
  // A dead peer to blame (a deferred receive's sender that died): every survivor's watcher
  // sees that death and names it; being told of a failure here would name this rank instead.
  if (peer >= 0 && !impl_->watch.alive(peer)) return false;
  tell_peers_failed();
  return true;
}

// Contract in gpu_engine.h. Copies kErrFailedBase + rank into each live mapped peer's
// Control.error, as refuse() does, but now and on a stream of its own rather than in a call's
// place: this engine's waits are all giving up, so nothing of ours is left to order after.
// A dead peer's scratch is not written (its memory may be gone with it).
void GpuEngine::tell_peers_failed() {
  EngineImpl& im = *impl_;
  DeviceGuard g(device_);
  im.flags->failure = stop_code(true);  // pinned: the copies' source
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();  // handled: the peers then wait until their timeout, as before
    return;
  }
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_ || !im.opened[r] || !im.watch.alive(r)) continue;
    char* word = im.dev.base[r] + offsetof(Control, error);
    if (cudaMemcpyAsync(word, &im.flags->failure, sizeof(uint64_t), cudaMemcpyDefault, s) != cudaSuccess)
      cudaGetLastError();  // handled: that peer waits until its timeout
  }
  cudaStreamDestroy(s);  // released once the copies are done
}

uint64_t GpuEngine::error_code() const {
  if (!impl_) return 0;
  if (impl_->watch.tripped() || __atomic_load_n(&impl_->flags->abort, __ATOMIC_ACQUIRE))
    return kErrAborted;
  if (__atomic_load_n(&impl_->flags->refused, __ATOMIC_ACQUIRE)) return kErrRefused;
  // A peer's failure word overwrites ours (a copy, not a CAS): our own timeout, if any, came first.
  if (__atomic_load_n(&impl_->flags->timed_out, __ATOMIC_ACQUIRE)) return kErrTimeout;
  return __atomic_load_n(&impl_->flags->failed, __ATOMIC_ACQUIRE) ? kErrFailed : 0;
}

// Contract in gpu_engine.h. Ordered on the caller's stream, where the refused call would have
// run: the operations this rank enqueued before it still complete (their peers' halves are
// ahead of the refused call in every peer's stream), and only what comes after is stopped. The
// copy engines write the word, not a kernel: peers' kernels spinning on a shared GPU cannot
// hold it back.
bool GpuEngine::refuse(uintptr_t stream) {
  if (!impl_) return false;
  DeviceGuard g(device_);
  EngineImpl& im = *impl_;
  HostFlags* f = im.flags;
  f->refusal = stop_code(false);  // pinned: the copies' source
  __atomic_store_n(&f->refused, static_cast<uint32_t>(rank_ + 1), __ATOMIC_RELEASE);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  bool told = true;
  for (int r = 0; r < nranks_; ++r) {
    if (r != rank_ && !im.opened[r]) continue;  // host-staged: no mapping of that peer
    char* word = im.dev.base[r] + offsetof(Control, error);
    if (cudaMemcpyAsync(word, &f->refusal, sizeof(uint64_t), cudaMemcpyDefault, s) != cudaSuccess) {
      cudaGetLastError();  // handled: reported as false
      told = told && r == rank_;
    }
  }
  return told;
}

void GpuEngine::note_stop(uint64_t code) const {
  if (!impl_ || code < kErrRefusedBase) return;
  const bool failed = code >= kErrFailedBase;
  uint32_t* word = failed ? &impl_->flags->failed : &impl_->flags->refused;
  uint32_t none = 0;
  const uint32_t who = static_cast<uint32_t>(code - (failed ? kErrFailedBase : kErrRefusedBase)) + 1;
  __atomic_compare_exchange_n(word, &none, who, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

uint64_t GpuEngine::stop_code(bool failed) const {
  return (failed ? kErrFailedBase : kErrRefusedBase) + static_cast<uint64_t>(rank_);
}

void GpuEngine::check() const {
  uint64_t code = error_code();
  if (code == kErrAborted) {
    int peer = impl_->watch.dead_peer();
    int64_t pid = impl_->watch.dead_pid();
    throw Error(ErrorKind::Peer,
                "rank " + std::to_string(rank_) + ": " +
                    (peer >= 0 ? "peer rank " + std::to_string(peer) : std::string("a peer")) +
                    (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string()) +
                    " died or failed; GPU operations of this communicator were aborted (data of "
                    "operations in flight is undefined; make a new communicator)",
                peer);
  }
  if (code == kErrFailed) {
    const int who = static_cast<int>(__atomic_load_n(&impl_->flags->failed, __ATOMIC_ACQUIRE)) - 1;
    throw Error(ErrorKind::Peer,
                "rank " + std::to_string(rank_) + ": rank " + std::to_string(who) + "'s GPU "
                "operations of this communicator stopped for a failure there (its own error says "
                "why), so this rank's were stopped too (data of operations in flight is "
                "undefined; make a new communicator)",
                who);
  }
  if (code == kErrRefused) {
    const int who = static_cast<int>(__atomic_load_n(&impl_->flags->refused, __ATOMIC_ACQUIRE)) - 1;
    if (who == rank_)
      throw Error(ErrorKind::Aborted,
                  "rank " + std::to_string(rank_) + ": this rank refused the arguments of a GPU "
                  "call (the ValueError or TypeError raised then says why); the other ranks may "
                  "have enqueued theirs, so GPU operations of this communicator were stopped on "
                  "every rank (make a new communicator)");
    throw Error(ErrorKind::Aborted,
                "rank " + std::to_string(rank_) + ": rank " + std::to_string(who) + " refused its "
                "arguments of a GPU call that this rank may have enqueued (its ValueError or "
                "TypeError says why); GPU operations of this communicator were stopped (data of "
                "operations in flight is undefined; make a new communicator)",
                who);
  }
  if (code == kErrTimeout)
    throw Error(ErrorKind::Timeout,
                "rank " + std::to_string(rank_) + ": a GPU operation timed out waiting for a peer "
                "(after " + seconds_text(timeout_s_) + "); results are invalid and this "
                "communicator cannot be used any more. Check that every rank makes the same calls "
                "with CUDA arrays of the same size (LINKWISE_CHECK=1 verifies that)");
}

void GpuEngine::check_open(const char* op) const {
  if (!impl_)
    throw Error(ErrorKind::Aborted, "rank " + std::to_string(rank_) + ": " + op +
                                        " on a closed GPU communicator");
  check();
}

}  // namespace linkwise::cuda
