// Shared-memory collectives for communicators whose ranks all share one host: all-reduce
// (one-shot for small messages, two-shot for large; reduce is the same with the result on
// the root only, see reduce()) and a pipelined broadcast, moving data
// through one segment mapped by every rank instead of through point-to-point messages; and,
// for large messages where the kernel allows it, single-copy all-reduce and broadcast
// straight between the ranks' own buffers (CMA, shm_cma.cc), optionally several threads per
// rank (ForkJoin). The segment then carries only the counters and addresses.
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
//     A reduce_scatter larger than the one-shot area runs the same rounds on the next piece
//     of every block at once: rank j combines block j's piece straight into its out, nothing
//     is copied out, and a_res=r still tells the peers that their `in` was read.
//   Block rounds (all_gather / all_to_all / gather larger than the one-shot area), in the
//     two-shot areas and counters: a_in=r (done reading every earlier round) → wait all
//     a_in>=r → a posting rank puts its piece (all_to_all: one per peer) in res, a_res=r →
//     a reading rank waits, per peer, for a_res>=r and copies its piece out. Every rank
//     posts and reads in all_gather and all_to_all; a gather's non-roots post and its root
//     reads. `res` is rewritten only after everyone's a_in reached the new round, as in
//     two-shot, so the protocols may follow each other in any order, and a gather's
//     non-root may return once its pieces are posted. It may then stamp its next round (in
//     a_in's other parity half) while a peer still checks this one; it stamps the round
//     after only once every a_in passed this round, so after every check of it.
//   Lanes (two-shot and broadcast, with helper threads): a message of at least 2 × lane_min
//     bytes is cut into L = min(lanes, bytes / lane_min) stripes (L agreed: the same on every
//     rank), and lane l runs the protocol above on stripe l with its own counters
//     (a_in[l], ..., c_done[l]), its own round / piece numbers and 1/L of the areas, so the
//     lanes never wait for one another and each rank's lanes may run on any of its threads
//     (ForkJoin hands them out in increasing order, so the lowest unfinished lane is running
//     on every rank: no deadlock even when a rank has fewer threads than lanes). Areas move
//     when L changes between calls: two-shot needs nothing for that (a rank starts a call
//     only after it finished every lane of the previous one, so a peer that published a_in
//     of the new call has read all it needed); for the broadcast the root first waits until
//     every rank copied every piece of earlier broadcasts (ring_drain), since readers may
//     still be copying when the root returns.
//   one-shot round r: copy in to half r&1 → b_in=r → wait all b_in>=r → combine all n in
//     rank order. Half r&1 is rewritten in round r+2, after everyone's b_in reached r+1.
//   broadcast piece i of a lane (numbered across calls): the root waits until every other
//     rank's c_done >= i-kBcSlots+1, copies piece i into ring slot i%kBcSlots, sets
//     c_in=c_done=i+1 (having stamped the call in c_stamp[lane], one word per ring slot); a
//     reader waits for root.c_in >= i+1, checks the stamp, copies it out, sets its c_done=i+1.
//   CMA all-reduce round r (large messages, when every rank may read and write every other
//     rank's memory with process_vm_readv/writev): publish my in/out addresses, x_in=r →
//     wait all x_in>=r → for each chunk of MY segment (part_off(count, n, rank)): read that
//     chunk of every rank's input into a thread-local buffer, combine in rank order 0..n-1,
//     write the result to every rank's output → x_done=r → wait all x_done>=r. The result of
//     segment s is computed once, by rank s, and copied everywhere, so all ranks get the same
//     bits. Each rank's memory traffic is ~ read S + write S (S = message bytes).
//     Aliasing contract: only rank s reads or writes segment s of any rank's buffers, and it
//     reads a chunk of every input before writing that chunk of any output, so in == out
//     (in place) is safe; in and out must not otherwise overlap. Peers touch my buffers only
//     between my x_in=r and their x_done=r, and I return only after every x_done>=r.
//   CMA broadcast round r (large messages): every rank publishes its buffer (the root its
//     source x; out of place the root copies x into its own out first, which no peer
//     touches), resets y_work/y_done to (r, 0), y_in=r. Reader q, once root.y_in>=r, claims
//     pieces of its own buffer (CAS on y_work, refused when the round differs or all are
//     claimed) and reads them from
//     the root; the root, meanwhile, claims pieces of each reader in turn and writes them
//     into it. Whoever copies a reader's last piece sets its y_fin=r. A reader returns once
//     its y_fin>=r, the root once every reader's y_fin>=r (its buffer is no longer read).
//     One copy per byte received, done by two processes at once.
// Every rank runs the same sequence of calls (the collective order), so the round and piece
// numbers agree everywhere. Mismatched calls (another kind, size, dtype, op or root on some
// rank) are caught without a debug mode (shm_coll_check.cc): each call packs its arguments
// into a descriptor; the counters that announce data (all-reduce rounds, broadcast pieces)
// carry it with the call's number in their cache line, so a rank compares every peer's as it
// reads the counter; and a wait that goes slow compares every peer's current call (number
// and descriptor), which catches calls whose protocols differ and so would wait for each
// other forever. The rank that sees it raises ValueError (then every later call raises:).
// After a failed call (mismatch, dead peer, timeout) the counters are no longer in step:
// mark_failed also stops the executor from that call's number (slot 0's `stop_call`), and
// that call and every later one on every rank raise: PeerError naming the peer when one died
// or failed (what its waits would have raised), else CommAbortedError (begin_call: one
// acquire load of a line that stays cached until then; a wait in a stopped call: its slow
// check). The calls numbered before it still run on a rank that is behind: every rank
// that got that far had done its part of them.
// Counters are 32-bit and compared modulo 2^32. Whether CMA is used
// and its size thresholds are agreed in connect() (every rank's probe must succeed; rank 0's
// thresholds are taken), so all ranks always pick the same protocol.
//
// Ordering: data is written before the counter is stored with release; readers load the
// counter with acquire. Waiting: spin `spin_us`, then sleep on the counter's futex (the
// setter wakes when the owner header's `sleepers` is non-zero); while asleep, check every
// 100 ms that the peer process lives (pidfd) and the timeout. A CMA copy from or to a dead
// peer fails with ESRCH and raises PeerError too. A rank whose collective fails sets its
// `failed` word (1 + the rank to blame) before raising, so a live peer waiting on it raises
// PeerError as well instead of waiting for the timeout. A rank that fails inside a CMA round
// first waits (cma_drain) until every live peer is done with its buffers, so no peer copies
// into memory that the caller frees or reuses after the error.
// Threading: one call at a time per object (the Python layer uses it for blocking calls
// only, which a correct program issues from one thread at a time in collective order). The
// CMA paths and the lanes spread a rank's work over `threads` helper threads (ForkJoin)
// internally; wait_ge/publish/mark_failed are safe from those threads (they only touch the
// segment's atomics and settings fixed in connect()). A lane that fails marks the rank
// failed at once, so peers waiting on its other lanes give up instead of timing out.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/reduce.h"
#include "core/status.h"
#include "transport/shm/shm_segment.h"

