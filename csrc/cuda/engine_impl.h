// GpuEngine's private state, shared by gpu_engine.cu (scratch paths) and reg_engine.cu
// (registered user buffers). Internal to csrc/cuda.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "cuda/gpu_device.cuh"
#include "cuda/peer_watch.h"

namespace linkwise::cuda {

// A peer allocation mapped into this process with cudaIpcOpenMemHandle.
struct RegMapping {
  std::string handle;  // the cudaIpcMemHandle bytes it was opened from
  char* mapped = nullptr;
};

struct EngineImpl {
  DevComm dev{};
  char* own = nullptr;
  HostFlags* flags = nullptr;  // pinned, mapped (dev.host is its device view); see gpu_device.cuh
  PeerWatch watch;             // sets flags->abort when a watched peer process dies
  bool opened[kMaxRanks] = {};
  // Point-to-point bookkeeping per peer: pieces so far, cumulative block counts, and the
  // cumulative total after each of the last two pieces sent (indexed by piece parity).
  uint64_t send_pieces[kMaxRanks] = {}, send_cum[kMaxRanks] = {}, send_ring[kMaxRanks][2] = {};
  uint64_t recv_pieces[kMaxRanks] = {}, recv_cum[kMaxRanks] = {};
  // Registered user buffers: (peer, peer's allocation base) -> mapping. A new handle for the
  // same (peer, base) means the peer freed and reallocated: the old mapping is closed.
  std::map<std::pair<int, uint64_t>, RegMapping> reg_cache;
  char* reg[2][kMaxRanks] = {};  // per call: buffer `slot` of every rank, as mapped here
  // sig counters: what we have added on each peer (posted) and awaited from each (seen).
  uint64_t posted[6][kMaxRanks] = {}, seen[6][kMaxRanks] = {};
};

// Makes `device` current for the scope and restores the caller's device (torch and cupy
// keep their own notion of the current device).
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev);
    if (prev != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int now = -1;
    cudaGetDevice(&now);
    if (prev >= 0 && now != prev) cudaSetDevice(prev);
  }
};

}  // namespace linkwise::cuda
