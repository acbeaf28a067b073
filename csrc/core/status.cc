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

std::string number_text(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  return b;
}

std::string seconds_text(double s) { return number_text(s) + " s"; }

}  // namespace linkwise
