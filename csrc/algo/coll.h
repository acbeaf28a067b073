// The CPU collectives: their parameters, and the small toolkit every algorithm uses.
//
// Algorithms are written against the point-to-point Engine only (isend/irecv/wait); their
// shape (ring order, tree parent/children, chain) arrives as plain data from Python's
// Schedule, so a planner can replace the default without touching this code.
//
// Tags: a collective's messages carry tag = bit 63 | seq << 24 | kind << 16 | step, where
// seq is the communicator's collective counter (every rank calls collectives in the same
// order) and step numbers the phases of one call; user tags are < 2^62, so the two never
// meet. Messages of one (peer, tag) arrive in order, so one step may carry many chunks.
//
// Threading: a collective runs on one thread (the caller's, GIL released, or the
// communicator's worker for async calls); several may run at once on distinct seqs.
// Buffers: borrowed for the call; `send` is never written; `recv` is written only as the
// collective's contract says (see run_collective).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/reduce.h"
#include "p2p/engine.h"

namespace linkwise {

enum class CollKind : int {
  AllReduce = 0, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Gather, Scatter, Barrier, kCount
};
enum class Algo : int { Auto = 0, Ring, Tree, Chain, Direct };

struct CollParams {
  CollKind kind = CollKind::Barrier;
  DType dtype = DType::U8;
  RedOp op = RedOp::Sum;
  int root = 0;
  uint64_t seq = 0;          // per-communicator collective number (same on every rank)
  Algo algo = Algo::Auto;    // Python resolves Auto; the executor treats it as the default
  size_t chunk_bytes = 1 << 20;
  std::vector<int> order;    // ring order (a permutation of ranks); empty = 0..n-1
  int parent = -1;           // tree/chain: this rank's parent toward the root (-1 at root)
  std::vector<int> children; // tree/chain: this rank's children, in send order
  double timeout = 300.0;
};

// Runs one collective on `engine`. send/recv are byte ranges (count elements implied by the
// kind; see bind_coll.cc and collectives.py). For in-place calls send == recv. Throws Error.
void run_collective(Engine& engine, const CollParams& p, const void* send, size_t send_bytes,
                    void* recv, size_t recv_bytes);

// Point-to-point helpers bound to one collective call.
class CollCtx {
 public:
  // call_bytes: the size every rank passes for this call (see run_collective), carried in
  // every message's code so that a call of another size fails even where the messages would
  // fit (a prefix: a broadcast of 1 MiB read as 512 KiB, in whole chunks).
  CollCtx(Engine& e, const CollParams& p, size_t call_bytes) : e_(e), p_(p), call_bytes_(call_bytes) {}
  int rank() const { return e_.rank(); }
  int size() const { return e_.size(); }
  const CollParams& params() const { return p_; }
  uint64_t tag(int step) const { return collective_tag(p_.seq, static_cast<uint32_t>(p_.kind), step); }
  // Every message header carries (kind, dtype, op, a 16-bit hash of the call's size): the
  // engine requires equal codes, so the receiver fails a message of a call reduced another
  // way or of another size (collective_code in p2p/engine.h).
  uint32_t wire_code() const {
    const bool reducing = p_.kind == CollKind::AllReduce || p_.kind == CollKind::Reduce ||
                          p_.kind == CollKind::ReduceScatter;
    return collective_code(static_cast<uint32_t>(p_.kind), reducing ? static_cast<uint32_t>(p_.dtype) : 15,
                           reducing ? static_cast<uint32_t>(p_.op) : 15, call_bytes_);
  }
  std::shared_ptr<Request> isend(int peer, const void* buf, size_t bytes, int step) {
    return e_.isend(peer, buf, bytes, tag(step), wire_code(), false);
  }
  std::shared_ptr<Request> irecv(int peer, void* buf, size_t bytes, int step) {
    return e_.irecv(peer, buf, bytes, tag(step), wire_code(), false);
  }
  // Every receive of a collective expects an exact size; a shorter message means the ranks
  // called it with different sizes or dtypes (a longer one fails in the engine already).
  void wait(const std::shared_ptr<Request>& r) {
    if (!r) return;
    e_.wait(*r, p_.timeout, "collective");
    if (r->kind == Request::Kind::Recv && r->transferred() != r->bytes) size_mismatch(*r);
  }
  // Waits for every request (all of them, even after a failure, so no buffer is in use when
  // this returns normally); rethrows the first error.
  void wait_all(std::vector<std::shared_ptr<Request>>& rs) {
    for (auto& r : rs) wait(r);
    rs.clear();
  }
  // After a failure mid-collective (call from the catch block): fail every pending request of
  // the communicator (the design's rule: a failed communicator is aborted, never left
  // hanging), so none still points into this call's buffers once the exception leaves it,
  // and tell the peers, blaming the rank the failure names (Engine::abort_and_notify).
  void abort_after_failure() {
    int blame = -1;
    try {
      throw;
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Peer) blame = e.peer();
    } catch (...) {
    }
    e_.abort_and_notify("a collective failed on this rank", blame, p_.seq);  // the peers stop from this call
  }
  void send(int peer, const void* buf, size_t bytes, int step) { wait(isend(peer, buf, bytes, step)); }
  void recv(int peer, void* buf, size_t bytes, int step) { wait(irecv(peer, buf, bytes, step)); }

 private:
  [[noreturn]] void size_mismatch(const Request& r) const;
  Engine& e_;
  const CollParams& p_;
  size_t call_bytes_;
};

// Scratch memory reused across collectives. Fresh pages cost a page fault each (several us
// on a VM, hundreds per MiB), so algorithms take their buffers from here instead of
// allocating per call. Threading: one pool per thread, and a collective runs start to end
// on one thread (the caller's or the communicator's worker), so a slot is never used by two
// calls at once. Within one call each use takes its own slot (see ScratchSlot).
enum ScratchSlot { kRingA, kRingB, kTreeChildren, kTreeAcc, kDoublingTmp, kDirectSlots, kDispatchCopy, kNumSlots };
char* coll_scratch(ScratchSlot slot, size_t bytes);

// Splits `count` elements into n nearly equal parts; part i is [off(i), off(i+1)).
inline size_t part_off(size_t count, int n, int i) {
  size_t q = count / n, r = count % n;
  return q * i + std::min<size_t>(i, r);
}

// Algorithm families (one file each).
void ring_all_reduce(CollCtx& c, void* buf, size_t count);
void ring_reduce_scatter(CollCtx& c, void* work, size_t block_count, void* out);
void ring_all_gather(CollCtx& c, void* out, size_t block_bytes);
void rd_all_reduce(CollCtx& c, void* buf, size_t count);
void direct_all_reduce(CollCtx& c, void* buf, size_t count);
void tree_broadcast(CollCtx& c, void* buf, size_t bytes);
void tree_reduce(CollCtx& c, const void* in, void* out, size_t count);
void pairwise_all_to_all(CollCtx& c, const void* in, void* out, size_t block_bytes, bool copy_own = true);
void linear_gather(CollCtx& c, const void* in, void* out, size_t block_bytes);
void linear_scatter(CollCtx& c, const void* in, void* out, size_t block_bytes);
void dissemination_barrier(CollCtx& c);

}  // namespace linkwise
