#include "p2p/engine.h"

#include <algorithm>
#include <cstring>
#include <functional>

#include "core/wait.h"

namespace linkwise {

namespace {

constexpr uint32_t kHeaderMagic = 0x314d574c;  // "LWM1"
constexpr uint32_t kEager = 1;
constexpr uint32_t kPull = 2;
constexpr size_t kStage = 4096;          // header + payload up to this go out in one write
constexpr int kMessagesPerPass = 16;     // incoming messages one progress pass may finish per peer

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
    std::memcpy(dst, buf_.data() + pos_, take);
    pos_ += take;
    if (pos_ == buf_.size()) {
      buf_.clear();
      pos_ = 0;
    }
    return take;
  }
  bool alive() override { return true; }
  std::string describe() const override { return "loopback"; }

 private:
  std::vector<char> buf_;
  size_t pos_ = 0;
};

std::string tag_text(uint64_t tag) { return "tag " + std::to_string(tag); }

}  // namespace

struct Engine::Unexpected {
  MsgHeader hdr{};
  std::unique_ptr<char[]> data;
  size_t got = 0;
  bool complete = false;
  bool deferred = false;           // a pulled message not copied yet (data is empty)
  std::shared_ptr<Request> bound;  // a receive waiting for the rest of this message
};

struct Engine::Peer {
  int rank = -1;
  std::unique_ptr<PeerLink> link;
  Transport* transport = nullptr;
  bool dead = false;
  // Sending: the front of send_queue is on the wire, `wire_pos` bytes of it written.
  std::list<std::shared_ptr<Request>> send_queue;
  bool front_started = false;
  size_t wire_pos = 0;
  MsgHeader out_hdr{};
  size_t stage_len = 0;  // > 0: header and payload were copied to `stage`
  char stage[kStage];
  std::list<std::shared_ptr<Request>> awaiting_ack;  // pulled sends the peer has not copied yet
  uint32_t pulls_sent = 0;
  // Receiving.
  std::list<std::shared_ptr<Request>> posted;
  std::list<Unexpected> unexpected;
  MsgHeader in_hdr{};
  size_t in_hdr_got = 0;
  bool in_msg = false;
  std::shared_ptr<Request> in_req;               // the matched receive, or
  std::list<Unexpected>::iterator in_unexp;      // where the message is buffered
  size_t in_got = 0;

  bool has_work() const {
    return !send_queue.empty() || !awaiting_ack.empty() || !posted.empty() || in_msg;
  }
};

