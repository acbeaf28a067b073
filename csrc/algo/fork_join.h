// A small fork-join pool: run(parts, f) calls f(part, thread) for every part in [0, parts),
// spread over the calling thread and up to threads-1 helper threads, and returns once every
// call has returned. Parts are handed out dynamically (an atomic counter), so a slow thread
// takes fewer. `thread` (0 = the caller) indexes per-thread scratch owned by the user.
//
// Used by the shared-memory collectives to move a large message with several cores per rank
// on hosts with spare cores. Helpers are started on the first run() that has work for them
// (never in a process that does not need them, e.g. before a fork). Between runs a helper
// spins for `spin_us` (a run that follows soon, as in a loop of collectives, starts without
// a wake-up, which costs tens of microseconds in a VM and is paid by the slowest of every
// rank's helpers), then sleeps on a condition variable; the caller likewise spins up to
// `spin_us` for the helpers to finish before it sleeps. The owner picks spin_us ~ 0 when
// cores are scarce, so idle helpers do not take a core from a rank that needs it.
// Threading: one run() at a time (the owner's thread). f may throw; the first exception is
// rethrown by run() after every helper has stopped touching the current job.
// Memory ordering: job_/parts_/next_/err_ are written by the owner before gen_ is stored
// with release, and read by helpers after they load gen_ with acquire; a helper's writes
// (its parts' results, err_) happen before its release decrement of busy_, which the owner
// loads with acquire before it returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include "core/process_local.h"

namespace linkwise {

class ForkJoin {
 public:
  explicit ForkJoin(int threads, double spin_us = 0.0)
      : threads_(threads < 1 ? 1 : threads), spin_us_(spin_us < 0 ? 0.0 : spin_us) {}
  ~ForkJoin();
  ForkJoin(const ForkJoin&) = delete;
  ForkJoin& operator=(const ForkJoin&) = delete;

  int threads() const { return threads_; }
  // on_interrupt (optional): called once, on the owner's thread, when core/wait.h's
  // interrupted() turns true while the owner waits for helpers still in f (its own parts
  // done); it must make their f return soon (ShmColl: marks the rank failed, so their waits
  // give up). run() still returns only after every helper left f.
  void run(int parts, const std::function<void(int, int)>& f, const std::function<void()>& on_interrupt = {});

 private:
  void helper(int index);
  void take(int thread);  // claims and runs parts of the current job until none is left
  bool spin_until(const std::function<bool()>& ready) const;  // true once ready() within spin_us_

  const int threads_;
  const double spin_us_;
  std::vector<OwnedThread> helpers_;  // joined only by the process that started them
  std::mutex mu_;  // guards the sleeps (start_cv_, done_cv_) and err_
  std::condition_variable start_cv_, done_cv_;
  std::atomic<uint64_t> gen_{0};  // job number
  std::atomic<int> busy_{0};      // helpers still inside the current job
  std::atomic<bool> stop_{false};
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0;
  std::atomic<int> next_{0};
  std::exception_ptr err_;  // under mu_
};

}  // namespace linkwise
