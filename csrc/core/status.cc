#include "core/status.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace linkwise {

void fail_check(const char* expr, const char* file, int line, const std::string& what) {
  throw Error(ErrorKind::Internal, std::string("linkwise internal check failed: ") + expr + " (" +
                                       what + ") at " + file + ":" + std::to_string(line));
}

void fail_errno(const std::string& what) {
  throw Error(ErrorKind::Internal, what + ": " + std::strerror(errno));
}

std::string seconds_text(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%g s", s);
  return b;
}

}  // namespace linkwise
