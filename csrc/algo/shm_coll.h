// Shared-memory collectives for communicators whose ranks all share one host: all-reduce
// (one-shot for small messages, two-shot for large) and a pipelined broadcast, moving data
// through one segment mapped by every rank instead of through point-to-point messages.
//
// Layout: the segment holds one Slot per rank: a header of counters (each on its own cache
// line) and data areas that only the slot's owner writes and everyone reads:
//   two  - two-shot all-reduce: `in` (my copies of the segments others reduce), `res` (my
//          reduced segment);  one - one-shot all-reduce, two halves used by round parity;
//   bc   - broadcast, a ring of kBcSlots pieces.
// Protocols (each has its own counters and areas, so they never interfere):
//   two-shot round r: copy in → a_in=r → wait all a_in>=r → reduce my segment into res and
//     out → a_res=r → wait all a_res>=r → copy the others' segments from their res. A peer
//     rewrites `in` only after everyone's a_res reached r (they finished reading it), and
//     `res` only after everyone's a_in reached r+1 (they finished copying from it).
//   one-shot round r: copy in to half r&1 → b_in=r → wait all b_in>=r → combine all n in
//     rank order. Half r&1 is rewritten in round r+2, after everyone's b_in reached r+1.
//   broadcast piece i (numbered across calls): the root waits until every other rank's
//     c_done >= i-kBcSlots+1, copies piece i into ring slot i%kBcSlots, sets c_in=c_done=i+1;
//     a reader waits for root.c_in >= i+1, copies it out, sets its c_done=i+1.
// Every rank runs the same sequence of calls (the collective order), so the round and piece
// numbers agree everywhere. Counters are 32-bit and compared modulo 2^32.
//
// Ordering: data is written before the counter is stored with release; readers load the
// counter with acquire. Waiting: spin `spin_us`, then sleep on the counter's futex (the
// setter wakes when the owner header's `sleepers` is non-zero); while asleep, check every
// 100 ms that the peer process lives (pidfd) and the timeout.
// Threading: one call at a time per object (the Python layer uses it for blocking calls
// only, which a correct program issues from one thread at a time in collective order).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/reduce.h"
#include "transport/shm/shm_segment.h"

namespace linkwise {

class ShmColl {
 public:
  static constexpr size_t kTwoPiece = 1024 << 10;  // bytes per two-shot round
  static constexpr size_t kOneMax = 32 << 10;     // one-shot up to this many bytes
  static constexpr size_t kBcPiece = 128 << 10;
  static constexpr int kBcSlots = 8;

  static size_t segment_bytes(int n);
  // create: rank 0 makes the segment (ftruncate to segment_bytes(n)); others open it.
  ShmColl(const std::string& name, bool create, int rank, int n, double spin_us);
  ~ShmColl();
  // After every rank has constructed its ShmColl (a barrier): learn the peers' pids.
  void connect();
  void unlink() { seg_.unlink(); }
  const std::string& segment_name() const { return seg_.name(); }  // what the others open

  void all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, double timeout);
  void broadcast(void* buf, size_t bytes, int root, double timeout);

 private:
  struct Slot;
  Slot* slot(int r) const;
  void wait_ge(int peer, std::atomic<uint32_t>& word, uint32_t target, const char* what);
  void publish(std::atomic<uint32_t>& word, uint32_t value);
  bool peer_gone(int peer);
  void one_shot(const void* in, void* out, size_t count, DType t, RedOp op);
  void two_shot(const void* in, void* out, size_t count, DType t, RedOp op);

  ShmSegment seg_;
  int rank_, n_;
  double spin_us_;
  double timeout_ = 300.0;
  uint32_t two_round_ = 0, one_round_ = 0;
  uint64_t piece_ = 0;  // broadcast pieces so far (counters carry it modulo 2^32)
  std::vector<int> pidfds_;
};

}  // namespace linkwise
