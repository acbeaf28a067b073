// GpuEngine's private state, shared by gpu_engine.cu (scratch paths) and reg_engine.cu
// (registered user buffers). Internal to csrc/cuda.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/gpu_device.cuh"
#include "cuda/ipc_closer.h"
#include "cuda/peer_watch.h"
#include "cuda/reg_cache.h"

namespace linkwise::cuda {

// A registered buffer's description (reg_describe): its allocation's IPC handle, then base,
// offset and allocation size.
constexpr size_t kDescBytes = sizeof(cudaIpcMemHandle_t) + 3 * sizeof(uint64_t);

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
  // Registered user buffers: peers' allocations mapped through CUDA IPC, per (peer, base),
  // bounded, each closed only once the work that used it is done (contract in reg_cache.h),
  // by the closer's thread: a close waits for the whole device (ipc_closer.h). Both caches
  // hand their closes to it; close() finishes it after a device sync.
  std::shared_ptr<IpcCloser> closer;
  // What the closer must not close under (engine_quiet), guarded by close_gate: deferred
  // receives begun and neither finished nor dropped (defer_open; once finished, their copy is
  // a piece below), and every point-to-point piece not done yet: per stream, an event
  // recorded after its latest send or receive (p2p_pending; P2pPiece, pruned as they
  // complete). A close waits for these, and what they wait for is ours (a helper's copy) or
  // a peer's call that may wait for one of ours enqueued later; a close holds that back.
  // Collectives need no entry: a rank's collective waits only for the peers' same call.
  std::mutex close_gate;
  std::atomic<int> defer_open{0};
  std::vector<std::pair<cudaStream_t, cudaEvent_t>> p2p_pending;
  RegCache reg_cache;
  // per call: buffer `slot` of every rank, as mapped here; slot 2 is every rank's prs scratch
  // (reg_prs.cu), mapped once and kept
  char* reg[3][kMaxRanks] = {};
  // Deferred receives (p2p_defer.cu, contract there): the senders' allocations they map (a
  // cache of its own, so that the helper threads never touch reg_cache, which the caller's
  // thread uses; CUDA counts an allocation opened by both once per open), the mutex of the
  // helper threads of different sources around it, and one private stream per source (made
  // by the caller's thread on the source's first deferred receive, destroyed by close).
  RegCache p2p_cache;
  std::mutex p2p_mu;
  cudaStream_t defer_stream[kMaxRanks] = {};
  // sig counters: what we have added on each peer (posted) and awaited from each (seen).
  uint64_t posted[kSigKinds][kMaxRanks] = {}, seen[kSigKinds][kMaxRanks] = {};
  // Two-stream pipelines (reg_pipeline.cu): a second stream of this engine's device and the
  // events that fork it from / join it back into the caller's stream. Created on first use,
  // destroyed by GpuEngine::close; used only inside one call (joined before it returns).
  // Work-claiming chain broadcast (bcast_dchain.cu): calls so far (every rank counts every
  // call, so the number is the same on all ranks) and our Control.dchain_claim's value now.
  uint64_t dchain_calls = 0, dchain_claimed = 0;
  // Push reduce-scatter all_reduce (reg_prs.cu): items per owner summed over calls (the seq
  // base, the same on every rank), our Control.prs_claim's value now, the cumulative prs_ag
  // total expected from each peer, and our prs scratch (cudaMalloc, freed by close).
  uint64_t prs_items = 0, prs_claimed = 0, prs_ag_seen[kMaxRanks] = {};
  char* prs_own = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

// RegCache's safety rule (reg_cache.h): declared by every registered operation after its
// DeviceGuard; when its enqueuing ends (returned or threw) it records one event on s, after all
// its work (the two-stream pipelines join their side stream back into s first), and hands it
// to every cache entry the slots reference. An event rather than synchronising the streams
// later: the caller may destroy its stream meanwhile, and the host must not wait (reg_cache.h).
// reg_engine.cu.
// `cache`: the cache whose slots the operation used (im.reg_cache when null).
struct RegUse {
  EngineImpl& im;
  cudaStream_t s;
  RegCache* cache = nullptr;
  ~RegUse();
};
// Its CUDA hooks (reg_engine.cu): open maps now, close hands the mapping to `closer`.
void init_reg_cache(RegCache& cache, int rank, IpcCloser& closer);
// A buffer's description (reg_describe) read back: its allocation's IPC handle, base, the
// buffer's offset in it and the allocation's size; Invalid when malformed (reg_engine.cu).
struct Described {
  std::string handle;
  uint64_t base = 0, offset = 0, bytes = 0;
  char* local() const { return reinterpret_cast<char*>(base + offset); }  // our own buffer
};
Described read_description(const std::string& desc, int peer);
// Peer `peer`'s described buffer mapped through `cache` as slot `slot`: its address here.
char* map_described(RegCache& cache, int slot, int peer, const std::string& desc);
cudaError_t preload_defer_kernels();  // p2p_defer.cu; see preload_copy_kernels (launch.h)
void release_defer(EngineImpl& im);   // p2p_defer.cu; close(), after a device sync
// True when no deferred receive is outstanding and every point-to-point piece is done: the
// closer may close now (ipc_closer.h). Called with im.close_gate held (p2p_defer.cu).
bool engine_quiet(EngineImpl& im);
// Declared by every send and receive before it enqueues on s: holds im.close_gate meanwhile
// (no close starts between its enqueue and its note: the close would wait for it), then
// notes the piece (p2p_pending) so that the closer waits until s gets past it (p2p_defer.cu).
// Not nested: recv_now's scratch branch declares none itself (recv does).
struct P2pPiece {
  EngineImpl& im;
  cudaStream_t s;
  std::lock_guard<std::mutex> gate{im.close_gate};
  ~P2pPiece();
};

// Registered-path synchronisation (reg_engine.cu, sig_kernel): one launch posts
// sig[pk[i]][rank] += pa[i] on peer pp[i] (after a system fence: every earlier write of the
// stream, copy-engine writes included, is visible first), then waits our sig[wk[i]][wp[i]] >=
// want[i]; all_kind >= 0 adds a rendezvous (post +1 to every peer, wait all_want[p] from each).
struct SigArgs {
  int np = 0;
  int pk[kMaxRanks], pp[kMaxRanks];
  uint64_t pa[kMaxRanks];
  int nw = 0;
  int wk[kMaxRanks], wp[kMaxRanks];
  uint64_t want[kMaxRanks];
  int all_kind = -1;
  uint64_t all_want[kMaxRanks];
  void post(int kind, int peer, uint64_t add) { pk[np] = kind, pp[np] = peer, pa[np] = add, ++np; }
  void wait(int kind, int peer, uint64_t v) { wk[nw] = kind, wp[nw] = peer, want[nw] = v, ++nw; }
};
void launch_sig(const DevComm& c, const SigArgs& a, cudaStream_t s);
cudaError_t preload_sig_kernel();  // loads sig_kernel now (preload_defer_kernels says why)
// Every rank posts +1 to every peer and waits for each peer's matching post (kSigRendezvous):
// on return (on the GPU) every peer's stream has reached this point.
void rendezvous(EngineImpl& im, int rank, int nranks, cudaStream_t s);
// fork_side: im.side (created on first use) starts after everything enqueued on s so far;
// join_side: s continues after everything enqueued on im.side so far (reg_pipeline.cu).
cudaError_t fork_side(EngineImpl& im, cudaStream_t s);
cudaError_t join_side(EngineImpl& im, cudaStream_t s);
void release_side(EngineImpl& im);

// Inside GpuEngine's members: a CUDA call whose failure throws (GpuEngine::fail names `op`).
#define LW_CUDA(call, op)                        \
  do {                                           \
    cudaError_t e_ = (call);                     \
    if (e_ != cudaSuccess) fail((op), e_);       \
  } while (0)

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
