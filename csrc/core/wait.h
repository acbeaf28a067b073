// Waiting without burning the CPU: a deadline clock and a futex on shared memory. Ranks spin
// briefly (latency) and then sleep in the kernel; how long they spin is chosen in Python
// (comm._default_spin_us) and passed in EngineOptions.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
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

// A timeout argument a wait cannot honour: NaN never compares as spent, so such a wait would
// outlast any timeout. Throws ErrorKind::Invalid ("<op>: timeout is NaN ..."); callers check
// before they post anything.
[[noreturn]] void throw_nan_timeout(const char* op);
inline void check_timeout(double timeout_s, const char* op) {
  if (timeout_s != timeout_s) throw_nan_timeout(op);  // inline: Engine::wait asks on every wait
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