namespace linkwise {

class ForkJoin;
struct Stamp;

// Settings of the single-copy (CMA) paths and of the helper threads; see connect().
struct ShmCollOptions {
  bool enable = true;         // false: never use CMA (force the copy-through-segment paths)
  size_t ar_min = 256 << 10;  // all-reduces of at least this many bytes use CMA
  size_t bc_min = 256 << 10;  // broadcasts of at least this many bytes use CMA
  size_t chunk = 128 << 10;   // all-reduce: bytes reduced per step (fits L2 twice)
  size_t piece = 256 << 10;   // broadcast: bytes per claimed piece
  size_t lane_min = 256 << 10;  // two-shot / ring broadcast: bytes per lane at least
  int threads = 1;            // helper threads per rank (this rank's own; rank 0's sets the lanes)
  // All-reduces of at most this many bytes run one-shot (every rank reads every input: n x
  // bytes each), larger ones two-shot (~2 x bytes each, one more wait); capped at kOneMax.
  size_t one_max = 32 << 10;
};

class ShmColl {
 public:
  // Bytes per two-shot round; 2 MiB (fewer rounds) ran ~10% faster than 1 MiB at 8-16 MiB.
  static constexpr size_t kTwoPiece = 2048 << 10;
  static constexpr size_t kOneMax = 32 << 10;     // one-shot up to this many bytes
  // The largest one-shot all-reduce is rank 0's ShmCollOptions::one_max, at most kOneMax.
  bool one_shot_fits(size_t bytes) const { return bytes <= opt_.one_max; }
  static constexpr size_t kBcPiece = 256 << 10;  // 256 KiB: ~15% faster than 128 KiB at 1-4 MiB
  static constexpr int kBcSlots = 8;
  static constexpr int kMaxLanes = 16;  // counters per lane live in the slot header; threads beyond it share lanes

