// Shared memory between processes of one host, mapped into this process.
//
// Two kinds:
//  * private (create_private): an anonymous memfd. It has no name in /dev/shm, so nothing can
//    be left behind when processes die, and it does not count against a container's small
//    /dev/shm (Docker's default is 64 MiB). Peers open it through the creator's
//    /proc/<pid>/fd/<fd> (same user), which name() returns; the creator keeps the fd open
//    until unlink(), after which no new process can open it.
//  * named (create): a POSIX segment "/linkwise-<job>-..." in /dev/shm, for callers that must
//    agree on a name before they can talk. Its creator unlinks it as soon as every peer has
//    mapped it; a crash in between leaves it behind (linkwise launch removes leftovers).
//
// Memory is reserved when the segment is made (posix_fallocate), so a full /dev/shm or memory
// limit is a clear error at setup rather than a SIGBUS at the first touch. Mappings are
// populated up front (MAP_POPULATE): a first touch costs a page fault of several
// microseconds on a VM, which would otherwise land on the first messages.
#pragma once

#include <cstddef>
#include <string>

namespace linkwise {

class ShmSegment {
 public:
  static ShmSegment create_private(const std::string& label, size_t bytes);
  static ShmSegment create(const std::string& name, size_t bytes);
  // Opens a peer's segment by what its creator's name() returned (either kind).
  static ShmSegment open(const std::string& name);
  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  void* data() const { return base_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Creator only, idempotent: no new process can open the segment afterwards; mappings stay.
  void unlink();

 private:
  static ShmSegment map_new(int fd, const std::string& name, size_t bytes, bool named);
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  int fd_ = -1;          // a private segment's memfd, open until unlink()
  bool owner_ = false;
  bool named_ = false;
  bool unlinked_ = false;
};

}  // namespace linkwise
