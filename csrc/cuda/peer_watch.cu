// PeerWatch (peer_watch.h): the watcher thread of a GPU communicator.
#include "cuda/peer_watch.h"

#include "core/process.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace linkwise::cuda {

void PeerWatch::start(const std::vector<int64_t>& pids) {
  stop();
  pid_of_rank_ = pids;
  for (size_t r = 0; r < pids.size(); ++r) {
    if (pids[r] <= 0) continue;
    int fd = -1;
#ifdef SYS_pidfd_open
    fd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pids[r]), 0));
    if (fd < 0 && errno == ESRCH) {  // already gone
      dead_pid_.store(pids[r], std::memory_order_release);
      trip(static_cast<int>(r));
      continue;
    }
#endif
    fds_.push_back(fd);
    ranks_.push_back(static_cast<int>(r));
    pids_.push_back(pids[r]);
  }
  if (ranks_.empty()) return;
  stop_fd_ = eventfd(0, EFD_CLOEXEC);
  thread_ = OwnedThread([this] { loop(); });
}

void PeerWatch::stop() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    if (write(stop_fd_, &one, sizeof(one)) < 0) { /* the thread also ends on a death */ }
    thread_.join();
  }
  for (int fd : fds_)
    if (fd >= 0) close(fd);
  if (stop_fd_ >= 0) close(stop_fd_);
  stop_fd_ = -1;
  fds_.clear(), ranks_.clear(), pids_.clear(), pid_of_rank_.clear();
}

bool PeerWatch::trip(int peer) {
  int none = kNone;
  if (!dead_.compare_exchange_strong(none, peer, std::memory_order_acq_rel)) return false;
  if (flags_) __atomic_store_n(&flags_->abort, 1u, __ATOMIC_RELEASE);  // after dead_: readers see why
  return true;
}

bool PeerWatch::alive(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(pid_of_rank_.size()) || pid_of_rank_[rank] <= 0) return true;
  return !process_gone_without_pidfd(static_cast<pid_t>(pid_of_rank_[rank]));
}

void PeerWatch::loop() {
  std::vector<pollfd> p;
  bool fallback = false;
  for (int fd : fds_) {
    p.push_back({fd, POLLIN, 0});  // fd -1: poll ignores the entry
    fallback |= fd < 0;
  }
  p.push_back({stop_fd_, POLLIN, 0});
  for (;;) {
    int n = poll(p.data(), p.size(), fallback ? 100 : -1);
    if (n < 0 && errno != EINTR) return;
    if (p.back().revents) return;  // stop()
    for (size_t i = 0; i < fds_.size(); ++i) {
      bool gone = fds_[i] >= 0 ? p[i].revents != 0
                               : process_gone_without_pidfd(static_cast<pid_t>(pids_[i]));  // zombies too
      if (gone) {
        dead_pid_.store(pids_[i], std::memory_order_release);
        trip(ranks_[i]);
        return;
      }
    }
  }
}

}  // namespace linkwise::cuda
