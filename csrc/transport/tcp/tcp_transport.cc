#include "transport/tcp/tcp_transport.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>

#include "core/status.h"

namespace linkwise {

class TcpLink : public PeerLink {
 public:
  TcpLink(TcpTransport* owner, int peer, int fd) : owner_(owner), peer_(peer), fd_(fd) {
    int flags = fcntl(fd_, F_GETFL, 0);
    fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::lock_guard<std::mutex> g(owner_->mu_);
    owner_->links_.push_back(this);
  }
  ~TcpLink() override {
    {
      std::lock_guard<std::mutex> g(owner_->mu_);
      auto& v = owner_->links_;
      v.erase(std::remove(v.begin(), v.end(), this), v.end());
    }
    close(fd_);
  }

  size_t write_some(const void* data, size_t n) override {
    if (closed_.load(std::memory_order_relaxed) || n == 0) return 0;
    ssize_t got = ::send(fd_, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        want_write_.store(true, std::memory_order_relaxed);  // poll for POLLOUT while it lasts
        return 0;
      }
      closed_.store(true, std::memory_order_relaxed);  // EPIPE, ECONNRESET: the peer is gone
      return 0;
    }
    want_write_.store(static_cast<size_t>(got) < n, std::memory_order_relaxed);
    return static_cast<size_t>(got);
  }

  void flush() override {}

  size_t read_some(void* dst, size_t n) override {
    if (n == 0) return 0;
    ssize_t got = ::recv(fd_, dst, n, MSG_DONTWAIT);
    if (got > 0) return static_cast<size_t>(got);
    if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
      closed_.store(true, std::memory_order_relaxed);  // orderly close or reset
    return 0;
  }

  bool alive() override { return !closed_.load(std::memory_order_relaxed); }

  void close_write() override { ::shutdown(fd_, SHUT_WR); }  // the peer reads EOF

  std::string describe() const override { return "TCP to rank " + std::to_string(peer_); }

  int fd() const { return fd_; }
  bool want_write() const { return want_write_.load(std::memory_order_relaxed); }

 private:
  TcpTransport* owner_;
  int peer_;
  int fd_;
  std::atomic<bool> closed_{false};
  std::atomic<bool> want_write_{false};
};

TcpTransport::TcpTransport() {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) fail_errno("eventfd");
}

TcpTransport::~TcpTransport() { close(wake_fd_); }

std::unique_ptr<PeerLink> TcpTransport::adopt(int peer, int fd) {
  return std::make_unique<TcpLink>(this, peer, fd);
}

void TcpTransport::sleep(uint32_t, int64_t timeout_us) {
  std::vector<struct pollfd> fds;
  {
    std::lock_guard<std::mutex> g(mu_);
    fds.reserve(links_.size() + 1);
    for (TcpLink* l : links_) {
      short ev = POLLIN;
      if (l->want_write()) ev |= POLLOUT;
      if (l->alive()) fds.push_back({l->fd(), ev, 0});
    }
  }
  fds.push_back({wake_fd_, POLLIN, 0});
  int ms = static_cast<int>((timeout_us + 999) / 1000);
  int n = poll(fds.data(), fds.size(), ms);
  if (n > 0 && (fds.back().revents & POLLIN)) {
    uint64_t v;
    while (read(wake_fd_, &v, sizeof(v)) > 0) {
    }
  }
}

void TcpTransport::wake() {
  uint64_t one = 1;
  ssize_t r = write(wake_fd_, &one, sizeof(one));
  (void)r;
}

}  // namespace linkwise
