#include "p2p/request.h"

#include <sys/eventfd.h>
#include <unistd.h>

namespace linkwise {

Request::~Request() {
  int fd = event_fd_.load();
  if (fd >= 0) close(fd);
}

void Request::rethrow() const {
  if (failed()) throw Error(err_kind_, err_, err_peer_);
}

int Request::event_fd() {
  int fd = event_fd_.load(std::memory_order_acquire);
  if (fd >= 0) return fd;
  int fresh = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fresh < 0) fail_errno("eventfd for a request");
  int expected = -1;
  if (!event_fd_.compare_exchange_strong(expected, fresh)) {
    close(fresh);
    return expected;
  }
  // Completion may have happened before the fd existed: signal it now.
  if (done()) {
    uint64_t one = 1;
    ssize_t r = write(fresh, &one, sizeof(one));
    (void)r;
  }
  return fresh;
}

void Request::complete(size_t transferred) {
  transferred_ = transferred;
  // seq_cst on done_ and event_fd_ here and in event_fd(): whichever side comes second sees
  // the other, so the eventfd is signalled at least once.
  done_.store(true, std::memory_order_seq_cst);
  int fd = event_fd_.load(std::memory_order_seq_cst);
  if (fd >= 0) {
    uint64_t one = 1;
    ssize_t r = write(fd, &one, sizeof(one));
    (void)r;
  }
}

void Request::fail(ErrorKind kind, std::string message, int peer) {
  err_kind_ = kind;
  err_ = std::move(message);
  err_peer_ = peer;
  complete(0);
}

}  // namespace linkwise
