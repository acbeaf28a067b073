#include "algo/shm_coll.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "algo/coll.h"
#include "algo/fork_join.h"
#include "algo/shm_coll_slot.h"
#include "algo/shm_kernels.h"
#include "core/copy.h"
#include "core/process.h"
#include "core/status.h"
#include "core/wait.h"
#include "transport/shm/cma.h"

namespace linkwise {

// Copies into a large destination that will not be read again soon (a big message's user
// buffer) with non-temporal stores, which skip the read-for-ownership of every destination
// line: out-of-cache copies move 2 streams of memory traffic instead of 3.
void copy_out(void* dst, const void* src, size_t n, bool stream) {
#if defined(__SSE2__)
  if (stream && n >= 4096) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  copy_bytes(dst, src, n);
}

size_t ShmColl::segment_bytes(int n) { return static_cast<size_t>(n) * Slot::bytes(); }

ShmColl::ShmColl(const std::string& name, bool create, int rank, int n, double spin_us)
    : rank_(rank), n_(n), spin_us_(spin_us) {
  seg_ = create ? ShmSegment::create_private(name, segment_bytes(n)) : ShmSegment::open(name);
  LW_CHECK(seg_.size() >= segment_bytes(n), "collective segment has room for every rank");
  slot(rank_)->h().pid = static_cast<int64_t>(getpid());
  slot(rank_)->h().self_addr = reinterpret_cast<uint64_t>(slot(rank_));
  cma_allow_peers();  // peers may read and write our buffers in the CMA paths
}

ShmColl::~ShmColl() {
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
  for (char* p : scratch_) std::free(p);
}

void ShmColl::connect(const ShmCollOptions& opt, double timeout) {
  timeout_ = timeout;
  pidfds_.assign(n_, -1);
  pids_.assign(n_, 0);
  bool ok = opt.enable;
  for (int r = 0; r < n_; ++r) {
    pids_[r] = slot(r)->h().pid;
    if (r == rank_) continue;
#ifdef SYS_pidfd_open
    pidfds_[r] = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pids_[r]), 0));
#endif
    // Reading works iff writing does (the same ptrace-attach check), so one probe per peer.
    if (ok) ok = cma_probe(pids_[r], reinterpret_cast<const void*>(slot(r)->h().self_addr), pids_[r]);
  }
  auto& me = slot(rank_)->h();
  me.cma_ok = ok ? 1 : 0;
  me.ar_min = opt.ar_min;
  me.bc_min = opt.bc_min;
  me.chunk = opt.chunk;
  me.piece = opt.piece;
  me.lane_min = opt.lane_min;
  me.one_max = opt.one_max;
  me.lanes = static_cast<uint64_t>(std::clamp(opt.threads, 1, kMaxLanes));
  publish(me.hello.v, 1);
  bool all = true;
  for (int r = 0; r < n_; ++r) {
    if (r != rank_) wait_ge(r, slot(r)->h().hello.v, 1, "setup");
    all = all && slot(r)->h().cma_ok;
  }
  auto& zero = slot(0)->h();
  opt_ = opt;
  opt_.ar_min = std::max<size_t>(1, zero.ar_min);
  opt_.bc_min = std::max<size_t>(1, zero.bc_min);
  opt_.chunk = std::max<size_t>(4096, zero.chunk & ~size_t(63));
  opt_.piece = std::max<size_t>(4096, zero.piece);
  opt_.lane_min = std::max<size_t>(4096, zero.lane_min);
  opt_.one_max = std::min<size_t>(kOneMax, zero.one_max);
  opt_.threads = std::max(1, opt.threads);
  lanes_ = static_cast<int>(std::clamp<uint64_t>(zero.lanes, 1, kMaxLanes));
  cma_ = all;
  // Helpers start on the first run that needs them, and spin between runs as long as a waiting
  // rank spins (short when cores are scarce).
  pool_ = std::make_unique<ForkJoin>(opt_.threads, spin_us_);
}

