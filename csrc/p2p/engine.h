// The point-to-point engine: tagged, ordered messages over PeerLinks.
//
// Wire format on every link: a MsgHeader, then (eager) `size` payload bytes, or (pull) nothing:
// the receiver copies the payload straight from the sender's memory and acknowledges.
// Matching: a message goes to the oldest posted receive from its peer with its tag; one that
// arrives before its receive is kept in an "unexpected" list. An eager one is kept whole; a
// pulled one is only noted ("deferred"), so that a receive posted a little later still gets a
// single copy. A thread about to sleep first pulls every deferred message into a buffer of
// its own and acknowledges it, so a sender never waits on a receiver that is blocked
// elsewhere (both ranks sending large messages before receiving cannot deadlock).
// Messages of one (peer, tag) complete in order.
//
// Threading: one mutex guards all matching and link state. Any thread may post, test and
// wait; a waiting thread progresses every link itself (spin briefly, then sleep on the
// transports). A progress thread, started on the first non-blocking request, keeps
// non-blocking requests moving while nobody waits (for asyncio and overlap).
//
// Failures: a dead peer fails every operation that involves it with ErrorKind::Peer, once
// nothing it sent before dying is left to read. Timeouts are per wait.
// Collective failures spread: a rank whose collective number N fails aborts its engine and
// sends an abort notice (a kAbort header naming the rank it blames and N) to every live peer
// whose outgoing stream is between messages. A peer that reads one stops: its collectives
// numbered N and up fail (PeerError naming the blamed rank), and so does point-to-point, but
// the collectives before N go on, since a rank that is behind must still finish calls whose
// data its peers sent before they failed (every rank runs its collectives in order, so the
// rank that failed N had finished all of them). It passes the notice on, so survivors never
// wait on a rank that has given up. A peer whose stream is in the middle of a message when
// the engine aborts gets no notice (it would corrupt the stream): its link is closed instead,
// and it raises PeerError naming this rank. A stopped engine that keeps running queues the
// notices it passes on behind the message on the wire instead. A collective refused on one
// rank (notify_refused) fails the receives the others post for it from that rank, as a
// mismatch would.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "p2p/request.h"
#include "transport/transport.h"
#include "core/process_local.h"

namespace linkwise {

constexpr uint64_t kNoStop = ~uint64_t{0};  // no collective number is stopped

struct MsgHeader {
  uint32_t magic;
  uint32_t kind;   // kEager or kPull (or a header-only notice: engine_internal.h)
  uint64_t tag;
  uint64_t size;
  uint64_t addr;   // kPull: the payload's address in the sender; kAbort: the number it stops from
  uint32_t dtype;
  uint32_t seq;    // kPull: the number the receiver acknowledges (PeerLink::post_ack)
};

struct EngineOptions {
  double spin_us = 50.0;               // spin this long before sleeping
  size_t pull_threshold = 64 << 10;    // messages >= this go single-copy where a link can
};

class Engine {
 public:
  Engine(int rank, int size, EngineOptions options);
  ~Engine();

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Setup, before any traffic: `transport` outlives the engine's use of its links.
  void add_transport(std::shared_ptr<Transport> transport);
  void set_link(int peer, std::unique_ptr<PeerLink> link, Transport* transport);

  std::shared_ptr<Request> isend(int peer, const void* buf, size_t bytes, uint64_t tag, uint32_t dtype, bool is_async);
  std::shared_ptr<Request> irecv(int peer, void* buf, size_t capacity, uint64_t tag, uint32_t dtype, bool is_async);

