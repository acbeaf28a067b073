// Device-side view of a GPU communicator: trivially-copyable handles passed by value to
// kernels, plus the system-scope flag primitives every kernel synchronises with.
//
// Scratch layout (one cudaMalloc per rank, mapped into every peer through CUDA IPC):
//
//   [ Control (flags, 64 KiB, zeroed at setup) | data: 2 parities x Region ]
//   Region = in[nranks][slot_bytes] | gather[nranks][slot_bytes] | p2p[nranks][slot_bytes]
//
// `in[src]` and `gather[src]` are written only by rank `src` (remote stores over NVLink) and
// read only by the owner; so are p2p[src] slots. Parity = epoch & 1 (collectives) or piece & 1
// (point-to-point), so consecutive operations never share a slot.
//
// Memory-ordering contracts (all flags are u64 in the owner's Control block):
//  * start[src] = e   : rank src's kernel of epoch e has begun, hence (kernel boundary) every
//                       block of its epoch e-1 kernel is finished, reads of our parity included.
//                       A writer of parity e&1 slots on peer p waits start[p] >= e-1 first.
//  * ready[phase][block][src] = e : block `block` of rank src wrote its part of epoch e's data
//                       into our slots. Written with st.release.sys after __syncthreads() and
//                       __threadfence_system(); read with ld.acquire.sys, then __syncthreads().
//  * p2p_data[src], p2p_ack[dst] : counters bumped with red.release.sys.add by every block of a
//                       point-to-point piece; the host knows the cumulative totals to wait for.
//
// Failure contract (wait_ge): every device-side wait is bounded. It gives up when
//  * our Control.error is nonzero (latched: once a wait of this engine failed, every later
//    wait gives up within ~kLocalPollTicks, so a queue of kernels drains fast; a rank that
//    refused the arguments of a call its peers may be in writes kErrRefusedBase + its rank
//    there, in every rank's Control, and a wait that sees such a value records it in
//    HostFlags::refused: GpuEngine::refuse; a rank whose engine stopped for a failure of its
//    own writes kErrFailedBase + its rank, recorded in HostFlags::failed: GpuEngine::abort),
//  * the host set HostFlags::abort (a peer process died: GpuEngine's watchdog, gpu_engine.h),
//    polled every ~kHostPollTicks since the host word is a PCIe read, or
//  * it spun spin_limit ticks (the communicator's timeout): then it also sets
//    HostFlags::timed_out so the host can report it without synchronising.
// A wait that gives up returns false; kernels carry on without the data (results undefined),
// so the stream drains and the host raises (PeerError / TimeoutError) at its next call.
#pragma once

#include <cstdint>