ShmColl::Slot* ShmColl::slot(int r) const {
  return reinterpret_cast<Slot*>(static_cast<char*>(seg_.data()) + static_cast<size_t>(r) * Slot::bytes());
}

bool ShmColl::peer_closed(int peer, bool first) const {
  const uint32_t closed = slot(peer)->h().closed.v.load(std::memory_order_acquire);
  return first ? closed == kClosedFirst : closed != 0;
}

void ShmColl::mark_closed() {
  auto& h = slot(rank_)->h();
  const bool failed = h.failed.v.load(std::memory_order_acquire) != 0;
  h.closed.v.store(failed ? kClosedAfterFailure : kClosedFirst, std::memory_order_seq_cst);
}

bool ShmColl::peer_gone(int peer) {
  if (peer_closed(peer)) return true;
  int fd = pidfds_.empty() ? -1 : pidfds_[peer];
  if (fd >= 0) {
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;  // a pidfd turns readable when the process terminates (zombie or not)
  }
  return process_gone_without_pidfd(static_cast<pid_t>(slot(peer)->h().pid));  // zombies too
}

void ShmColl::publish(std::atomic<uint32_t>& word, uint32_t value) {
  word.store(value, std::memory_order_seq_cst);
  if (slot(rank_)->h().sleepers.v.load(std::memory_order_seq_cst) > 0) futex_wake_all(&word);
}

void ShmColl::peer_died(int peer, const char* what) const {
  const std::string who = "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) + " (pid " +
                          std::to_string(slot(peer)->h().pid) + ")";
  if (peer_closed(peer))
    throw Error(ErrorKind::Peer, who + " closed its communicator while this rank waited in a shared-memory " + what,
                peer);
  throw Error(ErrorKind::Peer,
              who + " died during a shared-memory " + what + ". Look at that rank's output for the cause.", peer);
}

void ShmColl::wait_ge(int peer, std::atomic<uint32_t>& word, uint32_t target, const char* what,
                      bool every_peer) {
  if (reached(word.load(std::memory_order_acquire), target)) return;
  const auto t0 = Clock::now();
  while (seconds_since(t0) * 1e6 < spin_us_) {
    for (int i = 0; i < 16; ++i) {
      if (reached(word.load(std::memory_order_acquire), target)) return;
      cpu_relax();
    }
  }
  auto& sleepers = slot(peer)->h().sleepers.v;
  auto last_check = Clock::now();
  while (true) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = word.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(&word, v, 2000);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(word.load(std::memory_order_acquire), target)) return;
    if (seconds_since(last_check) >= 0.1) {
      last_check = Clock::now();
      check_calls();  // a peer in this call with other arguments: it may never publish `word`
      if (interrupted()) throw_interrupted(rank_, std::string("shared-memory ") + what);  // Ctrl-C
      // Stopped from another thread of this rank (close(), or another collective of the
      // communicator failed: the engine's failure hook): this call can no longer complete.
      if (slot(rank_)->h().failed.v.load(std::memory_order_acquire) && !reached(word.load(std::memory_order_acquire), target))
        throw Error(ErrorKind::Aborted,
                    "rank " + std::to_string(rank_) + ": this rank's shared-memory collectives were stopped (" +
                        (peer_closed(rank_, true) ? "the communicator was closed" : "another of its collectives failed") +
                        ") while it waited in a shared-memory " + what,
                    -1);
      // A peer that closed with a call pending also marked itself failed (its stop): report the close.
      if (peer_closed(peer, true) && !reached(word.load(std::memory_order_acquire), target)) peer_died(peer, what);
      const uint32_t blame = slot(peer)->h().failed.v.load(std::memory_order_acquire);
      if (blame && !reached(word.load(std::memory_order_acquire), target)) {
        const int culprit = static_cast<int>(blame) - 1;
        // `what` is this rank's call; the peer may have failed in another one (a mismatch).
        const std::string who = culprit == peer ? "a collective failed on peer rank " + std::to_string(peer)
                                                : "peer rank " + std::to_string(peer) +
                                                      " gave up on a collective because rank " +
                                                      std::to_string(culprit) + " failed";
        throw Error(ErrorKind::Peer,
                    "rank " + std::to_string(rank_) + ": " + who + " while this rank waited in a shared-memory " +
                        what + ". Look at rank " + std::to_string(culprit) + "'s output for the cause.",
                    culprit);
      }
      if (peer_gone(peer) && !reached(word.load(std::memory_order_acquire), target)) peer_died(peer, what);
      if (every_peer) {  // every slot has the same layout: q's copy of `word` is at the same offset
        const size_t at = static_cast<size_t>(reinterpret_cast<char*>(&word) - reinterpret_cast<char*>(slot(peer)));
        for (int q = 0; q < n_; ++q) {
          auto& theirs = *reinterpret_cast<std::atomic<uint32_t>*>(reinterpret_cast<char*>(slot(q)) + at);
          if (q != rank_ && q != peer && !reached(theirs.load(std::memory_order_acquire), target) && peer_gone(q))
            peer_died(q, what);
        }
      }
      // This call is stopped (it failed on a rank, or one gave up before it): it cannot complete.
      if (stops(calls_.load(std::memory_order_relaxed)) && !reached(word.load(std::memory_order_acquire), target))
        throw_stopped();
      if (seconds_since(t0) > timeout_)
        throw Error(ErrorKind::Timeout, "rank " + std::to_string(rank_) + ": shared-memory " + what +
                                            " waited more than " + seconds_text(timeout_) + " for rank " +
                                            std::to_string(peer) + "; check that every rank calls it with the same arguments and host arrays "
                                            "(LINKWISE_CHECK=1 verifies that), or raise LINKWISE_TIMEOUT",
                    peer);
    }
  }
}