  // Blocks until req is done or timeout_s passes (then ErrorKind::Timeout); rethrows its error.
  // named_s: the timeout the error names, where timeout_s is what is left of it (wait_all's
  // whole budget); below 0: timeout_s.
  void wait(Request& req, double timeout_s, const char* op, double named_s = -1.0);
  // Progresses once; true when req is done (its error, if any, is thrown by wait/rethrow).
  bool test(Request& req);
  // Removes a request that has not started moving (it fails with ErrorKind::Timeout: a wait on
  // it timed out); false if it already has (or is done).
  bool cancel(Request& req);
  // Fails every pending request and refuses new ones. Idempotent.
  void abort(const std::string& why);
  // A wait gives up on req, which started moving (engine_wait.cc): abort, and for a
  // point-to-point request tell the peers (abort_and_notify).
  void give_up_moving(const Request& req, const std::string& why);
  // abort(why), then ends this side's stream on every link (close_write): a peer reads what
  // was written before, then finds the link closed and raises PeerError naming this rank,
  // as if this process had exited (Communicator.close on a rank that goes on living).
  void close(const std::string& why);
  // abort(why), and an abort notice blaming rank `blame` (-1: none, e.g. a timeout) to every
  // live peer; after collective number `from` failed on this rank (algo/coll.h), which the
  // peers stop from; 0 stops everything there (a failure not tied to one collective number).
  // Notices go out once, and again only for a lower `from`.
  void abort_and_notify(const std::string& why, int blame, uint64_t from = 0);
  // A collective this rank refused before any of its data moved (an argument error): a
  // refusal notice (a kRefused header carrying `number`, the collective's seq as its tags
  // carry it: algo/coll.h) goes to every live peer behind what is already queued to it. A
  // peer's receives of that collective from this rank, posted or yet to come, then fail
  // (ErrorKind::Invalid) instead of waiting for the timeout; ranks that refused it too never
  // post any, so where every rank refused a call nothing fails.
  void notify_refused(uint64_t number);
  // The lowest rank whose refusal notice of collective `number` has been read (-1: none).
  int refused_by(uint64_t number);
  // Called under the engine's lock when a collective failure reaches this engine: once with
  // own = true when this rank's own collective failed (abort_and_notify), once with own =
  // false when a peer's notice stopped it; `blame` as there. The shared-memory executor of
  // the same communicator stops through it, so its calls cannot pair with calls the failed
  // collective left out of step. Set after such failures, it is called for them at once.
  // Must not block or call the engine. Empty: none.
  void set_failure_hook(std::function<void(int blame, bool own)> hook);
  // The collective numbers (algo/coll.h) this rank has started or refused so far run below
  // next_collective(): a failure elsewhere (the shared-memory executor's) stops the peers
  // from there, not the collectives before it. Any thread.
  void note_collective(uint64_t number) {
    uint64_t cur = next_coll_.load(std::memory_order_relaxed);
    while (number + 1 > cur && !next_coll_.compare_exchange_weak(cur, number + 1, std::memory_order_relaxed)) {
    }
  }
  uint64_t next_collective() const { return next_coll_.load(std::memory_order_relaxed); }
  std::string describe_link(int peer);
  // False once peer's process is known to have exited or closed its link (also when its link
  // already failed); true for this rank and for peers without a link. Thread-safe.
  bool peer_alive(int peer);
  // Why collective `number` (a seq as its tags carry it) cannot run here: the engine was
  // aborted, or a peer's notice stopped collectives from a number at most `number`. Empty
  // while it may run. kAnyCall: whether the engine was aborted or stopped at all.
  static constexpr uint64_t kAnyCall = ~uint64_t{0};
  std::string abort_reason(uint64_t number = kAnyCall);
  // The rank whose death or failure aborted or stopped the engine, for `number` as above (its
  // requests fail with PeerError); -1 while it may run, or when it stopped for another reason.
  int abort_peer(uint64_t number = kAnyCall);
  // One progress pass over every link (reads abort notices that arrived while nobody waited).
  void poll();

 private:
  struct Unexpected;
  struct Peer;

  void check_peer_arg(int peer, const char* op);
  bool progress_locked();                  // one pass over every link; true if anything moved
  bool progress_send(Peer& p);
  bool progress_recv(Peer& p);
  void start_incoming(Peer& p);
  void finish_incoming(Peer& p);
  void reap_dead_peers_locked();
  void materialize_deferred_locked();
  bool deliver_deferred_locked(Peer& p, Unexpected& u, Request* req);
  void fail_peer_locked(Peer& p, const std::string& why);
  void withdraw_pulls_locked(Peer& p, int blame);
  void take_withdrawal_locked(Peer& p, const WithdrawnError& e, uint64_t tag);
  void abort_locked(const std::string& reason, ErrorKind kind, int peer);
  void record_failure_locked(const std::string& reason, ErrorKind kind, int peer);
  bool stopped_locked(uint64_t tag) const;
  void stop_locked(uint64_t from, const std::string& reason, ErrorKind kind, int peer);
  void pass_stop_on_locked(int blame, uint64_t from);
  void note_failure_locked(int blame, bool own);
  std::string own_abort_reason(const std::string& why) const;
  void notify_abort_locked(int blame, uint64_t from);
  void take_abort_notice_locked(Peer& from, int blame, uint64_t stop_from);
  void take_refusal_locked(Peer& from, uint64_t number);
  void fail_refused_locked(Peer& from, Request& req);
  void complete_locked(Request& req, size_t transferred);
  void fail_locked(Request& req, ErrorKind kind, const std::string& msg, int peer);
  bool match_unexpected_locked(Peer& p, const std::shared_ptr<Request>& req);
  void sleep_once(int64_t timeout_us, const std::function<bool()>& ready);
  void note_pull_announced(size_t bytes);
  void adapt_spin(double budget_us, double slept_us);
  bool spin_for_pulls_locked(std::chrono::steady_clock::time_point now) const;
  void wake_all();
  void progress_thread_main();
  void note_async_posted();