namespace linkwise::cuda {

constexpr int kMaxRanks = 16;
constexpr int kSigKinds = 7;  // SigKind's values (below)
constexpr int kMaxBlocks = 128;
constexpr int kPhases = 2;
constexpr int kChainBlocks = 256;  // Control.chain_blk's length: most blocks of the push chain
// Per rank: the Control block, then the LL region (ll.cuh: 2 parities x kMaxRanks slots of
// kLLSlotBytes, written only by the LL kernels), then the data regions. All zeroed at setup.
constexpr size_t kControlStructBytes = 128 * 1024;
constexpr int kDchainItems = 8192;  // Control.item_flag's length: most items of one dchain call
// Push reduce-scatter all_reduce (reg_prs.cu): slots per sender (Control.prs_arrive / prs_ack)
// and the bytes of the prs scratch each sender owns on each owner.
constexpr int kPrsSlots = 64;
constexpr size_t kPrsPeerBytes = size_t(8) << 20;
static_assert(kPrsPeerBytes % kPrsSlots == 0, "slots of whole bytes");
constexpr size_t kLLSlotBytes = 512 * 1024;
constexpr size_t kControlBytes = kControlStructBytes + 2 * kMaxRanks * kLLSlotBytes;

struct Control {
  uint64_t start[kMaxRanks];
  uint64_t ready[kPhases][kMaxBlocks][kMaxRanks];
  uint64_t p2p_data[kMaxRanks];
  uint64_t p2p_ack[kMaxRanks];
  uint64_t error;  // kErrTimeout / kErrAborted once a wait of this engine gave up, or
                   // kErrRefusedBase + rank from a refusing rank (latched; GpuEngine::refuse), or
                   // kErrFailedBase + rank from a rank stopped by its own failure (GpuEngine::abort)
  // Registered-buffer paths (reg_engine.cu): sig[kind][src] is a counter that rank src bumps
  // (red.release.sys.add, after __threadfence_system) and we wait on (ld.acquire.sys). Both
  // sides know the cumulative totals on the host (issue order), as with p2p_data / p2p_ack.
  uint64_t sig[kSigKinds][kMaxRanks];
  // Device-side epoch numbering (epoch_begin / epoch_arrive / epoch_end below): seq =
  // (epoch of this rank's last collective kernel << kArrivalBits; 52 bits, never wraps) | how
  // many blocks of a running epoch_arrive kernel have arrived (0 between kernels), and how
  // many blocks of a running epoch_end kernel are done. Written only by this rank's own
  // kernels, never by peers.
  uint64_t seq;
  unsigned int done_blocks;
  // One-kernel registered broadcast (bcast_push.cu): piece_arrive[k] counts the blocks of the
  // running kernel that finished piece k; the last one resets it to 0 (so it is 0 between
  // launches) and posts kSigPiece to the peers. Written only by this rank's own kernels.
  unsigned int piece_arrive[64];
  // Push-chain broadcast (bcast_chain.cu): chain_blk[b] counts the pieces that block b of
  // each call's chain predecessor stored into our x (red.release.sys by it, ld.acquire.sys by
  // our block b); chain_used[b] is how many of them our block b consumed in earlier calls
  // (written only by our own block b, read by the next launch). Cumulative, never reset.
  uint64_t chain_blk[kChainBlocks];
  uint64_t chain_used[kChainBlocks];
  // Work-claiming chain broadcast (bcast_dchain.cu): dchain_claim is a cumulative counter our
  // own blocks claim items from (atomicAdd; the host keeps its value at each call's start);
  // item_flag[w] = the call number (EngineImpl::dchain_calls) once the call's chain
  // predecessor stored item w into our x (st.release.sys by it after a system fence,
  // ld.acquire.sys by us). Call numbers only grow, so the flags are never reset.
  uint64_t dchain_claim;
  uint64_t item_flag[kDchainItems];
  // Push reduce-scatter all_reduce (reg_prs.cu; contract there): prs_claim is a cumulative
  // counter our own blocks claim units from (host keeps its value per call); prs_ag[p] counts
  // the reduced items owner p stored into our out (red.release.sys by p); prs_arrive[q][j] =
  // seq of the item sender q stored into slot j of our prs scratch; prs_ack[p][j] = seq of our
  // item in slot j of p's scratch that owner p has read. All written with release, read with
  // acquire, cumulative (never reset).
  uint64_t prs_claim;
  uint64_t prs_ag[kMaxRanks];
  uint64_t prs_arrive[kMaxRanks][kPrsSlots];
  uint64_t prs_ack[kMaxRanks][kPrsSlots];
};
constexpr int kMaxPieces = 64;  // piece_arrive's length
// kSigP2pLocal: our own counter per source, bumped by our deferred receives' private streams
// when a receive's data is in (p2p_defer.cu); never written by peers.
enum SigKind : int { kSigChain = 0, kSigChainDone = 1, kSigP2pReady = 2, kSigP2pDone = 3,
                     kSigRendezvous = 4, kSigPiece = 5, kSigP2pLocal = 6 };
static_assert(sizeof(Control) <= kControlStructBytes, "Control must fit its reserved bytes");
// Error codes: Control.error holds kErrTimeout, kErrAborted, kErrRefusedBase + the refusing
// rank or kErrFailedBase + the failed rank; GpuEngine::error_code reports kErrTimeout,
// kErrAborted, kErrRefused or kErrFailed.
constexpr uint64_t kErrTimeout = 1, kErrAborted = 2, kErrRefused = 3, kErrFailed = 4,
                   kErrRefusedBase = 256, kErrFailedBase = 512;
static_assert(kErrRefusedBase + kMaxRanks <= kErrFailedBase, "the two ranges must not meet");

// Pinned host memory mapped into the device (cudaHostAllocMapped), one per engine. `abort` is
// written only by the host (watchdog thread or GpuEngine::abort; a release store after the
// reason is recorded), read by waits with volatile loads. `timed_out` is written only by
// device waits (volatile store + __threadfence_system), read by the host without a sync.
// `refused` (the refusing rank + 1) by a device wait that saw a refusal in Control.error, or
// by the host of the refusing rank itself; `refusal` is that rank's host-written source of the
// copies into every Control.error (GpuEngine::refuse). `failed` (the failed rank + 1) by a
// device wait that saw kErrFailedBase + rank; `failure` is the source of the copies a failing
// rank makes into its peers' Control.error (GpuEngine::abort).
struct HostFlags {
  uint32_t abort;
  uint32_t timed_out;
  uint32_t refused;
  uint32_t failed;
  uint64_t refusal;
  uint64_t failure;
};

// What a kernel needs: every rank's scratch base (ours included) and the geometry.
struct DevComm {
  char* base[kMaxRanks];  // base[r] = rank r's scratch as mapped in this process
  int rank;
  int nranks;
  size_t slot_bytes;
  uint64_t spin_limit;  // clock64 ticks a wait may take before the kernel reports a timeout
  HostFlags* host;      // device view of the engine's HostFlags (never null once constructed)

