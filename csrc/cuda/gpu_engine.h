// GpuEngine: one communicator's GPU data plane (host side; builds without nvcc).
//
// Owns a scratch area on its device (cudaMalloc), exported through a CUDA IPC handle; peers'
// areas are opened with cudaIpcOpenMemHandle. Layout and flag contracts: gpu_device.cuh.
//
// Threading: not thread-safe; one thread (the caller's) uses it at a time, except the deferred
// receives' helper threads: recv_defer_finish (hence recv_now and recv) for their own source
// (p2p_defer.cu has the contract). Ordering: every
// rank must issue the same collectives in the same order, and all of one engine's operations
// must be ordered on the GPU (one stream, or streams the caller synchronises), as with NCCL.
// Point-to-point pieces between a pair are matched in issue order (tags are not matched).
// Every method enqueues on `stream` (a cudaStream_t as an integer, 0 = legacy default) and
// returns without waiting for the GPU. Pointers are device pointers on this engine's device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace linkwise::cuda {

struct EngineImpl;

int device_count();  // 0 when there is no usable CUDA device

class GpuEngine {
 public:
  GpuEngine(int rank, int nranks, int device, size_t slot_bytes, double timeout_s);
  ~GpuEngine();
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  std::string ipc_handle() const;                         // our scratch's cudaIpcMemHandle
  void open_peers(const std::vector<std::string>& handles);  // every rank's, in rank order
  void close();
  bool closed() const { return impl_ == nullptr; }  // close() ran: everything is released

  // algo: 0 auto, 1 one-shot, 2 two-shot. dtype / op codes: launch.h's DType / RedOp.
  void all_reduce(uintptr_t x, uintptr_t out, size_t count, int dtype, int op, uintptr_t stream,
                  int algo);
  void reduce_scatter(uintptr_t x, uintptr_t out, size_t count_per_rank, int dtype, int op,
                      uintptr_t stream);
  // check() plus: raises (Aborted) once close() ran, instead of touching released state.
  void check_open(const char* op) const;
  void broadcast(uintptr_t x, size_t nbytes, int root, uintptr_t stream);  // in place
  // Root's src (nbytes) into every rank's x: in place when src == x; otherwise the root's LL
  // kernel reads src and writes x itself (above the LL size a copy on the stream comes
  // first). Non-roots ignore src. src and x are equal or do not overlap.
  void broadcast_from(uintptr_t src, uintptr_t x, size_t nbytes, int root, uintptr_t stream);
  void all_gather(uintptr_t x, uintptr_t out, size_t nbytes, uintptr_t stream);
  void all_to_all(uintptr_t x, uintptr_t out, size_t nbytes_per_rank, uintptr_t stream);
  void send(uintptr_t x, size_t nbytes, int dst, uintptr_t stream);
  void recv(uintptr_t x, size_t nbytes, int src, uintptr_t stream);
  void barrier(uintptr_t stream);
  void synchronize(uintptr_t stream);  // waits for the stream (GIL released by the binding)

  // Failures (contracts: gpu_device.cuh "Failure contract", peer_watch.h). watch_peers: the
  // pid of every rank (0 = do not watch; ours is ignored); a watched peer's death aborts every
  // device wait of this engine. abort(peer): the same for a failure of this rank's own (peer =
  // the rank to blame, -1 unknown; a failed deferred receive, a launch after a reserved counter,
  // GpuComm.abort): the first abort also stops the live peers' device waits, which would
  // otherwise wait for ours until their timeout (tell_peers_failed; their check() then raises
  // PeerError naming this rank), unless the blamed peer is dead: a watched peer's death is seen
  // by every survivor, which then names it. Returns whether the peers are to be told (they
  // were, through the mapped scratch; host-staged ones only through Staged.stop).
  // error_code: 0, kErrTimeout (a device wait timed out), kErrAborted, kErrFailed (a peer's
  // abort stopped us) or kErrRefused (refuse below, here or on a peer); no synchronisation, so
  // it reports what the device or the watchdog recorded so far. check: throws PeerError
  // (aborted, failed), TimeoutError (timed out) or CommAbortedError (refused) once one
  // happened, for good.
  void watch_peers(const std::vector<int64_t>& pids);
  bool abort(int peer);
  uint64_t error_code() const;
  void check() const;
  // refuse: this rank refused the arguments of a call (any check: a role's, e.g. the root's
  // out, or one every rank makes that failed here; src/linkwise/cuda/refusal.py), after its
  // peers may have enqueued their kernels for it, which would wait for it until the timeout. Enqueued on `stream` in the call's place: copies
  // kErrRefusedBase + rank into every rank's Control.error (peers' through their mapped
  // scratch, ours too), so their device waits give up at once and record the refusal in their
  // HostFlags::refused (gpu_device.cuh); this rank's own check() raises from now on. Final, like
  // a dead peer: every rank's check() then raises CommAbortedError naming this rank. False
  // when a copy could not be enqueued (the peers then wait until the timeout).
  bool refuse(uintptr_t stream);
  // note_stop: records a peer's (or this rank's own) refusal or failure code (kErrRefusedBase
  // / kErrFailedBase + rank) that reached this rank by another way than a device wait: a
  // host-staged channel's stop word (stage_channel.h). check() raises it from then on, as if a
  // device wait had seen it. The first code noted of each kind stays.
  void note_stop(uint64_t code) const;
  // The code this rank tells its peers: kErrFailedBase + rank (failed) or kErrRefusedBase + rank.
  uint64_t stop_code(bool failed) const;

