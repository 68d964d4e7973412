#include "log.hpp"

#include <c10/util/Exception.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>

namespace cam {

LogLevel parse_log_level(const std::string& name) {
  if (name == "error") return LogLevel::kError;
  if (name == "warn") return LogLevel::kWarn;
  if (name == "info") return LogLevel::kInfo;
  if (name == "debug") return LogLevel::kDebug;
  TORCH_CHECK(false, "cam option log_level: expected error, warn, info or debug, got '", name, "'");
}

const char* log_level_name(LogLevel l) {
  switch (l) {
    case LogLevel::kError: return "error";
    case LogLevel::kWarn: return "warn";
    case LogLevel::kInfo: return "info";
    case LogLevel::kDebug: return "debug";
  }
  return "?";
}

void log_line(LogLevel l, const std::string& who, const std::string& text) {
  timeval tv;
  gettimeofday(&tv, nullptr);
  tm t;
  localtime_r(&tv.tv_sec, &t);
  char head[96];
  std::snprintf(head, sizeof(head), "[torch_cam %c %02d:%02d:%02d.%06ld pid %d] ", "EWID"[int(l)], t.tm_hour,
                t.tm_min, t.tm_sec, long(tv.tv_usec), int(getpid()));
  std::string line = head + who + ": " + text + "\n";
  // One write: lines of concurrent ranks and threads stay whole.
  ssize_t ignored = ::write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

}  // namespace cam