  __host__ __device__ Control* ctrl(int r) const { return reinterpret_cast<Control*>(base[r]); }
  // Region of parity `par` in rank r's scratch.
  __host__ __device__ char* region(int r, int par) const {
    return base[r] + kControlBytes + static_cast<size_t>(par) * 3 * nranks * slot_bytes;
  }
  __host__ __device__ char* in_slot(int r, int par, int src) const {
    return region(r, par) + static_cast<size_t>(src) * slot_bytes;
  }
  __host__ __device__ char* gather_slot(int r, int par, int src) const {
    return region(r, par) + static_cast<size_t>(nranks + src) * slot_bytes;
  }
  __host__ __device__ char* p2p_slot(int r, int par, int src) const {
    return region(r, par) + static_cast<size_t>(2 * nranks + src) * slot_bytes;
  }
};

inline size_t scratch_bytes(int nranks, size_t slot_bytes) {
  return kControlBytes + 2 * 3 * static_cast<size_t>(nranks) * slot_bytes;
}

#ifdef __CUDACC__
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys_add(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Poll periods of wait_ge's failure checks, in clock64 ticks (~2 GHz): the local error word
// (an L2 hit) every ~8 us of waiting, the host abort word (a PCIe read) every ~130 us. Short
// waits, the latency-critical case, never pay for either.
constexpr uint64_t kLocalPollTicks = 1ull << 14, kHostPollTicks = 1ull << 18;

// The failure checks of one spinning wait (failure contract above), shared by wait_ge and the
// LL loads (ll.cuh). give_up() is called after each unsuccessful poll; it reads the local error
// word and the host abort word only at the periods above, so a wait that succeeds quickly
// costs one clock64 per poll. True means the wait must stop (the error is recorded).
struct WaitGuard {
  uint64_t t0 = 0, local_at = kLocalPollTicks, host_at = 4 * kLocalPollTicks;

  __device__ __forceinline__ bool give_up(const DevComm& c) {
    const uint64_t now = clock64();
    if (t0 == 0) t0 = now;
    const uint64_t dt = now - t0;
    if (dt <= local_at) return false;
    local_at = dt + kLocalPollTicks;
    auto* err = reinterpret_cast<unsigned long long*>(&c.ctrl(c.rank)->error);
    const unsigned long long code = *reinterpret_cast<volatile unsigned long long*>(err);
    if (code) {
      if (code >= kErrFailedBase) {  // a peer stopped for its own failure (GpuEngine::abort)
        *reinterpret_cast<volatile uint32_t*>(&c.host->failed) =
            static_cast<uint32_t>(code - kErrFailedBase) + 1;
        __threadfence_system();
      } else if (code >= kErrRefusedBase) {  // a peer refused (GpuEngine::refuse): tell our host
        *reinterpret_cast<volatile uint32_t*>(&c.host->refused) =
            static_cast<uint32_t>(code - kErrRefusedBase) + 1;
        __threadfence_system();
      }
      return true;
    }
    if (dt > host_at) {
      host_at = dt + kHostPollTicks;
      if (*reinterpret_cast<volatile uint32_t*>(&c.host->abort)) {
        atomicCAS(err, 0ull, static_cast<unsigned long long>(kErrAborted));
        return true;
      }
    }
    if (dt > c.spin_limit) {
      atomicCAS(err, 0ull, static_cast<unsigned long long>(kErrTimeout));
      *reinterpret_cast<volatile uint32_t*>(&c.host->timed_out) = 1;
      __threadfence_system();
      return true;
    }
    return false;
  }
};

// Spins until *p >= want (true). False when the wait gave up (failure contract above).
__device__ __forceinline__ bool wait_ge(const DevComm& c, const uint64_t* p, uint64_t want) {
  if (ld_acquire_sys(p) >= want) return true;
  WaitGuard guard;
  unsigned ns = 32;
  while (ld_acquire_sys(p) < want) {
    if (guard.give_up(c)) return false;
    __nanosleep(ns);
    if (ns < 256) ns *= 2;
  }
  return true;
}

// Epochs live on the device so that a collective can be captured in a CUDA graph and replayed:
// nothing the host passes changes from call to call. Every collective kernel (one launch = one
// epoch) numbers itself seq's epoch + 1, the same in all its blocks, and leaves seq =
// epoch << kArrivalBits for the next one, in one of two ways:
//  * epoch_begin (every thread reads seq) + epoch_end (the last block to finish, counted in
//    done_blocks, advances seq once every block has read it);
//  * epoch_arrive (thread 0 of each block adds 1 to seq with one atomic, which returns the
//    epoch and the block's arrival rank; the last block to arrive advances seq at once): no
//    work at the kernel's end (the LL kernels, ll.cuh).
// Both leave seq in the same state, so kernels of either kind may follow each other.
// Ordering: kernels of one engine are stream-ordered, so the next kernel's read of seq comes
// after the kernel boundary that publishes the increment. Ranks issue the same collectives in
// the same order, so every rank numbers them alike, captured or not.
constexpr int kArrivalBits = 12;  // grids of up to 4095 blocks
__device__ __forceinline__ uint64_t epoch_begin(const DevComm& c) {
  return (*reinterpret_cast<volatile uint64_t*>(&c.ctrl(c.rank)->seq) >> kArrivalBits) + 1;
}

// Called by every thread of every block at the very end of an epoch_begin kernel.
__device__ __forceinline__ void epoch_end(const DevComm& c) {
  __syncthreads();  // every thread of this block has read seq (epoch_begin) before this point
  if (threadIdx.x == 0) {
    Control* k = c.ctrl(c.rank);
    __threadfence();  // our reads of seq happen before our arrival is counted
    unsigned int prev = atomicAdd(&k->done_blocks, 1u);
    if (prev == gridDim.x - 1) {  // last block: every block has read seq
      __threadfence();
      k->done_blocks = 0;
      *reinterpret_cast<volatile uint64_t*>(&k->seq) = k->seq + (1ull << kArrivalBits);
    }
  }
}

// Thread 0 of each block, once, at the start of an epoch_arrive kernel: the kernel's epoch.
// Every block's atomic comes before the last arrival's store (it saw them all counted), and
// that store comes before the next kernel (kernel boundary).
__device__ __forceinline__ uint64_t epoch_arrive(const DevComm& c) {
  auto* s = reinterpret_cast<unsigned long long*>(&c.ctrl(c.rank)->seq);
  const unsigned long long old = atomicAdd(s, 1ull);
  const uint64_t epoch = (old >> kArrivalBits) + 1;
  if ((old & ((1ull << kArrivalBits) - 1)) == gridDim.x - 1)
    *reinterpret_cast<volatile unsigned long long*>(s) = epoch << kArrivalBits;
  return epoch;
}

// Thread t < nranks (t != rank) of block 0 announces "epoch e started" to peer t.
__device__ __forceinline__ void announce_start(const DevComm& c, uint64_t epoch) {
  if (blockIdx.x == 0 && threadIdx.x < c.nranks && threadIdx.x != c.rank)
    st_release_sys(&c.ctrl(threadIdx.x)->start[c.rank], epoch);
}

// Thread t < nranks of the block waits until peer t may be written for epoch e (it has begun
// epoch e-1, so it is done reading parity e&1 from epoch e-2). Ends with __syncthreads().
__device__ __forceinline__ void wait_peers_started(const DevComm& c, uint64_t epoch) {
  if (threadIdx.x < c.nranks && threadIdx.x != c.rank && epoch >= 2)
    wait_ge(c, &c.ctrl(c.rank)->start[threadIdx.x], epoch - 1);
  __syncthreads();
}

// After this block's stores to peer `dst`: publish ready[phase][block][rank] = e there.
// Caller guarantees all threads of the block reach this (it begins with __syncthreads()).
__device__ __forceinline__ void signal_all(const DevComm& c, int phase, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x < c.nranks && threadIdx.x != c.rank) {
    __threadfence_system();
    st_release_sys(&c.ctrl(threadIdx.x)->ready[phase][blockIdx.x][c.rank], epoch);
  }
}

// Waits for ready[phase][block][src] >= e from every peer; ends with __syncthreads().
__device__ __forceinline__ void wait_all(const DevComm& c, int phase, uint64_t epoch) {
  if (threadIdx.x < c.nranks && threadIdx.x != c.rank)
    wait_ge(c, &c.ctrl(c.rank)->ready[phase][blockIdx.x][threadIdx.x], epoch);
  __syncthreads();
}
#endif

}  // namespace linkwise::cuda
