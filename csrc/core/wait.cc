#include "core/wait.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <thread>

namespace linkwise {

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us) {
  struct timespec ts;
  ts.tv_sec = timeout_us / 1000000;
  ts.tv_nsec = (timeout_us % 1000000) * 1000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

double default_spin_us(int local_ranks) {
  unsigned cores = std::thread::hardware_concurrency();
  if (cores == 0) cores = 1;
  // With a core per rank, spinning for a while costs nothing and saves a wake-up (~5 us).
  // With more ranks than cores a spinner steals the core its peer needs: barely spin.
  if (static_cast<unsigned>(local_ranks) <= cores) return 200.0;
  return 2.0;
}

}  // namespace linkwise
