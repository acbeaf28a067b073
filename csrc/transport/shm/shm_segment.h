// A named POSIX shared-memory segment, mapped into this process.
//
// Ownership: the creator names it "/linkwise-<job>-<rank>" so a launcher can find leftovers;
// it unlinks the name as soon as every peer has mapped it, so that nothing is left in
// /dev/shm even if the process is later killed. The mapping lives until destruction.
// Mappings are populated up front (MAP_POPULATE): a first touch costs a page fault of
// several microseconds on a VM, which would otherwise land on the first messages.
#pragma once

#include <cstddef>
#include <string>

namespace linkwise {

class ShmSegment {
 public:
  static ShmSegment create(const std::string& name, size_t bytes);
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
  void unlink();  // idempotent; the mapping stays valid

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;
  bool unlinked_ = false;
};

}  // namespace linkwise
