// StageReduce: host-staged all_reduce among GPU processes of one host, through shared pinned
// memory (the LINKWISE_P2P_DISABLE=1 path when every peer shares this host). Host code only:
// the copy engines move the bytes, the host reduces and publishes flags.
//
// Memory: every rank creates one private ShmSegment (anonymous memfd, shm_segment.h) that all
// ranks map and pin (cudaHostRegister, portable): [Flags | pad to 4 KiB | in[slots] |
// out[slots]], each slot slot_bytes. Setup (GpuComm / staged.py): every rank creates its
// segment, the names (/proc/<pid>/fd/<fd>) are all-gathered, every rank open()s the others'
// (attach), a barrier, then every rank unlink()s its own (closes its fd). Nothing is ever in
// /dev/shm.
//
// Protocol. All ranks cut every all_reduce into chunks of the same elements and number them
// k = 0, 1, ... over the object's life; chunk k uses slot s = k % slots. Chunk k is split into
// nranks parts by element (part q = [len*q/n, len*(q+1)/n)); rank q reduces part q. Flags are
// single-writer counters in the owner's segment, each on its own cache line: written by the
// owner with release stores, read by everyone with acquire loads.
//  (1) rank r copies chunk k of x device->host into its in[s] once every rank q has
//      h2d[s]_q >= k - slots + 1 (everyone finished chunk k - slots, so nobody reads in[s] or
//      out[s] of any rank for it any more); after the copy completed (event): in_ready[s] = k+1.
//  (2) once in_ready[s]_q >= k+1 for every q, rank r reduces part r of every rank's in[s] in
//      rank order (float16/bfloat16 accumulated in float32, rounded once, as the GPU kernels
//      do, so results are bitwise the NVLink path's) into its out[s]: red_ready[s] = k+1.
//  (3) once red_ready[s]_q >= k+1 for every q, rank r copies every part q from out_q[s]
//      host->device into chunk k of its out; after the copies completed: h2d[s] = k+1.
// Stages overlap across chunks: the device->host copies run on one internal stream, the
// host->device copies on another (PCIe is full duplex), the reduction on the calling thread.
// Both streams first wait for the caller's stream (an event), so x is final and out free; the call
// returns when its last host->device copy completed (blocking the host like the rest of the
// staged path). Waiting spins ~50 us, then naps (2..200 us), asks the engine whether a peer
// died (PeerError), and throws TimeoutError after timeout_s without progress.
//
// Threading: one thread uses it at a time. Every rank calls all_reduce with the same count,
// dtype and op, in the same order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gpu_engine.h"
#include "transport/shm/shm_segment.h"

namespace linkwise::cuda {

struct StageReduceFlags;  // lives in each segment (stage_reduce.cu)

class StageReduce {
 public:
  StageReduce(int rank, int nranks, int slots, size_t slot_bytes, int device, double timeout_s,
              const GpuEngine* engine, const std::string& label);
  ~StageReduce();
  StageReduce(const StageReduce&) = delete;
  StageReduce& operator=(const StageReduce&) = delete;

  const std::string& name() const { return own_.name(); }
  void attach(const std::vector<std::string>& names);  // every rank's name(), rank order
  void unlink() { own_.unlink(); }
  // dtype / op: launch.h codes. x and out: device pointers (may be equal).
  void all_reduce(uintptr_t x, uintptr_t out, size_t count, int dtype, int op, uintptr_t stream);
  size_t slot_bytes() const { return slot_bytes_; }

 private:
  char* in(int r, int s) const;
  char* out(int r, int s) const;
  StageReduceFlags* flags(int r) const;
  void reduce_part(uint64_t k, size_t len, size_t lo, size_t hi, int dtype, int op);
  [[noreturn]] void fail(const char* what, cudaError_t e) const;

  int rank_, nranks_, slots_, device_;
  size_t slot_bytes_;
  double timeout_s_;
  const GpuEngine* engine_;
  ShmSegment own_;
  std::vector<ShmSegment> peers_;     // index r: rank r's segment (ours left empty)
  std::vector<char*> base_;           // every rank's segment as mapped here
  std::vector<void*> registered_;     // mappings pinned with cudaHostRegister
  cudaStream_t d2h_ = nullptr, h2d_ = nullptr;
  cudaEvent_t entry_ = nullptr;
  std::vector<cudaEvent_t> d2h_ev_, h2d_ev_;  // one per slot
  std::vector<float> acc_;            // float32 accumulator for 16-bit types
  uint64_t next_ = 0;                 // index of the next chunk
};

}  // namespace linkwise::cuda