Engine::Engine(int rank, int size, EngineOptions options) : rank_(rank), size_(size), opt_(options) {
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
    if (aborted_) {
      fail_locked(*req, ErrorKind::Aborted, abort_reason_, -1);
    } else if (p.dead) {
      fail_locked(*req, ErrorKind::Peer, "rank " + std::to_string(rank_) + ": cannot send to rank " +
                                             std::to_string(peer) + ", which is gone", peer);
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
    if (aborted_) {
      fail_locked(*req, ErrorKind::Aborted, abort_reason_, -1);
    } else if (!match_unexpected_locked(p, req)) {
      if (p.dead)
        fail_locked(*req, ErrorKind::Peer, "rank " + std::to_string(rank_) + ": cannot receive from rank " +
                                               std::to_string(peer) + ", which is gone", peer);
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

// Why `h` cannot be received into `req`, or "" when it fits.
static std::string misfit(const Request& req, const MsgHeader& h, int me, ErrorKind* kind) {
  if (h.size > req.bytes) {
    *kind = ErrorKind::Invalid;
    return "rank " + std::to_string(me) + ": a message of " + std::to_string(h.size) + " bytes from rank " +
           std::to_string(req.peer) + " (" + tag_text(h.tag) + ") does not fit the receive buffer of " +
           std::to_string(req.bytes) + " bytes; receive into a buffer of at least " + std::to_string(h.size) +
           " bytes (the message is kept for the next receive with this tag)";
  }
  if (!dtypes_compatible(h.dtype, req.dtype)) {
    *kind = ErrorKind::Type;
    return "rank " + std::to_string(me) + ": rank " + std::to_string(req.peer) + " sent " + dtype_name(h.dtype) +
           " data (" + tag_text(h.tag) + ") but the receive buffer holds " + dtype_name(req.dtype) +
           "; receive into an array of the sender's dtype (the message is kept)";
  }
  return "";
}

bool Engine::match_unexpected_locked(Peer& p, const std::shared_ptr<Request>& req) {
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    if (it->hdr.tag != req->tag || it->bound) continue;
    ErrorKind kind;
    std::string why = misfit(*req, it->hdr, rank_, &kind);
    if (!why.empty()) {
      fail_locked(*req, kind, why, -1);
    } else if (it->deferred) {
      deliver_deferred_locked(p, *it, req.get());
      p.unexpected.erase(it);
    } else if (it->complete) {
      if (it->hdr.size) std::memcpy(req->buf, it->data.get(), it->hdr.size);
      size_t n = it->hdr.size;
      p.unexpected.erase(it);
      complete_locked(*req, n);
    } else {
      it->bound = req;
    }
    return true;
  }
  return false;
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
  while (!p.send_queue.empty()) {
    Request& r = *p.send_queue.front();
    if (!p.front_started) {
      bool pull = r.bytes >= opt_.pull_threshold && link.can_pull();
      if (pull && p.awaiting_ack.size() >= PeerLink::kMaxPullsInFlight) break;  // acks first
      uint32_t seq = 0;
      if (pull) {
        seq = ++p.pulls_sent;
        if (seq == 0) seq = ++p.pulls_sent;  // 0 marks an empty ack slot
      }
      p.out_hdr = MsgHeader{kHeaderMagic, pull ? kPull : kEager, r.tag, r.bytes,
                            pull ? reinterpret_cast<uint64_t>(r.buf) : 0, r.dtype, seq};
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
      p.awaiting_ack.push_back(std::move(req));
    } else {
      complete_locked(*req, req->bytes);
    }
  }
  if (moved) link.flush();
  // Acks may come in any order (the receiver pulls when each receive is posted).
  for (auto it = p.awaiting_ack.begin(); it != p.awaiting_ack.end();) {
    if (!link.acked(static_cast<uint32_t>((*it)->pull_seq))) {
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

bool Engine::progress_recv(Peer& p) {
  bool moved = false;
  PeerLink& link = *p.link;
  // Bounded work per pass: a peer that streams without pause must not keep this thread here
  // (its caller waits for one particular request, and other peers need turns too).
  int budget = kMessagesPerPass;
  try {
    while (budget-- > 0) {
      if (!p.in_msg) {
        size_t n = link.read_some(reinterpret_cast<char*>(&p.in_hdr) + p.in_hdr_got, sizeof(MsgHeader) - p.in_hdr_got);
        p.in_hdr_got += n;
        moved |= n > 0;
        if (p.in_hdr_got < sizeof(MsgHeader)) break;
        p.in_hdr_got = 0;
        if (p.in_hdr.magic != kHeaderMagic) {
          fail_peer_locked(p, "the byte stream from rank " + std::to_string(p.rank) +
                                  " is corrupted (bad message header); were two jobs mixed up?");
          return true;
        }
        start_incoming(p);
      }
      const MsgHeader& h = p.in_hdr;
      char* dst = p.in_req ? static_cast<char*>(p.in_req->buf) : p.in_unexp->data.get();  // null if deferred
      if (h.kind == kPull) {
        if (p.in_req) {
          if (h.size) link.pull(dst, h.addr, h.size);
          link.post_ack(h.seq);
        } else {
          p.in_unexp->deferred = true;  // pulled when its receive is posted, or before sleeping
        }
        p.in_got = h.size;
        moved = true;
      } else {
        while (p.in_got < h.size) {
          size_t n = link.read_some(dst + p.in_got, h.size - p.in_got);
          if (n == 0) break;
          p.in_got += n;
          moved = true;
        }
      }
      if (p.in_got < h.size) break;
      finish_incoming(p);
    }
  } catch (const Error& e) {
    fail_peer_locked(p, e.what());
    return true;
  }
  return moved;
}

void Engine::start_incoming(Peer& p) {
  const MsgHeader& h = p.in_hdr;
  p.in_msg = true;
  p.in_got = 0;
  p.in_req.reset();
  for (auto it = p.posted.begin(); it != p.posted.end(); ++it) {
    if ((*it)->tag != h.tag) continue;
    std::shared_ptr<Request> req = *it;
    p.posted.erase(it);
    ErrorKind kind;
    std::string why = misfit(*req, h, rank_, &kind);
    if (why.empty()) {
      p.in_req = std::move(req);
      return;
    }
    fail_locked(*req, kind, why, -1);  // and keep the message for a receive that fits
    break;
  }
  p.unexpected.emplace_back();
  p.in_unexp = std::prev(p.unexpected.end());
  p.in_unexp->hdr = h;
  if (h.kind != kPull) p.in_unexp->data.reset(new char[h.size ? h.size : 1]);
}

void Engine::finish_incoming(Peer& p) {
  p.in_msg = false;
  const size_t n = p.in_hdr.size;
  if (p.in_req) {
    std::shared_ptr<Request> req = std::move(p.in_req);
    complete_locked(*req, n);
    return;
  }
  auto it = p.in_unexp;
  if (it->deferred) return;  // stays in the list until a receive or a sleeper pulls it
  it->complete = true;
  it->got = n;
  if (it->bound) {
    std::shared_ptr<Request> req = std::move(it->bound);
    if (n) std::memcpy(req->buf, it->data.get(), n);
    p.unexpected.erase(it);
    complete_locked(*req, n);
  }
}

void Engine::complete_locked(Request& req, size_t transferred) {
  req.complete(transferred);
  if (req.is_async) pending_async_.fetch_sub(1);
  if (sleepers_.load() > 0) wake_all();  // a waiter for it may be asleep on a transport
}

void Engine::fail_locked(Request& req, ErrorKind kind, const std::string& msg, int peer) {
  req.fail(kind, msg, peer);
  if (req.is_async) pending_async_.fetch_sub(1);
  if (sleepers_.load() > 0) wake_all();
}

void Engine::fail_peer_locked(Peer& p, const std::string& why) {
  if (p.dead) return;
  p.dead = true;
  const std::string msg = "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(p.rank) +
                          " is gone (" + p.link->describe() + "): " + why +
                          ". Look at that rank's output for the cause.";
  auto fail_all = [&](std::list<std::shared_ptr<Request>>& l) {
    for (auto& r : l) fail_locked(*r, ErrorKind::Peer, msg, p.rank);
    l.clear();
  };
  fail_all(p.send_queue);
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
  p.unexpected.remove_if([](const Unexpected& u) { return u.deferred; });
}

// Pulls a deferred message into req's buffer (or, with req null, into a buffer of its own,
// after which it is an ordinary complete unexpected message) and acknowledges it.
void Engine::deliver_deferred_locked(Peer& p, Unexpected& u, Request* req) {
  const size_t n = u.hdr.size;
  try {
    if (req) {
      if (n) p.link->pull(req->buf, u.hdr.addr, n);
    } else {
      u.data.reset(new char[n ? n : 1]);
      if (n) p.link->pull(u.data.get(), u.hdr.addr, n);
    }
    p.link->post_ack(u.hdr.seq);
  } catch (const Error& e) {
    if (req) fail_locked(*req, ErrorKind::Peer, e.what(), p.rank);
    u.deferred = false;
    fail_peer_locked(p, e.what());
    return;
  }
  u.deferred = false;
  if (req) {
    complete_locked(*req, n);
  } else {
    u.complete = true;
    u.got = n;
  }
}

void Engine::materialize_deferred_locked() {
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (p.dead) continue;
    for (auto& u : p.unexpected) {
      if (u.deferred) deliver_deferred_locked(p, u, nullptr);
      if (p.dead) break;  // failing the peer dropped its other deferred entries
    }
  }
}

void Engine::reap_dead_peers_locked() {
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.rank == rank_ || !p.has_work()) continue;
    if (p.link->alive()) continue;
    // Take whatever it sent before it died, then fail what is left.
    progress_recv(p);
    progress_send(p);
    if (p.has_work()) fail_peer_locked(p, "its process exited or closed the connection");
  }
}

bool Engine::cancel(Request& req) {
  std::lock_guard<std::mutex> g(mu_);
  if (req.done()) return false;
  Peer& p = *peers_[req.peer];
  auto drop = [&](std::list<std::shared_ptr<Request>>& l, bool skip_front) {
    for (auto it = l.begin(); it != l.end(); ++it) {
      if (it->get() != &req) continue;
      if (skip_front && it == l.begin() && p.front_started) return false;
      std::shared_ptr<Request> keep = *it;
      l.erase(it);
      fail_locked(req, ErrorKind::Aborted, "the operation was cancelled", -1);
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

void Engine::abort(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = "rank " + std::to_string(rank_) + ": the communicator was aborted: " + why;
  }
  for (auto& pp : peers_) {
    Peer& p = *pp;
    auto fail_all = [&](std::list<std::shared_ptr<Request>>& l) {
      for (auto& r : l) fail_locked(*r, ErrorKind::Aborted, abort_reason_, -1);
      l.clear();
    };
    fail_all(p.send_queue);
    fail_all(p.awaiting_ack);
    fail_all(p.posted);
    if (p.in_req) fail_locked(*p.in_req, ErrorKind::Aborted, abort_reason_, -1);
    for (auto& u : p.unexpected)
      if (u.bound) fail_locked(*u.bound, ErrorKind::Aborted, abort_reason_, -1);
    p.in_req.reset();
    p.in_msg = false;
  }
}

}  // namespace linkwise