  static size_t segment_bytes(int n);
  // create: rank 0 makes the segment (ftruncate to segment_bytes(n)); others open it.
  ShmColl(const std::string& name, bool create, int rank, int n, double spin_us);
  ~ShmColl();
  // After every rank has constructed its ShmColl (a barrier): learn the peers' pids, probe
  // whether CMA works with each of them, and wait until every rank has done so (a barrier
  // through the segment). CMA is used only if every rank enabled it and every probe passed;
  // the thresholds, chunk, piece, lane_min and the lane count (its threads, at most
  // kMaxLanes) are rank 0's; threads are this rank's own.
  void connect(const ShmCollOptions& opt, double timeout);
  bool cma() const { return cma_; }
  // The agreed smallest CMA broadcast (SIZE_MAX when CMA is off): the same on every rank.
  size_t cma_bcast_min() const { return cma_ ? opt_.bc_min : SIZE_MAX; }
  // How many all-reduces / broadcasts took the CMA path (tests check that they ran).
  uint64_t cma_all_reduces() const { return cma_ar_calls_; }
  uint64_t cma_broadcasts() const { return cma_bc_calls_; }
  // How many calls in the two-shot areas (all_reduce, reduce, and the larger reduce_scatter,
  // all_gather and all_to_all) / ring broadcasts ran on more than one lane.
  uint64_t lane_all_reduces() const { return lane_ar_calls_; }
  uint64_t lane_broadcasts() const { return lane_bc_calls_; }
  int size() const { return n_; }
  int rank() const { return rank_; }
  int max_lanes() const { return lanes_; }  // agreed by every rank at connect()
  size_t one_shot_max() const { return opt_.one_max; }  // likewise
  void unlink() { seg_.unlink(); }
  // This rank gives up on its collectives from its next call, on every rank, while the calls
  // before it run on (a late rank still needs them). A call in progress here, if any, fails
  // too: its waits see this rank's `failed` word, and so do peers waiting on this rank for
  // what it has not posted (PeerError naming it, or `blame`); once it raises it stops the
  // calls from its own number (mark_failed). Used when this rank closes with calls pending or
  // gives up waiting for one, and when another collective of the communicator failed here
  // (a point-to-point one, which ran in issue order: the engine's failure hook). blame >= 0:
  // a rank died or failed (later calls raise PeerError naming it). Safe from any thread.
  void stop(int blame = -1);
  // This rank closed its communicator (it may go on living): peers waiting on it for what it
  // has not posted raise PeerError naming it, as if it had died (its pieces of calls it
  // finished stay readable: a wait on a word already reached never looks). Set before any
  // stop() of the close, so a peer that sees this rank's `failed` sees this too and reports
  // the close. Safe from any thread.
  void mark_closed();
  // A peer's abort notice reached this rank (the failure hook). The peer stopped this host's
  // executor itself (stop, or mark_failed) before it sent the notice, and then nothing
  // changes here; if it could not (it never set the executor up), stop(blame).
  void stop_on_notice(int blame);
  // A collective refused its arguments on this rank before reaching the executor: number the
  // calls as if it had run, so that where only this rank refused it, the next call meets the
  // peers' pending one under another number (a mismatch) rather than pairing with it, and
  // (unless the executor already stopped) publish the refusal, so that peers waiting in that
  // call raise within ~0.1 s (their slow waits' check_calls) instead of at the timeout. Owner thread, in issue order (the Python
  // layer queues it behind pending async calls).
  void skip_call();
  const std::string& segment_name() const { return seg_.name(); }  // what the others open