// Peers waiting on this rank (for data of a call it has not finished: a wait on a word
// already reached never looks) raise PeerError naming `culprit`; calls from `from` are stopped.
// A dead or failed peer is what later calls report (PeerError, as the waits would); any other
// failure (mismatch, timeout) stops the executor with this rank named.
void ShmColl::fail_from(uint64_t from, const Error& e) {
  const int culprit = e.peer() < 0 ? rank_ : e.peer();
  auto& f = slot(rank_)->h().failed.v;
  if (f.load(std::memory_order_relaxed) == 0) f.store(static_cast<uint32_t>(culprit + 1));
  stop_calls(from, stop_reason(e.kind() == ErrorKind::Peer ? culprit : -1));
}

void ShmColl::mark_failed(const Error& e) {  // from this call (the last one begun; the first when none was)
  fail_from(std::max<uint64_t>(calls_.load(std::memory_order_relaxed), 1), e);
}

void ShmColl::stop(int blame) {
  fail_from(calls_.load(std::memory_order_relaxed) + 1,
            Error(blame >= 0 ? ErrorKind::Peer : ErrorKind::Aborted, "stopped", blame));
}

// The reason goes with the lowest number (the stop that makes a call fail is the lowest one
// at or below it). A first stop writes its reason before its number, so whoever sees a number
// sees a reason; a lower one replaces the reason just after (two racing stops may briefly
// show one's number with the other's reason: the message only).
void ShmColl::stop_calls(uint64_t from, uint32_t why) {
  auto& h = slot(0)->h();
  uint32_t none = 0;
  h.stopped.v.compare_exchange_strong(none, why);
  uint64_t cur = h.stop_call.v.load(std::memory_order_relaxed);
  while (cur == 0 || from < cur) {
    if (h.stop_call.v.compare_exchange_weak(cur, from, std::memory_order_release, std::memory_order_relaxed)) {
      if (cur != 0) h.stopped.v.store(why, std::memory_order_release);
      return;
    }
  }
}

void ShmColl::stop_on_notice(int blame) {
  if (slot(0)->h().stop_call.v.load(std::memory_order_acquire) != 0) return;  // the sender stopped it
  stop(blame);
}

