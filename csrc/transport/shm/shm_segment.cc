#include "transport/shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "core/status.h"

namespace linkwise {

// Sizes and maps a freshly created segment; on failure removes it and throws.
ShmSegment ShmSegment::map_new(int fd, const std::string& name, size_t bytes, bool named) {
  auto undo = [&](const std::string& what, int err) {
    close(fd);
    if (named) shm_unlink(name.c_str());
    errno = err;
    fail_errno(what);
  };
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) undo("ftruncate of shared memory " + name, errno);
  int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    undo("reserving " + std::to_string(bytes >> 10) + " KiB of shared memory for " + name +
             (named ? " (is /dev/shm large enough? containers often have 64 MiB: docker --shm-size)"
                    : " (memory limit?)"),
         err);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) undo("mmap of shared memory " + name, errno);
  ShmSegment seg;
  seg.base_ = base;
  seg.bytes_ = bytes;
  seg.owner_ = true;
  seg.named_ = named;
  if (named) {
    close(fd);
    seg.name_ = name;
  } else {
    seg.fd_ = fd;
    seg.name_ = "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd);
  }
  return seg;
}

ShmSegment ShmSegment::create_private(const std::string& label, size_t bytes) {
  // The label only names the memfd in /proc/<pid>/maps (peers open it by /proc/<pid>/fd), and
  // memfd_create refuses names over 249 bytes with EINVAL: split communicators' ids grow with
  // each level and with their colours, so a long label is cut, never refused.
  constexpr size_t kMemfdNameMax = 249;
  const std::string shown = label.size() > kMemfdNameMax ? label.substr(0, kMemfdNameMax) : label;
  int fd = memfd_create(shown.c_str(), MFD_CLOEXEC);
  if (fd < 0) fail_errno("memfd_create for shared memory " + label);
  return map_new(fd, label, bytes, false);
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(" + name + ") for create");
  return map_new(fd, name, bytes, true);
}

ShmSegment ShmSegment::open(const std::string& name) {
  const bool is_private = name.rfind("/proc/", 0) == 0;  // a memfd, through its creator's fd
  int fd = is_private ? ::open(name.c_str(), O_RDWR | O_CLOEXEC) : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    fail_errno(std::string(is_private ? "open(" : "shm_open(") + name + ") of a peer's segment" +
               (is_private ? " (peers must run as the same user and see each other's /proc)" : ""));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    fail_errno("fstat of shared memory " + name);
  }
  void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (base == MAP_FAILED) fail_errno("mmap of shared memory " + name);
  ShmSegment seg;
  seg.base_ = base;
  seg.bytes_ = static_cast<size_t>(st.st_size);
  seg.name_ = name;
  return seg;
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    this->~ShmSegment();
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    name_ = std::move(o.name_);
    fd_ = std::exchange(o.fd_, -1);
    owner_ = std::exchange(o.owner_, false);
    named_ = std::exchange(o.named_, false);
    unlinked_ = std::exchange(o.unlinked_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  if (owner_) unlink();
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
}

void ShmSegment::unlink() {
  if (!owner_ || unlinked_) return;
  if (named_) shm_unlink(name_.c_str());
  if (fd_ >= 0) close(fd_);  // a memfd lives on in the mappings; its /proc name is gone
  fd_ = -1;
  unlinked_ = true;
}

}  // namespace linkwise
