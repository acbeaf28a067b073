// The engine's failures that reach past one request: aborting (this rank's own collective
// failure, close), the abort notices that spread a collective failure, the stop a notice puts
// a peer in, and refusal notices. engine.h ("Collective failures spread") states the rules.
#include "p2p/engine_internal.h"

#include <algorithm>

#include "core/wait.h"

namespace linkwise {

using namespace engine_detail;

void Engine::abort(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  abort_locked(own_abort_reason(why), ErrorKind::Aborted, -1);
}

void Engine::close(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  abort_locked(own_abort_reason(why), ErrorKind::Aborted, -1);
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.write_closed || p.rank == rank_) continue;
    p.write_closed = true;
    try {
      p.link->close_write();
    } catch (const Error&) {
      // the peer is gone too
    }
  }
}

void Engine::abort_and_notify(const std::string& why, int blame, uint64_t from) {
  std::lock_guard<std::mutex> g(mu_);
  if (blame >= 0)  // a rank died or failed: later calls here raise PeerError naming it, as the peers' do
    abort_locked(own_abort_reason(why + " (rank " + std::to_string(blame) + " died or failed)"), ErrorKind::Peer,
                 blame);
  else
    abort_locked(own_abort_reason(why), ErrorKind::Aborted, -1);
  notify_abort_locked(blame, from & kCollNumberMask);
}

void Engine::notify_refused(uint64_t number) {
  note_collective(number & kCollNumberMask);
  std::lock_guard<std::mutex> g(mu_);
  if (aborted_) return;  // the peers raise already
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.rank == rank_) continue;
    auto notice = std::make_shared<Request>(Request::Kind::Send, p.rank, number & kCollNumberMask, nullptr, 0, 0);
    notice->notice = kRefused;  // 0 bytes: never pulled; completes once written (nobody waits for it)
    p.send_queue.push_back(std::move(notice));
    progress_send(p);
  }
}

int Engine::refused_by(uint64_t number) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& pp : peers_)
    if (std::find(pp->refused.begin(), pp->refused.end(), number & kCollNumberMask) != pp->refused.end())
      return pp->rank;
  return -1;
}

// Tag 0 (not a collective's) is stopped by any stop: what kAnyCall asks.
static uint64_t tag_of_call(uint64_t number) {
  return number == Engine::kAnyCall ? 0 : collective_tag(number, 0, 0);
}

std::string Engine::abort_reason(uint64_t number) {
  std::lock_guard<std::mutex> g(mu_);
  return stopped_locked(tag_of_call(number)) ? abort_reason_ : std::string();
}

int Engine::abort_peer(uint64_t number) {
  std::lock_guard<std::mutex> g(mu_);
  return stopped_locked(tag_of_call(number)) && abort_kind_ == ErrorKind::Peer ? abort_peer_ : -1;
}

void Engine::set_failure_hook(std::function<void(int blame, bool own)> hook) {
  std::lock_guard<std::mutex> g(mu_);
  failure_hook_ = std::move(hook);
  if (!failure_hook_) return;
  if (own_failure_noted_) failure_hook_(own_failure_blame_, true);  // failed before it was set
  if (notice_failure_noted_) failure_hook_(notice_failure_blame_, false);
}

std::string Engine::own_abort_reason(const std::string& why) const {
  return "rank " + std::to_string(rank_) + ": the communicator was aborted: " + why;
}

// The first abort's or stop's (reason, kind, peer) is what requests failing later report.
void Engine::record_failure_locked(const std::string& reason, ErrorKind kind, int peer) {
  if (aborted_ || stop_from_ != kNoStop) return;
  abort_reason_ = reason;
  abort_kind_ = kind;  // PeerError after a death or a peer's failure
  abort_peer_ = peer;
}

// Runs the failure hook once for each origin (the shared-memory executor stops through it).
void Engine::note_failure_locked(int blame, bool own) {
  bool& noted = own ? own_failure_noted_ : notice_failure_noted_;
  if (noted) return;
  noted = true;
  (own ? own_failure_blame_ : notice_failure_blame_) = blame;
  if (failure_hook_) failure_hook_(blame, own);
}