  void all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, double timeout);
  // The all-reduce's protocols with the result kept on root only: root passes its out (which
  // may be in, as for all_reduce), every other rank out == nullptr and its in is only read.
  // Each rank still reduces its own part (two-shot, CMA: nobody's bandwidth idles); the
  // non-roots skip the copy-out (two-shot) or the writes into their own buffers (CMA) but
  // keep every wait, so the areas' reuse rules above still hold. One-shot, a non-root posts
  // its input and returns: its next one-shot round first waits for this one (settle_owed),
  // so a mismatch or a dead peer may reach it one call later, as with a buffered MPI send.
  void reduce(const void* in, void* out, size_t count, DType t, RedOp op, int root, double timeout);
  // Root's src (ignored elsewhere) lands in every rank's buf; src == buf is in place. Out of
  // place the root copies src to its own buf itself while the others receive (the CMA path:
  // readers pull from src meanwhile); src and buf must be the same or not overlap.
  void broadcast(const void* src, void* buf, size_t bytes, int root, double timeout);
  // all_reduce in two steps for the latency path, so that the caller may hold a lock (the
  // GIL) during the first: start() returns -1 when the message does not take the one-shot
  // path (then call all_reduce; nothing was done), 1 when it is complete (the peers were
  // already there: start() spins at most kStartSpinUs for them, never sleeps and never
  // raises), 0 when this rank's input is posted and all_reduce_finish(out, count, t, op)
  // must follow (exactly once, before any other call; it waits, may sleep and raise).
  int all_reduce_start(const void* in, void* out, size_t count, DType t, RedOp op, double timeout);
  void all_reduce_finish(void* out, size_t count, DType t, RedOp op);
  static constexpr double kStartSpinUs = 10.0;

  struct Slot;
  // In call descriptors (shm_coll_check.cc); all_gather, reduce_scatter and all_to_all run
  // through exchange().
  enum CallKind {
    kAllReduce = 0, kBroadcast = 1, kAllGather = 2, kReduceScatter = 3, kAllToAll = 4, kReduce = 5, kGather = 6,
    kScatter = 7
  };
  static const char* call_name(uint64_t desc);  // a descriptor's kind as a name (shm_coll_check.cc)

  // all_gather, reduce_scatter and all_to_all (shm_exchange.cc), in_bytes = x's bytes, of
  // any size: a larger reduce_scatter runs the two-shot all-reduce's rounds with the
  // copy-out left out (reduce_scatter() below; out may be x's block `rank` exactly), a larger
  // all_gather or all_to_all block_rounds(). Up to kOneMax, each rank reads
  // in_bytes (n x in_bytes for all_gather), not the one-shot all-reduce's n x, so the whole
  // area is used whatever one_shot_max() is. One one-shot round, in the one-shot
  // all-reduce's area and round count: copy x in, b_in = r, wait for every peer's round r,
  // then read what this rank needs from every rank's copy (all_gather: all of it, rank
  // order; all_to_all: block `rank` of each; reduce_scatter: block `rank` of each, combined
  // in rank order). out may be x (in place): x was copied in first. out holds n * in_bytes
  // (all_gather), in_bytes / n (reduce_scatter) or in_bytes (all_to_all); t and op matter
  // for reduce_scatter only.
  void exchange(CallKind kind, const void* in, size_t in_bytes, void* out, DType t, RedOp op, double timeout);
  // gather and scatter (shm_exchange.cc); bytes = one rank's block. A gather larger than
  // kOneMax in all (n x bytes) runs block_rounds(); else, and for scatter (at most kOneMax in
  // all), one one-shot round each in the exchange's area. gather: every rank's in (bytes) lands
  // at block q of root's out (n x bytes; nullptr elsewhere); the non-roots post and return.
  // scatter: root's in (n x bytes; ignored elsewhere) block q lands in rank q's out (bytes);
  // the root posts and returns, the others read their block once the root posted. A rank
  // that returned without seeing every peer's post owes the round (owe_round), as a reduce's
  // non-root does. gather's out must not overlap in other than as in's own block (the
  // binding stages in otherwise); scatter's out may overlap in anywhere.
  void gather(const void* in, size_t bytes, void* out, int root, double timeout);
  void scatter(const void* in, void* out, size_t bytes, int root, double timeout);

