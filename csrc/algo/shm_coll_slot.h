// Internal to the shared-memory collectives (shm_coll.cc, shm_cma.cc): one rank's Slot in
// the collective segment, and helpers both files use. See algo/shm_coll.h for the protocols.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "algo/shm_coll.h"
#include "algo/shm_kernels.h"

namespace linkwise {

// The number and descriptor of the call (ShmColl::call_, desc_) that published a counter,
// stored (relaxed) in the counter's line before the counter, so a peer that acquired the
// counter reads them from the line it already holds (ShmColl::stamp, check_line).
struct Stamp {
  std::atomic<uint32_t> seq;
  std::atomic<uint64_t> desc;
};
struct alignas(64) Line {
  std::atomic<uint32_t> v;
  Stamp stamp;  // used by the lines that announce data: x_in, y_in
};
// b_in and a_in: a stamp per round parity, since a peer may already be in the next round
// while this rank still checks the last one (one-shot: a rooted call's rank needs no second
// wait; two-shot areas: a gather's non-root returns once its pieces are posted). Nobody
// stamps the round after that before every check of this one: see algo/shm_coll.h.
struct alignas(64) ParityLine {
  std::atomic<uint32_t> v;
  Stamp stamp[2];
};
// Broadcast pieces: one stamp per ring slot (piece_stamp()), a line per lane next to c_in.
// The root may be up to kBcSlots pieces ahead, across calls, so one stamp per counter would
// often show a later call; slot i%kBcSlots's stamp stays until every reader is done with
// piece i.
struct alignas(64) PieceStamps {
  std::atomic<uint64_t> piece[ShmColl::kBcSlots];
};
// The owner's current call: `desc`, then `seq` (release). Peers read it only when a wait is
// slow (ShmColl::check_calls), to tell a mismatched call from a slow peer.
struct alignas(64) CallLine {
  std::atomic<uint64_t> desc;
  std::atomic<uint32_t> seq;
};
struct alignas(64) Line64 {
  std::atomic<uint64_t> v;
};

constexpr uint32_t kClosedFirst = 1, kClosedAfterFailure = 2;  // Header::closed

constexpr size_t kSlotHeader = 8192;  // two pages: the per-lane counters of 16 lanes fill one

inline bool reached(uint32_t have, uint32_t want) { return static_cast<int32_t>(have - want) >= 0; }

constexpr size_t kStreamMin = 8 << 20;  // messages at least this big are copied out with streaming stores
constexpr size_t kSub = 32 << 10;       // reduce, then copy out, this many bytes at a time (in L1/L2)
// Ranks whose inputs are reduced in one pass (reduce_many_store); 2 ranks keep the pair kernel.
inline bool one_pass(int n) { return n >= 3 && n <= kManyMax; }

// Copies n bytes; with stream (and n >= 4 KiB) through non-temporal stores, for destinations
// that will not be read again soon (a big message's user buffer): no read-for-ownership.
void copy_out(void* dst, const void* src, size_t n, bool stream);

// Combines v(0), ..., v(n-1) (element pointers, fetched once each, in rank order) into res
// and writes the result to out as well: the last combination in one pass when a fused kernel
// exists (algo/shm_kernels.h; then the caller fences streamed stores), else reduce3 + copy_out.
// `res` may be the buffer v(0) returned (exact alias). out == nullptr: into res only.
template <class V>
void combine_store(int n, char* res, char* out, V&& v, size_t m, DType t, RedOp op, bool stream) {
  const char* first = v(0);
  const char* second = v(1);
  if (n == 2 && out && reduce_store2(res, out, first, second, m, t, op, stream)) return;
  reduce3(res, first, second, m, t, op);
  for (int q = 2; q < n; ++q) {
    const char* next = v(q);
    if (q == n - 1 && out && reduce_store2(res, out, res, next, m, t, op, stream)) return;
    reduce_into(res, next, m, t, op);
  }
  if (op == RedOp::Avg) avg_finish(res, m, t, n);
  if (out) copy_out(out, res, m * dtype_size(t), stream);
}

// Every field is written by the slot's owner only, except y_work/y_done (see shm_coll.h).
struct ShmColl::Slot {
  struct Header {
    int64_t pid;
    uint64_t self_addr;  // where the owner mapped this slot: peers probe CMA by reading `pid` there
    ParityLine a_in[kMaxLanes];  // per lane, as the three below
    Line a_res[kMaxLanes], c_in[kMaxLanes], c_done[kMaxLanes];
    PieceStamps c_stamp[kMaxLanes];
    ParityLine b_in;
    Line sleepers;
    Line failed;  // 1 + the rank blamed, once a collective failed on the owner (then never cleared)
    // Set once the owner closed its communicator (ShmColl::mark_closed; never cleared):
    // kClosedFirst, or kClosedAfterFailure when `failed` was set before (that failure is what
    // peers report; a `failed` or a stop after kClosedFirst came of the close).
    Line closed;
    CallLine call;
    // The owner's latest call refused before it reached the executor (skip_call; 0: none).
    // Peers waiting in that call read it in their slow waits (check_calls) and raise instead
    // of waiting for the timeout; it outlives the owner's later calls, unlike `call`.
    Line refused;
    // Slot 0's only: why the executor stopped (ShmColl::stop_calls): 1 + the rank whose call
    // failed, or kStoppedByPeer | 1 + a rank that died or failed (any rank sets it; the
    // lowest stop's).
    Line stopped;
    // Slot 0's only: the first call number (every rank numbers calls alike) that fails on
    // every rank, 0 while none; the lowest of all stops. Calls before it still run: the
    // failure did not touch them, and a late rank still needs them to finish.
    Line64 stop_call;
    // connect(): the owner's probe result and settings, valid once hello == 1.
    Line hello;
    uint32_t cma_ok;  // the owner may read and write every peer's memory (and wants to)
    uint64_t ar_min, bc_min, chunk, piece, lane_min, lanes, one_max;
    // CMA all-reduce: this round's buffers (owner's addresses), then x_in = round.
    Line x_in, x_done;
    uint64_t x_src, x_dst;
    // CMA broadcast: this round's buffer, y_work = round<<32 | pieces claimed, y_done =
    // round<<32 | pieces copied, then y_in = round; y_fin = round once all pieces landed.
    Line y_in, y_fin;
    Line64 y_work, y_done;
    // round << 32 | call number, written before y_in: a peer that reads it after y_in >= r
    // knows whether it is this round's (compare the call strictly) or a later one's (the
    // owner went on: a reader may pull every piece itself, the root may push every piece).
    Line64 y_call;
    uint64_t y_addr;
  };
  static_assert(sizeof(Header) <= kSlotHeader, "slot header fits its pages");
  Header& h() { return *reinterpret_cast<Header*>(this); }
  char* base() { return reinterpret_cast<char*>(this); }
  char* two_in() { return base() + kSlotHeader; }
  char* two_res() { return two_in() + kTwoPiece; }
  char* one(uint32_t round) { return two_res() + kTwoPiece + (round & 1) * kOneMax; }
  char* bc(uint64_t piece) { return two_res() + kTwoPiece + 2 * kOneMax + (piece % kBcSlots) * kBcPiece; }
  static constexpr size_t bytes() { return kSlotHeader + 2 * kTwoPiece + 2 * kOneMax + kBcSlots * kBcPiece; }
};

inline bool ShmColl::stops(uint64_t call) const {
  const uint64_t from = slot(0)->h().stop_call.v.load(std::memory_order_acquire);
  return from != 0 && call >= from;
}

}  // namespace linkwise
