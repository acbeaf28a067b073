// Errors of the data plane.
//
// Contract: recoverable failures throw linkwise::Error with a Kind that the bindings map to
// a Python exception (Timeout -> linkwise.TimeoutError, Peer -> linkwise.PeerError, Invalid ->
// ValueError, Type -> TypeError, Aborted -> linkwise.CommAbortedError, Internal ->
// linkwise.LinkwiseError, Interrupted -> the exception a Python signal handler raised while
// the call waited, KeyboardInterrupt for Ctrl-C: core/wait.h's interrupted()). Invariants that
// can only fail through a bug use LW_CHECK.
#pragma once

#include <stdexcept>
#include <string>

namespace linkwise {

enum class ErrorKind { Internal, Timeout, Peer, Invalid, Type, Aborted, Interrupted };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message, int peer = -1)
      : std::runtime_error(std::move(message)), kind_(kind), peer_(peer) {}
  ErrorKind kind() const { return kind_; }
  int peer() const { return peer_; }

 private:
  ErrorKind kind_;
  int peer_;
};

[[noreturn]] void fail_check(const char* expr, const char* file, int line, const std::string& what);
[[noreturn]] void fail_errno(const std::string& what);  // throws Internal with strerror(errno)
// A duration for messages: "20 s", "0.5 s", "2.25 s" (not std::to_string's "20.000000").
std::string number_text(double v);   // "%g" (snprintf: no iostreams in the module, wait.cc)
std::string seconds_text(double s);

}  // namespace linkwise

#define LW_CHECK(cond, what)                                                   \
  do {                                                                         \
    if (!(cond)) ::linkwise::fail_check(#cond, __FILE__, __LINE__, (what));    \
  } while (0)
