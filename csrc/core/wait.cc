#include "core/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
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

// The number as "%g" prints it ("nan", "-1", "inf", "0.5": what std::ostringstream printed).
// snprintf (number_text), not iostreams: on the GPU machine's image (g++ 13.3, Python 3.12.3,
// gVisor) formatting the double through std::ostringstream segfaulted inside
// std::ostream::_M_insert<double> (cuda-gdb backtrace), so every bad timeout killed the process;
// with snprintf tests/test_native_error_kinds.py passes there (docs/benchmarks.md, thirty-fifth
// session). Keep iostreams out of the module.
void throw_bad_timeout(const char* op, double timeout_s) {
  throw Error(ErrorKind::Invalid, std::string(op) + ": timeout " + number_text(timeout_s) +
                                      ": give seconds, a positive finite number");
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
