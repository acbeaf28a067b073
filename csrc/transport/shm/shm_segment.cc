#include "transport/shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "core/status.h"

namespace linkwise {

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(" + name + ") for create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    errno = e;
    fail_errno("ftruncate of shared memory " + name + " (is /dev/shm large enough?)");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    fail_errno("mmap of shared memory " + name);
  }
  ShmSegment seg;
  seg.base_ = base;
  seg.bytes_ = bytes;
  seg.name_ = name;
  seg.owner_ = true;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(" + name + ") of a peer's segment");
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
    owner_ = std::exchange(o.owner_, false);
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
  if (owner_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
}

}  // namespace linkwise
