// Whether a peer process has terminated, where no pidfd tells (kernels before 5.3, or a
// container whose seccomp filter refuses pidfd_open): the fallback of every peer watch
// (shared-memory links, the shared-memory collectives, the GPU plane's PeerWatch).
//
// kill(pid, 0) alone is fooled by a zombie: it succeeds until the parent reaps the process.
// A rank's parent need not reap it at once (`linkwise launch` keeps an exited rank unreaped
// until the job ends, so that its pid, its process group's id, cannot pass to another
// process while the launcher may still signal that group), so a zombie counts as gone: its
// state in /proc/<pid>/stat is 'Z' (or 'X', being reaped). Costs a kill() and, for a live
// process, an open/read/close of that file: callers check at most every few milliseconds.
// Threading: any thread; no state.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace linkwise {

inline bool process_gone_without_pidfd(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;  // EPERM: it exists (another user's)
  char path[32];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return kill(pid, 0) != 0 && errno == ESRCH;  // reaped since; or no /proc: as kill() says
  char buf[512];
  ssize_t n;
  do {
    n = read(fd, buf, sizeof buf - 1);
  } while (n < 0 && errno == EINTR);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  // "pid (comm) S ...": comm may hold spaces and parentheses, so the state follows the last ')'.
  const char* end = std::strrchr(buf, ')');
  if (end == nullptr || end[1] != ' ') return false;
  return end[2] == 'Z' || end[2] == 'X';
}

}  // namespace linkwise
