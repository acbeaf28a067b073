// StageChannel: host-staged GPU transfers between processes of one host through shared memory
// that every side maps and pins (cudaHostRegister, portable). The writer's device->host copy
// lands straight in memory the readers' host->device copies read: no CPU copy in between (the
// path for LINKWISE_P2P_DISABLE=1 when peers share a host).
//
// Segment: a private ShmSegment (anonymous memfd, transport/shm/shm_segment.h): [Header |
// SlotFlags[slots] | pad to 4 KiB | slots x slot_bytes]. One writer, `readers` readers (1 for
// send/recv, n-1 for a broadcast). Ownership: the writer creates it; readers open it through
// name() = /proc/<writer pid>/fd/<fd>, which the writer sends them in a host message. The
// writer's unlink() closes that fd once every reader has mapped it (or the channel is
// destroyed); readers' unlink() does nothing. Nothing ever appears in /dev/shm, so a crash
// leaves nothing behind and a container's small /dev/shm does not limit the size. The
// mapping lives until the channel is destroyed (host unregistered first).
//
// Protocol: both sides number chunks k = 0, 1, ... over the channel's life (messages are cut
// into slot_bytes chunks identically on every side). Chunk k uses slot s = k % slots.
//  * writer may fill slot s for chunk k once acks[s] >= (k / slots) * readers (every reader
//    finished its host->device copy of the chunk that used s before); after its D2H copy has
//    completed (event), it publishes full[s] = k + 1 with a release store.
//  * a reader may copy chunk k out once full[s] >= k + 1 (acquire load); after its H2D copy
//    has completed (event) it does acks[s] += 1 (release RMW).
// Up to `slots` chunks are in flight per side, so the writer's D2H of chunk k+1 overlaps the
// readers' H2D of chunk k. Waiting polls flags and events, spinning briefly and then sleeping
// with a growing nap (2..200 us), and throws a timeout after `timeout_s`; while napping it
// also asks `engine` (if given) whether a peer died (GpuEngine::check: PeerError).
//
// Stopping: a side that refused the arguments of a call its peers may be waiting in, or whose
// GPU plane stopped for a failure of its own, stop()s every channel it has with a
// gpu_device.cuh error code (kErrRefusedBase or kErrFailedBase + its rank). A side that finds
// the word set, at a message's start or while it waits, records the code in its engine
// (GpuEngine::note_stop) and raises its check()'s error: CommAbortedError naming the refusing
// rank, PeerError naming the failed one. Final, as on the NVLink path (GpuEngine::refuse).
//
// Threading: one thread uses a channel at a time; calls block the host until this side's
// copies of the message have completed (the GIL is released by the binding).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/gpu_engine.h"
#include "transport/shm/shm_segment.h"

namespace linkwise::cuda {

struct StageHeader;  // lives in the segment (stage_channel.cu)

class StageChannel {
 public:
  // create=true: make the segment (writer side; `name` is only a label for /proc/<pid>/maps);
  // else open the writer's name() (reader side; the geometry is read from the header).
  // device: the CUDA device whose stream is used. engine: the communicator's GpuEngine for
  // peer-death checks (may be null; must outlive the channel).
  StageChannel(const std::string& name, bool create, int readers, int slots, size_t slot_bytes,
               int device, double timeout_s, const GpuEngine* engine = nullptr);
  ~StageChannel();
  StageChannel(const StageChannel&) = delete;
  StageChannel& operator=(const StageChannel&) = delete;

  const std::string& name() const { return seg_.name(); }
  void unlink();
  // Any side, once (the channel is unusable after): see "Stopping" above.
  void stop(uint64_t code);
  // Sends nbytes from device pointer src (enqueued on stream after the work already there).
  void write(uintptr_t src, size_t nbytes, uintptr_t stream);
  // Receives nbytes into device pointer dst (enqueued on stream).
  void read(uintptr_t dst, size_t nbytes, uintptr_t stream);
  size_t slot_bytes() const { return slot_bytes_; }
  int slots() const { return slots_; }

 private:
  void run(bool writer, char* dev, size_t nbytes, cudaStream_t s);
  void check_stopped() const;  // throws once a side stopped the channel
  [[noreturn]] void fail(const char* what, cudaError_t e) const;

  ShmSegment seg_;
  const GpuEngine* engine_ = nullptr;
  StageHeader* hdr_ = nullptr;
  char* data_ = nullptr;
  int readers_ = 1, slots_ = 2, device_ = 0;
  size_t slot_bytes_ = 0;
  double timeout_s_ = 0;
  bool registered_ = false;
  uint64_t next_ = 0;  // index of this side's next chunk
  std::vector<cudaEvent_t> events_;  // one per slot: completion of that slot's copy
};

}  // namespace linkwise::cuda