// Fails every pending request with (kind, reason, peer) and stops progress for good.
void Engine::abort_locked(const std::string& reason, ErrorKind kind, int peer) {
  record_failure_locked(reason, kind, peer);
  aborted_ = true;
  for (auto& pp : peers_) {
    Peer& p = *pp;
    auto fail_all = [&](std::list<std::shared_ptr<Request>>& l) {
      for (auto& r : l) fail_locked(*r, kind, abort_reason_, peer);
      l.clear();
    };
    fail_all(p.send_queue);
    withdraw_pulls_locked(p, peer);
    fail_all(p.awaiting_ack);
    fail_all(p.posted);
    if (p.in_req) fail_locked(*p.in_req, kind, abort_reason_, peer);
    for (auto& u : p.unexpected)
      if (u.bound) fail_locked(*u.bound, kind, abort_reason_, peer);
    p.in_req.reset();
    p.in_msg = false;
  }
}

// A peer's notice: collectives numbered `from` and up fail here, and point-to-point, while
// the engine goes on moving the earlier collectives' messages. Requests it stops fail now,
// except those whose bytes are already moving:
//  - a point-to-point send partly on the wire or waiting for its pull's ack, or a receive
//    being filled: they complete (their bytes move whole; a point-to-point message carries no
//    collective number, so cutting it could cut what an earlier collective needs behind it);
//  - a stopped collective's receive being filled: it fails once its bytes are in
//    (complete_locked), so no buffer handed back to the caller is still written;
//  - a stopped collective's send partly on the wire cannot be taken back, and its receiver may
//    have stopped reading (aborted): this side's stream to that peer ends there, as an abort's
//    does. Collectives run in order, so every message of an earlier one went out before it:
//    the peer loses nothing it still needs, and raises PeerError naming this rank for the rest.
//    A stopped collective's pulled send waiting for its ack is withdrawn.
void Engine::stop_locked(uint64_t from, const std::string& reason, ErrorKind kind, int peer) {
  record_failure_locked(reason, kind, peer);
  if (aborted_ || from >= stop_from_) return;
  stop_from_ = from;
  for (auto& pp : peers_) {
    Peer& p = *pp;
    const Request* front = p.send_queue.empty() ? nullptr : p.send_queue.front().get();
    if (front && p.front_started && p.wire_pos > 0 && is_coll_tag(front->tag) && stopped_locked(front->tag)) {
      for (auto& r : p.send_queue)
        if (!r->notice) fail_locked(*r, abort_kind_, abort_reason_, abort_peer_);
      p.send_queue.clear();
      p.front_started = false;
      p.write_closed = true;
      try {
        p.link->close_write();
      } catch (const Error&) {
        // the peer is gone too
      }
    }
    for (auto it = p.send_queue.begin(); it != p.send_queue.end();) {
      Request& r = **it;
      const bool front = it == p.send_queue.begin() && p.front_started;
      if (r.notice || !stopped_locked(r.tag) || (front && p.wire_pos > 0)) {
        ++it;
        continue;
      }
      if (front) p.front_started = false, p.stage_len = 0;  // announced to nobody yet (as in cancel)
      fail_locked(r, abort_kind_, abort_reason_, abort_peer_);
      it = p.send_queue.erase(it);
    }
    for (auto it = p.awaiting_ack.begin(); it != p.awaiting_ack.end();) {
      if (!is_coll_tag((*it)->tag) || !stopped_locked((*it)->tag)) {
        ++it;
        continue;
      }
      if (p.link) p.link->withdraw(static_cast<uint32_t>((*it)->pull_seq), abort_peer_);
      fail_locked(**it, abort_kind_, abort_reason_, abort_peer_);
      it = p.awaiting_ack.erase(it);
    }
    for (auto it = p.posted.begin(); it != p.posted.end();) {
      if (!stopped_locked((*it)->tag)) {
        ++it;
        continue;
      }
      fail_locked(**it, abort_kind_, abort_reason_, abort_peer_);
      it = p.posted.erase(it);
    }
  }
}

