// Waiting without burning the CPU: a deadline clock and a futex on shared memory. Ranks spin
// briefly (latency) and then sleep in the kernel; how long they spin is chosen in Python
// (comm._default_spin_us) and passed in EngineOptions.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>

namespace linkwise {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Cross-process futex on a 32-bit word in shared memory (not FUTEX_PRIVATE).
// futex_wait returns when *word != expected, on a wake, or after timeout_us.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_us);
void futex_wake_all(std::atomic<uint32_t>* word);

// Timeouts a wait cannot honour: NaN never compares as spent, infinity never runs out, and a
// negative one has run out before the call. Both checks throw ErrorKind::Invalid ("<op>:
// timeout ...: give seconds, a positive finite number"; config.seconds says the same) before
// anything is posted. A user's timeout must be positive (README); the internal polls that
// finish or withdraw a request at once pass 0 to Engine::wait, which checks only the rest.
[[noreturn]] void throw_bad_timeout(const char* op, double timeout_s);
inline void check_timeout(double timeout_s, const char* op) {  // inline: Engine::wait asks on every wait
  if (!(timeout_s >= 0 && timeout_s < std::numeric_limits<double>::infinity())) throw_bad_timeout(op, timeout_s);
}
inline void check_user_timeout(double timeout_s, const char* op) {
  if (!(timeout_s > 0 && timeout_s < std::numeric_limits<double>::infinity())) throw_bad_timeout(op, timeout_s);
}

// Ctrl-C while a call waits. The waits that may last (past their spin: Engine::wait,
// ShmColl::wait_ge, an async collective's wait, a GPU request's event_wait, ForkJoin::run's
// owner waiting for helpers) call interrupted() every ~0.1 s and, when it is true, give up
// as on a timeout but throw ErrorKind::Interrupted. The Python bindings set
// the check (bindings/module.cc): on the main thread only, it runs the pending signal
// handlers (a SIGINT's raises KeyboardInterrupt) and keeps what they raised for the error
// translator. Without a check set, never interrupted. Safe from any thread.
using InterruptCheck = bool (*)();
void set_interrupt_check(InterruptCheck check);
bool interrupted();
// The Error an interrupted wait throws (`what`: the call that waited).
[[noreturn]] void throw_interrupted(int rank, const std::string& what);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace linkwise