 private:
  Slot* slot(int r) const;
  // Waits until peer's word (a counter in peer's slot) reaches target. Raises PeerError when
  // that peer died or failed first, TimeoutError after timeout_. With every_peer (a round
  // every rank must reach), also PeerError when another peer died before its own copy of
  // that counter (the same place in its slot) reached target: the peer waited for may be
  // alive but busy elsewhere (say, in a receive from this rank), and the round can never
  // complete.
  void wait_ge(int peer, std::atomic<uint32_t>& word, uint32_t target, const char* what, bool every_peer = false);
  [[noreturn]] void peer_died(int peer, const char* what) const;
  void publish(std::atomic<uint32_t>& word, uint32_t value);
  bool peer_gone(int peer);  // exited, or closed its communicator
  // Closed its communicator (first: before any failure of its own, so what failed or stopped
  // after it came of the close).
  bool peer_closed(int peer, bool first = false) const;
  // The all-reduce / reduce paths after begin_call; out == nullptr: this rank keeps no result.
  void reduce_call(const void* in, void* out, size_t count, DType t, RedOp op);
  void one_shot(const void* in, void* out, size_t count, DType t, RedOp op);
  uint32_t one_shot_post(const void* in, size_t bytes);
  void one_shot_finish(uint32_t r, void* out, size_t count, DType t, RedOp op);
  void one_shot_wait(uint32_t r, const char* what);  // every peer's round r posted (and its stamp checked)
  void settle_owed();  // before the next one-shot post: the wait an owed round skipped (owe_round)
  // The current call's name, for errors ("all_reduce", "gather", ...; from desc_).
  const char* call_what() const { return call_name(desc_); }
  // A one-shot round this rank posted but did not wait for every peer's post of (a rooted
  // call's root or non-root): the next one-shot post waits for it first (settle_owed).
  void owe_round(uint32_t r);
  // Combines count elements at byte offset off of every rank's round-r input, in rank order.
  void one_shot_combine(uint32_t r, void* out, size_t count, DType t, RedOp op, size_t off = 0);
  int lanes_for(size_t bytes) const;
  void run_lanes(int lanes, const std::function<void(int)>& lane);
  void two_shot(const void* in, void* out, size_t count, DType t, RedOp op);
  void two_shot_lanes(const void* in, void* out, size_t count, size_t stride, DType t, RedOp op, bool stream);
  void two_shot_lane(int lane, int lanes, const char* in, char* out, size_t count, size_t stride, DType t, RedOp op,
                     bool stream);
  // A reduce_scatter larger than the one-shot area (after begin_call): two-shot rounds that
  // take a piece of every block (block elements each), each rank reducing its own block's
  // piece into out; no copy-out. out may be exactly this rank's block of in.
  void reduce_scatter(const void* in, void* out, size_t block, DType t, RedOp op);
  // What block rounds move: a block from every rank to every rank (all_gather), a block
  // for every rank from every rank (all_to_all), every rank's block to the root (gather).
  // (Not scatter: its root would post every block, n x the bytes on one rank, where
  // messages let each rank copy its block straight out of the root's x: 4-9x slower from
  // 1 MiB at 16 ranks on the 32-core host, docs/benchmarks.md.)
  enum class BlockMove { kAllGather, kAllToAll, kGather };
  // An all_gather, all_to_all or gather larger than the one-shot area (after begin_call;
  // shm_block_rounds.cc): rounds in the two-shot areas and counters (a_in: every read of the
  // rounds before is done; a_res: my pieces are posted), the posting ranks putting the next
  // piece of their block (all_to_all: of each of their blocks) in res, the reading ranks
  // copying the pieces meant for them out. bytes: one block; out is nullptr on a gather's
  // non-roots. in may be exactly this rank's block of out (all_gather, a gather's root) or
  // out itself (all_to_all); any other overlap is staged.
  void block_rounds(BlockMove m, int root, const void* in, void* out, size_t bytes);
  void block_lane(BlockMove m, int root, int lane, int lanes, const char* src, char* dst, size_t count,
                  size_t stride, bool stream);
  void cma_all_reduce(const void* in, void* out, size_t count, DType t, RedOp op);
  void cma_chunk(size_t o, size_t m, DType t, RedOp op, bool stream, int thread);
  void ring_broadcast(const char* src, char* buf, size_t bytes, int root);
  void ring_lane(int lane, int lanes, char* buf, size_t bytes, int root, bool stream);
  void ring_drain();
  void cma_broadcast(const void* src, void* buf, size_t bytes, int root);
  void cma_take_pieces(int q, int root, uint32_t r, uint64_t src, uint64_t dst, size_t bytes);
  void mark_failed(const Error& e);  // fail_from this call
  void fail_from(uint64_t from, const Error& e);  // sets my `failed`; stops the calls from `from`
  static constexpr uint32_t kStoppedByPeer = 1u << 16;  // in `stopped`: a peer died or failed
  // The `stopped` word for a failure blaming `blame` (a rank that died or failed), or, for -1,
  // for one on this rank.
  uint32_t stop_reason(int blame) const {
    return blame >= 0 ? kStoppedByPeer | static_cast<uint32_t>(blame + 1) : static_cast<uint32_t>(rank_ + 1);
  }
  // Calls numbered `from` and up fail on every rank (why: the `stopped` word; the lowest
  // number wins, with its reason). Safe from any thread.
  void stop_calls(uint64_t from, uint32_t why);
  // Whether call number `call` (calls_ numbering) is stopped; throw_stopped raises its error.
  bool stops(uint64_t call) const;  // inline, in shm_coll_slot.h
  [[noreturn]] void throw_stopped() const;
  // Mismatch checks (shm_coll_check.cc): begin_call numbers this call and publishes its
  // descriptor; check_line throws when a peer's stamp of the same round differs;
  // check_calls (slow waits only) when a peer in the same call has another descriptor or
  // refused it (skip_call).
  // Throws CommAbortedError (or PeerError) when this call is stopped (stops()).
  void begin_call(CallKind kind, size_t bytes, DType t, RedOp op, int root);
  // stamp: this call's number and descriptor into a line I am about to publish. check_line,
  // after acquiring peer q's line: throws when it announces this call with another
  // descriptor, or (strict: all-reduce rounds, where no peer can be a call ahead or behind)
  // another call.
  void stamp(Stamp& s) const;
  void check_line(int q, const Stamp& s, bool strict) const;
  void check_calls() const;
  [[noreturn]] void mismatch(int q, uint32_t their_call, uint64_t theirs) const;
  // The ValueError of a call that differs: "... this rank called <this call>, rank q <theirs>."
  [[noreturn]] void differs(int q, const std::string& theirs) const;
  // A broadcast piece's stamp: this call's number and its byte count modulo 2^32 (the root
  // and kind are implied: only the root's broadcasts write pieces to its slot). A reader
  // compares it strictly, since the piece belongs to this very call; piece_mismatch names
  // what it can. (Earlier forms in one 32-bit word let through some size pairs, such as 4
  // and 262144 bytes, and calls 16 apart after refused calls: acceptance runs.)
  uint64_t piece_stamp() const;
  [[noreturn]] void piece_mismatch(int root) const;
  void cma_drain();
  char* scratch(int thread);

