#include "core/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <sstream>
#include <string>

#include "core/status.h"

namespace linkwise {

namespace {
std::atomic<InterruptCheck> g_interrupt_check{nullptr};
}  // namespace

void set_interrupt_check(InterruptCheck check) { g_interrupt_check.store(check, std::memory_order_release); }

bool interrupted() {
  const InterruptCheck check = g_interrupt_check.load(std::memory_order_acquire);
  return check && check();
}

void throw_bad_timeout(const char* op, double timeout_s) {
  std::ostringstream text;
  text << op << ": timeout " << timeout_s << ": give seconds, a positive finite number";
  throw Error(ErrorKind::Invalid, text.str());
}

void throw_interrupted(int rank, const std::string& what) {
  throw Error(ErrorKind::Interrupted, "rank " + std::to_string(rank) + ": " + what + " was interrupted");
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  struct timespec ts;
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = (timeout_us % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace linkwise