  // Events of async requests: event_record (below) makes one; event_query: done? (throws the
  // CUDA error, or PeerError when a dead peer caused it); event_wait: polls until done (true)
  // or timeout_s passed (false); event_destroy releases it (pending or not).
  bool event_query(uintptr_t ev);
  bool event_wait(uintptr_t ev, double timeout_s);
  static void event_destroy(uintptr_t ev);

  // Registered user buffers (reg_engine.cu). reg_describe: what peers need to map the
  // allocation holding ptr (IPC handle of its base, base, offset, allocation size), as bytes.
  // reg_map: every rank's description (rank order) -> buffer `slot` (0, 1; 2 = prs scratch) of every rank
  // for the next *_reg call; peer allocations are opened once and cached per (peer, base),
  // reopened when the handle changes; the cache is bounded (reg_cache_limits: entries, bytes
  // of peers' allocations) and closes a peer's mapping once that peer describes an allocation
  // overlapping it, each only after the work that used it completed (reg_cache.h), on a thread
  // of its own (ipc_closer.h). The *_reg
  // calls copy with the copy engines (cudaMemcpyAsync between IPC-mapped pointers) and
  // synchronise with sig counters.
  std::string reg_describe(uintptr_t ptr) const;
  void reg_map(const std::vector<std::string>& descs, int slot);
  void all_gather_reg(uintptr_t out, size_t nbytes, uintptr_t stream);  // slot 0 = x
  // root_src: on the root of an out-of-place broadcast its x (x above is then its out), else 0.
  void broadcast_reg(uintptr_t x, size_t nbytes, int root, size_t piece, uintptr_t stream, uintptr_t root_src);
  void send_reg(size_t nbytes, int dst, uintptr_t stream);  // peer dst pulls our x (its recv_defer_finish)
  // Deferred receives (p2p_defer.cu has the contract, including the one exception to this
  // class's one-thread rule): recv_defer_begin, on the caller's thread, makes `stream` wait for
  // the receive and returns an event for recv_defer_finish, which a helper thread of src calls
  // later to enqueue the receive itself on src's private stream: the scratch receive when
  // desc is empty, else the registered pull from the sender's buffer described by desc;
  // recv_now enqueues that receive on `stream` at once (the description is already here).
  uintptr_t recv_defer_begin(int src, uintptr_t stream);
  void recv_defer_finish(uintptr_t event, uintptr_t x, size_t nbytes, int src, const std::string& desc);
  // A begun receive that will never be finished (its helper failed or was closed): releases
  // its event and stops counting it as outstanding (ipc_closer.h).
  void recv_defer_drop(uintptr_t event);
  // A failure once the sender waits for this receive (its buffer cannot be mapped, a launch)
  // aborts the engine (abort(), which tells the sender), unless abort_on_failure is false:
  // recv_defer_finish's helper records the failure first and aborts then (defer_workers.h),
  // so that a caller who sees the abort finds the failure that caused it.
  void recv_now(uintptr_t x, size_t nbytes, int src, uintptr_t stream, const std::string& desc,
                bool abort_on_failure = true);
  // Large reductions read peers' registered inputs directly (reg_engine.cu, reg_reduce.cu):
  // all_reduce_reg: slot 0 = every rank's x, slot 1 = every rank's out (may equal x);
  // reduce_scatter_reg: slot 0 = every rank's x (count_per_rank * nranks elements), out local.
  void all_reduce_reg(size_t count, int dtype, int op, uintptr_t stream);
  void reduce_scatter_reg(uintptr_t out, size_t count_per_rank, int dtype, int op, uintptr_t stream);
  // all_reduce_rsag_reg: slot 0 = every rank's x (m * nranks elements), slot 1 = every rank's
  // own chunk of out (m elements at out + rank * m); reduce_scatter then copy-engine all_gather.
  void all_reduce_rsag_reg(size_t m, int dtype, int op, uintptr_t stream);
  // all_reduce_prs_reg (reg_prs.cu): push reduce-scatter + push all-gather in one kernel; x is
  // ours (read locally only), slot 0 = every rank's out (may equal x), slot 2 = every rank's
  // prs_scratch(), mapped once. prs_scratch: our (nranks-1) * kPrsPeerBytes scratch, made on
  // first use, freed by close.
  void all_reduce_prs_reg(uintptr_t x, size_t count, int dtype, int op, uintptr_t stream);
  uintptr_t prs_scratch();
  void reg_cache_limits(size_t entries, uint64_t bytes);
  size_t reg_cached() const;                     // peers' allocations mapped now
  // entries, their bytes, retired not closed yet, closes handed to the closer thread and not
  // done yet (ipc_closer.h: a close waits for the device, so it runs there)
  std::vector<uint64_t> reg_cache_stats() const;
  // Diagnostics: the push chain's per-block timestamps of the last call traced with
  // LINKWISE_GPU_PCHAIN_TRACE=1 (bcast_chain.cu), kChainBlocks x 4 ns values; synchronises.
  std::vector<uint64_t> pchain_trace();

