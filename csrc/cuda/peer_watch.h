// PeerWatch: notices that a peer process of a GPU communicator died and aborts the engine's
// device-side waits (HostFlags::abort, gpu_device.cuh), so survivors get PeerError instead of
// spinning until the timeout. Host code only.
//
// Which peers: the ones whose pid the caller passes (> 0): processes of this host and pid
// namespace (GpuComm checks that when it exchanges pids). Others (0) are not watched; a
// failure there is seen by the CPU engine's own links or ends in the timeout.
//
// Threading: start() and stop() from the owning thread; one watcher thread per engine blocks
// in poll() on the peers' pidfds (readable once a process has terminated, zombie or not) and
// an eventfd for stop(): no periodic wake-ups. Kernels without pidfd_open fall back to
// core/process.h's check every 100 ms (a zombie counts as dead). The first death it sees is
// recorded (dead_peer, then a release store of flags->abort = 1) and the thread ends: an
// abort is permanent for the engine.
// dead_peer() may be called from any thread (acquire load).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "cuda/gpu_device.cuh"
#include "core/process_local.h"

namespace linkwise::cuda {

class PeerWatch {
 public:
  PeerWatch() = default;
  ~PeerWatch() { stop(); }
  PeerWatch(const PeerWatch&) = delete;
  PeerWatch& operator=(const PeerWatch&) = delete;

  // The engine's host-mapped flags (they outlive us); before start() or trip().
  void attach(HostFlags* flags) { flags_ = flags; }
  // pids[r] > 0: watch rank r's process.
  void start(const std::vector<int64_t>& pids);
  void stop();
  // Records that `peer` failed (-1: unknown; first caller wins) and raises the abort flag.
  // True for the first caller only.
  bool trip(int peer);
  // False when rank's watched process has terminated (a zombie counts); true otherwise,
  // unwatched ranks included. A rank that trip() blamed is not taken as dead: a failure there
  // may be ours. Any thread, between start() and stop().
  bool alive(int rank) const;
  bool tripped() const { return dead_.load(std::memory_order_acquire) != kNone; }
  int dead_peer() const { return dead_.load(std::memory_order_acquire); }  // valid if tripped
  int64_t dead_pid() const { return dead_pid_.load(std::memory_order_acquire); }

 private:
  void loop();
  HostFlags* flags_ = nullptr;
  std::vector<int> fds_, ranks_;   // pidfds (or -1: fall back to kill) and their ranks
  std::vector<int64_t> pids_;
  std::vector<int64_t> pid_of_rank_;  // start()'s argument, for alive()
  int stop_fd_ = -1;
  OwnedThread thread_;  // joined only by the process that started it
  static constexpr int kNone = -2;
  std::atomic<int> dead_{kNone};
  std::atomic<int64_t> dead_pid_{0};
};

}  // namespace linkwise::cuda
