// The transport interface: what the engine and the algorithms see of a link to one peer.
//
// A PeerLink is a reliable, ordered, full-duplex byte stream to one peer, plus an optional
// single-copy "pull" path for large messages. Every call is non-blocking: it moves what it can
// now and says how much. Links know nothing about messages, tags or collectives; the Engine
// frames messages on top. Threading: a link is used by one thread at a time (the Engine's lock).
//
// A Transport owns the way to sleep until some link may have changed (a futex doorbell for
// shared memory, poll() for sockets) and a way to interrupt that sleep from another thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "core/status.h"

namespace linkwise {

// Thrown by PeerLink::pull when the sender withdrew the message (PeerLink::withdraw): the
// sender aborted. peer() is the sender; blame() the rank its abort blames, or -1.
class WithdrawnError : public Error {
 public:
  WithdrawnError(std::string message, int sender, int blame)
      : Error(ErrorKind::Peer, std::move(message), sender), blame_(blame) {}
  int blame() const { return blame_; }

 private:
  int blame_;
};

class PeerLink {
 public:
  virtual ~PeerLink() = default;

  // Append up to n bytes to the outgoing stream; returns how many were taken (0 when full).
  virtual size_t write_some(const void* data, size_t n) = 0;
  // Make the bytes written so far visible to the peer and wake it if it sleeps.
  virtual void flush() = 0;
  // Take up to n bytes of the incoming stream into dst; returns how many (0 when empty).
  virtual size_t read_some(void* dst, size_t n) = 0;

  // False once the peer is known to be gone (process exited, connection closed). Bytes it
  // sent before dying may still be readable.
  virtual bool alive() = 0;
  virtual std::string describe() const = 0;
  // Ends this side's outgoing stream for good: once the peer has read what was written before,
  // its alive() turns false, as if this process had exited. For an aborting rank that cannot
  // finish a half-written message (Engine::notify_abort_locked); nothing is written after it.
  virtual void close_write() = 0;

  // Single-copy path. When can_pull(), a sender may publish the address of its buffer with a
  // sequence number; the receiver copies straight out of the sender's memory (possibly much
  // later, and out of order with other pulled messages) and acknowledges that number. The
  // sender keeps at most kMaxPullsInFlight unacknowledged pulls per link (numbers are reused
  // modulo that many slots).
  static constexpr uint32_t kMaxPullsInFlight = 256;
  virtual bool can_pull() const { return false; }
  // `seq` names the message; a link may let the sender help with the copy (help_pull).
  virtual void pull(void* dst, uint64_t remote_addr, size_t n, uint32_t seq) {}
  // Sender side, called while a pulled message `seq` waits for its ack: copy part of it into
  // the receiver's buffer if the receiver has asked for help. True once this side is done
  // helping (nothing more to take), false if the receiver has not asked yet.
  virtual bool help_pull(uint32_t seq, const void* src, size_t n) { return true; }
  virtual void post_ack(uint32_t seq) {}
  virtual bool acked(uint32_t seq) { return false; }
  // Sender side: message `seq` was announced but its send failed (a wait timed out, or the
  // communicator aborted) before the ack, so the sender's buffer may be reused from now on.
  // `blame` is the rank the sender's abort blames (-1: none). The receiver's pull() checks for
  // this after copying and throws WithdrawnError instead of delivering bytes the user may
  // already have overwritten. If the check finds nothing, the copy ended before the
  // withdrawal, so before the sender returned to its user.
  virtual void withdraw(uint32_t seq, int blame) {}
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Sleeping without lost wake-ups, in three steps around a last check for progress:
  //   token = begin_sleep();  <check every link once more>;  sleep(token, us);  end_sleep();
  // Writers that publish after begin_sleep() make sleep() return at once.
  // Spurious returns are allowed. Called without the Engine's lock.
  virtual uint32_t begin_sleep() = 0;
  virtual void sleep(uint32_t token, int64_t timeout_us) = 0;
  virtual void end_sleep() = 0;
  // Interrupt sleep() in any thread of this process (new local work, or shutdown).
  virtual void wake() = 0;
};

}  // namespace linkwise