void ShmColl::all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, double timeout) {
  timeout_ = timeout;
  const size_t bytes = count * dtype_size(t);
  begin_call(kAllReduce, bytes, t, op, 0);
  reduce_call(in, out, count, t, op);
}

void ShmColl::reduce(const void* in, void* out, size_t count, DType t, RedOp op, int root, double timeout) {
  timeout_ = timeout;
  LW_CHECK(root >= 0 && root < n_ && (rank_ != root || out || count == 0), "reduce: a root in range, with an output");
  begin_call(kReduce, count * dtype_size(t), t, op, root);
  reduce_call(in, rank_ == root ? out : nullptr, count, t, op);
}

void ShmColl::reduce_call(const void* in, void* out, size_t count, DType t, RedOp op) {
  const size_t bytes = count * dtype_size(t);
  try {
    if (cma_ && bytes >= opt_.ar_min) cma_all_reduce(in, out, count, t, op);
    else if (one_shot_fits(bytes)) one_shot(in, out, count, t, op);
    else two_shot(in, out, count, t, op);
  } catch (const Error& e) {
    mark_failed(e);
    cma_drain();
    throw;
  }
}

void ShmColl::one_shot(const void* in, void* out, size_t count, DType t, RedOp op) {
  one_shot_finish(one_shot_post(in, count * dtype_size(t)), out, count, t, op);
}

// One-shot round r: my input into half r&1 of my area, then b_in = r.
uint32_t ShmColl::one_shot_post(const void* in, size_t bytes) {
  if (owed_round_) settle_owed();
  const uint32_t r = ++one_round_;
  Slot* me = slot(rank_);
  if (bytes) copy_bytes(me->one(r), in, bytes);  // 0: a rooted call's rank whose area nobody reads
  stamp(me->h().b_in.stamp[r & 1]);
  publish(me->h().b_in.v, r);
  return r;
}

// Waits for every peer's round r, then combines all inputs in rank order into out.
// A reduce's non-root (out == nullptr) reads nothing: it returns at once, and its next
// one-shot post first waits for this round (settle_owed), as the wait here would have.
void ShmColl::one_shot_finish(uint32_t r, void* out, size_t count, DType t, RedOp op) {
  if (!out) return owe_round(r);
  one_shot_wait(r, call_what());
  one_shot_combine(r, out, count, t, op);
}

void ShmColl::owe_round(uint32_t r) {
  owed_round_ = r;
  owed_call_ = call_;
  owed_desc_ = desc_;
}

// Half r&1 is rewritten in round r+2 only once every peer posted r+1, which a reader does
// after it finished reading round r: so before this rank posts the round after an owed one,
// it waits for every peer's owed round, and checks their stamps against that call (a
// mismatch there raises now, naming that call).
void ShmColl::settle_owed() {
  struct Restore {  // this call's number and descriptor come back however the wait ends
    ShmColl& s;
    uint32_t call;
    uint64_t desc;
    ~Restore() { s.call_ = call, s.desc_ = desc; }
  } restore{*this, call_, desc_};
  const uint32_t r = owed_round_;
  owed_round_ = 0;
  call_ = owed_call_, desc_ = owed_desc_;  // the owed call's, for check_line and its message
  one_shot_wait(r, call_name(desc_));
}

void ShmColl::one_shot_wait(uint32_t r, const char* what) {
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    wait_ge(q, slot(q)->h().b_in.v, r, what, true);
    check_line(q, slot(q)->h().b_in.stamp[r & 1], true);
  }
}

void ShmColl::one_shot_combine(uint32_t r, void* out, size_t count, DType t, RedOp op, size_t off) {
  if (one_pass(n_)) {
    const char* ins[kManyMax];
    for (int q = 0; q < n_; ++q) ins[q] = slot(q)->one(r) + off;
    if (reduce_many_store(out, out, ins, n_, count, t, op, false)) return;
  }
  reduce3(out, slot(0)->one(r) + off, slot(1)->one(r) + off, count, t, op);
  for (int q = 2; q < n_; ++q) reduce_into(out, slot(q)->one(r) + off, count, t, op);
  if (op == RedOp::Avg) avg_finish(out, count, t, n_);
}