  const int rank_;
  const int size_;
  const EngineOptions opt_;

  std::mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::shared_ptr<Transport>> transports_;
  bool aborted_ = false;  // everything fails (this rank's own failure, close, a notice stopping from 0)
  // A peer's notice stopped collectives numbered stop_from_ and up, and point-to-point;
  // kNoStop while none did (stop_locked).
  uint64_t stop_from_ = kNoStop;
  std::string abort_reason_;                   // of the first abort or stop
  ErrorKind abort_kind_ = ErrorKind::Aborted;  // of the first abort or stop: Peer when a rank died or failed
  int abort_peer_ = -1;
  bool own_failure_noted_ = false;     // the failure hook ran for this rank's own failure (or will, once set)
  bool notice_failure_noted_ = false;  // ... for a peer's notice
  uint64_t notice_from_sent_ = kNoStop;  // the lowest `from` the abort notices carried (notify_abort_locked)
  std::function<void(int, bool)> failure_hook_;
  int own_failure_blame_ = -1, notice_failure_blame_ = -1;  // their blames
  std::atomic<uint64_t> next_coll_{0};  // see note_collective (a running maximum)
  std::chrono::steady_clock::time_point last_test_reap_{};  // test()'s last look for dead peers
  // When the pulled messages announced so far should be copied by (engine_wait.cc); a waiter
  // keeps spinning until then while one still waits for its ack.
  std::chrono::steady_clock::time_point pulls_due_{};

  // How long wait() spins before it sleeps: opt_.spin_us, adapted (engine_wait.cc). Relaxed:
  // a racing update between two waiting threads only picks one of two valid budgets.
  std::atomic<double> spin_budget_us_;
  std::atomic<int> sleepers_{0};      // threads of this process asleep in sleep_once
  std::atomic<int> pending_async_{0}; // non-blocking requests not yet done
  std::mutex thread_mu_;
  std::condition_variable thread_cv_;
  OwnedThread progress_thread_;  // joined only by the process that started it
  bool stop_thread_ = false;
};

// Element type code carried in headers: (format character << 8) | itemsize; 0 = untyped.
// Codes with kCollCode set are a collective's instead (CollCtx::wire_code): kind in bits
// 24-27, dtype 20-23 and op 16-19 (15: not a reduction), a 16-bit hash of the call's size in
// 0-15. Two of them must be equal, so ranks that reduce another way, or pass another size,
// fail at the first message instead of combining garbage or reading a prefix.
constexpr uint32_t kCollCode = 1u << 31;
inline uint32_t collective_code(uint32_t kind, uint32_t dtype, uint32_t op, uint64_t call_bytes) {
  const uint32_t size_hash = static_cast<uint32_t>((call_bytes * 0x9E3779B97F4A7C15ull) >> 48);
  return kCollCode | (kind & 15) << 24 | (dtype & 15) << 20 | (op & 15) << 16 | size_hash;
}
// A collective's message tag: bit 63 | its number (the communicator's collective counter,
// 38 bits) << 24 | kind << 16 | step. User tags are < 2^62, so the two never meet; the engine
// reads the number back (engine_internal.h coll_number) to stop calls from a failed one on.
inline uint64_t collective_tag(uint64_t number, uint32_t kind, int step) {
  return (uint64_t{1} << 63) | (number & ((uint64_t{1} << 38) - 1)) << 24 | uint64_t{kind & 0xff} << 16 |
         static_cast<uint64_t>(step & 0xffff);
}
constexpr uint32_t kSwappedBytes = 1u << 16;  // in a dtype code: not this machine's byte order
uint32_t dtype_code(const char* format, size_t itemsize);
bool dtypes_compatible(uint32_t a, uint32_t b);
std::string dtype_name(uint32_t code);

}  // namespace linkwise
