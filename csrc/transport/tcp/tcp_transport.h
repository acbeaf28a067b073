// TCP transport: one connected, non-blocking socket per peer.
//
// Sockets are connected by the Python control plane (which knows addresses and interfaces)
// and handed over as file descriptors; the transport owns them from then on and closes them.
// Sleeping is poll() on every socket plus an eventfd for local wake-ups.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "transport/transport.h"

namespace linkwise {

class TcpLink;

class TcpTransport : public Transport {
 public:
  TcpTransport();
  ~TcpTransport() override;

  // Takes ownership of a connected stream socket to `peer`.
  std::unique_ptr<PeerLink> adopt(int peer, int fd);

  uint32_t begin_sleep() override { return 0; }
  void sleep(uint32_t token, int64_t timeout_us) override;
  void end_sleep() override {}
  void wake() override;

 private:
  friend class TcpLink;
  std::mutex mu_;                // guards links_ (sleep() reads it without the Engine's lock)
  std::vector<TcpLink*> links_;  // not owned; a link unregisters itself on destruction
  int wake_fd_ = -1;
};

}  // namespace linkwise