int ShmColl::all_reduce_start(const void* in, void* out, size_t count, DType t, RedOp op, double timeout) {
  const size_t bytes = count * dtype_size(t);
  // all_reduce raises, or (an owed round) may wait for peers, which this must not
  if ((cma_ && bytes >= opt_.ar_min) || !one_shot_fits(bytes) || stops(calls_.load(std::memory_order_relaxed) + 1) ||
      owed_round_)
    return -1;
  timeout_ = timeout;
  begin_call(kAllReduce, bytes, t, op, 0);
  const uint32_t r = one_shot_post(in, bytes);
  // Spin a little for the peers (no sleeping, no errors: the caller may hold a lock).
  const double bound = std::min(spin_us_, kStartSpinUs);
  const auto t0 = Clock::now();
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    auto& word = slot(q)->h().b_in.v;
    while (!reached(word.load(std::memory_order_acquire), r)) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      if (seconds_since(t0) * 1e6 >= bound) return 0;
    }
    const Stamp& st = slot(q)->h().b_in.stamp[r & 1];
    if (st.seq.load(std::memory_order_relaxed) != call_ || st.desc.load(std::memory_order_relaxed) != desc_)
      return 0;  // a mismatch: all_reduce_finish raises it
  }
  one_shot_combine(r, out, count, t, op);
  return 1;
}

void ShmColl::all_reduce_finish(void* out, size_t count, DType t, RedOp op) {
  try {
    one_shot_finish(one_round_, out, count, t, op);
  } catch (const Error& e) {
    mark_failed(e);
    throw;
  }
}

// Lanes of a message (see shm_coll.h): every rank computes the same from agreed settings.
int ShmColl::lanes_for(size_t bytes) const {
  if (lanes_ <= 1) return 1;
  return static_cast<int>(std::clamp<size_t>(bytes / opt_.lane_min, 1, static_cast<size_t>(lanes_)));
}

// Runs lane(0..lanes-1) on this rank's threads; one lane runs on the calling thread alone.
void ShmColl::run_lanes(int lanes, const std::function<void(int)>& lane) {
  if (lanes == 1) return lane(0);
  bool interrupted_here = false;  // the owner's thread only: helpers never look for Ctrl-C
  try {
    pool_->run(
        lanes,
        [&](int l, int) {
          try {
            lane(l);
          } catch (const Error& e) {
            // A helper's error (its wait saw this rank failed) may be stored before the
            // owner's interrupt: the interrupt is what the caller raises either way.
            if (e.kind() == ErrorKind::Interrupted) interrupted_here = true;
            mark_failed(e);  // now, so peers waiting on my other lanes give up too
            throw;
          }
        },
        [&] {  // Ctrl-C while helpers wait (off the main thread, they do not look for it)
          interrupted_here = true;
          mark_failed(Error(ErrorKind::Interrupted, "interrupted"));  // their waits see it and give up
        });
  } catch (const Error&) {
    if (interrupted_here) throw_interrupted(rank_, std::string("shared-memory ") + call_what());
    throw;
  }
}

void ShmColl::broadcast(const void* src, void* buf, size_t bytes, int root, double timeout) {
  timeout_ = timeout;
  begin_call(kBroadcast, bytes, DType::U8, RedOp::Sum, root);
  if (rank_ != root) src = buf;
  const char* s = static_cast<const char*>(src);
  char* b = static_cast<char*>(buf);
  if (s != b && s < b + bytes && b < s + bytes) {  // overlapping: not supported by the paths below
    std::memmove(b, s, bytes);
    s = b;
  }
  try {
    if (cma_ && bytes >= opt_.bc_min) cma_broadcast(s, b, bytes, root);
    else ring_broadcast(s, b, bytes, root);
  } catch (const Error& e) {
    mark_failed(e);
    cma_drain();
    throw;
  }
}

