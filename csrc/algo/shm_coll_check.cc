// Mismatched calls in the shared-memory collectives: descriptors of each call and the checks
// that compare them across ranks (see "Mismatched calls" in algo/shm_coll.h).
#include <string>

#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/status.h"

namespace linkwise {

namespace {

// A call's arguments in 64 bits: kind (4), dtype (4), op (4), root (12, modulo 4096), bytes
// (40: up to 1 TiB, modulo beyond). Broadcasts carry no dtype or op (15 each); only
// broadcasts, reduces, gathers and scatters carry a root.
uint64_t pack(int kind, size_t bytes, int dtype, int op, int root) {
  return static_cast<uint64_t>(kind & 15) | static_cast<uint64_t>(dtype & 15) << 4 |
         static_cast<uint64_t>(op & 15) << 8 | static_cast<uint64_t>(root & 4095) << 12 |
         (static_cast<uint64_t>(bytes) & ((uint64_t{1} << 40) - 1)) << 24;
}

std::string describe(uint64_t d) {
  const int kind = d & 15, dtype = (d >> 4) & 15, op = (d >> 8) & 15, root = (d >> 12) & 4095;
  const std::string bytes = std::to_string(d >> 24) + " bytes";
  if (kind == ShmColl::kBroadcast) return "broadcast of " + bytes + " from root " + std::to_string(root);
  if (kind == ShmColl::kAllGather) return "all_gather of " + bytes;
  if (kind == ShmColl::kAllToAll) return "all_to_all of " + bytes;
  const bool known = dtype < static_cast<int>(DType::kCount) && op < static_cast<int>(RedOp::kCount);
  if (kind == ShmColl::kGather) return "gather of " + bytes + " a rank to root " + std::to_string(root);
  if (kind == ShmColl::kScatter) return "scatter of " + bytes + " a rank from root " + std::to_string(root);
  return std::string(ShmColl::call_name(d)) + " of " + bytes +
         (known ? std::string(" of ") + dtype_str(static_cast<DType>(dtype)) + " (" +
                      redop_str(static_cast<RedOp>(op)) + ")"
                : std::string()) +
         (kind == ShmColl::kReduce ? " to root " + std::to_string(root) : std::string());
}

}  // namespace

const char* ShmColl::call_name(uint64_t desc) {
  static const char* const kNames[] = {"all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                       "all_to_all", "reduce",    "gather",     "scatter"};
  const uint64_t kind = desc & 15;
  return kind < sizeof(kNames) / sizeof(kNames[0]) ? kNames[kind] : "collective";
}

void ShmColl::throw_stopped() const {
  const uint32_t why = slot(0)->h().stopped.v.load(std::memory_order_acquire);
  const int who = static_cast<int>(why & (kStoppedByPeer - 1)) - 1;
  const std::string from = std::to_string(slot(0)->h().stop_call.v.load(std::memory_order_acquire));
  // It closed first: the stop came of the close (its own stop of calls it left pending, or a
  // peer that found it closed and failed naming it).
  if (who >= 0 && peer_closed(who, true)) {
    if (who == rank_)
      throw Error(ErrorKind::Aborted, "rank " + std::to_string(rank_) + ": the communicator was closed", -1);
    throw Error(ErrorKind::Peer,
                "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(who) +
                    " closed its communicator; the shared-memory collectives of this communicator stopped from "
                    "call " + from,
                who);
  }
  if (why & kStoppedByPeer)
    throw Error(ErrorKind::Peer,
                "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(who) +
                    " died or failed during a collective; the shared-memory collectives of this communicator "
                    "stopped from call " + from + ". Look at that rank's output for the cause.",
                who);
  const std::string where = who == rank_ ? "this rank" : "rank " + std::to_string(who);
  throw Error(ErrorKind::Aborted,
              "rank " + std::to_string(rank_) + ": the shared-memory collectives of this communicator stopped "
                  "from call " + from + " after a collective failed on " + where +
                  " (see the first error there); make a new communicator to go on");
}

void ShmColl::begin_call(CallKind kind, size_t bytes, DType t, RedOp op, int root) {
  const uint64_t number = calls_.load(std::memory_order_relaxed) + 1;
  if (stops(number)) throw_stopped();
  calls_.store(number, std::memory_order_relaxed);
  const bool rooted = kind == kReduce || kind == kGather || kind == kScatter;
  desc_ = kind == kBroadcast ? pack(kind, bytes, 15, 15, root)
                             : pack(kind, bytes, static_cast<int>(t), static_cast<int>(op), rooted ? root : 0);
  auto& call = slot(rank_)->h().call;
  call.desc.store(desc_, std::memory_order_relaxed);
  call.seq.store(++call_, std::memory_order_release);
}

void ShmColl::stamp(Stamp& s) const {
  s.seq.store(call_, std::memory_order_relaxed);
  s.desc.store(desc_, std::memory_order_relaxed);
}

void ShmColl::check_line(int q, const Stamp& s, bool strict) const {
  const uint32_t seq = s.seq.load(std::memory_order_relaxed);
  const uint64_t desc = s.desc.load(std::memory_order_relaxed);
  if (seq == call_ ? desc != desc_ : strict) mismatch(q, seq, desc);
}

void ShmColl::skip_call() {
  ++call_;
  const uint64_t number = calls_.load(std::memory_order_relaxed) + 1;
  calls_.store(number, std::memory_order_relaxed);
  // Once stopped (a call failed on some rank), every later call raises anyway: a refusal
  // published now would only turn the peers' PeerError or CommAbortedError into a misleading
  // ValueError. (The latency entries number the executor's own mismatch ValueError as a
  // refusal too, after it stopped the executor: fast_args.h's refusing.)
  if (!stops(number)) slot(rank_)->h().refused.v.store(call_, std::memory_order_release);
}

// Called every ~100 ms of a slow wait (possibly from helper threads: reads atomics and the
// owner's desc_/call_, fixed for the call). A peer in the same call with another descriptor,
// or that refused this call, is a mismatch; a peer in another call may just be slow (or
// done: broadcast roots run ahead).
void ShmColl::check_calls() const {
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    // 0 is "none" (a fresh segment); a call numbered 0 after 2^32 calls is not checked here.
    if (call_ != 0 && slot(q)->h().refused.v.load(std::memory_order_acquire) == call_)
      differs(q, "refused its arguments (its ValueError or TypeError says why) and will not take part");
    auto& call = slot(q)->h().call;
    const uint32_t seq = call.seq.load(std::memory_order_acquire);
    const uint64_t desc = call.desc.load(std::memory_order_relaxed);
    // Re-read seq: the descriptor belongs to that call only if seq did not move meanwhile.
    if (seq == call_ && call.seq.load(std::memory_order_acquire) == seq && desc != desc_) mismatch(q, seq, desc);
  }
}

uint64_t ShmColl::piece_stamp() const {
  const uint64_t bytes = desc_ >> 24;
  return static_cast<uint64_t>(call_) << 32 | (bytes & 0xffffffffu);
}

void ShmColl::piece_mismatch(int root) const {
  auto& call = slot(root)->h().call;
  const uint32_t seq = call.seq.load(std::memory_order_acquire);
  const uint64_t desc = call.desc.load(std::memory_order_relaxed);
  if (seq == call_ && call.seq.load(std::memory_order_acquire) == seq) mismatch(root, seq, desc);
  // The root already went on to later calls: its descriptor of this one is gone.
  differs(root, "(the root) a broadcast of another size or root, or another collective");
}

void ShmColl::mismatch(int q, uint32_t their_call, uint64_t theirs) const {
  const std::string theirs_text =
      their_call == call_ ? describe(theirs)
                          : describe(theirs) + " as its shared-memory collective number " + std::to_string(their_call) +
                                " (the ranks' sequences of calls differ: a call missing on one rank, or one "
                                "whose arguments were refused on one rank only)";
  differs(q, theirs_text + " (a barrier is a 1-byte uint8 all_reduce)");
}

void ShmColl::differs(int q, const std::string& theirs) const {
  throw Error(ErrorKind::Invalid,
              "rank " + std::to_string(rank_) + ": shared-memory collective number " + std::to_string(call_) +
                  " differs between ranks: this rank called " + describe(desc_) + ", rank " + std::to_string(q) +
                  " " + theirs + ". Call each collective with the same arguments, in the same order, on every rank.",
              -1);
}

}  // namespace linkwise
