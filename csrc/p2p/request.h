// A point-to-point operation in flight.
//
// Ownership: the Engine and the caller share a Request through shared_ptr. The caller keeps
// the buffer alive until done() (the Python binding holds the array for it). Threading:
// every field but `done_` and `event_fd_` is touched only under the Engine's lock; done_ is
// published with release order after the result fields are written.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/status.h"

namespace linkwise {

class Request {
 public:
  enum class Kind { Send, Recv };

  Request(Kind kind, int peer, uint64_t tag, void* buf, size_t bytes, uint32_t dtype)
      : kind(kind), peer(peer), tag(tag), buf(buf), bytes(bytes), dtype(dtype) {}
  ~Request();

  bool done() const { return done_.load(std::memory_order_acquire); }
  bool failed() const { return err_kind_ != nullptr_kind(); }
  // Throws the stored error, if any. Call only after done().
  void rethrow() const;
  // Bytes received (Recv) or sent (Send); valid after a successful completion.
  size_t transferred() const { return transferred_; }
  // An eventfd that becomes readable when the request completes (for asyncio). Created once.
  int event_fd();

  const Kind kind;
  const int peer;
  const uint64_t tag;
  void* const buf;       // send source or receive destination
  const size_t bytes;    // send size or receive capacity
  const uint32_t dtype;  // element type code, 0 when untyped (see dtype_code)
  bool is_async = false; // counted in the Engine's async work (its progress thread)

  // Engine-private progress state (under the Engine's lock).
  uint64_t pull_seq = 0;  // the kPull header's seq of a send awaiting its ack
  bool helped = false;    // this sender has done its share of the receiver's copy
  uint32_t notice = 0;    // a header-only notice of this kind (kRefused, kAbort), sent in turn, instead of a message
  uint64_t notice_arg = 0;  // kAbort: the collective number it stops from (its header's addr)

 private:
  friend class Engine;
  static ErrorKind nullptr_kind() { return static_cast<ErrorKind>(-1); }
  void complete(size_t transferred);
  void fail(ErrorKind kind, std::string message, int peer);

  std::atomic<bool> done_{false};
  size_t transferred_ = 0;
  ErrorKind err_kind_ = nullptr_kind();
  std::string err_;
  int err_peer_ = -1;
  std::atomic<int> event_fd_{-1};
};

}  // namespace linkwise
