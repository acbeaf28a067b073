// The receiving side of the engine: matching posted receives, unexpected and deferred
// (not yet pulled) messages, reading message bodies. Called under the Engine's lock.
#include <algorithm>
#include <cstring>

#include "core/copy.h"
#include "p2p/engine_internal.h"

namespace linkwise {

using namespace engine_detail;

// Why `h` cannot be received into `req`, or "" when it fits.
static std::string misfit(const Request& req, const MsgHeader& h, int me, ErrorKind* kind) {
  if (h.size > req.bytes) {
    *kind = ErrorKind::Invalid;
    if (is_coll_tag(h.tag))
      return "rank " + std::to_string(me) + ": a collective received " + std::to_string(h.size) + " bytes from rank " +
             std::to_string(req.peer) + " (" + tag_text(h.tag) + ") where " + std::to_string(req.bytes) +
             " were expected: the ranks called it with different sizes, dtypes or roots; call each collective "
             "with the same arguments on every rank (LINKWISE_CHECK=1 compares them first)";
    return "rank " + std::to_string(me) + ": a message of " + std::to_string(h.size) + " bytes from rank " +
           std::to_string(req.peer) + " (" + tag_text(h.tag) + ") does not fit the receive buffer of " +
           std::to_string(req.bytes) + " bytes; receive into a buffer of at least " + std::to_string(h.size) +
           " bytes (the message is kept for the next receive with this tag)";
  }
  if (((h.dtype | req.dtype) & kCollCode) && h.dtype != req.dtype) {
    *kind = ErrorKind::Invalid;
    const bool same_kind = ((h.dtype ^ req.dtype) & 0xffff0000u) == 0;  // so the sizes differ
    return "rank " + std::to_string(me) + ": rank " + std::to_string(req.peer) + "'s message in this collective (" +
           tag_text(h.tag) + ") " +
           (same_kind ? std::string("belongs to a call of another size")
                      : "moves " + dtype_name(h.dtype) + " where this rank's call moves " + dtype_name(req.dtype)) +
           ": the ranks called it with different sizes, dtypes or ops; call each collective with the same "
           "arguments on every rank (LINKWISE_CHECK=1 compares them first)";
  }
  if (!dtypes_compatible(h.dtype, req.dtype)) {
    *kind = ErrorKind::Type;
    return "rank " + std::to_string(me) + ": rank " + std::to_string(req.peer) + " sent " + dtype_name(h.dtype) +
           " data (" + tag_text(h.tag) + ") but the receive buffer holds " + dtype_name(req.dtype) +
           "; receive into an array of the sender's dtype (the message is kept)";
  }
  return "";
}

// Peer `from` refused collective `number` (Engine::notify_refused): its receives of that
// collective from `from` fail now, and those posted later at irecv (while it is among the
// kRefusalsKept latest).
void Engine::take_refusal_locked(Peer& from, uint64_t number) {
  from.refused.push_back(number);
  if (from.refused.size() > kRefusalsKept) from.refused.pop_front();
  for (auto it = from.posted.begin(); it != from.posted.end();) {
    if (is_coll_tag((*it)->tag) && coll_number((*it)->tag) == number) {
      std::shared_ptr<Request> req = std::move(*it);
      it = from.posted.erase(it);
      fail_refused_locked(from, *req);
    } else {
      ++it;
    }
  }
}

void Engine::fail_refused_locked(Peer& from, Request& req) {
  fail_locked(req, ErrorKind::Invalid,
              "rank " + std::to_string(rank_) + ": rank " + std::to_string(from.rank) + " refused its arguments of collective number " +
                  std::to_string(coll_number(req.tag)) +
                  " (its ValueError or TypeError says why) and will not send its part, which this rank waits "
                  "for; call each collective with the same arguments, in the same order, on every rank",
              -1);
}

bool Engine::match_unexpected_locked(Peer& p, const std::shared_ptr<Request>& req) {
  for (auto it = p.unexpected.begin(); it != p.unexpected.end(); ++it) {
    if (it->hdr.tag != req->tag || it->bound) continue;
    ErrorKind kind;
    std::string why = misfit(*req, it->hdr, rank_, &kind);
    if (it->failed) {
      fail_locked(*req, ErrorKind::Peer, p.failure, p.rank);
      p.unexpected.erase(it);
    } else if (!why.empty()) {
      fail_locked(*req, kind, why, -1);
    } else if (it->deferred) {
      deliver_deferred_locked(p, *it, req.get());
      p.unexpected.erase(it);
    } else if (it->complete) {
      if (it->hdr.size) copy_bytes(req->buf, it->data.get(), it->hdr.size);
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

bool Engine::progress_recv(Peer& p) {
  bool moved = false;
  PeerLink& link = *p.link;
  // Bounded work per pass: a peer that streams without pause must not keep this thread here
  // (its caller waits for one particular request, and other peers need turns too).
  int budget = kMessagesPerPass;
  size_t bytes_left = kBytesPerPass;
  try {
    while (budget-- > 0 && bytes_left > 0) {
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
        if (p.in_hdr.kind == kAbort) {
          take_abort_notice_locked(p, static_cast<int>(p.in_hdr.tag) - 1, p.in_hdr.addr);
          if (aborted_) return true;
          moved = true;
          continue;  // stopped from a number: the earlier collectives' messages still come
        }
        if (p.in_hdr.kind == kRefused) {
          take_refusal_locked(p, p.in_hdr.tag);
          moved = true;
          continue;
        }
        start_incoming(p);
      }
      const MsgHeader& h = p.in_hdr;
      char* dst = p.in_req ? static_cast<char*>(p.in_req->buf) : p.in_unexp->data.get();  // null if deferred
      if (h.kind == kPull) {
        if (p.in_req) {
          if (h.size) link.pull(dst, h.addr, h.size, h.seq);
          link.post_ack(h.seq);
        } else {
          p.in_unexp->deferred = true;  // pulled when its receive is posted, or before sleeping
        }
        p.in_got = h.size;
        moved = true;
      } else {
        while (p.in_got < h.size && bytes_left > 0) {
          size_t n = link.read_some(dst + p.in_got, std::min(h.size - p.in_got, bytes_left));
          if (n == 0) break;
          p.in_got += n;
          bytes_left -= n;
          moved = true;
        }
      }
      if (p.in_got < h.size) break;
      finish_incoming(p);
    }
  } catch (const WithdrawnError& e) {
    // Only a pull throws it, and a pulled message's header is all its sender wrote to the
    // stream, which is therefore between messages again: the receive fails, reading goes on.
    const uint64_t tag = p.in_hdr.tag;
    if (p.in_req) fail_locked(*p.in_req, ErrorKind::Peer, e.what(), e.blame() >= 0 ? e.blame() : p.rank);
    p.in_req.reset();
    p.in_msg = false;
    take_withdrawal_locked(p, e, tag);
    return true;
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
  for (auto it = p.posted.begin(); it != p.posted.end();) {
    if ((*it)->tag != h.tag) {
      ++it;
      continue;
    }
    std::shared_ptr<Request> req = *it;
    it = p.posted.erase(it);
    ErrorKind kind;
    std::string why = misfit(*req, h, rank_, &kind);
    if (why.empty()) {
      p.in_req = std::move(req);
      return;
    }
    // This receive fails; the message goes on to the next posted receive of its tag that
    // fits, else waits queued for one (so that receives posted early keep the tag's order).
    fail_locked(*req, kind, why, -1);
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
    if (n) copy_bytes(req->buf, it->data.get(), n);
    p.unexpected.erase(it);
    complete_locked(*req, n);
  }
}

// Pulls a deferred message into req's buffer (or, with req null, into a buffer of its own,
// after which it is an ordinary complete unexpected message) and acknowledges it. False when
// the pull failed: req failed (the caller erases u: its receive is done), or without req u is
// left marked failed, in its place (see Unexpected::failed); the peer failed or the
// communicator aborted.
bool Engine::deliver_deferred_locked(Peer& p, Unexpected& u, Request* req) {
  const size_t n = u.hdr.size;
  u.deferred = false;  // from here on the caller owns u's fate (fail_peer_locked marks only deferred ones failed)
  try {
    if (req) {
      if (n) p.link->pull(req->buf, u.hdr.addr, n, u.hdr.seq);
    } else {
      u.data.reset(new char[n ? n : 1]);
      if (n) p.link->pull(u.data.get(), u.hdr.addr, n, u.hdr.seq);
    }
    p.link->post_ack(u.hdr.seq);
  } catch (const WithdrawnError& e) {
    if (req) fail_locked(*req, ErrorKind::Peer, e.what(), e.blame() >= 0 ? e.blame() : p.rank);
    if (!req) u.failed = true, p.failure = e.what();
    take_withdrawal_locked(p, e, u.hdr.tag);
    return false;
  } catch (const Error& e) {
    if (req) fail_locked(*req, ErrorKind::Peer, e.what(), p.rank);
    u.failed = !req;  // fail_peer_locked sets p.failure
    fail_peer_locked(p, e.what());
    return false;
  }
  if (req) {
    complete_locked(*req, n);
  } else {
    u.complete = true;
    u.got = n;
  }
  return true;
}

void Engine::materialize_deferred_locked() {
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (p.dead) continue;
    for (auto& u : p.unexpected)
      if (u.deferred && !deliver_deferred_locked(p, u, nullptr) && p.dead)
        break;  // failing the peer marked its other deferred entries failed
  }
}

}  // namespace linkwise
