#include "transport/shm/cma.h"

#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cerrno>
#include <string>

#include "core/status.h"

namespace linkwise {

namespace {
void check_copy(ssize_t got, int peer_rank, const char* what) {
  if (got > 0) return;
  if (got < 0 && errno == ESRCH)
    throw Error(ErrorKind::Peer, "rank " + std::to_string(peer_rank) + " died", peer_rank);
  if (got == 0 || (got < 0 && errno == EFAULT))  // alive, but the memory it offered is unmapped
    throw Error(ErrorKind::Peer,
                "rank " + std::to_string(peer_rank) +
                    " no longer has the memory it offered for this transfer (its side of the operation "
                    "failed or was cancelled)",
                peer_rank);
  fail_errno(std::string(what) + " rank " + std::to_string(peer_rank));
}
}  // namespace

void cma_allow_peers() { prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0); }

bool cma_probe(int64_t pid, const void* addr, uint64_t expect) {
  uint64_t got = 0;
  struct iovec local = {&got, sizeof(got)};
  struct iovec remote = {const_cast<void*>(addr), sizeof(got)};
  return process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0) == sizeof(got) && got == expect;
}

void cma_read(int64_t pid, int peer_rank, void* local, uint64_t remote, size_t n) {
  char* out = static_cast<char*>(local);
  size_t done = 0;
  while (done < n) {
    struct iovec l = {out + done, n - done};
    struct iovec r = {reinterpret_cast<void*>(remote + done), n - done};
    ssize_t got = process_vm_readv(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    check_copy(got, peer_rank, "process_vm_readv from");
    done += static_cast<size_t>(got);
  }
}

void cma_write(int64_t pid, int peer_rank, uint64_t remote, const void* local, size_t n) {
  const char* in = static_cast<const char*>(local);
  size_t done = 0;
  while (done < n) {
    struct iovec l = {const_cast<char*>(in) + done, n - done};
    struct iovec r = {reinterpret_cast<void*>(remote + done), n - done};
    ssize_t got = process_vm_writev(static_cast<pid_t>(pid), &l, 1, &r, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    check_copy(got, peer_rank, "process_vm_writev to");
    done += static_cast<size_t>(got);
  }
}

}  // namespace linkwise