// A stopped engine keeps running, so the notice it passes on is queued: at the front of a
// peer's stream, or right behind the message partly on the wire, and leaves in turn.
void Engine::pass_stop_on_locked(int blame, uint64_t from) {
  note_failure_locked(blame, false);
  if (aborted_) return;  // notify_abort_locked told the peers already
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.write_closed || p.rank == rank_ || p.rank == blame || p.told_from <= from) continue;
    p.told_from = from;
    auto notice = std::make_shared<Request>(Request::Kind::Send, p.rank, static_cast<uint64_t>(blame + 1), nullptr, 0, 0);
    notice->notice = kAbort;  // completes once written; nobody waits for it
    notice->notice_arg = from;
    auto at = p.send_queue.begin();
    if (p.front_started && at != p.send_queue.end()) ++at;
    p.send_queue.insert(at, std::move(notice));
    try {
      progress_send(p);
    } catch (const Error&) {
      // the peer is gone too; nothing to tell it
    }
  }
}

// Best effort, bounded. A peer whose stream is in the middle of a message, or whose link will
// not take the 48-byte header within ~10 ms (a full ring the peer does not drain), cannot be
// sent a notice without corrupting the stream: its link is closed instead (close_write), so it
// fails with PeerError naming this rank rather than waiting for the rest of the message until
// this process exits. Writes never block (PeerLink contract). A stop passed on earlier may
// have queued a lower number than `from`: the notices carry the lower. Notices go out again
// only for a lower number: a point-to-point failure names the next collective, and a
// collective running on another thread then fails from its own, earlier number (its peers in
// it must be released too).
void Engine::notify_abort_locked(int blame, uint64_t from) {
  note_failure_locked(blame, true);
  from = std::min(from, stop_from_);
  if (from >= notice_from_sent_) return;
  notice_from_sent_ = from;
  const MsgHeader h{kHeaderMagic, kAbort, static_cast<uint64_t>(blame + 1), 0, from, 0, 0};
  for (auto& pp : peers_) {
    Peer& p = *pp;
    if (!p.link || p.dead || p.write_closed || p.rank == rank_ || p.rank == blame) continue;
    try {
      if (!p.link->alive()) continue;
      size_t done = 0;
      if (!(p.front_started && p.wire_pos > 0)) {
        const char* b = reinterpret_cast<const char*>(&h);
        const Clock::time_point t0 = Clock::now();
        while (done < sizeof h && seconds_since(t0) < 0.01) {
          const size_t n = p.link->write_some(b + done, sizeof h - done);
          if (n == 0) cpu_relax();
          done += n;
        }
        p.link->flush();
      }
      if (done < sizeof h) {
        p.link->close_write();
        p.write_closed = true;  // a later, lower notice must not follow into a closed stream
      }
    } catch (const Error&) {
      // the peer is gone too; nothing to tell it
    }
  }
}

// A peer gave up on collective `stop_from` (or on everything, 0): so does this rank from that
// collective on, blaming whom it blamed, and passes it on.
void Engine::take_abort_notice_locked(Peer& from, int blame, uint64_t stop_from) {
  const std::string msg =
      blame >= 0 ? "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(from.rank) +
                       " gave up on a collective because rank " + std::to_string(blame) +
                       " failed; the communicator is aborted. Look at rank " + std::to_string(blame) +
                       "'s output for the cause."
                 : "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(from.rank) +
                       " gave up on a collective (it timed out or failed); the communicator is aborted";
  stop_locked(stop_from, msg, blame >= 0 ? ErrorKind::Peer : ErrorKind::Aborted, blame);
  pass_stop_on_locked(blame, stop_from);
}

// This rank was copying a message (tagged `tag`) its sender withdrew: the sender aborted or
// stopped. An abort that blames a rank is that rank's failure passed on, as the sender's abort
// notice would (so survivors all name the rank that failed); otherwise the sender itself
// failed. A collective's message stops this rank from that collective's number (its sender
// stopped there at the latest; its notice, behind, may name a lower one).
void Engine::take_withdrawal_locked(Peer& p, const WithdrawnError& e, uint64_t tag) {
  if (is_coll_tag(tag))
    take_abort_notice_locked(p, e.blame() >= 0 ? e.blame() : p.rank, coll_number(tag));
  else if (e.blame() >= 0)
    take_abort_notice_locked(p, e.blame(), 0);
  else
    fail_peer_locked(p, e.what());
}

}  // namespace linkwise
