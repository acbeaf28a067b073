// The engine: posting, the sending side and failures. The receiving side is in
// engine_recv.cc, waiting in engine_wait.cc, aborts and stops in engine_abort.cc; engine.h
// states the contracts.
#include "p2p/engine_internal.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "core/copy.h"
#include "core/wait.h"

namespace linkwise {

namespace {

using namespace engine_detail;

// Messages a rank sends to itself: an unbounded in-memory byte queue. Never full, so a
// self-send completes at once; the receiver reads it under the same Engine lock.
class LoopbackLink : public PeerLink {
 public:
  size_t write_some(const void* data, size_t n) override {
    const char* p = static_cast<const char*>(data);
    buf_.insert(buf_.end(), p, p + n);
    return n;
  }
  void flush() override {}
  size_t read_some(void* dst, size_t n) override {
    size_t take = std::min(n, buf_.size() - pos_);
    copy_bytes(dst, buf_.data() + pos_, take);
    pos_ += take;
    if (pos_ == buf_.size()) {
      buf_.clear();
      pos_ = 0;
    }
    return take;
  }
  bool alive() override { return true; }
  std::string describe() const override { return "loopback"; }
  void close_write() override {}

 private:
  std::vector<char> buf_;
  size_t pos_ = 0;
};

}  // namespace

Engine::Engine(int rank, int size, EngineOptions options)
    : rank_(rank), size_(size), opt_(options), spin_budget_us_(options.spin_us) {
  LW_CHECK(size > 0 && rank >= 0 && rank < size, "rank within size");
  peers_.resize(size);
  for (int r = 0; r < size; ++r) {
    peers_[r] = std::make_unique<Peer>();
    peers_[r]->rank = r;
  }
  peers_[rank]->link = std::make_unique<LoopbackLink>();
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> g(thread_mu_);
    stop_thread_ = true;
  }
  thread_cv_.notify_all();
  wake_all();
  if (progress_thread_.joinable()) progress_thread_.join();
  abort("the communicator was destroyed");
}

void Engine::add_transport(std::shared_ptr<Transport> transport) {
  std::lock_guard<std::mutex> g(mu_);
  transports_.push_back(std::move(transport));
}

void Engine::set_link(int peer, std::unique_ptr<PeerLink> link, Transport* transport) {
  std::lock_guard<std::mutex> g(mu_);
  LW_CHECK(peer >= 0 && peer < size_ && peer != rank_, "link peer in range");
  peers_[peer]->link = std::move(link);
  peers_[peer]->transport = transport;
}

std::string Engine::describe_link(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  if (peer < 0 || peer >= size_ || !peers_[peer]->link) return "none";
  return peers_[peer]->link->describe();
}

bool Engine::peer_alive(int peer) {
  std::lock_guard<std::mutex> g(mu_);
  if (peer < 0 || peer >= size_ || peer == rank_ || !peers_[peer]->link) return true;
  const Peer& p = *peers_[peer];
  return !p.dead && p.link->alive();
}

void Engine::check_peer_arg(int peer, const char* op) {
  if (peer < 0 || peer >= size_)
    throw Error(ErrorKind::Invalid, std::string(op) + ": rank " + std::to_string(peer) +
                                        " is out of range; this communicator has ranks 0.." +
                                        std::to_string(size_ - 1));
  if (!peers_[peer]->link)
    throw Error(ErrorKind::Internal, std::string(op) + ": no link to rank " + std::to_string(peer));
}

std::shared_ptr<Request> Engine::isend(int peer, const void* buf, size_t bytes, uint64_t tag,
                                       uint32_t dtype, bool is_async) {
  auto req = std::make_shared<Request>(Request::Kind::Send, peer, tag, const_cast<void*>(buf), bytes, dtype);
  {
    std::lock_guard<std::mutex> g(mu_);
    check_peer_arg(peer, "send");
    Peer& p = *peers_[peer];
    if (stopped_locked(tag)) {
      fail_locked(*req, abort_kind_, abort_reason_, abort_peer_);
    } else if (p.dead || p.write_closed) {
      fail_locked(*req, ErrorKind::Peer, "rank " + std::to_string(rank_) + ": cannot send to rank " +
                                             std::to_string(peer) +
                                             ", which has left (its process exited, or it closed or aborted "
                                             "this communicator)",
                    peer);
    } else {
      p.send_queue.push_back(req);
      progress_send(p);  // small messages leave at once
    }
    if (is_async && !req->done()) {
      req->is_async = true;
      pending_async_.fetch_add(1);
    }
  }
  if (req->is_async) note_async_posted();
  else if (peer == rank_) wake_all();
  return req;
}

