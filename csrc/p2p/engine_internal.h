// Engine internals shared by engine.cc (posting, sending, failures) and engine_recv.cc
// (receiving and matching). Not part of the interface; see engine.h for the contracts.
#pragma once

#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "p2p/engine.h"

namespace linkwise {
namespace engine_detail {

constexpr uint32_t kHeaderMagic = 0x314d574c;  // "LWM1"
constexpr uint32_t kEager = 1;
constexpr uint32_t kPull = 2;
// Abort notice: tag = blamed rank + 1 (0: none), addr = the collective number it stops from
// (0: everything, point-to-point included), no payload.
constexpr uint32_t kAbort = 3;
constexpr uint32_t kRefused = 4;  // refusal notice: tag = the refused collective's number, no payload
constexpr size_t kRefusalsKept = 64;  // a peer's latest refusals a receive posted later is checked against
constexpr size_t kStage = 4096;          // header + payload up to this go out in one write
constexpr int kMessagesPerPass = 16;     // incoming messages one progress pass may finish per peer
// Payload bytes one progress pass may read from one peer's byte stream (TCP): a large message
// arriving without pause would otherwise keep the pass, and the engine's lock, until all of it
// is in (wait(timeout) overshot by ~0.15 s on a 128 MB receive); the caller's loop comes back.
constexpr size_t kBytesPerPass = size_t{8} << 20;
// Collective tags (collective_tag, engine.h) read as the collective's number and step.
inline bool is_coll_tag(uint64_t tag) { return tag >> 63; }
constexpr uint64_t kCollNumberMask = (uint64_t{1} << 38) - 1;
inline uint64_t coll_number(uint64_t tag) { return (tag >> 24) & kCollNumberMask; }
inline std::string tag_text(uint64_t tag) {
  if (!is_coll_tag(tag)) return "tag " + std::to_string(tag);
  return "collective number " + std::to_string(coll_number(tag)) + ", step " + std::to_string(tag & 0xffff);
}

}  // namespace engine_detail

struct Engine::Unexpected {
  MsgHeader hdr{};
  std::unique_ptr<char[]> data;
  size_t got = 0;
  bool complete = false;
  bool deferred = false;           // a pulled message not copied yet (data is empty)
  // A pulled message that can no longer be copied (its sender died, failed or withdrew it). It
  // keeps its place, so the receive it matches raises PeerError (`failure`) and the sender's
  // later messages with the same tag still go to later receives, in order.
  bool failed = false;
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
  char stage[engine_detail::kStage];
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
  std::string failure;  // why the peer failed (fail_peer_locked), for its failed messages
  std::deque<uint64_t> refused;  // the collective numbers of its latest refusal notices (kRefusalsKept)
  // The lowest collective number an abort notice to this peer stops from, written or queued
  // (kNoStop: none yet); a lower one is sent again.
  uint64_t told_from = kNoStop;
  bool write_closed = false;  // a stop ended this side's stream to it mid-message (stop_locked)

  bool has_work() const {
    return !send_queue.empty() || !awaiting_ack.empty() || !posted.empty() || in_msg;
  }
};

// Whether a request with this tag must fail here (see Engine::stop_from_). A non-collective
// tag (point-to-point, or 0 for "anything") is stopped by any stop. Inline: every post asks.
inline bool Engine::stopped_locked(uint64_t tag) const {
  if (aborted_) return true;
  if (stop_from_ == kNoStop) return false;
  return !engine_detail::is_coll_tag(tag) || engine_detail::coll_number(tag) >= stop_from_;
}

}  // namespace linkwise