  // Host-staged path helpers (reg_engine.cu): pinned host memory and async copies.
  static uintptr_t host_alloc(size_t nbytes);
  static void host_free(uintptr_t p);
  void copy_async(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream);
  uintptr_t event_record(uintptr_t stream);  // a new event recorded on stream
  void event_sync(uintptr_t ev);            // waits for it and destroys it
  // sendrecv's two streams (linkwise/cuda/sendrecv.py; reg_pipeline.cu): sendrecv_fork returns the
  // engine's side stream, which starts after the work enqueued on `stream` so far; sendrecv_join
  // makes `stream` go on only after what was enqueued on the side stream since. Host side: one
  // thread at a time; the side stream is shared with the registered pipelines, which also join it
  // before they return.
  uintptr_t sendrecv_fork(uintptr_t stream);
  void sendrecv_join(uintptr_t stream);

  int device() const { return device_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t oneshot_max = 256 * 1024;  // all_reduce auto: one-shot up to this many bytes
  size_t bcast_sag_min = 1 << 20;  // broadcast: scatter + all-gather from this many bytes
  int max_blocks = 64;              // blocks for bandwidth-bound launches
  int reg_blocks = 0;               // blocks of reg_reduce_kernel; 0 = SMs/4 (all_reduce), SMs/2

 private:
  int blocks_for(size_t bytes, size_t per_block) const;
  [[noreturn]] void fail(const char* op, int err) const;
  void check_launch(const char* op) const;
  void tell_peers_failed();  // abort's copies into the peers' Control.error (engine_failures.cu)
  // all_gather / all_to_all: launch(off, n) for each scratch-slot piece [off, off + n) of a
  // `bytes`-long block; with one rank, copies x's piece to out instead (gpu_engine.cu).
  template <class Launch>
  void per_slot_piece(const char* x, char* out, size_t bytes, uintptr_t stream, const char* what,
                      Launch launch);
  void reg_release();
  void reduce_reg(uintptr_t own_dst, size_t offset, size_t len, bool push, int dtype, int op,
                  uintptr_t stream, const char* what);
  // Registered broadcast from 3 ranks (contracts in the files): pull scatter-allgather on two
  // streams (reg_pipeline.cu), push scatter-allgather in one kernel (bcast_push.cu).
  void broadcast_pull(char* x, size_t nbytes, int root, int rounds, uintptr_t stream);
  void broadcast_push(char* x, size_t nbytes, int root, int rounds, uintptr_t stream);
  // Push chain, any number of ranks, one kernel (bcast_chain.cu).
  void broadcast_pchain(char* x, size_t nbytes, int root, uintptr_t stream);
  // Work-claiming push chain, any number of ranks, one kernel (bcast_dchain.cu).
  // root_src (root only, out of place): the kernel reads it and stores into x and the successor.
  void broadcast_dchain(char* x, size_t nbytes, int root, uintptr_t stream, const char* root_src);
  int sm_count_ = 0;

  int rank_, nranks_, device_;
  size_t slot_bytes_;
  double timeout_s_;
  EngineImpl* impl_ = nullptr;
};

}  // namespace linkwise::cuda