  ShmSegment seg_;
  int rank_, n_;
  double spin_us_;
  double timeout_ = 300.0;
  uint32_t one_round_ = 0, x_round_ = 0, y_round_ = 0;
  uint32_t call_ = 0;  // calls so far (the same on every rank); see begin_call
  // The same count in 64 bits, never swapped for an owed call's (settle_owed does call_):
  // what stops compare. Written by the owner thread only; read by the failure hook's thread.
  std::atomic<uint64_t> calls_{0};
  uint64_t desc_ = 0;  // this call's descriptor
  // A one-shot round this rank posted and returned from without waiting for every peer (a
  // reduce's non-root, a gather's non-root, any rank of a scatter; 0: none), with that
  // call's number and descriptor: settle_owed() waits for it.
  uint32_t owed_round_ = 0, owed_call_ = 0;
  uint64_t owed_desc_ = 0;
  uint32_t two_round_[kMaxLanes] = {};  // per lane
  uint64_t piece_[kMaxLanes] = {};      // broadcast pieces so far per lane (counters carry it modulo 2^32)
  int lanes_ = 1;                       // agreed lane count (rank 0's threads, at most kMaxLanes)
  int bc_lanes_ = 1;                    // lanes of the last ring broadcast (its areas)
  std::vector<int> pidfds_;
  std::vector<int64_t> pids_;
  bool cma_ = false;
  uint64_t cma_ar_calls_ = 0, cma_bc_calls_ = 0, lane_ar_calls_ = 0, lane_bc_calls_ = 0;
  int cma_busy_ = 0;  // inside a CMA round (1 all-reduce, 2 broadcast): peers may touch my buffers
  int y_root_ = 0;    // the current CMA broadcast's root
  ShmCollOptions opt_;
  std::unique_ptr<ForkJoin> pool_;
  std::vector<char*> scratch_;  // per thread: 2 * opt_.chunk bytes, allocated on first use
  std::vector<uint64_t> x_src_, x_dst_;  // this CMA round's buffers of every rank
};

}  // namespace linkwise
