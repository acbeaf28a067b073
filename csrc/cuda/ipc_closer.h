// IpcCloser: closes CUDA IPC mappings (cudaIpcCloseMemHandle) on a thread of its own.
//
// Why. cudaIpcCloseMemHandle waits until the device has finished the work enqueued before it,
// on every stream, and work that other threads enqueue meanwhile does not run before it
// returns (measured on an H100: a close took the whole 1.5 s of a kernel spinning on another
// stream, bench/gpu_ipc_close_sync.py; and a close made while a deferred receive waited on the
// device held back that receive's own copy, enqueued later by its helper, until the device
// wait timed out: tests/test_gpu_ipc_close.py; docs/benchmarks.md, thirty-seventh session).
// So a close must never happen while one of our kernels waits for work that is not enqueued
// yet and may come from this process: a deferred receive's wait (p2p_defer.cu) is released by
// its helper's copy, enqueued later; a send or receive waits for the peer's matching call,
// which may itself wait for a later call of ours (a close held back a rank's other GPU work,
// and its host, until a plain receive's wait timed out: tests/test_gpu_ipc_close.py). A rank's
// collective waits only for the peers' same call, which never waits for a later one of ours.
// Hence:
//  * the caches (reg_cache.h) hand their closes over here instead of closing (a close on the
//    caller's or a helper's thread would block it, and with it the work the device waits for);
//  * this thread closes only when `quiet()` (engine_quiet: no deferred receive outstanding,
//    i.e. begun and its data not in yet, and every send and receive piece done), holding
//    `gate` around the check and the closes; the engine takes `gate` while it enqueues a
//    deferred receive's wait or a send or receive piece (P2pPiece, engine_impl.h), so none
//    starts while a close runs (it waits for the close, which waits for earlier work only).
//    Until quiet() the closes wait here (polled every kPollUs); they may lag behind the cache's
//    bounds while point-to-point traffic is in flight.
// A close still comes only after the work that used the mapping completed (reg_cache.h's rule).
//
// Reopening: CUDA counts the opens of one handle in a process; a handle whose close is still
// queued here and is opened again gets the same address with one more count, and the queued
// close takes one away, so the new user's mapping stays.
//
// Threading: post() and pending() from any thread (mu_; never while holding `gate`). The
// thread is started by the first post() and runs until finish(), which closes everything
// posted without asking quiet() (the engine's close(), after a device sync, so nothing waits)
// and joins it. Made with make_process_local: a forked child never joins the parent's thread
// nor destroys its condition variable (core/process_local.h); finish() there does nothing.
#pragma once

#include <unistd.h>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <vector>

#include "core/process_local.h"

namespace linkwise::cuda {

class IpcCloser {
 public:
  IpcCloser(int device, std::mutex& gate, std::function<bool()> quiet)
      : device_(device), maker_(getpid()), gate_(gate), quiet_(std::move(quiet)) {}
  ~IpcCloser() { finish(); }
  IpcCloser(const IpcCloser&) = delete;
  IpcCloser& operator=(const IpcCloser&) = delete;

  void post(void* mapped);  // closed soon, on the closer's thread (never waits for the device)
  size_t pending();         // posted and not closed yet
  void finish();            // closes everything posted, then stops the thread

 private:
  static constexpr int kPollUs = 1000;
  void run();
  void close_all(std::vector<void*>& batch);  // on device_

  const int device_;
  const pid_t maker_;
  std::mutex& gate_;                 // the engine's (EngineImpl::close_gate)
  const std::function<bool()> quiet_;  // called with gate_ held
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<void*> queue_;  // guarded by mu_
  size_t closing_ = 0;        // taken off queue_, not closed yet (mu_)
  bool stop_ = false;         // mu_
  OwnedThread thread_;        // started by the first post(); joined by finish()
};

}  // namespace linkwise::cuda