std::shared_ptr<Request> Engine::irecv(int peer, void* buf, size_t capacity, uint64_t tag,
                                       uint32_t dtype, bool is_async) {
  auto req = std::make_shared<Request>(Request::Kind::Recv, peer, tag, buf, capacity, dtype);
  {
    std::lock_guard<std::mutex> g(mu_);
    check_peer_arg(peer, "recv");
    Peer& p = *peers_[peer];
    if (stopped_locked(tag)) {
      fail_locked(*req, abort_kind_, abort_reason_, abort_peer_);
    } else if (is_coll_tag(tag) && std::find(p.refused.begin(), p.refused.end(), coll_number(tag)) != p.refused.end()) {
      fail_refused_locked(p, *req);
    } else if (!match_unexpected_locked(p, req)) {
      if (p.dead)
        fail_locked(*req, ErrorKind::Peer, "rank " + std::to_string(rank_) + ": cannot receive from rank " +
                                               std::to_string(peer) +
                                             ", which has left (its process exited, or it closed or aborted "
                                             "this communicator)",
                    peer);
      else
        p.posted.push_back(req);
    }
    if (is_async && !req->done()) {
      req->is_async = true;
      pending_async_.fetch_add(1);
    }
  }
  if (req->is_async) note_async_posted();
  return req;
}

bool Engine::progress_locked() {
  if (aborted_) return false;
  bool moved = false;
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead) continue;
    moved |= progress_recv(p);
    moved |= progress_send(p);
  }
  return moved;
}

bool Engine::progress_send(Peer& p) {
  bool moved = false;
  PeerLink& link = *p.link;
  while (!p.send_queue.empty() && !p.write_closed) {
    Request& r = *p.send_queue.front();
    if (!p.front_started) {
      bool pull = !r.notice && r.bytes >= opt_.pull_threshold && link.can_pull();
      if (pull && p.awaiting_ack.size() >= PeerLink::kMaxPullsInFlight) break;  // acks first
      uint32_t seq = 0;
      if (pull) {
        seq = ++p.pulls_sent;
        if (seq == 0) seq = ++p.pulls_sent;  // 0 marks an empty ack slot
      }
      p.out_hdr = MsgHeader{kHeaderMagic, r.notice ? r.notice : pull ? kPull : kEager, r.tag, r.bytes,
                            pull ? reinterpret_cast<uint64_t>(r.buf) : r.notice_arg, r.dtype, seq};
      p.front_started = true;
      p.wire_pos = 0;
      p.stage_len = 0;
      if (!pull && sizeof(MsgHeader) + r.bytes <= kStage) {
        std::memcpy(p.stage, &p.out_hdr, sizeof(MsgHeader));
        if (r.bytes) std::memcpy(p.stage + sizeof(MsgHeader), r.buf, r.bytes);
        p.stage_len = sizeof(MsgHeader) + r.bytes;
      }
    }
    const bool pull = p.out_hdr.kind == kPull;
    const size_t wire_len = sizeof(MsgHeader) + (pull ? 0 : r.bytes);
    while (p.wire_pos < wire_len) {
      size_t n;
      if (p.stage_len)
        n = link.write_some(p.stage + p.wire_pos, p.stage_len - p.wire_pos);
      else if (p.wire_pos < sizeof(MsgHeader))
        n = link.write_some(reinterpret_cast<char*>(&p.out_hdr) + p.wire_pos, sizeof(MsgHeader) - p.wire_pos);
      else
        n = link.write_some(static_cast<const char*>(r.buf) + (p.wire_pos - sizeof(MsgHeader)), wire_len - p.wire_pos);
      if (n == 0) break;
      p.wire_pos += n;
      moved = true;
    }
    if (p.wire_pos < wire_len) break;
    std::shared_ptr<Request> req = std::move(p.send_queue.front());
    p.send_queue.pop_front();
    p.front_started = false;
    if (pull) {
      req->pull_seq = p.out_hdr.seq;
      note_pull_announced(req->bytes);
      p.awaiting_ack.push_back(std::move(req));
    } else {
      complete_locked(*req, req->bytes);
    }
  }
  if (moved) link.flush();
  // Acks may come in any order (the receiver pulls when each receive is posted). While one
  // is outstanding, this side may help copy it (two cores copy faster than one).
  for (auto it = p.awaiting_ack.begin(); it != p.awaiting_ack.end();) {
    Request& r = **it;
    const uint32_t seq = static_cast<uint32_t>(r.pull_seq);
    if (!r.helped) {
      try {
        r.helped = link.help_pull(seq, r.buf, r.bytes);
      } catch (const Error&) {
        r.helped = true;  // the receiver is gone; its death is noticed where it is waited for
      }
      moved |= r.helped;
    }
    if (!link.acked(seq)) {
      ++it;
      continue;
    }
    std::shared_ptr<Request> req = std::move(*it);
    it = p.awaiting_ack.erase(it);
    complete_locked(*req, req->bytes);
    moved = true;
  }
  return moved;
}

