// StagePacer: the waiting policy of a host-staged progress loop (StageChannel, StageReduce).
//
// The loop calls progressed() after a pass that moved a chunk, and idle(what) after a pass
// that moved nothing. idle() spins for the first 50 us (a chunk of a few MiB takes ~100 us),
// then asks the engine whether a peer died (PeerError rather than the timeout) and naps,
// doubling from 2 us up to 200 us; after timeout_s without progress it throws Timeout with
// the message what() builds (built only then). Threading: one loop, one thread.
#pragma once

#include <time.h>

#include <chrono>
#include <string>

#include "core/status.h"
#include "cuda/gpu_engine.h"

namespace linkwise::cuda {

class StagePacer {
 public:
  using clock = std::chrono::steady_clock;

  StagePacer(double timeout_s, const GpuEngine* engine)
      : limit_(timeout_s > 0 ? timeout_s : 1e9), engine_(engine) {}

  void progressed() {
    last_progress_ = clock::now();
    nap_ns_ = 0;
  }

  template <class What>
  void idle(What what) {
    const auto idle = clock::now() - last_progress_;
    if (idle > limit_) throw Error(ErrorKind::Timeout, what());
    if (idle < std::chrono::microseconds(50)) return;
    if (engine_) engine_->check();
    nap_ns_ = nap_ns_ ? (nap_ns_ < 200000 ? nap_ns_ * 2 : 200000) : 2000;
    timespec ts{0, nap_ns_};
    nanosleep(&ts, nullptr);
  }

 private:
  std::chrono::duration<double> limit_;
  const GpuEngine* engine_;
  clock::time_point last_progress_ = clock::now();
  long nap_ns_ = 0;
};

}  // namespace linkwise::cuda