void ShmColl::ring_broadcast(const char* src, char* b, size_t bytes, int root) {
  const int lanes = lanes_for(bytes);
  if (lanes != bc_lanes_) {
    if (rank_ == root) ring_drain();  // the ring's areas move: no one may still read the old ones
    bc_lanes_ = lanes;
  }
  if (lanes > 1) ++lane_bc_calls_;
  const bool stream = bytes >= kStreamMin;
  // The root sends from src (readers only ever see the ring); its own copy into b comes after,
  // while the readers drain the last pieces.
  char* from = rank_ == root ? const_cast<char*>(src) : b;  // the root's ring_lane only reads it
  run_lanes(lanes, [&](int l) {
    // Stripes of whole cache lines (the last one takes the rest).
    const size_t first = part_off(bytes / 64, lanes, l) * 64;
    const size_t end = l + 1 == lanes ? bytes : part_off(bytes / 64, lanes, l + 1) * 64;
    ring_lane(l, lanes, from + first, end - first, root, stream);
  });
  if (rank_ == root && src != b) copy_out(b, src, bytes, stream);
}

// One lane's stripe, in pieces of 1/lanes of a ring slot. A broadcast of 0 bytes still moves
// one empty piece on lane 0: every rank numbers the pieces alike, and a rank called with 0
// bytes against others' data meets the root's stamp (a mismatch raises) instead of falling a
// piece behind, which would hand it the previous broadcast's data from then on.
void ShmColl::ring_lane(int lane, int lanes, char* b, size_t bytes, int root, bool stream) {
  const size_t lp = (kBcPiece / static_cast<size_t>(lanes)) & ~size_t(63);
  Slot* rs = slot(root);
  const size_t pieces = bytes ? (bytes + lp - 1) / lp : lane == 0;
  for (size_t k = 0; k < pieces; ++k) {
    const size_t off = k * lp, len = std::min(lp, bytes - off);
    const uint64_t i = piece_[lane]++;
    char* area = rs->bc(i) + lane * lp;
    if (rank_ == root) {
      if (i >= static_cast<uint64_t>(kBcSlots)) {
        const uint32_t need = static_cast<uint32_t>(i - kBcSlots + 1);  // readers done with this slot's old piece
        for (int q = 0; q < n_; ++q)
          if (q != root) wait_ge(q, slot(q)->h().c_done[lane].v, need, "broadcast");
      }
      copy_bytes(area, b + off, len);
      rs->h().c_stamp[lane].piece[i % kBcSlots].store(piece_stamp(), std::memory_order_relaxed);
      publish(rs->h().c_done[lane].v, static_cast<uint32_t>(i + 1));
      publish(rs->h().c_in[lane].v, static_cast<uint32_t>(i + 1));
    } else {
      wait_ge(root, rs->h().c_in[lane].v, static_cast<uint32_t>(i + 1), "broadcast");
      const uint64_t theirs = rs->h().c_stamp[lane].piece[i % kBcSlots].load(std::memory_order_relaxed);
      if (theirs != piece_stamp()) piece_mismatch(root);
      copy_out(b + off, area, len, stream);
      publish(slot(rank_)->h().c_done[lane].v, static_cast<uint32_t>(i + 1));
    }
  }
}

// The new root, before the ring's areas move: wait until every other rank copied every
// piece of the earlier broadcasts (each rank's c_done reached the agreed piece count).
void ShmColl::ring_drain() {
  for (int l = 0; l < kMaxLanes; ++l) {
    if (piece_[l] == 0) continue;
    for (int q = 0; q < n_; ++q)
      if (q != rank_) wait_ge(q, slot(q)->h().c_done[l].v, static_cast<uint32_t>(piece_[l]), "broadcast");
  }
}

}  // namespace linkwise