void Engine::complete_locked(Request& req, size_t transferred) {
  // A stopped collective's receive that a peer's stop notice caught mid-transfer was left to
  // finish; now that its buffer is free it fails like the others (stop_locked). Point-to-point
  // transfers caught mid-way complete: their bytes did move.
  if (stop_from_ != kNoStop && is_coll_tag(req.tag) && stopped_locked(req.tag)) {
    fail_locked(req, abort_kind_, abort_reason_, abort_peer_);
    return;
  }
  req.complete(transferred);
  if (req.is_async) pending_async_.fetch_sub(1);
  if (sleepers_.load() > 0) wake_all();  // a waiter for it may be asleep on a transport
}

void Engine::fail_locked(Request& req, ErrorKind kind, const std::string& msg, int peer) {
  req.fail(kind, msg, peer);
  if (req.is_async) pending_async_.fetch_sub(1);
  if (sleepers_.load() > 0) wake_all();
}

// Before failing sends whose receiver may still be copying from their buffers: once they fail,
// the user may write those buffers again (PeerLink::withdraw). `blame` as in abort_locked.
void Engine::withdraw_pulls_locked(Peer& p, int blame) {
  if (!p.link) return;
  for (auto& r : p.awaiting_ack) p.link->withdraw(static_cast<uint32_t>(r->pull_seq), blame);
}

void Engine::fail_peer_locked(Peer& p, const std::string& why) {
  if (p.dead) return;
  p.dead = true;
  const std::string msg = "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(p.rank) +
                          " died or failed (" + p.link->describe() + "): " + why +
                          ". Look at that rank's output for the cause.";
  auto fail_all = [&](std::list<std::shared_ptr<Request>>& l) {
    for (auto& r : l) fail_locked(*r, ErrorKind::Peer, msg, p.rank);
    l.clear();
  };
  fail_all(p.send_queue);
  withdraw_pulls_locked(p, p.rank);
  fail_all(p.awaiting_ack);
  fail_all(p.posted);
  if (p.in_msg) {
    if (p.in_req) fail_locked(*p.in_req, ErrorKind::Peer, msg, p.rank);
    else {
      if (p.in_unexp->bound) fail_locked(*p.in_unexp->bound, ErrorKind::Peer, msg, p.rank);
      p.unexpected.erase(p.in_unexp);
    }
    p.in_req.reset();
    p.in_msg = false;
  }
  p.front_started = false;
  p.failure = msg;
  for (auto& u : p.unexpected)
    if (u.deferred) u.deferred = false, u.failed = true;  // cannot be copied any more
}

void Engine::reap_dead_peers_locked() {
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.rank == rank_ || !p.has_work()) continue;
    if (p.link->alive()) continue;
    // Take whatever it sent before it died, then fail what is left.
    progress_recv(p);
    progress_send(p);
    if (p.has_work()) fail_peer_locked(p, "its process exited, or it closed or aborted this communicator");
  }
}

bool Engine::cancel(Request& req) {
  std::lock_guard<std::mutex> g(mu_);
  if (req.done()) return false;
  Peer& p = *peers_[req.peer];
  auto drop = [&](std::list<std::shared_ptr<Request>>& l, bool skip_front) {
    for (auto it = l.begin(); it != l.end(); ++it) {
      if (it->get() != &req) continue;
      if (skip_front && it == l.begin() && p.front_started) {
        if (p.wire_pos > 0) return false;  // bytes of it are on the wire: too late
        // Announced to nobody yet (its header waits for room in the link): forget it; the
        // next message starts afresh (a pull number it took stays unused: acks name theirs).
        p.front_started = false;
        p.stage_len = 0;
      }
      std::shared_ptr<Request> keep = *it;
      l.erase(it);
      // Only a wait that timed out (or a dropped request) withdraws one: a later wait on it
      // raises TimeoutError again, the communicator itself being fine.
      fail_locked(req, ErrorKind::Timeout,
                  "rank " + std::to_string(rank_) + ": this " + (req.kind == Request::Kind::Recv ? "receive" : "send") +
                      " was withdrawn when a wait on it timed out (or was cancelled); post it again to retry",
                  -1);
      return true;
    }
    return false;
  };
  if (req.kind == Request::Kind::Recv) {
    if (drop(p.posted, false)) return true;
    for (auto& u : p.unexpected)
      if (u.bound.get() == &req) return false;  // already arriving
    return false;
  }
  return drop(p.send_queue, true);
}

void Engine::poll() {
  std::lock_guard<std::mutex> g(mu_);
  progress_locked();
}

}  // namespace linkwise
