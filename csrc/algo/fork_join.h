// A small fork-join pool: run(parts, f) calls f(part, thread) for every part in [0, parts),
// spread over the calling thread and up to threads-1 helper threads, and returns once every
// call has returned. Parts are handed out dynamically (an atomic counter), so a slow thread
// takes fewer. `thread` (0 = the caller) indexes per-thread scratch owned by the user.
//
// Used by the shared-memory collectives to move a large message with several cores per rank
// on hosts with spare cores. Helpers are started on the first run() that has work for them
// (never in a process that does not need them, e.g. before a fork) and sleep on a condition
// variable between runs.
// Threading: one run() at a time (the owner's thread). f may throw; the first exception is
// rethrown by run() after every helper has stopped touching the current job.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace linkwise {

class ForkJoin {
 public:
  explicit ForkJoin(int threads) : threads_(threads < 1 ? 1 : threads) {}
  ~ForkJoin();
  ForkJoin(const ForkJoin&) = delete;
  ForkJoin& operator=(const ForkJoin&) = delete;

  int threads() const { return threads_; }
  void run(int parts, const std::function<void(int, int)>& f);

 private:
  void helper(int index);
  void take(int thread);  // claims and runs parts of the current job until none is left

  const int threads_;
  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t gen_ = 0;  // job number, under mu_
  int busy_ = 0;      // helpers still inside the current job, under mu_
  bool stop_ = false;
  const std::function<void(int, int)>* job_ = nullptr;
  int parts_ = 0;
  std::atomic<int> next_{0};
  std::exception_ptr err_;  // under mu_
};

}  // namespace linkwise
